"""Load a causal LM and its tokenizer from one string: a local directory, a GGUF file, the bundled model, or a hub id.

    model, tokenizer = load_model_and_tokenizer("bundled")                   # SmolLM2-135M-Instruct
    model, tokenizer = load_model_and_tokenizer("runs/sft/checkpoint-100")   # save_pretrained output
    model, tokenizer = load_model_and_tokenizer("~/models/qwen3-0.6b.Q8_0.gguf")
    model, tokenizer = load_model_and_tokenizer("HuggingFaceTB/SmolLM2-360M-Instruct")  # needs the hub

Every failure is a :class:`ModelLoadError` whose one-line message names the spec and says what to do.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

BUNDLED_PREFIX = "bundled"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
# a hub id is `name` or `owner/name`; anything else that does not exist locally was meant as a path
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_TRUTHY = {"1", "true", "yes", "on"}
_HUB_PROBE_TIMEOUT_S = 3.0

_POINT_AT_LOCAL = (
    "point the spec at a local model directory (written by save_pretrained), at a .gguf file, "
    f"or use '{BUNDLED_PREFIX}' for the default model"
)


class ModelLoadError(ValueError):
    """A model spec could not be loaded; the message names the spec and how to fix it."""


def load_model_and_tokenizer(
    spec: str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for left-padded batched generation.

    ``spec`` is, in the order tried:

    - ``"bundled"`` or ``"bundled:<name>"``: a model teamrl ships (see :mod:`teamrl.models.bundled`),
      converted once into the teamrl cache;
    - an existing directory holding ``config.json``, weights and a tokenizer;
    - an existing ``.gguf`` file (dequantised to dense weights; needs the ``gguf`` package);
    - otherwise a Hugging Face hub id, served from the local hub cache or downloaded.

    ``dtype`` is ``"float32"`` (default), ``"bfloat16"`` (faster on CPUs with bf16 units such as
    AVX512-BF16 or AMX, much slower on CPUs without) or ``"float16"``.
    ``trust_remote_code`` is passed to transformers for directories and hub ids with custom code.
    The tokenizer is prepared by :func:`prepare_tokenizer`.

    Raises:
        ModelLoadError: the spec names nothing loadable, or loading it failed.
    """
    torch_dtype = parse_dtype(dtype, spec)
    if spec == BUNDLED_PREFIX or spec.startswith(f"{BUNDLED_PREFIX}:"):
        # bundled builds on the loaders below, so it can only be imported once this module is
        from teamrl.models.bundled import load_bundled

        model, tokenizer = load_bundled(spec.partition(":")[2] or None, dtype=torch_dtype)
    else:
        model, tokenizer = _load_path_or_hub(spec, torch_dtype, trust_remote_code)
    tokenizer = prepare_tokenizer(tokenizer, spec)
    if model.generation_config.pad_token_id is None:
        # generate() otherwise warns and picks eos on every call
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return move_to_device(model, device, spec), tokenizer


