"""What ``teamrl eval`` runs: its methods (prompt-only baselines, saved teams) and its settings, read from the
command line (:mod:`teamrl.flags`). Nothing heavy is imported here: the baselines register when first named."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from teamrl.flags import option
from teamrl.registry import BASELINES

#: The prefix of a saved team in ``--methods``.
TEAM_PREFIX = "team"
#: The saved team with its agents' weights moved one seat on, each seat keeping its prompt.
SWAPPED = "swapped"
#: Each trained agent (or the one after ``@``) in every seat, each seat keeping its prompt.
EVERY_ROLE = "every-role"
_TITLES = {"single": "single agent", "concat": "naive concatenation (untrained team)",
           "sequential": "sequential pipeline", "discussion": "one-round discussion"}
_PROGRAM_TITLES = {"single": "one model answering every agent's calls", "concat": "untrained team"}


@dataclass(frozen=True)
class Method:
    """One entry of ``--methods``: which baseline runs, and on whose model, or which saved team."""

    spec: str
    """As written, e.g. ``single:bundled`` or ``team:runs/x/team``."""
    baseline: str | None
    """The registered baseline that runs it; None for a saved team."""
    model: str | None = None
    """``single:MODEL``: the single agent's model spec."""
    team_dir: Path | None = None
    """``team:PATH``, ``swapped:PATH``, ``every-role:PATH@AGENT``: the saved team."""
    seats: str | None = None
    """Whose trained weights each seat runs, each seat keeping its own prompt: None (its own), ``"swapped"``
    (the next seat's agent's: with two agents, A's weights on B's prompt and B's on A's) or an agent's name (that
    agent's in every seat). How much a team loses so tells how much its agents specialised in their roles."""
    program: bool = False
    """It answers a program's calls (a program task): ``concat`` is then its untrained team, ``single`` one model
    answering every agent's calls."""

    @property
    def is_trained_team(self) -> bool:
        """A saved team as it was trained (``team:PATH``): what the report compares with every other method."""
        return self.team_dir is not None and self.seats is None

    @property
    def title(self) -> str:
        """A readable name for tables and plots."""
        if self.seats == "swapped":
            return f"trained team, roles swapped ({self.team_dir})"
        if self.seats is not None:
            return f"trained agent {self.seats} in every role ({self.team_dir})"
        if self.team_dir is not None:
            return f"trained team ({self.team_dir})"
        title = (_PROGRAM_TITLES if self.program else _TITLES).get(self.baseline, self.baseline)
        return f"{title} ({self.model})" if self.model else title

    @property
    def description(self) -> str:
        """What the method does and what each agent sees: the summary line of its baseline's docstring."""
        if self.seats == "swapped":
            return ("The saved team with its agents' trained weights moved one seat on (seat i runs agent i+1's "
                    "weights on seat i's own prompt); a team that specialised loses most here.")
        if self.seats is not None:
            return (f"Every seat runs agent {self.seats}'s trained weights on its own prompt: one trained agent "
                    f"playing every role.")
        if self.program:
            who = ("the saved team's agents (trained)" if self.team_dir is not None else
                   "one model, under every agent's name" if self.baseline == "single" else
                   "the untrained team: each agent its base model")
            return f"The program plays its episodes as it is; {who} answer its calls."
        if self.team_dir is not None:
            return ("Every agent answers its own observation; the answers are the joint action. The agents are "
                    "the saved team's (trained), run decentralised and sampled as training's held-out evaluation "
                    "samples them.")
        summary = (BASELINES[self.baseline].__doc__ or "").strip().splitlines()[0]
        return f"{summary} The single agent runs on {self.model}." if self.model else summary


