"""Users' code by name: module:attribute import paths, the config's folder, entry points; one-line errors."""

from __future__ import annotations

import sys
import uuid

import pytest

from teamrl.imports import (
    ENVIRONMENT_GROUP,
    ImportPathError,
    add_search_folder,
    entry_point,
    import_path_of,
    load_object,
    module_folder,
)


def _unique_module(tmp_path, source: str, folder: str = "") -> str:
    name = f"user_module_{uuid.uuid4().hex[:8]}"
    where = tmp_path / folder
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{name}.py").write_text(source)
    return name


def test_a_module_beside_the_config_is_found(tmp_path, monkeypatch):
    # A console script's sys.path holds neither the config's folder nor the working directory.
    name = _unique_module(tmp_path, "def score(completions, item):\n    return 1.0\n", "configs")
    monkeypatch.chdir(tmp_path)  # not the folder the module is in
    with pytest.raises(ImportPathError, match="no module named"):
        load_object(f"{name}:score", "env.kwargs.reward")
    add_search_folder(tmp_path / "configs")
    assert load_object(f"{name}:score", "env.kwargs.reward")([], {}) == 1.0


def test_a_module_in_the_working_directory_is_found(tmp_path, monkeypatch):
    name = _unique_module(tmp_path, "class Task:\n    class Inner:\n        value = 3\n")
    monkeypatch.chdir(tmp_path)
    assert load_object(f"{name}:Task.Inner", "env.name").value == 3


def test_errors_name_the_field_the_path_and_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ImportPathError, match=r"^env.kwargs.reward: no module named 'nowhere_at_all' .*"
                                              + str(tmp_path)):
        load_object("nowhere_at_all:score", "env.kwargs.reward")
    broken = _unique_module(tmp_path, "import numpy\nraise RuntimeError('bad data path')\n")
    with pytest.raises(ImportPathError, match=f"env.name: importing '{broken}'.*RuntimeError: bad data path"):
        load_object(f"{broken}:Task", "env.name")
    imports_missing = _unique_module(tmp_path, "import a_package_nobody_has\n")
    with pytest.raises(ImportPathError, match="a_package_nobody_has"):
        load_object(f"{imports_missing}:Task", "env.name")
    fine = _unique_module(tmp_path, "x = 1\n")
    with pytest.raises(ImportPathError, match=f"env.name: module '{fine}' .* has no 'Task'"):
        load_object(f"{fine}:Task", "env.name")
    with pytest.raises(ImportPathError, match=f"no module named '{fine}x' .* or install it; did you mean '{fine}'\\?$"):
        load_object(f"{fine}x:x", "env.name")
    with pytest.raises(ImportPathError, match="not an import path"):
        load_object("justaname", "env.kwargs.reward")


def test_import_paths_of_objects_round_trip_only_when_a_fresh_process_could_import_them(tmp_path, monkeypatch):
    name = _unique_module(tmp_path, "def score(c, i):\n    return 0.0\n")
    monkeypatch.chdir(tmp_path)
    score = load_object(f"{name}:score", "f")
    assert import_path_of(score) == f"{name}:score"
    assert module_folder(score) == str(tmp_path.resolve())

    def local(c, i):
        return 0.0

    assert import_path_of(local) is None
    assert import_path_of(lambda c, i: 0.0) is None


def test_an_installed_package_publishes_environments_by_entry_point(tmp_path, monkeypatch):
    name = _unique_module(tmp_path, "from teamrl.envs.digit_sum import DigitSumGame as Published\n")
    dist = tmp_path / "user_tasks-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: user-tasks\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENVIRONMENT_GROUP}]\npublished_digits = {name}:Published\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from teamrl.envs.base import make_env
    from teamrl.envs.digit_sum import DigitSumGame

    assert entry_point(ENVIRONMENT_GROUP, "published_digits") is DigitSumGame
    assert make_env("published_digits", length=2).length == 2
    with pytest.raises(ValueError, match="unknown environment 'unpublished'.*module:Class"):
        make_env("unpublished")


def test_module_folder_of_a_package_module_is_the_folder_above_the_package(tmp_path, monkeypatch):
    package = f"user_pkg_{uuid.uuid4().hex[:8]}"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "tasks.py").write_text("def f():\n    pass\n")
    monkeypatch.chdir(tmp_path)
    f = load_object(f"{package}.tasks:f", "f")
    assert module_folder(f) == str(tmp_path.resolve())
    assert str(tmp_path.resolve()) in sys.path
