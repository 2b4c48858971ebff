"""Held-out evaluation: one path for training, ``teamrl demo`` and ``teamrl eval``.

:func:`sample_held_out` samples a team's joint actions for held-out items; :meth:`teamrl.train.Trainer.evaluate`
(which ``teamrl demo`` and ``teamrl compare`` report) and ``teamrl eval``'s ``team:PATH`` method both call it, so
a team scores the same wherever it is evaluated: both play episodes ``algorithm.num_turns`` long (every turn's
joint reward summed), while ``teamrl eval``'s prompt-only baselines answer once. :func:`score` rewards any
method's joint actions with the environment's own joint reward and summarises them (:func:`method_metrics`,
:func:`sample_records`); ``teamrl eval`` reports that, and ``Trainer.evaluate`` the same numbers under
training's names (:func:`training_view`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from teamrl.envs.base import Environment, Item, Step
from teamrl.envs.centralized import CentralizedEnv
from teamrl.envs.checks import checked_observations, checked_rewards, first_observations
from teamrl.evaluation.baselines import Episode, MethodOutput, as_inner_joint_actions
from teamrl.evaluation.metrics import accuracy_at_k, normalised_return, pass_at_k, summarise_levels, tokens_per_second
from teamrl.rewards.base import RewardResult
from teamrl.rollout.generate import derive_seed

if TYPE_CHECKING:
    from teamrl.envs.program import ProgramTask
    from teamrl.rollout.episodes import Endpoint, ProgramEpisode
    from teamrl.rollout.tree import SampleFn

#: Held-out items per sampling call: a generate call's cost grows faster than its batch (longer padded
#: rows, bigger caches; timings in docs/evaluation.md).
EVAL_ITEMS_PER_BATCH = 8


def sample_held_out(sample: SampleFn, env: Environment, items: Sequence[Item], num_samples: int, seed: int,
                    items_per_batch: int = EVAL_ITEMS_PER_BATCH, num_turns: int = 1) -> MethodOutput:
    """``num_samples`` episodes per item (item-major) of the team behind ``sample``, each agent on its own
    observation, with the tokens generated and the seconds sampling took.

    An episode is ``num_turns`` turns: after the first, every agent sees the environment's feedback
    (``next_observations``) and answers once more, as in a training episode but without the tree (one joint
    action per turn); :func:`score` sums its turns' joint rewards. Items go ``items_per_batch`` at a time,
    batch b of turn t sampled under ``derive_seed(seed, b)`` (t = 1) or ``derive_seed(seed, t, b)``: the
    numbers depend on the seed, the items and the batching alone, not on what the caller's RNG did before,
    so evaluating before and after training draws alike and training's own stream is untouched.

    Raises:
        ValueError: ``items_per_batch`` or ``num_turns`` < 1.
    """
    if items_per_batch < 1:
        raise ValueError(f"items_per_batch: must be >= 1 (got {items_per_batch})")
    if num_turns < 1:
        raise ValueError(f"num_turns: must be >= 1 (got {num_turns})")
    observations = first_observations(env, items)
    answers, tokens, seconds = _sample_in_batches(sample, env, observations, num_samples, items_per_batch,
                                                  lambda batch: derive_seed(seed, batch))
    episodes = [Episode(items[row // num_samples], observations[row // num_samples], actions)
                for row, actions in enumerate(answers)]
    for turn in range(2, num_turns + 1):
        episodes, turn_tokens, turn_seconds = _next_turn(sample, env, episodes, turn, seed,
                                                         items_per_batch * num_samples)
        tokens, seconds = tokens + turn_tokens, seconds + turn_seconds
    return MethodOutput(episodes, tokens, seconds)


def _sample_in_batches(sample: SampleFn, env: Environment, observations: Sequence[list[str]], num_samples: int,
                       batch_size: int, batch_seed: Callable[[int], int]) -> tuple[list[list[str]], int, float]:
    """Every agent's ``num_samples`` answers to each of ``observations`` (a joint action per row, rows
    observation-major), ``batch_size`` observations per sampling call, call b under ``batch_seed(b)``; with
    the tokens generated and the seconds sampling took."""
    answers: list[list[str]] = []
    tokens, seconds = 0, 0.0
    for batch, start in enumerate(range(0, len(observations), batch_size)):
        chunk = observations[start:start + batch_size]
        began = time.perf_counter()
        generations = sample([[obs[i] for obs in chunk] for i in range(env.num_agents)], num_samples,
                             batch_seed(batch))
        seconds += time.perf_counter() - began
        tokens += sum(generation.num_tokens for generation in generations)
        answers += [[generation.texts[row] for generation in generations] for row in range(len(chunk) * num_samples)]
    return answers, tokens, seconds


def _next_turn(sample: SampleFn, env: Environment, episodes: Sequence[Episode], turn: int, seed: int,
               batch_size: int) -> tuple[list[Episode], int, float]:
    """Each episode one turn longer: its last joint action scored and kept in its history, then every agent's
    answer to the feedback (one sample per episode, ``batch_size`` episodes per sampling call)."""
    requests = [(episode.item, episode.actions, episode.history) for episode in episodes]
    results = checked_rewards(env, requests, env.joint_rewards(requests))
    histories = [(*episode.history, Step(tuple(episode.observations), tuple(episode.actions), result))
                 for episode, result in zip(episodes, results)]
    observations = [checked_observations(env, "next_observations", episode.item,
                                         env.next_observations(episode.item, history))
                    for episode, history in zip(episodes, histories)]
    answers, tokens, seconds = _sample_in_batches(sample, env, observations, 1, batch_size,
                                                  lambda batch: derive_seed(seed, turn, batch))
    longer = [Episode(episode.item, seen, actions, episode.trace, history)
              for episode, seen, actions, history in zip(episodes, observations, answers, histories)]
    return longer, tokens, seconds


def score(env: Environment, output: MethodOutput, num_samples: int,
          ks: Sequence[int] = (1,)) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """A method's metrics (:func:`method_metrics`) and records (:func:`sample_records`), every joint action of
    ``output`` (``num_samples`` per item) scored by the environment's own joint reward. A centralised policy's
    completions (:class:`~teamrl.envs.centralized.CentralizedEnv`) are scored as the joint actions of the task
    it plays, so its numbers are a team's. A multi-turn episode scores its return (:func:`episode_result`)."""
    if isinstance(env, CentralizedEnv):
        env, output = env.inner, as_inner_joint_actions(env, output)
    requests = [(episode.item, episode.actions, episode.history) for episode in output.episodes]
    last = checked_rewards(env, requests, env.joint_rewards(requests))
    rewards = [episode_result(episode.history, result) for episode, result in zip(output.episodes, last)]
    metrics = method_metrics(env, output, rewards, num_samples, ks)
    if output.episodes and output.episodes[0].history:  # whether later turns beat the first: the feedback's use
        turns = [[*(step.reward.total for step in episode.history), result.total]
                 for episode, result in zip(output.episodes, last)]
        metrics.update({f"turn{turn}/reward_mean": statistics.fmean(column)
                        for turn, column in enumerate(zip(*turns), start=1)})
    return metrics, sample_records(env, output.episodes, rewards, num_samples)


