"""benchmarks/gpu_check.py at tiny sizes on the CPU: every phase of both models runs and reports numbers.

The real check (the paper's sizes, bfloat16, CUDA) needs a GPU; this keeps the script from rotting between
the times one is at hand.
"""

from __future__ import annotations

import json

import pytest
import torch

BENCHMARK = "gpu_check"


@pytest.fixture(scope="module")
def bench(benchmark_script):
    return benchmark_script


def test_tiny_check_reports_every_phase(bench, tmp_path, capsys):
    out = tmp_path / "gpu_check.json"
    assert bench.main(["--tiny", "--device", "cpu", "--steps", "1", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["models"]) == {"qwen3_1_7b", "qwen2_5_coder_3b"}
    printed = capsys.readouterr().out
    for name, model in results["models"].items():
        assert model["num_generations"] == 4  # the paper presets' G
        for phase in ("train", "generate", "serve"):
            record = model[phase]
            if "skipped" in record:  # fastapi missing: said, not silently dropped
                assert phase == "serve" and f"[{name}] serve: skipped" in printed
                continue
            assert record["seconds"] > 0 and record["tokens"] > 0 and record["tokens_per_s"] > 0
            assert "peak_gpu_gb" in record  # None on the CPU
            assert f"[{name}] {phase}: " in printed
        assert len(model["train"]["step_s"]) == 1


def test_configs_have_the_papers_sizes(bench):
    """The configs in benchmarks/configs build models of the published parameter counts."""
    from transformers import AutoModelForCausalLM

    for name, billions in (("qwen3_1_7b", 1.72), ("qwen2_5_coder_3b", 3.09)):  # model cards: 1.7B, 3.09B
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(bench.model_config(name, tiny=False))
        assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_asked_for_and_absent_is_one_clear_line(bench, capsys):
    assert bench.main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no CUDA device" in err


def test_fallback_tokenizer_needs_no_files(bench):
    """Where the bundled tokenizer cannot be had offline (a bare GPU machine), the byte-level one serves."""
    tokenizer = bench.byte_level_tokenizer()
    ids = tokenizer("target 9 first")["input_ids"]
    assert tokenizer.decode(ids) == "target 9 first" and max(ids) < 151936
    assert tokenizer.pad_token_id == tokenizer.eos_token_id is not None
    assert "assistant: " in tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                                          add_generation_prompt=True)
