"""Fixtures for the model tests: one bundled-model cache shared by the whole session."""

from __future__ import annotations

from pathlib import Path

import pytest

from teamrl.models import bundled


@pytest.fixture(scope="session")
def bundled_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A teamrl cache root holding the bundled model, converted once for the whole session (~30 s)."""
    root = tmp_path_factory.mktemp("teamrl-cache")
    bundled.ensure_converted(bundled.get_bundled_model(), cache_dir=root)
    return root
