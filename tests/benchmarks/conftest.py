"""The benchmark scripts' tests load the script their module names in ``BENCHMARK`` (a file of benchmarks/)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def benchmark_script(request):
    """The module ``benchmarks/<BENCHMARK>.py`` of the requesting test module, loaded for its tests."""
    name = request.module.BENCHMARK
    sys.path.insert(0, str(BENCHMARKS))  # as when run as a script: its siblings import by name
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]
    sys.path.remove(str(BENCHMARKS))
