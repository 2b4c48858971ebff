"""A step's episodes of a program task: the user's program run G times on each item, every agent call recorded.

A program task (:class:`~teamrl.envs.program.ProgramTask`) has no per-agent observations: its program calls the
agents by name through an OpenAI-compatible endpoint, as often and in whatever order it likes, and returns the
episode's joint reward. :func:`run_episodes` runs the program ``num_episodes`` times on every item, all at once
(each in a thread of its own, under a per-episode timeout), each episode at a base URL of its own
(:class:`Endpoint`: the in-process gateway, :class:`~teamrl.serve.gateway.Gateway`), which records every call's
exact tokens in the episode (:class:`ProgramEpisode`). What comes back (:class:`ProgramRollout`): the (E, G) joint
rewards and, per agent, every call it answered as one row of a :class:`~teamrl.rollout.generate.Generation`, with
the episode each row belongs to. The learning half is MAGRPO's
(:meth:`~teamrl.algorithms.magrpo.MAGRPO.learn_episodes`).

Nothing here imports the gateway: the Trainer hands :func:`run_episodes` its endpoint.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from teamrl.envs.base import Item
from teamrl.envs.program import ProgramFault, ProgramTask
from teamrl.rewards.base import RewardResult
from teamrl.rollout.continuous import TokenCompletion
from teamrl.rollout.generate import Generation, derive_seed
from teamrl.user_code import describe_items


@dataclass
class AgentCall:
    """One completion an agent gave in an episode, as sampled."""

    agent: int
    completion: TokenCompletion


@dataclass
class ProgramEpisode:
    """One run of the program on one item: where it calls (its key in the endpoint's URL), what it called, and how
    it ended."""

    key: str
    item: Item
    seed: int
    """Seeds its calls' sampling: call k draws under ``derive_seed(seed, k, ...)``."""
    calls: list[AgentCall] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    """What the endpoint refused this episode (an unknown model, a prompt over the context), one line each."""
    result: RewardResult | None = None
    error: Exception | None = None
    """What stopped the program: its own exception (a UserCodeError) or a reward teamrl cannot use."""
    seconds: float = 0.0
    finished: bool = False
    _started: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def call_seed(self, asked: int | None) -> int:
        """The seed of the episode's next call (``asked``: the seed the program passed, if any): distinct per call
        and per episode, so that the G episodes of an item explore (a program passing a fixed seed would otherwise
        make them all alike)."""
        with self._lock:
            number, self._started = self._started, self._started + 1
        return derive_seed(self.seed, number, -1 if asked is None else asked)

    def record(self, agent: int, completion: TokenCompletion) -> None:
        with self._lock:
            self.calls.append(AgentCall(agent, completion))

    def refuse(self, message: str) -> None:
        with self._lock:
            self.faults.append(message)


class Endpoint(Protocol):
    """Where episodes call their agents (:class:`~teamrl.serve.gateway.Gateway`)."""

    def open(self, episode: ProgramEpisode) -> str:
        """Start answering ``episode``'s calls; its base URL (OpenAI's ``base_url``, ending in ``/v1``)."""
        ...

    def close(self, episode: ProgramEpisode) -> None:
        """Stop answering ``episode`` (a later call gets a 404)."""
        ...

    def wait_idle(self) -> None:
        """Block until no call is being answered (the agents' weights may change then)."""
        ...


@dataclass
class ProgramRollout:
    """A step's program episodes: the joint rewards and every agent's calls, ready for the update."""

    items: list[Item]
    episodes: list[list[ProgramEpisode]]
    """``episodes[e][g]``: episode g of item e."""
    rewards: torch.Tensor
    """(E, G) joint rewards."""
    generations: list[Generation]
    """Per agent, every call it answered (all episodes), one row each; no rows for an agent nobody called."""
    episode_of_row: list[torch.Tensor]
    """Per agent, (rows,) the flat episode index e * G + g of each row."""
    seconds: float = 0.0
    """Wall-clock time of the episodes (all at once)."""

    @property
    def num_tokens(self) -> int:
        return sum(generation.num_tokens for generation in self.generations)


def run_episodes(task: ProgramTask, endpoint: Endpoint, items: Sequence[Item], num_episodes: int, *, seed: int,
                 timeout: float | None = None, pad_token_ids: Sequence[int] = ()) -> ProgramRollout:
    """Run ``task``'s program ``num_episodes`` times on each of ``items``, all episodes at once, each in its own
    thread at its own base URL of ``endpoint``, episode g of item e seeded by ``derive_seed(seed, e, g)``.

    ``timeout`` (default the task's ``timeout_s``) bounds each episode. ``pad_token_ids[i]``: what agent i's rows
    are padded with.

    Raises:
        ProgramFault: an episode did not finish in time, or called what the endpoint refused (an unknown model, a
            prompt over the context), even if the program caught the error; a UserCodeError: the program raised;
            EnvironmentOutputError: it returned a reward teamrl cannot use. The first episode's (item order, then
            episode order), after every episode is closed.
    """
    timeout = task.timeout_s if timeout is None else timeout
    episodes = [[ProgramEpisode(f"{e}-{g}-{derive_seed(seed, e, g):x}", item, derive_seed(seed, e, g))
                 for g in range(num_episodes)] for e, item in enumerate(items)]
    flat = [episode for group in episodes for episode in group]
    start = time.perf_counter()
    plays = [_Play(task, episode, endpoint.open(episode)) for episode in flat]
    for play in plays:
        play.thread.start()
    deadline = start + timeout
    for play in plays:
        play.thread.join(max(0.0, deadline - time.perf_counter()))
    seconds = time.perf_counter() - start
    hung = [play.thread.is_alive() for play in plays]
    for play, stuck in zip(plays, hung):
        endpoint.close(play.episode)
        if stuck:
            play.stop()
    endpoint.wait_idle()
    for play, stuck in zip(plays, hung):
        error = _episode_error(task, play.episode, stuck, timeout)
        if error is not None:
            raise error
    rewards = torch.tensor([[episode.result.total for episode in group] for group in episodes], dtype=torch.float32)
    generations, rows = _agent_rows(flat, task.num_agents, pad_token_ids)
    return ProgramRollout(list(items), episodes, rewards, generations, rows, seconds)


class _Play:
    """One episode's thread: a daemon, so that a program that never returns cannot keep the process alive."""

    def __init__(self, task: ProgramTask, episode: ProgramEpisode, base_url: str):
        self.task, self.episode, self.base_url = task, episode, base_url
        self.cancel = None
        self.thread = threading.Thread(target=self._play, name=f"teamrl-episode-{episode.key}", daemon=True)

    def _play(self) -> None:
        began = time.perf_counter()
        try:
            self.episode.result = self.task.play(self.episode.item, self.base_url, on_start=self._cancellable)
        except Exception as err:  # said in one line where run_episodes raises it
            self.episode.error = err
        self.episode.seconds = time.perf_counter() - began
        self.episode.finished = True

    def _cancellable(self, cancel) -> None:
        self.cancel = cancel

    def stop(self) -> None:
        """Cancel an async program's task (a sync one's next call fails: its episode is closed)."""
        if self.cancel is not None:
            self.cancel()


def _episode_error(task: ProgramTask, episode: ProgramEpisode, hung: bool, timeout: float) -> Exception | None:
    where = f"on {describe_items(episode.item)}"
    if hung:
        return ProgramFault(f"{task.program_name} did not finish within {timeout:g} s {where} (env.kwargs.timeout_s); "
                            f"it made {len(episode.calls)} call(s) to the agents before it was stopped")
    if episode.faults:
        location = getattr(episode.error, "location", None)
        caught = "" if episode.error is not None else " (the program caught the error and went on)"
        return ProgramFault(f"{task.program_name} {episode.faults[0]}{f' at {location}' if location else ''}{caught}, "
                            f"{where}")
    return episode.error


def _agent_rows(episodes: Sequence[ProgramEpisode], num_agents: int, pad_token_ids: Sequence[int],
                ) -> tuple[list[Generation], list[torch.Tensor]]:
    """Per agent, its calls of every episode as the rows of one Generation (prompts left-padded, completions
    right-padded, exactly the recorded tokens trained), and the flat episode index of each row."""
    generations, rows = [], []
    for agent in range(num_agents):
        calls = [(index, call.completion) for index, episode in enumerate(episodes) for call in episode.calls
                 if call.agent == agent]
        generations.append(as_generation([completion for _, completion in calls],
                                         pad_token_ids[agent] if agent < len(pad_token_ids) else 0))
        rows.append(torch.tensor([index for index, _ in calls], dtype=torch.long))
    return generations, rows


def as_generation(completions: Sequence[TokenCompletion], pad_token_id: int = 0) -> Generation:
    """``completions`` as the rows of one :class:`~teamrl.rollout.generate.Generation`: prompts left-padded,
    completions right-padded with ``pad_token_id``, the mask on every recorded completion token."""
    prompt_width = max((len(c.prompt_ids) for c in completions), default=1)
    width = max((len(c.completion_ids) for c in completions), default=1)
    rows = len(completions)
    prompt_ids = torch.full((rows, prompt_width), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(rows, prompt_width, dtype=torch.long)
    completion_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros(rows, width, dtype=torch.long)
    logprobs = torch.zeros(rows, width)
    for row, completion in enumerate(completions):
        prompt, tokens = completion.prompt_ids, completion.completion_ids
        prompt_ids[row, prompt_width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        prompt_mask[row, prompt_width - len(prompt):] = 1
        completion_ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        completion_mask[row, :len(tokens)] = 1
        logprobs[row, :len(tokens)] = torch.tensor(completion.logprobs)
    return Generation(prompt_ids, prompt_mask, completion_ids, completion_mask, logprobs,
                      [completion.text for completion in completions])
