"""What training a program through the gateway costs, against the native path on the same work, in one run.

The work: the TL;DR pair, G episodes of one paper per round. Native: both agents' G completions of each prompt in one
mixed-adapter ``generate_team`` call, as the ``demo_tldr_cpu`` preset samples (``Trainer`` without the update).
Gateway: the same team behind teamrl's gateway, the same two prompts sent by the program
:func:`teamrl.examples.tldr_program.parallel` (the official ``AsyncOpenAI`` client, two concurrent calls an episode),
G episodes at once (:func:`teamrl.rollout.episodes.run_episodes`). Both are scored by the TL;DR reward; the rounds
alternate (native, gateway, native, ...) on the same papers, so that other work on the machine slows both alike.
Reported: seconds per episode and completion tokens per second of each, and their ratios (the gateway's cost); and
whether both sample the policy training trains: the largest gap, over every sampled token of every round, between
the log-prob a path recorded while sampling and the one training's forward pass recomputes
(:func:`~teamrl.algorithms.logprobs.token_logprobs`, outside the timed part), and whether the gateway's prompt ids
are the native prompt's.

Then team latency: one episode at a time through the gateway (the two agents' calls concurrently) against one model
writing both parts in one call (the ``tldr`` task's single-agent prompt, both agents' ``max_new_tokens``).

    python benchmarks/program_gateway.py [--model bundled|tiny] [--rounds 3] [--episodes 8] [--max-new-tokens 64]
        [--latency-episodes 4] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from teamrl.algorithms.logprobs import token_logprobs
from teamrl.config import load_config
from teamrl.envs.base import configured_env
from teamrl.evaluation.report import markdown_table
from teamrl.examples import tldr_program
from teamrl.rollout.episodes import ProgramEpisode, run_episodes
from teamrl.rollout.generate import Generation, encode_prompts, generate_team
from teamrl.serve.gateway import Gateway
from teamrl.team import Team


def build(model: str, max_new_tokens: int):
    """The demo preset's team (two LoRA agents named as the program calls them) and the tldr task."""
    config = load_config("demo_tldr_cpu", [f"team.model={model}", f"team.sampling.max_new_tokens={max_new_tokens}",
                                           "team.agents=[{name: planner}, {name: writer}]"])
    writing = configured_env(config.env.name, config.env.kwargs, config.env.folders)
    program = configured_env("program", {"program": "teamrl.examples.tldr_program:parallel", "data": "aclsum",
                                         "eval_split": "validation", "agents": ["planner", "writer"]})
    team = Team.from_config(config.team, writing, seed=config.seed)
    return team, writing, program


def native_prompts(team: Team, item: dict) -> list[list[str]]:
    """The program's two prompts for ``item``, rendered as training renders an agent's prompt."""
    text = tldr_program._text(item)
    messages = [tldr_program._chat(tldr_program.PLANNER, f"Text:\n{text}\n\n{tldr_program.ONE_SENTENCE}"),
                tldr_program._chat(tldr_program.DETAILED, f"Text:\n{text}\n\n{tldr_program.IN_DETAIL}")]
    return [[agent.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)]
            if agent.uses_chat_template else ["\n\n".join(m["content"] for m in chat)]
            for agent, chat in zip(team, messages)]


def native_round(team: Team, item: dict, episodes: int, seed: int) -> tuple[float, int, list[float], float]:
    """The program's two prompts, sampled natively: seconds, completion tokens, rewards, log-prob drift."""
    prompts = native_prompts(team, item)
    start = time.perf_counter()
    generations = generate_team(team, prompts, episodes, seed=seed)
    seconds = time.perf_counter() - start
    planner, writer = generations
    rewards = [tldr_program.tldr_reward(a, b).total for a, b in zip(planner.texts, writer.texts)]
    return seconds, planner.num_tokens + writer.num_tokens, rewards, logprob_drift(team, generations)