def parse_methods(text: str) -> list[Method]:
    """The methods of a comma-separated ``--methods`` value.

    Raises:
        ValueError: an unknown method, ``team:`` without a saved team, or a method given twice.
    """
    methods = []
    for spec in (part.strip() for part in text.split(",")):
        name, colon, argument = spec.partition(":")
        if name in (TEAM_PREFIX, SWAPPED, EVERY_ROLE) and argument:
            path, agent = argument.rsplit("@", 1) if name == EVERY_ROLE and "@" in argument else (argument, "")
            directory = Path(path).expanduser()
            if not (directory / "team.json").is_file():
                raise ValueError(f"--methods: {spec}: no saved team in {str(directory)!r} (no team.json); give a "
                                 f"directory written by Team.save_pretrained, e.g. RUN_DIR/team after teamrl train")
            if name == TEAM_PREFIX:
                methods.append(Method(spec, None, team_dir=directory))
            elif name == SWAPPED:
                methods.append(Method(spec, None, team_dir=directory, seats="swapped"))
            else:
                names = _agent_names(directory)
                if agent and agent not in names:
                    raise ValueError(f"--methods: {spec}: the saved team has no agent {agent!r} (it has "
                                     f"{', '.join(names)})")
                methods += [Method(f"{EVERY_ROLE}:{path}@{one}", None, team_dir=directory, seats=one)
                            for one in ([agent] if agent else names)]
        elif name == "single" and colon and argument:
            methods.append(Method(spec, name, model=argument))
        elif name in BASELINES and not colon:
            methods.append(Method(spec, name))
        else:
            raise ValueError(f"--methods: unknown method {spec!r}; use a comma-separated list of {method_forms()}")
    specs = [method.spec for method in methods]
    duplicates = sorted({spec for spec in specs if specs.count(spec) > 1})
    if duplicates:
        raise ValueError(f"--methods: {', '.join(duplicates)} given twice; list each method once")
    return methods


def method_forms() -> str:
    """Every form ``--methods`` accepts: the registered baselines, ``single:MODEL``, ``team:PATH`` and the
    specialisation checks of a saved team."""
    names = [f"{name}, {name}:MODEL" if name == "single" else name for name in BASELINES]
    return ", ".join([*names, f"{TEAM_PREFIX}:PATH", f"{SWAPPED}:PATH", f"{EVERY_ROLE}:PATH[@AGENT]"])


def _agent_names(team_dir: Path) -> list[str]:
    return [entry["name"] for entry in json.loads((team_dir / "team.json").read_text())["agents"]]


def parse_ks(text: str) -> tuple[int, ...]:
    """The k values of a comma-separated ``--k`` value (``"1,3"``), sorted and distinct."""
    try:
        ks = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise ValueError(f"--k: {text!r} is not a comma-separated list of integers, e.g. --k 1,3") from None
    if ks[0] < 1:
        raise ValueError(f"--k: every k must be >= 1 (got {text!r})")
    return tuple(ks)


@dataclass(frozen=True)
class EvalSettings:
    """What ``teamrl eval`` runs: the methods, on which items, how many samples, which k; each field is one of its
    flags."""

    methods: tuple[Method, ...] = option(
        "comma-separated methods (default: %(default)s): single (one model does the whole job), single:MODEL (another "
        "model), concat (the untrained agents in parallel, outputs joined), sequential (agent 2 sees agent 1's "
        "output), discussion (each agent revises after seeing the others' first answers), team:PATH (a saved team, "
        "decentralised), swapped:PATH (its agents' weights moved one seat on, each seat keeping its prompt), "
        "every-role:PATH[@AGENT] (each trained agent, or AGENT, in every seat)", "single,concat,sequential,discussion",
        parse=lambda text: tuple(parse_methods(text)))
    split: str = option("the environment's split (default: %(default)s)", "eval")
    max_items: int | None = option("at most this many items, the split's first ones (default: all)", None)
    num_samples: int = option("n: joint actions each method samples per item; pass@k needs k <= n (default: 1)", 1)
    ks: tuple[int, ...] = option("comma-separated k of pass@k and accuracy@k, each <= n (default: %(default)s)",
                                 "1", parse=parse_ks, flag="--k")
    team_sampling: Literal["saved", "config"] = option(
        "sampling settings of team:PATH methods: each saved team's own, those of its training (default), or the "
        "config's, as the baselines use", "saved")

    def __post_init__(self) -> None:
        if not self.methods:
            raise ValueError(f"--methods: no method given; use a comma-separated list of {method_forms()}")
        if self.num_samples < 1:
            raise ValueError(f"--num-samples: must be >= 1 (got {self.num_samples})")
        if self.max_items is not None and self.max_items < 1:
            raise ValueError(f"--max-items: must be >= 1 (got {self.max_items}); omit it for every item")
        too_big = [k for k in self.ks if k > self.num_samples]
        if too_big:
            raise ValueError(f"--k: k={too_big[0]} exceeds --num-samples {self.num_samples}; pass@k and "
                             f"accuracy@k need k <= n: lower --k or raise --num-samples to {max(too_big)}")
