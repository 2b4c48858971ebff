"""One library's side of ``comlrl_side_by_side.py``, run in its own process so its memory is its own.

    python benchmarks/side_by_side_worker.py teamrl|comlrl SPEC_JSON RESULT_JSON

Loads the bundled model's transformers directory, evaluates the team on held-out items (once, when
the spec asks), trains ``steps`` updates with the named library, evaluates again and writes the
timings and rewards to RESULT_JSON. Everything both libraries must share — the items and their order,
the prompts, the reward, the between-turn observation, the evaluation — is defined here once.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from comlrl_side_by_side import (
    AGENT_NAMES,
    RunSpec,
    comlrl_config,
    comlrl_model_config,
    joint_actions_per_step,
    teamrl_config,
)
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from teamrl.config import TrainConfig, config_from_dict, load_config
from teamrl.envs.base import Item, Step
from teamrl.envs.writing import TldrEnv
from teamrl.evaluation.compare import item_standard_error
from teamrl.models.bundled import ensure_converted, get_bundled_model
from teamrl.team import Agent
from teamrl.train import Trainer, batch_indices

#: Instruction of the second turn, after the agent's own first answer and the team's score.
REVISION_INSTRUCTION = "Rewrite your answer so that the team scores higher. Reply with the new answer only."


class TwoTurnTldrEnv(TldrEnv):
    """teamrl's ``tldr`` task with a second turn: each agent revises its answer after seeing the team's score.

    The tldr task is single-turn in teamrl; the benchmark needs a multi-turn variant both libraries
    can run, and CoMLRL's external transition can only build a prompt from the text, the agents'
    completions and their histories. So the feedback is what both can compute from those: the joint
    reward of the first turn, recomputed from the two completions. Each agent still sees only its own
    previous answer (decentralised observations). The second turn is scored by the same reward.
    """

    max_turns = 2

    def next_observations(self, item: Item, history: Sequence[Step]) -> list[str]:
        """Each agent's turn-2 observation: the text, its own last answer, the team's score, its instruction."""
        last = history[-1]
        levels = ", ".join(f"{name} {score:.2f}" for name, score in last.reward.parts.items())
        return [
            f"{self.text_label}:\n{item['text']}\n\nYour previous answer:\n{answer}\n\n"
            f"Your team's score: {last.reward.total:.2f} of {self.max_reward:.1f} ({levels}).\n\n"
            f"{instruction} {REVISION_INSTRUCTION}"
            for answer, instruction in zip(last.actions, self.instructions)
        ]


def make_env(spec: RunSpec) -> TldrEnv:
    """The benchmark task: teamrl's ``tldr`` on the offline aclsum abstracts, two turns when the spec says so."""
    cls = TwoTurnTldrEnv if spec.turns == 2 else TldrEnv
    return cls(source="aclsum", max_text_chars=spec.max_text_chars)