def episode_result(history: Sequence[Step], last: RewardResult) -> RewardResult:
    """An episode's return as one RewardResult: every turn's joint reward and parts summed (undiscounted: what
    training maximises at ``discount: 1``), the last turn's counts (the state the episode ended in: blocks
    built, tests passed). A one-turn episode's is its reward."""
    if not history:
        return last
    turns = [step.reward for step in history] + [last]
    parts: dict[str, float] = {}
    for result in turns:
        for name, value in result.parts.items():
            parts[name] = parts.get(name, 0.0) + value
    return RewardResult(sum(result.total for result in turns), parts, dict(last.counts))


def method_metrics(env: Environment, output: MethodOutput, rewards: Sequence[RewardResult], num_samples: int,
                   ks: Sequence[int]) -> dict[str, float]:
    """A method's metrics (names as in ``teamrl eval``'s ``results.json``).

    ``normalised_return`` (the mean return over the largest return of an episode that long,
    :meth:`~teamrl.envs.base.Environment.max_return`: a one-turn baseline and a team's multi-turn episodes
    on one scale), ``reward_mean``, ``reward_std``, ``level/PART`` (mean of each reward part),
    ``count/NAME`` (mean of each of the reward's counts, e.g. digit_sum's ``hits``), ``tokens``, ``seconds``,
    ``tokens_per_answer``, ``seconds_per_answer`` (a joint action's share of the batched wall-clock time)
    and ``tokens_per_s`` (:func:`score` adds ``turnT/reward_mean``, each turn's joint reward, to a multi-turn
    episode's); for a task graded by tests (:meth:`~teamrl.envs.base.Environment.test_pass_rate`, the
    coding tasks) also ``pass@k``, ``accuracy@k`` (averaged over items, from the item's ``num_samples`` joint
    actions) and ``tests_passed`` (the mean fraction of an item's held tests a joint action passes), and for one
    that names cooperation schemes (:attr:`~teamrl.envs.base.Environment.cooperation_schemes`) ``scheme/NAME``
    (the fraction of joint actions in each).
    """
    totals = [reward.total for reward in rewards]
    num_turns = len(output.episodes[0].history) + 1 if output.episodes else 1
    metrics = {"normalised_return": normalised_return(totals, env.max_return(num_turns)),
               "reward_mean": statistics.fmean(totals),
               "reward_std": statistics.pstdev(totals)}
    metrics.update({f"level/{name}": value for name, value in summarise_levels([r.parts for r in rewards]).items()})
    metrics.update({f"count/{name}": value for name, value in summarise_levels([r.counts for r in rewards]).items()})
    rates = [env.test_pass_rate(episode.item, reward) for episode, reward in zip(output.episodes, rewards)]
    if all(rate is not None for rate in rates):
        per_item = [rates[start:start + num_samples] for start in range(0, len(rates), num_samples)]
        for k in ks:
            metrics[f"pass@{k}"] = statistics.fmean(pass_at_k(num_samples, sum(r == 1.0 for r in item), k)
                                                    for item in per_item)
            metrics[f"accuracy@{k}"] = statistics.fmean(accuracy_at_k(item, k) for item in per_item)
        metrics["tests_passed"] = statistics.fmean(rates)
    if env.cooperation_schemes:
        schemes = [env.cooperation_scheme(episode.item, episode.actions) for episode in output.episodes]
        metrics.update({f"scheme/{name}": schemes.count(name) / len(schemes) for name in env.cooperation_schemes})
    answers = len(output.episodes)
    metrics.update({"tokens": float(output.tokens), "seconds": output.seconds,
                    "tokens_per_answer": output.tokens / answers, "seconds_per_answer": output.seconds / answers,
                    "tokens_per_s": tokens_per_second(output.tokens, max(output.seconds, 1e-9))})
    return metrics


