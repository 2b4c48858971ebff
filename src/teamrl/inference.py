"""Decentralised execution of a team: every agent answers its own prompt, concurrently, no controller.

Agents that share a LoRA base (and sampling settings) generate in ONE batched call with each row
routed through its own adapter; agents on different models run in parallel threads (torch releases
the GIL in its kernels). No agent ever sees another agent's prompt or output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from teamrl.rollout.generate import generate_team
from teamrl.team import Agent, Team


@dataclass
class TeamOutput:
    """What a team produced for a batch of observations."""

    texts: list[list[str]]
    """Agent-major: ``texts[i][input * num_samples + sample]`` is agent i's completion ``sample`` of input
    ``input`` (``num_samples`` consecutive rows per input), so ``[texts[i][row] for i in range(len(team))]``
    is the joint action of row ``row``. Note the transpose of :func:`run_team`'s ``observations[input][i]``."""
    tokens: int
    """Generated tokens, all agents together."""
    seconds: float
    """Wall-clock time of the whole team's answer (agents concurrently)."""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def run_team(team: Team, observations: list[list[str]], num_samples: int = 1, *,
             labels: list[str] | None = None) -> TeamOutput:
    """Each agent i generates ``num_samples`` completions from ``observations[input][i]`` for every input,
    from its own prompt only; returns all agents' texts, agent-major.

    ``observations`` is input-major (one list per input, one observation per agent: what
    :meth:`~teamrl.envs.base.Environment.observe` returns for an item); the output is agent-major:
    ``output.texts[i][input * num_samples + sample]`` is agent i's completion ``sample`` of ``input``. The joint
    action of sample ``s`` of input ``k``, in agent order (what :meth:`~teamrl.envs.base.Environment.joint_reward`
    scores), is therefore ``[texts[k * num_samples + s] for texts in output.texts]``.

    Raises:
        ValueError: a prompt does not fit its model's context (:func:`check_context`).
    """
    check_context(team, observations, labels)
    prompts = [[agent.prompt(obs[i]) for obs in observations] for i, agent in enumerate(team)]
    start = time.perf_counter()
    generations = generate_team(team, prompts, num_samples, concurrent=True)
    seconds = time.perf_counter() - start
    return TeamOutput(texts=[g.texts for g in generations], tokens=sum(g.num_tokens for g in generations),
                      seconds=seconds)


def check_context(team: Team, observations: list[list[str]], labels: list[str] | None = None) -> None:
    """Check, before anything generates, that agent i's prompt of ``observations[row][i]`` leaves room for
    its ``max_new_tokens`` in its model's context, for every row.

    Raises:
        ValueError: a prompt does not leave room (a longer prompt would run for minutes and gigabytes before
            the model fails or rambles). The message names the input (``labels[row]``, default ``input ROW``),
            the agent and how far to shorten it.
    """
    for i, agent in enumerate(team):
        _check_context(agent, [agent.prompt(obs[i]) for obs in observations], [obs[i] for obs in observations],
                       labels or [f"input {row}" for row in range(len(observations))])


def _check_context(agent: Agent, prompts: list[str], observations: list[str], labels: list[str]) -> None:
    # Tokenised as generation tokenises them (encode_prompts), one list per prompt, unpadded.
    encoded = agent.tokenizer(prompts, add_special_tokens=not agent.uses_chat_template)["input_ids"]
    for label, ids, observation in zip(labels, encoded, observations):
        error = context_error(agent, len(ids), agent.sampling.max_new_tokens, observation, label)
        if error is not None:
            raise ValueError(error)


def context_error(agent: Agent, prompt_tokens: int, max_new_tokens: int, observation: str, label: str) -> str | None:
    """Why a prompt of ``prompt_tokens`` tokens (``observation`` being the part the caller wrote, named ``label``)
    leaves ``agent``'s model no room for ``max_new_tokens`` more, with how far to shorten it; None when it fits (or
    the model states no limit)."""
    context = getattr(agent.model.config, "max_position_embeddings", None)
    room = None if context is None else context - max_new_tokens
    if room is None or prompt_tokens <= room:
        return None
    excess = -(-len(observation) * (prompt_tokens - room) // prompt_tokens)  # at the prompt's characters per token
    return (f"{label}: agent {agent.name!r}'s prompt is {prompt_tokens:,} tokens, which with "
            f"max_new_tokens={max_new_tokens:,} exceeds the model's context of {context:,} tokens; shorten the input "
            f"by about {excess:,} characters or more, or lower max_new_tokens")
