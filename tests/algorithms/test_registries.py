"""The registries a config names (``algorithm.name``, ``algorithm.advantage``, ``algorithm.logprob_aggregation``):
a user's own estimator, aggregation and algorithm train from YAML like shipped ones; unknown names and a second
registration of a taken name are one-line errors."""

from __future__ import annotations

import sys
import textwrap

import pytest
import yaml

from teamrl.algorithms.advantages import ADVANTAGES, register_advantage
from teamrl.config import ConfigError, load_config
from teamrl.registry import Registry, RegistryError
from teamrl.train import Trainer

USER_MODULE = '''
import torch

from teamrl.algorithms.advantages import register_advantage
from teamrl.algorithms.base import register_algorithm
from teamrl.algorithms.losses import register_aggregation
from teamrl.algorithms.magrpo import MAGRPO

CALLS = {"estimator": 0, "aggregation": 0, "learn": 0}


@register_advantage("{prefix}_median")
def median_baseline(returns: torch.Tensor) -> torch.Tensor:
    CALLS["estimator"] += 1
    return returns - returns.median(dim=-1, keepdim=True).values


@register_aggregation("{prefix}_half_sum")
def half_sum(token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    CALLS["aggregation"] += 1
    return 0.5 * (token_loss * mask).sum()


@register_algorithm("{prefix}_counted")
class Counted(MAGRPO):
    def learn(self, tree, agents, seeds):
        CALLS["learn"] += 1
        return super().learn(tree, agents, seeds)
'''


def write_user_module(folder, name: str) -> None:
    (folder / f"{name}.py").write_text(USER_MODULE.replace("{prefix}", name))


def write_config(folder, tiny_config_data, algorithm: dict, **top) -> str:
    data = tiny_config_data(steps=2, algorithm={"num_generations": 4, **algorithm}, **top)
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("how", ["paths", "imports"])
def test_a_users_estimator_aggregation_and_algorithm_train_from_yaml(tmp_path, tiny_config_data, how):
    module = f"user_rl_{how}"
    write_user_module(tmp_path, module)  # beside the YAML: found as the config's own modules are
    if how == "paths":  # each named by its module:name path (the module registers them on import)
        algorithm = {"name": f"{module}:Counted", "advantage": f"{module}:median_baseline",
                     "logprob_aggregation": f"{module}:half_sum"}
        config = load_config(write_config(tmp_path, tiny_config_data, algorithm))
    else:  # the module imported first, then named by the names it registers
        algorithm = {"name": f"{module}_counted", "advantage": f"{module}_median",
                     "logprob_aggregation": f"{module}_half_sum"}
        config = load_config(write_config(tmp_path, tiny_config_data, algorithm, imports=[module]))
    calls = sys.modules[module].CALLS
    with Trainer(config) as trainer:
        history = trainer.train()
    assert len(history) == 2
    assert calls["learn"] == 2
    assert calls["estimator"] >= 2 * 2  # every agent's advantages, every step
    assert calls["aggregation"] > 0  # the update's loss went through it
    assert all(step["reward/mean"] == step["reward/mean"] for step in history)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("name", "grpo", r"algorithm\.name: unknown algorithm 'grpo'; registered: magrpo, mareinforce, .*centralized"),
    ("advantage", "median", r"algorithm\.advantage: unknown advantage estimator 'median'; registered: mean, std, "
                            r"rloo, none, max"),
    ("logprob_aggregation", "token_max", r"algorithm\.logprob_aggregation: unknown log-prob aggregation "
                                         r"'token_max'; registered: token_sum, sequence_mean, token_mean"),
    ("advantage", "no_such_module:fn", r"algorithm\.advantage: no module named 'no_such_module'"),
])
def test_an_unknown_name_is_one_line_listing_what_is_registered(tiny_config, field, value, message):
    with pytest.raises(ConfigError, match=message) as err:
        tiny_config(algorithm={field: value})
    assert "\n" not in str(err.value)


def test_a_missing_import_is_a_config_error(tiny_config):
    with pytest.raises(ConfigError, match=r"imports\[0\]: no module named 'not_a_module_anywhere'"):
        tiny_config(imports=["not_a_module_anywhere"])


def test_registering_a_taken_name_again_is_an_error():
    with pytest.raises(RegistryError, match=r"algorithm\.advantage: 'mean' is already registered "
                                            r"\(teamrl\.algorithms\.advantages:mean_baseline\)"):
        @register_advantage("mean")
        def my_mean(returns):
            return returns
    assert ADVANTAGES["mean"].__name__ == "mean_baseline"  # the shipped one is still there


def test_the_same_definition_imported_twice_is_not_a_conflict():
    registry: Registry = Registry("thing", "things")

    def make():
        def thing():
            return 1
        return thing

    first, again = make(), make()  # two objects, one definition (a module imported twice)
    registry.register("one")(first)
    registry.register("one")(again)
    assert registry["one"] is again
    with pytest.raises(RegistryError):
        registry.register("one")(textwrap.dedent)  # another definition


def test_properties_given_at_registration_are_read_back():
    assert ADVANTAGES.properties("rloo") == {"leave_the_sample_out": True}
    assert ADVANTAGES.properties("mean") == {}
    from teamrl.algorithms.base import ALGORITHMS

    assert ALGORITHMS.properties("marloo") == {"advantage": "rloo"}
    assert ALGORITHMS.properties("madpo") == {"uses_reference": True}


@pytest.mark.parametrize(("algorithm", "message"), [
    ({"name": "iac", "normalize_advantages": "agent"},
     r"algorithm\.normalize_advantages: algorithm\.name='iac' does not use it; leave it out \(its default: 'none'\)"),
    ({"name": "maac", "advantage": "std"}, r"algorithm\.advantage: algorithm\.name='maac' does not use it"),
    ({"name": "madpo", "normalize_advantages": "agent"}, r"algorithm\.normalize_advantages: .*'madpo' does not"),
    ({"name": "magrpo", "critic": {"lr": 0.01}}, r"algorithm\.critic: algorithm\.name='magrpo' does not use it"),
    ({"name": "marlhf", "dpo": {"beta": 0.5}}, r"algorithm\.dpo: algorithm\.name='marlhf' does not use it"),
    ({"joint_mode": "aligned", "max_joint_actions": 16},
     r"algorithm\.max_joint_actions: caps cross mode's G\^n joint actions; aligned mode has G of them"),
])
def test_a_setting_the_algorithm_or_mode_would_ignore_is_refused_at_load(tiny_config, algorithm, message):
    with pytest.raises(ConfigError, match=message) as err:
        tiny_config(algorithm=algorithm)
    assert "\n" not in str(err.value)


def test_the_settings_an_algorithm_reads_still_load(tiny_config):
    tiny_config(algorithm={"name": "iac", "critic": {"lr": 0.01}})
    tiny_config(algorithm={"name": "magrpo", "normalize_advantages": "agent", "advantage": "none"})
    tiny_config(algorithm={"name": "madpo", "dpo": {"beta": 0.5}, "preference": {"pairs": "all"}})
    tiny_config(algorithm={"joint_mode": "cross", "max_joint_actions": 16, "num_generations": 4})