def chat_prompt(tokenizer: PreTrainedTokenizerBase, role: str, observation: str) -> str:
    """What an agent is conditioned on: its role as system message, the observation as user message.

    The same text teamrl's ``Agent.prompt`` builds (the teamrl worker asserts so).
    """
    messages = [{"role": "system", "content": role}, {"role": "user", "content": observation}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def training_items(env: TldrEnv, spec: RunSpec) -> list[Item]:
    """The items of every step in order: teamrl's data order, which CoMLRL is fed unshuffled."""
    items = env.items("train")
    return [items[i] for step in range(spec.steps) for i in batch_indices(len(items), spec.items, step, spec.seed)]


def tokens_until_eos(tokens: torch.Tensor, eos_token_id: int) -> int:
    """Generated tokens that count: up to and including the first EOS (all of them when there is none)."""
    hits = (tokens == eos_token_id).nonzero()
    return int(hits[0]) + 1 if hits.numel() else int(tokens.numel())


class BudgetSpent(Exception):
    """Raised from inside a library's training loop when the learning curve's minutes are spent."""


class TrainingClock:
    """A learning curve's clock: training wall-clock with the evaluations left out.

    ``evaluate()`` (the held-out numbers: ``reward/mean`` and its ``reward/se``) runs at the start, whenever
    ``every_seconds`` of training have passed since the last evaluation, and when ``budget_seconds`` are
    spent; :meth:`step_done` is called at the end of each update and says whether the budget is spent (the
    update under way when it runs out finishes, as in ``teamrl compare``).
    """

    def __init__(self, budget_seconds: float, every_seconds: float,
                 evaluate: Callable[[], dict[str, float]]) -> None:
        self.budget_seconds, self.every_seconds, self.evaluate = budget_seconds, every_seconds, evaluate
        self.train_seconds, self.steps = 0.0, 0
        self.step_seconds: list[float] = []
        self.curve: list[dict[str, float]] = []
        self._record()

    def _record(self) -> None:
        began = time.perf_counter()
        point = self.evaluate()
        self.curve.append({"step": self.steps, "train_seconds": self.train_seconds, **point,
                           "eval_seconds": time.perf_counter() - began})
        print(f"  step {self.steps:3d}, {self.train_seconds / 60:5.2f} min of training: held-out "
              f"{point['reward/mean']:.3f} ± {point.get('reward/se', 0.0):.3f}", flush=True)
        self._resumed = time.perf_counter()

    def step_done(self) -> bool:
        """Count the update that just ended; evaluate when due. True once the budget is spent."""
        seconds = time.perf_counter() - self._resumed
        self.train_seconds += seconds
        self.step_seconds.append(seconds)
        self.steps += 1
        spent = self.train_seconds >= self.budget_seconds
        last = self.curve[-1]["train_seconds"]
        if spent or (self.every_seconds and self.train_seconds - last >= self.every_seconds):
            self._record()
        else:
            self._resumed = time.perf_counter()
        return spent

    def finish(self) -> None:
        """Training ended before the budget was spent: evaluate the final weights unless that was just done."""
        if self.curve[-1]["step"] != self.steps:
            self._record()

    def result(self) -> dict[str, Any]:
        """What the worker reports in learning-curve mode."""
        return {"curve": self.curve, "step_times": self.step_seconds, "train_seconds": self.train_seconds,
                "steps": self.steps}


def _rss_status_gb(field: str) -> float | None:
    """A memory field of ``/proc/self/status`` (``VmHWM``: peak resident set; ``VmRSS``: current) in GB."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 / 1e9 for line in lines if line.startswith(f"{field}:")), None)


@contextlib.contextmanager
def training_memory(result: dict[str, Any]) -> Iterator[None]:
    """Record in ``result`` the peak RSS before the block (loading, the first evaluation: ``setup_peak_rss_gb``)
    and within it alone (``train_peak_rss_gb``): the kernel's peak is reset to the current RSS on entry
    (``/proc/self/clear_refs``, Linux 4.0+; None where it cannot be). The evaluation is the same code for
    both libraries, and with many episodes its batched sampling, not training, can set a worker's peak.
    The reset also hides the earlier peak from ``wait4``, hence ``setup_peak_rss_gb``."""
    result["setup_peak_rss_gb"] = _rss_status_gb("VmHWM")
    try:
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    yield
    result["train_peak_rss_gb"] = _rss_status_gb("VmHWM") if reset else None


class HeldOut(NamedTuple):
    """A held-out evaluation: the mean joint reward of each turn, and each item's episodes' turn-1 rewards."""

    per_turn: list[float]
    first_turn_by_item: list[list[float]]

    def curve_point(self) -> dict[str, float]:
        """A learning curve's numbers (single-turn runs): the mean, and its standard error over items."""
        samples = [{"item": i, "reward": reward} for i, rewards in enumerate(self.first_turn_by_item)
                   for reward in rewards]
        return {"reward/mean": self.per_turn[0], "reward/se": item_standard_error(samples)}


@torch.no_grad()
def evaluate(policies: Sequence[Callable[[], torch.nn.Module]], tokenizer: PreTrainedTokenizerBase, env: TldrEnv,
             spec: RunSpec) -> HeldOut:
    """Joint rewards on the first ``eval_items`` held-out items; the same code for both libraries.

    ``policies[i]()`` returns agent i's model ready to sample (for LoRA agents on one base: the base
    routed through agent i's adapter).

    Every item gets ``eval_samples`` episodes; at each turn each agent samples one completion per
    episode from its own prompt (one batched, left-padded ``generate`` per agent and turn) with the
    training sampling settings, from a fixed seed, so equal weights give equal numbers.
    """
    items = list(env.items("eval"))[: spec.eval_items]
    episodes: list[tuple[Item, tuple[Step, ...]]] = [(item, ()) for item in items for _ in range(spec.eval_samples)]
    tokenizer.padding_side = "left"
    per_turn, first_turn = [], []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.eval_seed)
        for _ in range(spec.turns):
            observations = [env.next_observations(item, history) if history else env.observe(item)
                            for item, history in episodes]
            actions = [_sample(policy(), tokenizer,
                               [chat_prompt(tokenizer, env.roles[i], obs[i]) for obs in observations], spec)
                       for i, policy in enumerate(policies)]
            rewards = []
            for e, (item, history) in enumerate(episodes):
                joint = tuple(agent_actions[e] for agent_actions in actions)
                reward = env.joint_reward(item, joint, history)
                rewards.append(reward.total)
                episodes[e] = (item, (*history, Step(tuple(observations[e]), joint, reward)))
            per_turn.append(float(np.mean(rewards)))
            first_turn = first_turn or rewards
    by_item = [first_turn[i * spec.eval_samples:(i + 1) * spec.eval_samples] for i in range(len(items))]
    return HeldOut(per_turn, by_item)


