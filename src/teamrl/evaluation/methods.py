"""What ``teamrl eval`` runs: its methods (prompt-only baselines, saved teams) and its settings, read from the
command line (:mod:`teamrl.flags`). Nothing heavy is imported here: the baselines register when first named."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from teamrl.flags import option
from teamrl.registry import BASELINES

#: The prefix of a saved team in ``--methods``.
TEAM_PREFIX = "team"
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
    """``team:PATH``: the saved team."""
    program: bool = False
    """It answers a program's calls (a program task): ``concat`` is then its untrained team, ``single`` one model
    answering every agent's calls."""

    @property
    def title(self) -> str:
        """A readable name for tables and plots."""
        if self.team_dir is not None:
            return f"trained team ({self.team_dir})"
        title = (_PROGRAM_TITLES if self.program else _TITLES).get(self.baseline, self.baseline)
        return f"{title} ({self.model})" if self.model else title

    @property
    def description(self) -> str:
        """What the method does and what each agent sees: the summary line of its baseline's docstring."""
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
        if name == TEAM_PREFIX and argument:
            directory = Path(argument).expanduser()
            if not (directory / "team.json").is_file():
                raise ValueError(f"--methods: {spec}: no saved team in {str(directory)!r} (no team.json); give a "
                                 f"directory written by Team.save_pretrained, e.g. RUN_DIR/team after teamrl train")
            methods.append(Method(spec, None, team_dir=directory))
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
    """Every form ``--methods`` accepts: the registered baselines, ``single:MODEL`` and ``team:PATH``."""
    names = [f"{name}, {name}:MODEL" if name == "single" else name for name in BASELINES]
    return ", ".join([*names, f"{TEAM_PREFIX}:PATH"])


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
        "decentralised)", "single,concat,sequential,discussion", parse=lambda text: tuple(parse_methods(text)))
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
