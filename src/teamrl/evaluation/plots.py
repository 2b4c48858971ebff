"""Plots of a run, as PNG files (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def plot_reward_curve(
    history: Sequence[dict[str, float]],
    path: str | Path,
    *,
    before: float | None = None,
    after: float | None = None,
    max_reward: float | None = None,
    title: str = "Joint reward during MAGRPO training",
) -> Path:
    """Training joint reward per step (and its running mean), with held-out before/after marks."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [int(h["step"]) for h in history]
    rewards = [h["reward/mean"] for h in history]
    window = max(1, len(rewards) // 10)
    running = [sum(rewards[max(0, i - window + 1): i + 1]) / len(rewards[max(0, i - window + 1): i + 1])
               for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, rewards, color="tab:blue", alpha=0.35, marker="o", markersize=3, label="training batch")
    ax.plot(steps, running, color="tab:blue", linewidth=2, label=f"running mean ({window} steps)")
    if before is not None:
        ax.axhline(before, color="tab:gray", linestyle="--", label=f"held-out before: {before:.2f}")
    if after is not None:
        ax.axhline(after, color="tab:green", linestyle="--", label=f"held-out after: {after:.2f}")
    if max_reward is not None:
        ax.set_ylim(0, max_reward)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    ax.set_ylabel("joint reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
