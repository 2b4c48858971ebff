"""load_model_and_tokenizer on tiny models built here: local directories, GGUF files, and every error path."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from teamrl.models import loading
from teamrl.models.loading import ModelLoadError, load_model_and_tokenizer

TINY_WORDS = ["<unk>", "<eos>", "the", "team", "writes", "code", "and", "tests", "it"]


def tiny_llama(vocab_size: int, *, tie_word_embeddings: bool = False) -> LlamaForCausalLM:
    """A randomly initialised 2-layer Llama small enough to build, save and load in well under a second."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie_word_embeddings,
    )
    return LlamaForCausalLM(config).eval()


def tiny_word_tokenizer(*, with_eos: bool = True) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over ``TINY_WORDS`` with no pad token, like many base models."""
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(TINY_WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {"eos_token": "<eos>"} if with_eos else {}
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", **special)


@pytest.fixture
def tiny_model_dir(tmp_path: Path) -> Path:
    """A directory with a tiny Llama and a word-level tokenizer (no pad token), as save_pretrained writes them."""
    directory = tmp_path / "tiny"
    tiny_llama(len(TINY_WORDS)).save_pretrained(directory)
    tiny_word_tokenizer().save_pretrained(directory)
    return directory


CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def test_directory_loads_weights_and_prepares_tokenizer(tiny_model_dir: Path):
    expected = tiny_llama(len(TINY_WORDS)).state_dict()

    model, tokenizer = load_model_and_tokenizer(str(tiny_model_dir))

    assert model.dtype == torch.float32
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)
    # no pad token in the saved tokenizer: eos stands in, and generation pads on the left
    assert tokenizer.pad_token == tokenizer.eos_token == "<eos>"
    assert tokenizer.padding_side == "left"
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    batch = tokenizer(["the team", "the team writes code"], return_tensors="pt", padding=True)
    assert batch["attention_mask"][0].tolist() == [0, 0, 1, 1]
    assert tokenizer.decode(batch["input_ids"][1]) == "the team writes code"


def test_dtype_is_applied(tiny_model_dir: Path):
    model, _ = load_model_and_tokenizer(str(tiny_model_dir), dtype="bf16")

    assert model.dtype == torch.bfloat16


def _permute_for_gguf(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary row order for q/k, which the GGUF reader undoes."""
    rows_per_half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, rows_per_half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    """A GPT-2 style byte-level vocabulary: the 256 byte symbols, a few merges, and two control tokens."""
    byte_symbols = list(bytes_to_unicode().values())
    merges = ["h e", "l l", "he ll", "hell o"]
    specials = ["<|im_start|>", "<|im_end|>"]
    tokens = byte_symbols + [merge.replace(" ", "") for merge in merges] + specials
    normal = len(tokens) - len(specials)
    token_types = [gguf.TokenType.NORMAL] * normal + [gguf.TokenType.CONTROL] * len(specials)
    return tokens, merges, token_types