def loadable_reference(spec: str) -> str | None:
    """What plain transformers loads for the base model ``spec`` without teamrl, for a PEFT adapter's
    ``base_model_name_or_path`` (what ``AutoPeftModelForCausalLM`` loads the base from): the absolute path
    of a model directory (the bundled model's converted one in the teamrl cache), or a hub id.

    None where transformers alone has no such thing: the 'tiny' test model exists only in memory, and
    PEFT cannot load a ``.gguf`` file as a base (``teamrl export`` writes a loadable base beside the adapters).
    Absolute, because transformers resolves a relative path against the working directory, not the adapter.
    """
    if spec == "tiny":
        return None
    if spec == BUNDLED_PREFIX or spec.startswith(f"{BUNDLED_PREFIX}:"):
        from teamrl.models.bundled import converted_directory, get_bundled_model

        return str(converted_directory(get_bundled_model(spec.partition(":")[2] or None)).absolute())
    path = Path(spec).expanduser()
    if path.is_dir():
        return str(path.absolute())
    return spec if is_hub_id(spec) else None


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` names a Hugging Face hub model (``name`` or ``owner/name``) rather than a local path."""
    return bool(_HUB_ID.match(spec)) and not spec.lower().endswith(".gguf") and not Path(spec).expanduser().exists()


def _load_path_or_hub(
    spec: str, dtype: torch.dtype, trust_remote_code: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Dispatch a non-bundled spec to the directory, GGUF or hub loader, or explain why none applies."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return load_directory(path, dtype=dtype, spec=spec, trust_remote_code=trust_remote_code)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"model spec {spec!r} is a file but not a .gguf file; {_POINT_AT_LOCAL} "
                "(for a transformers model, pass its directory, not a file in it)"
            )
        return load_gguf(path, dtype=dtype, spec=spec)
    if not _HUB_ID.match(spec) or spec.lower().endswith(".gguf"):
        raise ModelLoadError(
            f"model spec {spec!r}: no such file or directory ({path.absolute()}); {_POINT_AT_LOCAL}"
        )
    return load_from_hub(spec, dtype=dtype, trust_remote_code=trust_remote_code)


def parse_dtype(dtype: str, spec: str) -> torch.dtype:
    """The torch dtype named by ``dtype`` (``"float32"``, ``"bf16"``, ...), or a :class:`ModelLoadError`."""
    try:
        return _DTYPES[dtype.lower()]
    except (KeyError, AttributeError):
        raise ModelLoadError(
            f"model spec {spec!r}: unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}"
        ) from None


def move_to_device(model: PreTrainedModel, device: str, spec: str) -> PreTrainedModel:
    """``model`` moved to ``device``, or a :class:`ModelLoadError` naming the device and the spec."""
    try:
        return model.to(torch.device(device))
    except (RuntimeError, AssertionError) as error:  # torch signals a missing backend with an AssertionError
        raise ModelLoadError(
            f"model spec {spec!r}: cannot use device {device!r} ({_first_line(error)}); "
            "pass device='cpu' or a device this torch build supports"
        ) from error


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase, spec: str) -> PreTrainedTokenizerBase:
    """Give ``tokenizer`` a pad token and left padding, as batched generation needs.

    A tokenizer without a pad token gets its eos token as pad. That is safe in teamrl because every
    batch carries explicit attention and completion masks: no code finds the end of a prompt or of a
    completion by looking for the first pad/eos token (SmolLM2 ships with pad == eos == ``<|im_end|>``,
    which also closes every chat turn, so such a search would be wrong anyway).

    Raises:
        ModelLoadError: the tokenizer has neither a pad nor an eos token.
    """
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(
                f"model spec {spec!r}: the tokenizer has neither a pad nor an eos token; add one with "
                "tokenizer.add_special_tokens(...) (and model.resize_token_embeddings), save_pretrained "
                "both, and load that directory"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_directory(
    path: Path, *, dtype: torch.dtype, spec: str, trust_remote_code: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a model and tokenizer written by ``save_pretrained`` into ``path``, without touching the hub."""
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        hint = (
            f"it holds {ggufs[0].name}: pass that file's path as the spec"
            if ggufs
            else "point at a directory written by model.save_pretrained and tokenizer.save_pretrained"
        )
        raise ModelLoadError(f"model spec {spec!r}: directory {path} has no config.json; {hint}")
    options = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    fix = "check that the directory holds a complete save_pretrained output of model and tokenizer"
    with _load_errors(spec, fix):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **options)
        tokenizer = AutoTokenizer.from_pretrained(path, **options)
    return model, tokenizer


def load_gguf(
    path: Path, *, dtype: torch.dtype, spec: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a ``.gguf`` file as a dense transformers model (weights dequantised) and its tokenizer.

    The returned model carries no trace of the GGUF quantizer, so it trains and ``save_pretrained``\\ s
    like any other model.
    """
    missing = [package for package in ("gguf", "accelerate") if importlib.util.find_spec(package) is None]
    if missing:
        raise ModelLoadError(
            f"model spec {spec!r}: loading a GGUF file needs the package(s) {', '.join(missing)}; "
            f"pip install {' '.join(missing)}"
        )
    # transformers resolves gguf_file against a directory, as it would inside a hub repo
    options = {"gguf_file": path.name, "local_files_only": True}
    with (_load_errors(spec, "check that it is a complete GGUF of an architecture transformers supports"),
          _conversion_bar_follows_transformers()):
        tokenizer = AutoTokenizer.from_pretrained(path.parent, **options)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, dtype=dtype, **_dense_gguf_option(), **options
        )
    return _without_gguf_quantizer(model), tokenizer


@contextlib.contextmanager
def _conversion_bar_follows_transformers() -> Iterator[None]:
    """Draw the GGUF conversion's progress bar only when transformers' progress bars are on.

    transformers draws that bar with tqdm itself, past its own switch
    (``transformers.utils.logging.disable_progress_bar``, which :func:`teamrl.runtime.quiet_libraries` turns
    off): for the conversion, its module's ``tqdm`` is transformers' switched one.
    """
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_loading
        from transformers.utils import logging as transformers_logging
    except ImportError:  # a transformers without this module draws no such bar
        yield
        return
    drawn_with = getattr(gguf_loading, "tqdm", None)
    if drawn_with is None:
        yield
        return
    gguf_loading.tqdm = transformers_logging.tqdm
    try:
        yield
    finally:
        gguf_loading.tqdm = drawn_with


def _dense_gguf_option() -> dict:
    """``from_pretrained`` options asking for dense weights from a GGUF.

    transformers >= 5 can keep some architectures' GGUF weights packed, which training cannot use.
    Versions without ``GgufConfig`` always dequantise, so they need no option.
    """
    try:
        from transformers.utils.quantization_config import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _without_gguf_quantizer(model: PreTrainedModel) -> PreTrainedModel:
    """``model`` with the GGUF quantizer and its config entry removed.

    The weights are already dense; left in place, these make ``save_pretrained`` write a
    ``quantization_config`` that no loader can honour and make PEFT treat the model as quantized.
    Some transformers versions drop them already after dequantising; others do not.
    """
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def load_from_hub(
    spec: str, *, dtype: torch.dtype, trust_remote_code: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load hub id ``spec`` from the local Hugging Face cache, else download it if the hub can be reached.

    Without a reachable hub this fails at once with a :class:`ModelLoadError`, instead of spending
    ~50 s in huggingface_hub's retries and ending in a deep traceback.
    """
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = isinstance(try_to_load_from_cache(spec, "config.json"), str)
    except ValueError as error:  # huggingface_hub rejects a malformed repo id
        raise ModelLoadError(
            f"model spec {spec!r} is not a local path and not a valid hub id ({_first_line(error)}); "
            f"{_POINT_AT_LOCAL}"
        ) from error
    if not cached and not hub_reachable():
        raise ModelLoadError(
            f"model spec {spec!r} is not a local directory or file, is not in the local Hugging Face cache, "
            f"and the Hugging Face Hub is unreachable (offline); {_POINT_AT_LOCAL}"
        )
    offline = {"local_files_only": True} if cached else {}
    with _load_errors(spec, f"check the hub id, or {_POINT_AT_LOCAL}"):
        # the PEFT-adapter lookup ignores the top-level local_files_only and would query the hub
        model = AutoModelForCausalLM.from_pretrained(
            spec, dtype=dtype, trust_remote_code=trust_remote_code, adapter_kwargs=dict(offline), **offline
        )
        tokenizer = AutoTokenizer.from_pretrained(spec, trust_remote_code=trust_remote_code, **offline)
    return model, tokenizer


def hub_reachable() -> bool:
    """Whether the Hugging Face Hub can be contacted: not in offline mode and its host accepts a connection.

    With an HTTP(S) proxy configured the direct probe says nothing, so the hub counts as reachable and
    the download itself decides.
    """
    from huggingface_hub import constants

    offline_flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    if constants.HF_HUB_OFFLINE or any(flag.lower() in _TRUTHY for flag in offline_flags):
        return False
    endpoint = urlparse(constants.ENDPOINT)
    if endpoint.scheme in urllib.request.getproxies():
        return True
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=_HUB_PROBE_TIMEOUT_S).close()
    except OSError:
        return False
    return True


@contextlib.contextmanager
def _load_errors(spec: str, fix: str) -> Iterator[None]:
    """Turn any failure inside the block into a one-line :class:`ModelLoadError` naming ``spec`` and ``fix``.

    The original exception stays chained as ``__cause__`` for debugging.
    """
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as error:
        raise ModelLoadError(
            f"model spec {spec!r}: loading failed ({type(error).__name__}: {_first_line(error)}); {fix}"
        ) from error


def _first_line(error: BaseException) -> str:
    """The first non-empty line of an exception's message, so errors stay one line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
