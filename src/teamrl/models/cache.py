"""A small on-disk cache of built directories: location, integrity manifest, lock, atomic publish.

A cached directory is trusted only if it carries a manifest, written last, that lists every file with its
size and sha256 (checking it on each load is cheap next to loading the model; measured in
docs/reports/step-time.md#the-bundled-model-and-the-model-cache). A directory is built in a temporary sibling
and renamed into place, under an exclusive lock, so readers never see half of one and concurrent builders
never mix their files.
The lock uses ``fcntl.flock``: POSIX only, like the rest of teamrl's sandboxing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MANIFEST_NAME = "teamrl-manifest.json"
_STAGING_MARK = ".staging-"
_RETIRED_MARK = ".retired-"
_CHUNK = 1 << 22


def cache_root() -> Path:
    """The teamrl cache directory: ``$TEAMRL_CACHE``, else ``$XDG_CACHE_HOME/teamrl``, else ``~/.cache/teamrl``.

    Empty variables count as unset, as the XDG base-directory spec asks.
    """
    if explicit := os.environ.get("TEAMRL_CACHE"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "teamrl"
    return Path.home() / ".cache" / "teamrl"


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's contents, read in chunks so memory stays flat."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _listed_files(directory: Path) -> list[Path]:
    """Every regular file under ``directory`` except the manifest, sorted for a stable manifest."""
    return sorted(
        path for path in directory.rglob("*") if path.is_file() and path.name != MANIFEST_NAME
    )


def write_manifest(directory: Path, meta: Mapping[str, Any]) -> None:
    """Record ``meta`` and every file's size and sha256 in ``directory``'s manifest.

    Call it after the last file is written: the manifest's presence is what marks the directory complete.
    """
    files = {
        str(path.relative_to(directory)): {"size": path.stat().st_size, "sha256": file_sha256(path)}
        for path in _listed_files(directory)
    }
    manifest = {"meta": dict(meta), "files": files}
    partial = directory / f"{MANIFEST_NAME}.partial"
    partial.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    os.replace(partial, directory / MANIFEST_NAME)


def manifest_problem(directory: Path, expected_meta: Mapping[str, Any]) -> str | None:
    """Why ``directory`` is not a complete, intact build matching ``expected_meta``; ``None`` if it is.

    Checks, cheapest first: the directory and manifest exist and parse, the manifest's meta matches,
    every listed file exists with the recorded size, and every file's sha256 matches.
    """
    if not directory.is_dir():
        return "it does not exist"
    manifest_path = directory / MANIFEST_NAME
    if not manifest_path.is_file():
        return f"{MANIFEST_NAME} is missing (an interrupted build?)"
    try:
        manifest = json.loads(manifest_path.read_text())
        meta, files = manifest["meta"], manifest["files"]
    except (ValueError, KeyError, TypeError) as error:
        return f"{MANIFEST_NAME} is unreadable ({error})"
    mismatched = {key: meta.get(key) for key, value in expected_meta.items() if meta.get(key) != value}
    if mismatched:
        return f"it was built with {mismatched}, expected {dict(expected_meta)}"
    if not files:
        return f"{MANIFEST_NAME} lists no files"
    for name, record in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != record["size"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {record['size']}"
    for name, record in files.items():
        if file_sha256(directory / name) != record["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None


@contextlib.contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if needed) for the ``with`` block.

    The kernel releases the lock when the process dies, so a crashed builder never leaves it held.
    """
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process to release %s", lock_path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def new_staging_directory(target: Path) -> Path:
    """An empty, uniquely named sibling of ``target`` to build into (same file system, so rename is atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}{_STAGING_MARK}"))


def remove_leftovers(target: Path) -> None:
    """Delete staging and retired siblings of ``target`` that killed builds left behind.

    Only call this while holding ``target``'s lock: then no live builder owns any of them.
    """
    for mark in (_STAGING_MARK, _RETIRED_MARK):
        for leftover in target.parent.glob(f".{target.name}{mark}*"):
            shutil.rmtree(leftover, ignore_errors=True)


def publish_directory(staging: Path, target: Path) -> None:
    """Move the finished ``staging`` directory to ``target``, replacing whatever was there.

    ``rename`` cannot replace a non-empty directory, so an old ``target`` is first renamed aside and
    deleted afterwards; a reader therefore sees the old directory, no directory, or the new one — never
    a mix. Call it while holding ``target``'s lock.
    """
    if target.exists():
        retired = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}{_RETIRED_MARK}"))
        os.replace(target, retired / target.name)
        os.replace(staging, target)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, target)
