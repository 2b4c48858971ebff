"""Plots of a run and of an evaluation, as PNG files (matplotlib, headless)."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from teamrl.envs.code_schemes import SCHEMES
from teamrl.run_dir import CONFIG_FILE, CURVE_FILE, EVAL_FILE, METRICS_FILE, read_records

#: One colour per cooperation scheme, in the order of ``SCHEMES``, the same in every plot.
SCHEME_COLOURS = dict(zip(SCHEMES, ("tab:gray", "tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown")))


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend: there is no display on servers and CI."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` (its folder made if needed) and free it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    _pyplot().close(fig)
    return path


def _wrapped(labels: Sequence[str], width: int = 18) -> list[str]:
    return [textwrap.fill(label, width) for label in labels]


EPISODE_RETURN = "reward/episode/mean"
"""Training's episode return per step in ``metrics.jsonl``: every turn's joint reward summed down the tree."""


def plot_reward_curve(
    history: Sequence[Mapping[str, float]],
    path: str | Path,
    *,
    held_out: Sequence[Mapping[str, float]] = (),
    max_reward: float | None = None,
    title: str = "Joint reward during MAGRPO training",
    num_turns: int = 1,
) -> Path:
    """Training's joint reward per step (and its running mean), with the held-out evaluations as points.

    Both curves show one quantity. Held-out evaluation plays episodes of ``num_turns`` turns and scores their
    return, every turn's joint reward summed; so, when ``num_turns`` > 1, the training curve is the episode
    return of each step's rollout (:data:`EPISODE_RETURN`), not the first turn's reward (``reward/mean``, which
    a sparse reward leaves at 0). A run logged before that metric existed has only ``reward/mean``: it is drawn
    and labelled as the turn-1 reward it is.

    ``held_out``: evaluations with their ``step`` and ``reward/mean`` (a run's ``eval.jsonl``), in step order.
    ``max_reward``: the top of the y axis (for episodes, the largest return of one).
    """
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()

    episodes = num_turns > 1
    turn_one_only = episodes and not all(EPISODE_RETURN in h for h in history)
    key = "reward/mean" if turn_one_only or not episodes else EPISODE_RETURN
    quantity = f"episode return ({num_turns} turns, joint rewards summed)" if episodes else "joint reward"
    training = "training: turn-1 joint reward only (logged before episode returns were)" if turn_one_only \
        else "training batch"
    steps = [int(h["step"]) for h in history]
    rewards = [h[key] for h in history]
    window = max(1, len(rewards) // 10)
    running = [sum(rewards[max(0, i - window + 1): i + 1]) / len(rewards[max(0, i - window + 1): i + 1])
               for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, rewards, color="tab:blue", alpha=0.35, marker="o", markersize=3, label=training)
    ax.plot(steps, running, color="tab:blue", linewidth=2, label=f"running mean ({window} steps)")
    if held_out:
        first, last = held_out[0], held_out[-1]
        change = (f"{first['reward/mean']:.2f} at step {first['step']:g} -> {last['reward/mean']:.2f} at step "
                  f"{last['step']:g}" if len(held_out) > 1 else f"{last['reward/mean']:.2f} at step {last['step']:g}")
        ax.plot([e["step"] for e in held_out], [e["reward/mean"] for e in held_out], color="tab:green",
                marker="s", markersize=5, linewidth=1.5,
                label=f"held-out{' episodes' if episodes else ''}: {change}")
    if max_reward is not None:
        ax.set_ylim(0, max_reward)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    ax.set_ylabel(quantity)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


def plot_run(run_dir: str | Path, path: str | Path | None = None) -> Path:
    """The reward curve of a training run, from its files: the training reward of every step (``metrics.jsonl``)
    and the held-out evaluations (``eval.jsonl``, absent in runs from before they existed), both episode
    returns when the run's ``algorithm.num_turns`` is above 1 (:func:`plot_reward_curve`); written to ``path``
    (default ``RUN_DIR/reward_curve.png``), which is returned.

    Raises:
        ValueError: ``run_dir`` holds no training run (neither file), or nothing was logged there yet.
    """
    run_dir = Path(run_dir)
    if not (run_dir / METRICS_FILE).is_file() and not (run_dir / EVAL_FILE).is_file():
        raise ValueError(f"run_dir: {str(run_dir)!r} is not a training run (no {METRICS_FILE} or {EVAL_FILE} in it); "
                         f"give the run_dir of a teamrl train run")
    metrics, evaluations = read_records(run_dir / METRICS_FILE), read_records(run_dir / EVAL_FILE)
    if not metrics and not evaluations:
        raise ValueError(f"run_dir: {str(run_dir)!r} has logged no step yet; plot it once training has begun")
    config = yaml.safe_load((run_dir / CONFIG_FILE).read_text()) if (run_dir / CONFIG_FILE).is_file() else None
    algorithm = (config or {}).get("algorithm", {})
    name = algorithm.get("name")
    title = f"Joint reward during {name.upper()} training" if name else "Joint reward during training"
    return plot_reward_curve(metrics or [], run_dir / CURVE_FILE if path is None else path,
                             held_out=evaluations or [], title=title, num_turns=algorithm.get("num_turns", 1))


def plot_methods(methods: Sequence[str], series: Mapping[str, Sequence[float]], path: str | Path, *,
                 title: str = "Methods compared") -> Path:
    """Grouped bars: one group per method, one bar per series (e.g. normalised return, pass@1), on [0, 1].

    ``series`` maps a series' name to one value per method, in the order of ``methods``.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(methods) + 2), 4), dpi=120)
    width = 0.8 / max(1, len(series))
    for index, (name, values) in enumerate(series.items()):
        offsets = [position + (index - (len(series) - 1) / 2) * width for position in range(len(methods))]
        bars = ax.bar(offsets, values, width, label=name, color=f"C{index}")
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    ax.set_xticks(range(len(methods)), _wrapped(methods), fontsize=8)
    ax.set_ylim(0, 1.25)  # room above a full bar for its label and the legend
    ax.set_ylabel("fraction of the maximum")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", ncol=len(series))
    return _save(fig, path)


def plot_schemes(methods: Sequence[str], distributions: Sequence[Mapping[str, float]], path: str | Path, *,
                 title: str = "Cooperation schemes of the joint actions") -> Path:
    """One horizontal bar per method, split by the fraction of its joint actions in each scheme."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 1.4 + 0.6 * len(methods)), dpi=120)
    rows = range(len(methods))
    left = [0.0] * len(methods)
    for scheme, colour in SCHEME_COLOURS.items():
        fractions = [distribution.get(scheme, 0.0) for distribution in distributions]
        ax.barh(rows, fractions, left=left, color=colour, label=scheme)
        left = [start + fraction for start, fraction in zip(left, fractions)]
    ax.set_yticks(rows, _wrapped(methods, 28), fontsize=8)
    ax.invert_yaxis()  # the first method on top, as in the tables
    ax.set_xlim(0, 1)
    ax.set_xlabel("fraction of joint actions")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return _save(fig, path)
