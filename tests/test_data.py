"""Task data loading: local formats, slicing, field errors, aclsum, and the hub failing fast offline."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from teamrl import data
from teamrl.data import DataError, MissingFieldError, holdout_split, load_records, read_file, source_kind

FIXTURES = Path(__file__).parent / "envs" / "data"
POSTS = FIXTURES / "posts.jsonl"
POST_IDS = [f"p{i}" for i in range(1, 11)]
# a dataset id no hub has and no cache holds, so a hub test can never download anything
NO_SUCH_DATASET = "teamrl-tests/no-such-dataset"


@pytest.mark.parametrize("name", ["posts.jsonl", "posts.json", "posts.csv"])
def test_every_text_format_reads_the_same_records(name):
    records = load_records(str(FIXTURES / name))
    assert [r["id"] for r in records] == POST_IDS
    assert records == read_file(POSTS)
    assert set(records[0]) == {"id", "text", "summary"}


def test_parquet_reads_the_same_records(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "posts.parquet"
    pq.write_table(pa.Table.from_pylist(read_file(POSTS)), path)
    assert load_records(str(path), start=3, limit=2) == read_file(POSTS)[3:5]


def test_parquet_without_pyarrow_names_the_file_and_the_install(tmp_path, monkeypatch):
    path = tmp_path / "posts.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"posts\.parquet: reading \.parquet files needs pyarrow: pip install pyarrow"):
        load_records(str(path))


def test_start_and_limit_slice_in_source_order():
    source = str(POSTS)
    assert [r["id"] for r in load_records(source, start=2, limit=3)] == ["p3", "p4", "p5"]
    assert [r["id"] for r in load_records(source, start=8)] == ["p9", "p10"]
    assert [r["id"] for r in load_records(source, start=8, limit=5)] == ["p9", "p10"]
    assert load_records(source, start=1, limit=4) == load_records(source, start=1, limit=4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"start": 10}, r"start=10 is past the last record \(it has 10\)"),
        ({"start": -1}, r"start must be >= 0"),
        ({"limit": 0}, r"limit must be >= 1"),
    ],
)
def test_bad_slices_are_named(kwargs, message):
    with pytest.raises(DataError, match=message):
        load_records(str(POSTS), **kwargs)


def test_missing_field_names_the_field_the_file_and_the_fields_that_exist():
    with pytest.raises(MissingFieldError) as info:
        load_records(str(FIXTURES / "posts.csv"), start=4, fields=["text", "prompt"])
    message = str(info.value)
    assert "posts.csv: record 4 has no field 'prompt' (its fields: id, text, summary)" in message
    assert info.value.field == "prompt" and info.value.available == ["id", "text", "summary"]
    assert isinstance(info.value, ValueError)


def test_files_with_a_split_placeholder(tmp_path):
    for split, ids in (("train", ["a", "b"]), ("validation", ["c"])):
        (tmp_path / f"set-{split}.jsonl").write_text("".join(json.dumps({"id": i}) + "\n" for i in ids))
    source = str(tmp_path / "set-{split}.jsonl")
    assert data.has_splits(source)
    assert [r["id"] for r in load_records(source, "validation")] == ["c"]
    with pytest.raises(DataError, match="set-test.jsonl: no such file"):
        load_records(source, "test")
    with pytest.raises(DataError, match="has splits, so a split must be given"):
        load_records(source)
    with pytest.raises(DataError, match=r"a single file has no split 'train'; .*\{split\} in the path"):
        load_records(str(POSTS), "train")


def test_unreadable_files_give_one_line_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n\n{"id": 2,\n')
    not_objects = tmp_path / "numbers.json"
    not_objects.write_text("[1, 2]")
    cases = [
        (bad, r"bad\.jsonl:3: not valid JSON"),
        (not_objects, r"numbers\.json: record 0 is not an object with fields \(got int\)"),
        (tmp_path / "missing.jsonl", r"missing\.jsonl: no such file"),
        (tmp_path / "notes.txt", r"unsupported file type '\.txt'; use one of \.jsonl, \.json, \.csv, \.parquet"),
    ]
    for path, message in cases:
        with pytest.raises(DataError, match=message) as info:
            read_file(path)
        assert "\n" not in str(info.value)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl: has no records"):
        load_records(str(empty))


def test_source_kinds():
    assert source_kind("aclsum") == "aclsum"
    assert source_kind("trl-lib/tldr") == "hub"
    assert source_kind("OpenMLRL/arXiv_abstract") == "hub"
    for path in ("posts.jsonl", "data/x-{split}.csv", "./tldr", "/abs/path", "~/data", "a/b/c", str(FIXTURES)):
        assert source_kind(path) == "file", path


def test_aclsum_splits_and_fields():
    pytest.importorskip("aclsum")
    splits = {split: load_records("aclsum", split) for split in data.ACLSUM_SPLITS}
    assert {split: len(records) for split, records in splits.items()} == {"train": 100, "validation": 50, "test": 100}
    ids = [r["id"] for records in splits.values() for r in records]
    assert len(set(ids)) == 250  # splits are disjoint
    first = splits["validation"][0]
    assert set(first) == {"id", "title", "abstract", "introduction", "conclusion"}
    assert first["id"] == "2021.eacl-main.84"
    assert first["abstract"].startswith("Identifying named entities in written text is an essential component")
    assert " ." not in first["abstract"] and "( " not in first["abstract"]
    sliced = load_records("aclsum", "train", start=5, limit=2)
    assert [r["id"] for r in sliced] == [r["id"] for r in splits["train"][5:7]]
    with pytest.raises(DataError, match=r"aclsum: unknown split 'val'; it has train, validation, test"):
        load_records("aclsum", "val")


def test_aclsum_not_installed_says_how_to_install(monkeypatch):
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match=r"aclsum package is not installed: pip install aclsum, or point at a local"):
        load_records("aclsum", "train")


def test_detokenize_undoes_tokeniser_spacing():
    sentence = "Query expansion ( QE ) , e.g. [ 3 ] , works ; it 's 5 % better , isn't it ?"
    assert data.detokenize(sentence) == "Query expansion (QE), e.g. [3], works; it's 5% better, isn't it?"


def test_hub_without_datasets_says_how_to_install_or_use_a_file(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError) as info:
        load_records("trl-lib/tldr", "train")
    message = str(info.value)
    assert "hub dataset 'trl-lib/tldr'" in message and "pip install 'teamrl[hub]'" in message
    assert "env.kwargs.source=/path/to/data.jsonl" in message and "\n" not in message


def test_hub_rows_are_sliced_and_checked(monkeypatch):
    datasets = pytest.importorskip("datasets")
    import teamrl.models.loading

    rows = [{"prompt": f"post {i}", "completion": f"tl;dr {i}"} for i in range(5)]
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(teamrl.models.loading, "hub_reachable", lambda: True)
    assert load_records("trl-lib/tldr", "test", start=1, limit=2, fields=["prompt"]) == rows[1:3]
    assert calls == [("trl-lib/tldr", "test")]
    with pytest.raises(MissingFieldError, match=r"hub dataset 'trl-lib/tldr' test: record 3 has no field 'text'"):
        load_records("trl-lib/tldr", "test", start=3, fields=["text"])
    with pytest.raises(DataError, match="start=5 is past the last record"):
        load_records("trl-lib/tldr", "test", start=5)


@pytest.fixture
def no_hub(monkeypatch):
    """A hub endpoint that cannot resolve, with no offline flag and no proxy: the 'no network' case."""
    pytest.importorskip("datasets")
    import datasets
    from huggingface_hub import constants

    offline_flags = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    for name in [n for n in os.environ if n.lower().endswith("_proxy") or n in offline_flags]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)


def test_unreachable_hub_fails_at_once_with_one_line(no_hub):
    began = time.monotonic()
    with pytest.raises(DataError) as info:
        load_records(NO_SUCH_DATASET, "train")
    assert time.monotonic() - began < 20  # datasets alone retries for ~25 s
    message = str(info.value)
    assert message.startswith(f"hub dataset {NO_SUCH_DATASET!r}: the Hugging Face hub is unreachable")
    assert "env.kwargs.source=/path/to/data.jsonl" in message and "HF_HUB_OFFLINE=1" in message
    assert "\n" not in message


def test_offline_mode_reads_the_cache_only_and_fails_fast(monkeypatch):
    pytest.importorskip("datasets")
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    began = time.monotonic()
    with pytest.raises(DataError) as info:
        load_records(NO_SUCH_DATASET, "train")
    assert time.monotonic() - began < 20
    message = str(info.value)
    assert message.startswith(f"hub dataset {NO_SUCH_DATASET!r} split 'train': ")
    assert "env.kwargs.source=" in message and "\n" not in message


def test_holdout_split_is_deterministic_and_disjoint():
    records = [{"id": str(i)} for i in range(20)]
    train, evaluation = holdout_split(records, 0.25, seed=3)
    assert (train, evaluation) == holdout_split(records, 0.25, seed=3)
    assert len(evaluation) == 5 and len(train) == 15
    assert {r["id"] for r in train}.isdisjoint(r["id"] for r in evaluation)
    assert train == sorted(train, key=lambda r: int(r["id"]))  # source order kept
    assert holdout_split(records, 0.25, seed=4) != (train, evaluation)
    assert len(holdout_split(records, 3, seed=0)[1]) == 3
    assert len(holdout_split(records, 0.01, seed=0)[1]) == 1  # a fraction holds out at least one
    for bad in (20, 0, 1.5):
        with pytest.raises(DataError, match=f"eval_size={bad}"):
            holdout_split(records, bad, seed=0)
