"""Decentralised execution of a team: every agent answers its own prompt, concurrently, no controller.

Agents that share a LoRA base (and sampling settings) generate in ONE batched call with each row
routed through its own adapter; agents on different models run in parallel threads (torch releases
the GIL in its kernels). No agent ever sees another agent's prompt or output.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from teamrl.rollout.generate import Generation, generate
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
    groups: dict[int, list[int]] = {}
    for i, agent in enumerate(team):
        groups.setdefault(id(agent.model), []).append(i)

    def run_group(indices: list[int]) -> dict[int, Generation]:
        agents = [team[i] for i in indices]
        prompts = {i: [team[i].prompt(obs[i]) for obs in observations] for i in indices}
        shared_batch = len(agents) > 1 and all(a.adapter is not None for a in agents) and \
            all(a.sampling == agents[0].sampling for a in agents)
        if not shared_batch:
            return {i: generate(team[i], prompts[i], num_samples) for i in indices}
        rows = [p for i in indices for p in prompts[i]]
        names = [team[i].adapter for i in indices for _ in observations]
        merged = generate(agents[0], rows, num_samples, adapter_names=names)
        per_agent = len(observations) * num_samples
        return {i: _rows(merged, k * per_agent, (k + 1) * per_agent) for k, i in enumerate(indices)}

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(groups)) as pool:
        results: dict[int, Generation] = {}
        for part in pool.map(run_group, groups.values()):
            results.update(part)
    seconds = time.perf_counter() - start
    ordered = [results[i] for i in range(len(team))]
    return TeamOutput(texts=[g.texts for g in ordered], tokens=sum(g.num_tokens for g in ordered), seconds=seconds)


def _rows(gen: Generation, start: int, stop: int) -> Generation:
    return Generation(gen.prompt_ids[start:stop], gen.prompt_mask[start:stop], gen.completion_ids[start:stop],
                      gen.completion_mask[start:stop], gen.sampling_logprobs[start:stop], gen.texts[start:stop])