def gateway_round(program, gateway: Gateway, item: dict, episodes: int, seed: int) -> tuple[float, int, list[float],
                                                                                              float]:
    rollout = run_episodes(program, gateway, [item], episodes, seed=seed)
    team = gateway.served.team
    prompts = native_prompts(team, item)
    for agent, prompt, generation in zip(team, prompts, rollout.generations):
        ids, mask = encode_prompts(agent, prompt)
        expected = ids[0][mask[0].bool()].tolist()
        for row_ids, row_mask in zip(generation.prompt_ids, generation.prompt_mask):
            if row_ids[row_mask.bool()].tolist() != expected:
                raise AssertionError(f"{agent.name}: the gateway's prompt ids are not the native prompt's")
    return rollout.seconds, rollout.num_tokens, rollout.rewards.reshape(-1).tolist(), logprob_drift(
        team, rollout.generations)


def logprob_drift(team: Team, generations: list[Generation]) -> float:
    """The largest |sampling log-prob - training's recomputed log-prob| over every sampled token of ``generations``
    (one per agent): 0 up to float error when a path samples the policy that training trains."""
    drift = 0.0
    for agent, generation in zip(team, generations):
        agent.activate()
        with torch.no_grad():
            recomputed = token_logprobs(agent.model, generation.prompt_ids, generation.prompt_mask,
                                        generation.completion_ids, generation.completion_mask,
                                        temperature=agent.sampling.temperature)
        sampled = generation.completion_mask.bool()
        drift = max(drift, float((recomputed - generation.sampling_logprobs)[sampled].abs().max()))
    return drift


async def _single_call(base_url: str, single_prompt: str, role: str, max_tokens: int) -> int:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0) as client:
        answer = await client.chat.completions.create(model="planner", max_tokens=max_tokens,
                                                      messages=tldr_program._chat(role, single_prompt))
    return answer.usage.completion_tokens