def sample_records(env: Environment, episodes: Sequence[Episode], rewards: Sequence[RewardResult],
                   num_samples: int) -> list[dict[str, Any]]:
    """``results.json``'s record of each joint action: what each agent saw and wrote, and its reward."""
    records = []
    for index, (episode, reward) in enumerate(zip(episodes, rewards)):
        record = {"item": episode.item.get("id"), "sample": index % num_samples,
                  "observations": episode.observations, "actions": episode.actions,
                  "reward": reward.total, "parts": reward.parts, "counts": reward.counts, **episode.trace}
        if episode.history:  # a multi-turn episode: its earlier turns, its last above
            record["earlier_turns"] = [{"observations": list(step.observations), "actions": list(step.actions),
                                        "reward": step.reward.total} for step in episode.history]
        if env.cooperation_schemes:
            record["scheme"] = env.cooperation_scheme(episode.item, episode.actions)
        records.append(record)
    return records


def program_held_out(task: ProgramTask, endpoint: Endpoint, items: Sequence[Item], num_samples: int, seed: int,
                     items_per_batch: int = EVAL_ITEMS_PER_BATCH) -> list[ProgramEpisode]:
    """``num_samples`` episodes of a program task on each of ``items`` (item-major), played against ``endpoint``
    (the agents of a training run, or whatever answers there), ``items_per_batch`` items' episodes at once, batch b
    seeded by ``derive_seed(seed, b)``: the held-out evaluation of a program, as :func:`sample_held_out` is another
    task's."""
    from teamrl.rollout.episodes import run_episodes

    episodes = []
    for batch, start in enumerate(range(0, len(items), items_per_batch)):
        rollout = run_episodes(task, endpoint, items[start:start + items_per_batch], num_samples,
                               seed=derive_seed(seed, batch))
        episodes += [episode for group in rollout.episodes for episode in group]
    return episodes