def write_tiny_llama_gguf(path: Path) -> dict[str, torch.Tensor]:
    """Write a tiny float32 llama GGUF with its tokenizer metadata; return the state dict it encodes."""
    tokens, merges, token_types = _byte_level_vocab()
    model = tiny_llama(len(tokens), tie_word_embeddings=True)
    config = model.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("teamrl tiny test llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    state = model.state_dict()
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight":  # tied to the embedding, which the GGUF stores once
            continue
        stem, _, suffix = hf_name.rpartition(".")
        gguf_name = f"{names.get_name(stem)}.{suffix}"
        weight = tensor.numpy()
        if ".attn_q." in gguf_name:
            weight = _permute_for_gguf(weight, config.num_attention_heads)
        elif ".attn_k." in gguf_name:
            weight = _permute_for_gguf(weight, config.num_key_value_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


def test_gguf_file_loads_dense_weights_and_tokenizer(tmp_path: Path):
    path = tmp_path / "tiny-llama.gguf"
    expected = write_tiny_llama_gguf(path)

    model, tokenizer = load_model_and_tokenizer(str(path))

    assert getattr(model, "hf_quantizer", None) is None
    assert not hasattr(model.config, "quantization_config")
    loaded = model.state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.padding_side == "left"
    assert tokenizer.decode(tokenizer("hello world")["input_ids"]) == "hello world"
    assert "hello" in tokenizer.convert_ids_to_tokens(tokenizer("hello")["input_ids"])
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "<|im_start|>hi<|im_end|>"


def test_gguf_model_saves_as_plain_transformers_directory(tmp_path: Path):
    path = tmp_path / "tiny-llama.gguf"
    write_tiny_llama_gguf(path)
    model, tokenizer = load_model_and_tokenizer(str(path))
    model.save_pretrained(tmp_path / "saved")
    tokenizer.save_pretrained(tmp_path / "saved")

    reloaded, _ = load_model_and_tokenizer(str(tmp_path / "saved"))

    assert "quantization_config" not in (tmp_path / "saved" / "config.json").read_text()
    torch.testing.assert_close(reloaded.state_dict(), model.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize(
    "spec", ["no/such/model/dir", "missing-model.gguf", "./missing", "~/no-such-teamrl-model"]
)
def test_missing_local_path_is_a_clear_error(spec: str):
    with pytest.raises(ModelLoadError, match="no such file or directory") as caught:
        load_model_and_tokenizer(spec)

    assert repr(spec) in str(caught.value)
    assert ".gguf" in str(caught.value) and "\n" not in str(caught.value)


def test_hub_id_offline_fails_fast_with_the_fix(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = "teamrl-tests/no-such-model"
    started = time.monotonic()

    with pytest.raises(ModelLoadError, match="unreachable") as caught:
        load_model_and_tokenizer(spec)

    assert time.monotonic() - started < 10
    message = str(caught.value)
    assert repr(spec) in message and "local model directory" in message and ".gguf" in message
    assert "\n" not in message


def test_hub_id_in_the_local_hub_cache_loads_offline(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    import huggingface_hub.constants

    commit = "0" * 40
    repo = tmp_path / "hub" / "models--teamrl-tests--tiny"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(loading, "hub_reachable", lambda: False)
    started = time.monotonic()

    model, tokenizer = load_model_and_tokenizer("teamrl-tests/tiny")

    assert time.monotonic() - started < 10
    assert model.config.vocab_size == len(TINY_WORDS) and tokenizer.padding_side == "left"


def test_hub_counts_as_unreachable_in_offline_mode(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    assert loading.hub_reachable() is False


def test_directory_without_config_is_a_clear_error(tmp_path: Path):
    with pytest.raises(ModelLoadError, match="has no config.json") as caught:
        load_model_and_tokenizer(str(tmp_path))

    assert repr(str(tmp_path)) in str(caught.value)


def test_directory_holding_a_gguf_points_at_the_file(tmp_path: Path):
    (tmp_path / "model.Q4_K_M.gguf").write_bytes(b"GGUF")

    with pytest.raises(ModelLoadError, match="model.Q4_K_M.gguf: pass that file"):
        load_model_and_tokenizer(str(tmp_path))


def test_file_that_is_not_gguf_is_a_clear_error(tiny_model_dir: Path):
    spec = str(tiny_model_dir / "config.json")

    with pytest.raises(ModelLoadError, match="not a .gguf file") as caught:
        load_model_and_tokenizer(spec)

    assert repr(spec) in str(caught.value)


def test_truncated_weights_give_a_one_line_error(tiny_model_dir: Path):
    weights = tiny_model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])

    with pytest.raises(ModelLoadError, match="loading failed") as caught:
        load_model_and_tokenizer(str(tiny_model_dir))

    assert repr(str(tiny_model_dir)) in str(caught.value) and "\n" not in str(caught.value)
    assert caught.value.__cause__ is not None


def test_tokenizer_without_pad_or_eos_is_rejected(tmp_path: Path):
    tiny_llama(len(TINY_WORDS)).save_pretrained(tmp_path)
    tiny_word_tokenizer(with_eos=False).save_pretrained(tmp_path)

    with pytest.raises(ModelLoadError, match="neither a pad nor an eos token"):
        load_model_and_tokenizer(str(tmp_path))


def test_unknown_dtype_lists_the_choices(tiny_model_dir: Path):
    with pytest.raises(ModelLoadError, match="unknown dtype 'float8'.*bfloat16"):
        load_model_and_tokenizer(str(tiny_model_dir), dtype="float8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device_is_a_clear_error(tiny_model_dir: Path):
    with pytest.raises(ModelLoadError, match="cannot use device 'cuda'"):
        load_model_and_tokenizer(str(tiny_model_dir), device="cuda")


def test_unknown_bundled_name_lists_the_bundled_models():
    with pytest.raises(ModelLoadError, match="'bundled:smollm2-135m-instruct'") as caught:
        load_model_and_tokenizer("bundled:gpt-5")

    assert "'bundled:gpt-5'" in str(caught.value)


_LIBRARY_NOISE_SCRIPT = """
import sys
from pathlib import Path

if sys.argv[1] == "quiet":
    from teamrl.runtime import quiet_libraries

    quiet_libraries()
from teamrl.config import config_from_dict
from teamrl.envs.base import make_env
from teamrl.models.bundled import convert_gguf_to_directory
from teamrl.team import Team

gguf_path, directory = Path(sys.argv[2]), Path(sys.argv[3])
convert_gguf_to_directory(gguf_path, directory, spec=str(gguf_path))  # what the bundled model's first use does
team = {"model": str(directory), "training": "lora", "agents": [{"name": "first"}, {"name": "second"}]}
Team.from_config(config_from_dict({"team": team}).team, make_env("digit_sum"))  # PEFT's adapters
"""
# What the libraries print on that path: the GGUF conversion's bar (tqdm, past transformers' switch),
# save_pretrained's bar, and the FutureWarning of PEFT reading transformers' deprecated property.
_LIBRARY_NOISE = ("Converting and de-quantizing GGUF tensors", "Writing model shards", "is_gradient_checkpointing")


@pytest.mark.slow
def test_a_quiet_process_converts_saves_and_adapts_a_gguf_model_without_library_noise(tmp_path: Path):
    import subprocess
    import sys

    path = tmp_path / "tiny-llama.gguf"
    write_tiny_llama_gguf(path)
    printed = {}
    for mode in ("quiet", "verbose"):
        result = subprocess.run([sys.executable, "-c", _LIBRARY_NOISE_SCRIPT, mode, str(path), str(tmp_path / mode)],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        printed[mode] = result.stderr
    assert printed["quiet"] == ""
    for noise in _LIBRARY_NOISE:  # without quiet_libraries (teamrl --verbose, the Python API), all of it stays
        assert noise in printed["verbose"], (noise, printed["verbose"])
