"""Task records (one dict per task item) from a local file, the ``aclsum`` package or the Hugging Face hub.

One entry point, :func:`load_records`, takes a *source* string:

* ``"aclsum"``: the 250 ACL papers the ``aclsum`` PyPI package ships (MIT; ``pip install aclsum``), read
  from its packaged JSONL files with no network and without importing the package. Splits ``train``
  (100 papers), ``validation`` (50) and ``test`` (100); fields ``id`` (ACL Anthology id), ``title``,
  ``abstract``, ``introduction``, ``conclusion`` (see :func:`load_aclsum`).
* a local file: ``.jsonl`` (one JSON object a line), ``.json`` (a list of objects), ``.csv`` (a header
  row; every value a string) or ``.parquet`` (needs ``pyarrow``). A path containing ``{split}`` names
  one file per split, e.g. ``data/tldr-{split}.jsonl``; any other file is a single split.
* anything else: a Hugging Face hub dataset id such as ``trl-lib/tldr``, loaded with
  ``datasets.load_dataset`` (the optional ``datasets`` package). The hub is probed first, so an offline
  machine gets a one-line :class:`DataError` at once instead of minutes of download retries.

Records come back in the source's order; ``start`` and ``limit`` slice them deterministically.
Every failure is a one-line :class:`DataError` (a ``ValueError``) that names the source, file or field
and says how to fix it.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

Record = dict[str, Any]

ACLSUM = "aclsum"
#: aclsum's split names (as teamrl names them) and the packaged files that hold them.
ACLSUM_SPLITS = {"train": "train.jsonl", "validation": "val.jsonl", "test": "test.jsonl"}
#: The paper sections aclsum keeps, each a list of (tokenised) sentences.
ACLSUM_SECTIONS = ("abstract", "introduction", "conclusion")
#: Local file formats :func:`read_file` reads, by suffix.
FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
SPLIT_PLACEHOLDER = "{split}"

_LOCAL_HINT = "or point at a local file instead, e.g. env.kwargs.source=/path/to/data.jsonl"

# aclsum's sentences are tokenised ("methods ( QE ) , e.g. it 's"); these undo the spacing so that a
# model reads ordinary prose.
_SPACE_BEFORE = re.compile(r" ([.,;:!?%)\]}]|'s\b|'re\b|'ve\b|'ll\b|'d\b|'m\b|n't\b)")
_SPACE_AFTER = re.compile(r"([(\[{]) ")


class DataError(ValueError):
    """Task data could not be loaded; the message names the source, file or field and how to fix it."""


class MissingFieldError(DataError):
    """A record lacks a required field. ``field`` is the missing name, ``available`` the record's fields."""

    def __init__(self, origin: str, index: int, field: str, available: Sequence[str]):
        self.field = field
        self.available = list(available)
        super().__init__(
            f"{origin}: record {index} has no field {field!r} (its fields: {', '.join(self.available) or 'none'})"
        )


def source_kind(source: str) -> Literal["aclsum", "file", "hub"]:
    """How :func:`load_records` reads ``source``.

    ``"aclsum"`` for exactly ``"aclsum"``. ``"file"`` when the path exists, ends in one of
    :data:`FILE_SUFFIXES`, contains ``{split}``, starts with ``/``, ``.`` or ``~``, or has more than one
    ``/`` (a hub id has at most one). ``"hub"`` otherwise.
    """
    if source == ACLSUM:
        return "aclsum"
    path = Path(source).expanduser()
    looks_like_path = source.startswith(("/", ".", "~")) or source.count("/") > 1
    if SPLIT_PLACEHOLDER in source or looks_like_path or path.suffix.lower() in FILE_SUFFIXES or path.exists():
        return "file"
    return "hub"


def has_splits(source: str) -> bool:
    """Whether ``source`` has named splits: aclsum, a hub dataset, or a file path containing ``{split}``."""
    return source_kind(source) != "file" or SPLIT_PLACEHOLDER in source