def program_score(task: Environment, episodes: Sequence[ProgramEpisode], num_samples: int, agent_names: Sequence[str],
                  seconds: float) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """A program's metrics and records under ``teamrl eval``'s names (:func:`method_metrics`, :func:`sample_records`):
    normalised return, reward mean and spread, each part's and count's mean, tokens and seconds, and ``calls/AGENT``
    (calls per episode); each record's ``actions`` are each agent's answers in the episode, joined."""
    rewards = [episode.result for episode in episodes]
    totals = [reward.total for reward in rewards]
    tokens = sum(len(call.completion.completion_ids) for episode in episodes for call in episode.calls)
    metrics = {"normalised_return": normalised_return(totals, task.max_return(1)),
               "reward_mean": statistics.fmean(totals), "reward_std": statistics.pstdev(totals)}
    metrics.update({f"level/{name}": value for name, value in summarise_levels([r.parts for r in rewards]).items()})
    metrics.update({f"count/{name}": value for name, value in summarise_levels([r.counts for r in rewards]).items()})
    for index, name in enumerate(agent_names):
        metrics[f"calls/{name}"] = statistics.fmean(sum(call.agent == index for call in episode.calls)
                                                    for episode in episodes)
    metrics.update({"tokens": float(tokens), "seconds": seconds, "tokens_per_answer": tokens / len(episodes),
                    "seconds_per_answer": seconds / len(episodes),
                    "tokens_per_s": tokens_per_second(tokens, max(seconds, 1e-9))})
    records = [{"item": episode.item.get("id"), "sample": index % num_samples,
                "actions": ["\n---\n".join(call.completion.text for call in episode.calls if call.agent == seat)
                            for seat in range(len(agent_names))],
                "calls": [{"agent": agent_names[call.agent], "text": call.completion.text} for call in episode.calls],
                "reward": episode.result.total, "parts": episode.result.parts, "counts": episode.result.counts}
               for index, episode in enumerate(episodes)]
    return metrics, records


def program_view(episodes: Sequence[ProgramEpisode], agent_names: Sequence[str],
                 ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """:func:`training_view`'s numbers and records for a program's episodes: ``reward/mean`` and ``reward/std`` as
    training computes them, ``reward/PART`` and ``count/NAME`` means, ``calls/AGENT`` (calls per episode); each record
    with the agents' answers in the order the program called them."""
    totals = torch.tensor([episode.result.total for episode in episodes])
    view = {"reward/mean": float(totals.mean()), "reward/std": float(totals.std()) if totals.numel() > 1 else 0.0}
    view.update({f"reward/{name}": value for name, value in
                 sorted(summarise_levels([episode.result.parts for episode in episodes]).items())})
    view.update({f"count/{name}": value for name, value in
                 sorted(summarise_levels([episode.result.counts for episode in episodes]).items())})
    for index, name in enumerate(agent_names):
        view[f"calls/{name}"] = statistics.fmean(sum(call.agent == index for call in episode.calls)
                                                 for episode in episodes)
    samples = [{"item": episode.item.get("id"),
                "calls": [{"agent": agent_names[call.agent], "text": call.completion.text} for call in episode.calls],
                "reward": episode.result.total, "reward_parts": episode.result.parts,
                "reward_counts": episode.result.counts} for episode in episodes]
    return view, samples


def training_view(metrics: dict[str, float], records: Sequence[dict[str, Any]],
                  ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """:func:`score`'s numbers under the names training logs, for :meth:`teamrl.train.Trainer.evaluate`.

    ``reward/mean`` and ``reward/std`` are computed as training's own
    (:func:`teamrl.algorithms.advantages.rollout_metrics`: float32, std with Bessel's correction), so a held-out
    point sits on the reward curve beside them; ``reward/PART`` is ``level/PART``, ``count/NAME`` stays, both in
    name order, and a multi-turn episode's ``turnT/reward_mean`` is ``reward/turnT/mean`` (training's name).
    The records keep the keys of training's ``samples.jsonl`` (``reward_parts``, ``reward_counts``).
    """
    totals = torch.tensor([record["reward"] for record in records])
    view = {"reward/mean": float(totals.mean()), "reward/std": float(totals.std()) if totals.numel() > 1 else 0.0}
    view.update({f"reward/{name.removeprefix('level/')}": value for name, value in sorted(metrics.items())
                 if name.startswith("level/")})
    view.update({name: value for name, value in sorted(metrics.items()) if name.startswith("count/")})
    view.update({f"reward/{name.removesuffix('/reward_mean')}/mean": value for name, value in sorted(metrics.items())
                 if name.startswith("turn") and name.endswith("/reward_mean")})
    samples = [{"item": record["item"], "observations": record["observations"], "actions": record["actions"],
                "reward": record["reward"], "reward_parts": record["parts"], "reward_counts": record["counts"],
                **({"earlier_turns": record["earlier_turns"]} if "earlier_turns" in record else {})}
               for record in records]
    return view, samples