def latency(program, writing, gateway: Gateway, items: list[dict], max_new_tokens: int) -> dict[str, float]:
    """Seconds per answer, one at a time: the team (two concurrent calls) and one model writing both parts."""
    team_seconds, single_seconds, team_tokens, single_tokens = [], [], [], []
    writer = gateway.served.team[0]  # one model writing both parts gets both agents' tokens
    own = writer.sampling
    for n, item in enumerate(items):
        rollout = run_episodes(program, gateway, [item], 1, seed=1000 + n)
        team_seconds.append(rollout.seconds)
        team_tokens.append(rollout.num_tokens)

        episode = ProgramEpisode(f"single-{n}", item, seed=n)
        url = gateway.open(episode)
        writer.sampling = dataclasses.replace(own, max_new_tokens=2 * max_new_tokens)
        start = time.perf_counter()
        single_tokens.append(asyncio.run(_single_call(
            url, writing.single_agent_observation({"text": tldr_program._text(item)}), writing.single_agent_role,
            2 * max_new_tokens)))
        single_seconds.append(time.perf_counter() - start)
        writer.sampling = own
        gateway.close(episode)
    return {"team_s": statistics.median(team_seconds), "single_s": statistics.median(single_seconds),
            "team_tokens": statistics.mean(team_tokens), "single_tokens": statistics.mean(single_tokens)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bundled", help="team.model: bundled (default) or tiny")
    parser.add_argument("--rounds", type=int, default=3, help="native/gateway pairs of rounds (default: %(default)s)")
    parser.add_argument("--episodes", type=int, default=8, help="G: episodes of one paper a round (default: 8)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="each agent's (default: %(default)s)")
    parser.add_argument("--latency-episodes", type=int, default=4, help="one-at-a-time answers timed (default: 4)")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args()

    began, load_start = time.perf_counter(), os.getloadavg()[0]
    team, writing, program = build(args.model, args.max_new_tokens)
    items = list(writing.items("train"))
    rounds = []
    with Gateway(team, program) as gateway:
        native_round(team, items[0], 2, seed=0)  # warm-up: kernels, allocations, the first imports
        gateway_round(program, gateway, items[0], 2, seed=0)
        for r in range(args.rounds):
            item = items[1 + r]
            for path in ("native", "gateway"):
                load = os.getloadavg()[0]
                seconds, tokens, rewards, drift = (
                    native_round(team, item, args.episodes, seed=r) if path == "native" else
                    gateway_round(program, gateway, item, args.episodes, seed=r))
                rounds.append({"round": r, "path": path, "seconds": seconds, "tokens": tokens,
                               "reward": statistics.mean(rewards), "rewards": rewards, "logprob_drift": drift,
                               "load": load})
                print(f"  round {r} {path}: {seconds:.1f} s, {tokens} tokens, load {load:.1f}", file=sys.stderr,
                      flush=True)
        team_latency = latency(program, writing, gateway, items[10:10 + args.latency_episodes], args.max_new_tokens)

    def total(path: str, key: str) -> float:
        return sum(r[key] for r in rounds if r["path"] == path)

    def rewards_of(path: str) -> list[float]:
        return [reward for r in rounds if r["path"] == path for reward in r["rewards"]]

    def reward_cell(path: str) -> str:
        values = rewards_of(path)
        return f"{statistics.mean(values):.2f} ± {statistics.stdev(values) / len(values) ** 0.5:.2f}"

    def reward_gap(se: bool = False) -> float:
        """Gateway minus native mean reward, or its SE (the two paths' episodes independent)."""
        gateway, native = rewards_of("gateway"), rewards_of("native")
        if se:
            return (statistics.variance(gateway) / len(gateway) + statistics.variance(native) / len(native)) ** 0.5
        return statistics.mean(gateway) - statistics.mean(native)

    def drift(path: str) -> float:
        return max(r["logprob_drift"] for r in rounds if r["path"] == path)

    episodes = args.rounds * args.episodes
    native_s, gateway_s = total("native", "seconds") / episodes, total("gateway", "seconds") / episodes
    native_tps = total("native", "tokens") / total("native", "seconds")
    gateway_tps = total("gateway", "tokens") / total("gateway", "seconds")
    summary = {"native_s_per_episode": native_s, "gateway_s_per_episode": gateway_s,
               "cost_per_episode": gateway_s / native_s, "native_tokens_per_s": native_tps,
               "gateway_tokens_per_s": gateway_tps, "cost_per_token": native_tps / gateway_tps,
               "reward_gap": reward_gap(), "reward_gap_se": reward_gap(se=True),
               "native_logprob_drift": drift("native"), "gateway_logprob_drift": drift("gateway"), **team_latency,
               "team_over_single_latency": team_latency["team_s"] / team_latency["single_s"]}
    header = (f"{datetime.date.today().isoformat()}, model {args.model}, {args.rounds} rounds x {args.episodes} "
              f"episodes, max_new_tokens {args.max_new_tokens}, {platform.machine()} {os.cpu_count()} cores, torch "
              f"threads {torch.get_num_threads()}, load average {load_start:.1f} at the start, "
              f"{time.perf_counter() - began:.0f} s in all")
    headers = ["", "native (generate_team)", "gateway (program, 2 concurrent calls)", "gateway / native"]
    table = markdown_table(headers, [
        ["seconds per episode", f"{native_s:.2f}", f"{gateway_s:.2f}", f"{gateway_s / native_s:.2f}x"],
        ["completion tokens/s", f"{native_tps:.1f}", f"{gateway_tps:.1f}", f"{native_tps / gateway_tps:.2f}x cost"],
        ["mean joint reward (± SE over episodes)", reward_cell("native"), reward_cell("gateway"),
         f"{reward_gap():+.2f} ± {reward_gap(se=True):.2f}"],
        ["largest sampling vs recomputed log-prob gap", f"{drift('native'):.1e}", f"{drift('gateway'):.1e}", ""]])
    latency_table = markdown_table(["one answer at a time", "median seconds", "completion tokens"], [
        ["team: the two agents concurrently (program)", f"{team_latency['team_s']:.2f}",
         f"{team_latency['team_tokens']:.0f}"],
        ["one model writing both parts", f"{team_latency['single_s']:.2f}", f"{team_latency['single_tokens']:.0f}"]])
    print(f"{header}\n\n{table}\n\n{latency_table}\n\nteam / single latency: "
          f"{summary['team_over_single_latency']:.2f}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"header": header, "summary": summary, "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()