def load_records(
    source: str,
    split: str | None = None,
    *,
    start: int = 0,
    limit: int | None = None,
    fields: Sequence[str] = (),
) -> list[Record]:
    """The records of ``split`` of ``source`` (see the module docstring), sliced to ``[start, start + limit)``.

    ``split`` is required by sources with splits (:func:`has_splits`) and must be None for a single
    file. ``limit=None`` keeps every record from ``start`` on. ``fields`` must be present in every
    returned record, else :class:`MissingFieldError` names the first record without one.
    Raises :class:`DataError` for an unknown split, a ``start`` past the last record, an empty source,
    or a source that cannot be read.
    """
    if start < 0:
        raise DataError(f"{source}: start must be >= 0 (got {start})")
    if limit is not None and limit < 1:
        raise DataError(f"{source}: limit must be >= 1 or None for all records (got {limit})")
    kind = source_kind(source)
    if has_splits(source) and split is None:
        raise DataError(f"{source}: has splits, so a split must be given (e.g. 'train')")
    if kind == "hub":
        records = load_hub(source, split, start=start, limit=limit)
        origin = f"hub dataset {source!r} {split}"
    else:
        path = None if kind == "aclsum" else _file_for_split(source, split)
        origin = f"aclsum {split}" if path is None else str(path)
        records = select(load_aclsum(split) if path is None else read_file(path), start, limit, origin)
    require_fields(records, fields, origin, start)
    return records


def _file_for_split(source: str, split: str | None) -> Path:
    if SPLIT_PLACEHOLDER in source:
        return Path(source.replace(SPLIT_PLACEHOLDER, split)).expanduser()
    if split is not None:
        raise DataError(
            f"{source}: a single file has no split {split!r}; leave the split unset or put "
            f"{SPLIT_PLACEHOLDER} in the path (e.g. data/{SPLIT_PLACEHOLDER}.jsonl)"
        )
    return Path(source).expanduser()


def select(records: Sequence[Record], start: int, limit: int | None, origin: str) -> list[Record]:
    """``records[start:start + limit]`` (all from ``start`` when ``limit`` is None).

    Raises :class:`DataError` naming ``origin`` when there are no records or ``start`` is past the last.
    """
    _check_start(len(records), start, origin)
    return list(records[start : None if limit is None else start + limit])


def _check_start(count: int, start: int, origin: str) -> None:
    if count == 0:
        raise DataError(f"{origin}: has no records")
    if start >= count:
        raise DataError(f"{origin}: start={start} is past the last record (it has {count})")


def require_fields(records: Sequence[Record], fields: Sequence[str], origin: str, first_index: int = 0) -> None:
    """Raise :class:`MissingFieldError` for the first record (numbered from ``first_index``) lacking a field."""
    for offset, record in enumerate(records):
        for field in fields:
            if field not in record:
                raise MissingFieldError(origin, first_index + offset, field, list(record))


def read_file(path: str | Path) -> list[Record]:
    """Every record of a local ``.jsonl``, ``.json`` (a list of objects), ``.csv`` or ``.parquet`` file, in order.

    JSONL blank lines are skipped. CSV values are strings (the header row gives the field names).
    Parquet needs ``pyarrow``. Raises :class:`DataError` for a missing file, an unknown suffix, invalid
    JSON (with its line) or a record that is not an object.
    """
    path = Path(path).expanduser()
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise DataError(f"{path}: unsupported file type {suffix or '(none)'!r}; use one of {', '.join(FILE_SUFFIXES)}")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    records = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet}[suffix](path)
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            raise DataError(f"{path}: record {index} is not an object with fields (got {type(record).__name__})")
    return records


def _read_jsonl(path: Path) -> list[Any]:
    records = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{line_number}: not valid JSON ({err.msg})") from None
    return records