def _sample(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, prompts: list[str], spec: RunSpec) -> list[str]:
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    was_training = model.training
    model.eval()
    out = model.generate(**encoded, do_sample=True, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
                         max_new_tokens=spec.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    model.train(was_training)
    completions = out[:, encoded["input_ids"].shape[1]:]
    return [tokenizer.decode(row[: tokens_until_eos(row, tokenizer.eos_token_id)], skip_special_tokens=True).strip()
            for row in completions]


# --------------------------------------------------------------------------------------------------
# teamrl


def teamrl_trainer_config(spec: RunSpec, model_dir: Path, run_dir: Path) -> TrainConfig:
    """teamrl's config for ``spec``: the matched one, or the preset ``spec.teamrl_preset`` as it ships, on the
    same local model directory (and, for a learning curve, with steps enough for any budget)."""
    if spec.teamrl_preset is None:
        return config_from_dict(teamrl_config(spec, str(model_dir), str(run_dir)))
    return load_config(spec.teamrl_preset, [f"team.model={model_dir}", f"seed={spec.seed}", f"run_dir={run_dir}",
                                            f"steps={spec.steps}", "logging.progress_bar=false",
                                            "logging.sample_every=0", "checkpoint.save_every=0"])


def run_teamrl(spec: RunSpec, model_dir: Path, run_dir: Path) -> dict[str, Any]:
    """Train with teamrl's public API (``Trainer.train_step``), for ``spec.steps`` steps or ``spec.minutes``."""
    started = time.perf_counter()
    env = make_env(spec)
    trainer = Trainer(teamrl_trainer_config(spec, model_dir, run_dir), env=env)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    first = env.observe(env.items("train")[0])
    for i, agent in enumerate(trainer.team):
        assert agent.prompt(first[i]) == chat_prompt(tokenizer, env.roles[i], first[i]), "prompts differ"
    setup_seconds = time.perf_counter() - started
    policies = [_policy(agent) for agent in trainer.team]
    if spec.minutes:
        clock = TrainingClock(60 * spec.minutes, 60 * spec.eval_every_minutes,
                              lambda: evaluate(policies, tokenizer, env, spec).curve_point())
        for _ in range(spec.steps):  # the preset's schedule ends at its last step, whatever the minutes left
            trainer.train_step()
            if clock.step_done():
                break
        else:
            clock.finish()
        return {"setup_seconds": setup_seconds, **clock.result()}
    before = evaluate(policies, tokenizer, env, spec).per_turn if spec.eval_before else None
    history, memory = [], {}
    with training_memory(memory):
        train_start = time.perf_counter()
        for _ in range(spec.steps):
            history.append(trainer.train_step())
        train_seconds = time.perf_counter() - train_start
    joint_actions = sum(m[f"turn{t}/joint_actions"] for m in history for t in range(1, spec.turns + 1))
    assert joint_actions == spec.steps * joint_actions_per_step(spec), (joint_actions, spec)
    return {
        "setup_seconds": setup_seconds,
        "train_seconds": train_seconds,
        "step_times": [m["time/step"] for m in history],
        "generation_seconds": sum(m["time/generation"] for m in history),
        "update_seconds": sum(m["time/update"] for m in history),
        "generated_tokens": int(sum(m["tokens/generated"] for m in history)),
        "optimizer_steps_per_agent": spec.steps,
        "train_reward_turn1": [m["reward/turn1/mean"] for m in history],
        **memory,
        "reward_before": before,
        "reward_after": evaluate(policies, tokenizer, env, spec).per_turn,
    }


def _policy(agent: Agent) -> Callable[[], torch.nn.Module]:
    def policy() -> torch.nn.Module:
        agent.activate()
        return agent.model
    return policy


# --------------------------------------------------------------------------------------------------
# CoMLRL


def run_comlrl(spec: RunSpec, model_dir: Path) -> dict[str, Any]:
    """Train with CoMLRL's ``MAGRPOTrainer`` on the same items, prompts, reward and next-turn prompts."""
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    class TimedMAGRPOTrainer(MAGRPOTrainer):
        """CoMLRL's trainer unchanged, with clocks and a token counter around its generation and update."""

        clock: TrainingClock | None = None

        def start_clock(self, eos_token_id: int) -> None:
            self.eos_token_id = eos_token_id
            self.generation_seconds = self.update_seconds = 0.0
            self.generated_tokens = 0
            self.update_ends: list[float] = []
            self.optimizer_steps = [0] * self.num_agents

        def _generate_completions(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            start = time.perf_counter()
            out = super()._generate_completions(*args, **kwargs)
            self.generation_seconds += time.perf_counter() - start
            self.generated_tokens += sum(tokens_until_eos(t, self.eos_token_id) for t in out["completion_input_ids"][0])
            return out

        def _update_from_samples(self, agent_idx: int, samples: list[Any]) -> None:
            start = time.perf_counter()
            super()._update_from_samples(agent_idx, samples)
            self.update_seconds += time.perf_counter() - start
            # CoMLRL steps the optimiser once per train_batch_size samples
            self.optimizer_steps[agent_idx] += -(-len(samples) // int(self.args.train_batch_size))

        def _drain_ready_buffers(self, ready_agents: list[int]) -> None:
            super()._drain_ready_buffers(ready_agents)
            if ready_agents:  # an update of the agents: the end of one step
                self.update_ends.append(time.perf_counter())
                if self.clock is not None and self.clock.step_done():
                    raise BudgetSpent

    started = time.perf_counter()
    env = make_env(spec)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # CoMLRL takes the first pad token of a prompt as the prompt's end. SmolLM2's pad token is its EOS,
    # which also closes the chat template's system and user turns, so with it CoMLRL would train on
    # (and reward) the rest of the prompt. A pad token that never occurs in a prompt avoids that;
    # generation still stops at EOS and the decoded text drops special tokens either way.
    tokenizer.pad_token = "<|endoftext|>"
    by_id = {item["id"]: item for item in env.items("train")}

    def record(item: Item) -> dict[str, Any]:
        # CoMLRL hands an external transition only the record's "prompt" field: make it the item id.
        fields = {"prompt": item["id"]}
        fields.update({f"prompt_{i}": chat_prompt(tokenizer, env.roles[i], obs)
                       for i, obs in enumerate(env.observe(item))})
        return fields

    def reward(summaries: list[str], details: list[str], *, batch_items: list[dict[str, Any]]) -> list[float]:
        # teamrl strips completions before scoring them; do the same so the reward sees the same text.
        item = by_id[batch_items[0]["prompt"]]
        return [env.joint_reward(item, (a.strip(), b.strip())).total for a, b in zip(summaries, details)]

    def transition(prompt: str, agent_completions: list[str], **_: Any) -> list[str]:
        item = by_id[prompt]
        actions = tuple(c.strip() for c in agent_completions)
        first = env.observe(item)
        history = (Step(tuple(first), actions, env.joint_reward(item, actions)),)
        return [chat_prompt(tokenizer, env.roles[i], obs) for i, obs in enumerate(env.next_observations(item, history))]

    formatters = [lambda r, i=i: r[f"prompt_{i}"] for i in range(len(AGENT_NAMES))]
    _seed_everything(spec.seed)
    trainer = TimedMAGRPOTrainer(
        agent_model=str(model_dir),
        num_agents=len(AGENT_NAMES),
        tokenizer=tokenizer,
        model_config=comlrl_model_config(spec),
        train_dataset=[record(item) for item in training_items(env, spec)],
        reward_func=reward,
        formatters=formatters,
        external_transition=transition if spec.turns > 1 else None,
        args=MAGRPOConfig(**comlrl_config(spec)),
    )
    trainer.start_clock(tokenizer.eos_token_id)
    setup_seconds = time.perf_counter() - started
    eval_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policies = [lambda model=model: model for model in trainer.agents]
    if spec.minutes:
        trainer.clock = TrainingClock(60 * spec.minutes, 60 * spec.eval_every_minutes,
                                      lambda: evaluate(policies, eval_tokenizer, env, spec).curve_point())
        with contextlib.suppress(BudgetSpent):
            trainer.train()
        if trainer.clock.curve[-1]["train_seconds"] < 60 * spec.minutes:
            raise RuntimeError(f"CoMLRL ran out of items ({spec.steps} steps) before {spec.minutes} minutes")
        return {"setup_seconds": setup_seconds, **trainer.clock.result()}
    before = evaluate(policies, eval_tokenizer, env, spec).per_turn if spec.eval_before else None
    memory: dict[str, Any] = {}
    with training_memory(memory):
        train_start = time.perf_counter()
        trainer.train()
        train_seconds = time.perf_counter() - train_start
    ends = [train_start, *trainer.update_ends]
    assert len(ends) - 1 == spec.steps, f"CoMLRL updated {len(ends) - 1} times, expected {spec.steps}"
    return {
        "setup_seconds": setup_seconds,
        "train_seconds": train_seconds,
        "step_times": [b - a for a, b in zip(ends, ends[1:])],
        "generation_seconds": trainer.generation_seconds,
        "update_seconds": trainer.update_seconds,
        "generated_tokens": trainer.generated_tokens,
        "optimizer_steps_per_agent": trainer.optimizer_steps[0],
        "train_reward_turn1": None,
        **memory,
        "reward_before": before,
        "reward_after": evaluate(policies, eval_tokenizer, env, spec).per_turn,
    }


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def main() -> None:
    """Run the library named on the command line and write its result."""
    library, spec_json, result_path = sys.argv[1:4]
    spec = RunSpec.from_json(spec_json)
    if spec.threads:
        torch.set_num_threads(spec.threads)
    model_dir = ensure_converted(get_bundled_model())
    if library == "teamrl":
        with tempfile.TemporaryDirectory(prefix="teamrl-bench-") as run_dir:
            result = run_teamrl(spec, model_dir, Path(run_dir))
    elif library == "comlrl":
        result = run_comlrl(spec, model_dir)
    else:
        raise SystemExit(f"unknown library {library!r}; expected teamrl or comlrl")
    if spec.minutes:  # a learning curve: its own result (comlrl_learning_curve.py)
        Path(result_path).write_text(json.dumps({**result, "torch_threads": torch.get_num_threads()}, indent=2))
        return
    joint_actions = spec.steps * joint_actions_per_step(spec)
    seconds = result["train_seconds"]
    result.update({
        "torch_threads": torch.get_num_threads(),
        "joint_actions": joint_actions,
        "step_seconds": seconds / spec.steps,
        "generation_seconds_per_step": result["generation_seconds"] / spec.steps,
        "update_seconds_per_step": result["update_seconds"] / spec.steps,
        "joint_actions_per_second": joint_actions / seconds,
        "tokens_per_second": result["generated_tokens"] / seconds,
    })
    Path(result_path).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
