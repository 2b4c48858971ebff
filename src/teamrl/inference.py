"""Decentralised execution of a team: every agent answers its own prompt, concurrently, no controller.

Agents that share a LoRA base (and sampling settings) generate in ONE batched call with each row
routed through its own adapter; agents on different models run in parallel threads (torch releases
the GIL in its kernels). No agent ever sees another agent's prompt or output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from teamrl.rollout.generate import generate_team
from teamrl.team import Team


@dataclass
class TeamOutput:
    """What a team produced for a batch of observations."""

    texts: list[list[str]]
    """texts[i][row]: agent i's completion for observation row ``row`` (``num_samples`` rows per input)."""
    tokens: int
    """Generated tokens, all agents together."""
    seconds: float
    """Wall-clock time of the whole team's answer (agents concurrently)."""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def run_team(team: Team, observations: list[list[str]], num_samples: int = 1) -> TeamOutput:
    """Each agent i generates from ``observations[row][i]`` for every row; returns all agents' texts."""
    prompts = [[agent.prompt(obs[i]) for obs in observations] for i, agent in enumerate(team)]
    start = time.perf_counter()
    generations = generate_team(team, prompts, num_samples, concurrent=True)
    seconds = time.perf_counter() - start
    return TeamOutput(texts=[g.texts for g in generations], tokens=sum(g.num_tokens for g in generations),
                      seconds=seconds)