def _read_json(path: Path) -> list[Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: a .json file must hold a list of records, not a {type(data).__name__}")
    return data


def _read_csv(path: Path) -> list[Any]:
    with path.open(encoding="utf-8", newline="") as handle:
        return list(csv.DictReader(handle))


def _read_parquet(path: Path) -> list[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading .parquet files needs pyarrow: pip install pyarrow "
            "(the hub extra, pip install 'teamrl[hub]', includes it)"
        ) from None
    return pq.read_table(path).to_pylist()


def load_aclsum(split: str) -> list[Record]:
    """The ACL papers of aclsum's ``split`` ('train', 'validation' or 'test'), in the package's order.

    Reads the JSONL files inside the installed ``aclsum`` package directly: no network, and the
    package's own reader (and its ``sienna`` dependency) is never imported. Each record has ``id`` (the
    ACL Anthology id), ``title``, and ``abstract``, ``introduction`` and ``conclusion``: the section's
    sentences joined by spaces, with the tokeniser's spacing around punctuation undone.
    """
    if split not in ACLSUM_SPLITS:
        raise DataError(f"aclsum: unknown split {split!r}; it has {', '.join(ACLSUM_SPLITS)}")
    spec = importlib.util.find_spec(ACLSUM)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"aclsum: the aclsum package is not installed: pip install aclsum, {_LOCAL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / "dataset" / ACLSUM_SPLITS[split]
    return [_aclsum_record(raw) for raw in read_file(path)]


def _aclsum_record(raw: Record) -> Record:
    record = {"id": raw["id"], "title": raw["title"]}
    for section in ACLSUM_SECTIONS:
        record[section] = " ".join(detokenize(sentence) for sentence in raw["sentences"][section])
    return record


def detokenize(sentence: str) -> str:
    """Undo tokeniser spacing: drop the space before ``. , ; : ! ? % ) ] }`` and clitics (``'s``, ``n't``, ...)
    and the space after ``( [ {``."""
    return _SPACE_AFTER.sub(r"\1", _SPACE_BEFORE.sub(r"\1", sentence))


def load_hub(name: str, split: str, *, start: int = 0, limit: int | None = None) -> list[Record]:
    """Rows ``[start, start + limit)`` of ``split`` of the hub dataset ``name``, via ``datasets.load_dataset``.

    ``datasets`` is an optional dependency, imported here only. In the hub's offline mode
    (``HF_HUB_OFFLINE=1`` set before Python starts) ``datasets`` reads its local cache only. Otherwise
    the hub's host is probed first (:func:`teamrl.models.loading.hub_reachable`): an unreachable hub is
    a :class:`DataError` at once, where ``datasets`` would retry for about half a minute. Every failure
    is a one-line :class:`DataError` naming the dataset and how to use a local file instead.
    """
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"hub dataset {name!r}: loading from the Hugging Face hub needs the datasets package "
            f"(pip install 'teamrl[hub]'), {_LOCAL_HINT}"
        ) from None
    # datasets < 2.20 names its offline flag HF_DATASETS_OFFLINE only; later versions keep it as an alias
    offline = getattr(datasets.config, "HF_HUB_OFFLINE", False) or datasets.config.HF_DATASETS_OFFLINE
    if not offline:
        from teamrl.models.loading import hub_reachable

        if not hub_reachable():
            raise DataError(
                f"hub dataset {name!r}: the Hugging Face hub is unreachable; {_LOCAL_HINT} "
                "(or set HF_HUB_OFFLINE=1 to read a copy in the local datasets cache)"
            )
    try:
        dataset = datasets.load_dataset(name, split=split)
    except Exception as err:  # datasets raises many types; all mean "cannot load this one"
        message = next((line for line in str(err).splitlines() if line.strip()), "")
        raise DataError(
            f"hub dataset {name!r} split {split!r}: {type(err).__name__}: {message}; {_LOCAL_HINT}"
        ) from err
    _check_start(len(dataset), start, f"hub dataset {name!r} {split}")
    stop = len(dataset) if limit is None else min(len(dataset), start + limit)
    # select before converting: a hub split can hold 100k+ rows and only the slice is needed
    return dataset.select(range(start, stop)).to_list()


def holdout_split(
    records: Sequence[Record], eval_size: int | float, seed: int
) -> tuple[list[Record], list[Record]]:
    """Split ``records`` into (train, eval) deterministically, for a source without its own splits.

    ``eval_size`` is a count (an int >= 1) or a fraction (a float in (0, 1), rounded, at least 1).
    The eval records are a random sample drawn with ``random.Random(seed)``; both parts keep the source
    order. Raises :class:`DataError` unless at least one record is left for training.
    """
    if isinstance(eval_size, float) and not 0 < eval_size < 1:
        raise DataError(f"eval_size={eval_size}: a fraction must be in (0, 1); give a count as an int")
    count = max(1, round(eval_size * len(records))) if isinstance(eval_size, float) else eval_size
    if not 1 <= count < len(records):
        raise DataError(
            f"eval_size={eval_size} leaves no records to train on ({len(records)} records); use a smaller eval_size"
        )
    held_out = set(random.Random(seed).sample(range(len(records)), count))
    train = [r for i, r in enumerate(records) if i not in held_out]
    evaluation = [r for i, r in enumerate(records) if i in held_out]
    return train, evaluation
