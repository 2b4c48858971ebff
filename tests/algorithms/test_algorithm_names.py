"""``algorithm.name``: every shipped name builds and is documented, MAREINFORCE/MARLOO/MAReMax fix MAGRPO's
advantage estimator (one way to say each), and the centralised baseline's config is checked up front."""

from __future__ import annotations

from pathlib import Path

import pytest

from teamrl.algorithms.base import ALGORITHMS, algorithm_class
from teamrl.algorithms.centralized import Centralized
from teamrl.algorithms.magrpo import MAGRPO
from teamrl.config import AlgorithmConfig, ConfigError

ALGORITHM_PAGE = Path(__file__).resolve().parents[2] / "docs" / "algorithm.md"
SHIPPED = [name for name, cls in ALGORITHMS.items() if cls.__module__.startswith("teamrl.")]


def test_the_nine_shipped_algorithms_are_registered():
    assert sorted(SHIPPED) == ["centralized", "iac", "maac", "madpo", "magrpo", "mareinforce", "maremax", "marlhf",
                               "marloo"]


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_name_is_registered_and_documented(name):
    assert algorithm_class(name) is ALGORITHMS[name]
    table = ALGORITHM_PAGE.read_text().split("## Algorithms", 1)[1]
    assert f"| `{name}`" in table, f"docs/algorithm.md#algorithms has no row for {name}"


def test_the_reinforce_variants_are_magrpo_and_centralized_is_magrpo_on_another_environment():
    assert all(algorithm_class(name) is MAGRPO for name in ("magrpo", "mareinforce", "marloo", "maremax"))
    assert algorithm_class("centralized") is Centralized and issubclass(Centralized, MAGRPO)


@pytest.mark.parametrize(("name", "advantage", "estimator"), [
    ("magrpo", None, "mean"),
    ("magrpo", "std", "std"),
    ("centralized", "rloo", "rloo"),
    ("mareinforce", None, "none"),
    ("marloo", None, "rloo"),
    ("maremax", None, "max"),
    ("maremax", "max", "max"),  # saying it twice, the same way, is fine
])
def test_advantage_estimator(name, advantage, estimator):
    config = AlgorithmConfig(name=name, advantage=advantage)
    config.validate("algorithm")
    assert config.advantage_estimator == estimator


def test_a_variant_name_with_another_advantage_is_an_error_naming_both_fields(tiny_config):
    with pytest.raises(ConfigError, match=r"algorithm\.advantage: algorithm\.name='maremax' is MAGRPO with "
                                          r"advantage 'max'.*algorithm\.name='magrpo'.*\(got 'mean'\)"):
        tiny_config(algorithm={"name": "maremax", "advantage": "mean"})


def test_centralized_needs_exactly_one_agent(tiny_config):
    with pytest.raises(ConfigError, match=r"team\.agents: algorithm\.name='centralized' trains one policy.*"
                                          r"\(got \['first', 'second'\]\)"):
        tiny_config(algorithm={"name": "centralized"})


@pytest.mark.parametrize(("field", "value"), [("num_turns", 2), ("learners", "individual")])
def test_centralized_is_single_turn_and_joint(tiny_config, field, value):
    with pytest.raises(ConfigError, match=rf"algorithm\.{field}: must be .* with name='centralized'"):
        tiny_config(algorithm={"name": "centralized", field: value}, team={"agents": [{"name": "central"}]})
