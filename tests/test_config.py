"""Config loading: documented defaults, overrides, and one-line errors that name the field."""

from __future__ import annotations

import subprocess
import sys

import pytest

from teamrl.config import ConfigError, TrainConfig, config_from_dict, describe_fields, load_config


def test_defaults_validate_and_every_field_is_documented():
    config = config_from_dict({})
    assert isinstance(config, TrainConfig)
    assert config.algorithm.num_generations == 4
    assert config.algorithm.advantage is None and config.algorithm.advantage_estimator == "mean"
    for name, _default, help_text in describe_fields():
        assert help_text, f"config field {name} has no documentation"


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  num_generations: 6\nteam:\n  sampling: {max_new_tokens: 12}\n")
    config = load_config(path, ["algorithm.num_turns=2", "optim.lr=1e-2", "team.agents=[{name: a}, {name: b}]"])
    assert config.algorithm.num_generations == 6
    assert config.algorithm.num_turns == 2
    assert config.optim.lr == 0.01
    assert config.team.sampling.max_new_tokens == 12
    assert [a.name for a in config.team.agents] == ["a", "b"]


def test_per_agent_sampling_overrides_the_team_settings():
    config = config_from_dict({"team": {"sampling": {"temperature": 0.9, "max_new_tokens": 10},
                                        "agents": [{"name": "a", "sampling": {"max_new_tokens": 30}}, {"name": "b"}]}})
    assert config.team.agent_sampling(0).max_new_tokens == 30
    assert config.team.agent_sampling(0).temperature == 0.9
    assert config.team.agent_sampling(1).max_new_tokens == 10


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"algorithm": {"num_generatons": 4}}, "algorithm.num_generatons"),        # unknown key (typo)
        ({"bogus": 1}, "bogus"),
        ({"algorithm": {"num_generations": "four"}}, "algorithm.num_generations"),  # wrong type
        ({"optim": {"lr": "fast"}}, "optim.lr"),
        ({"optim": {"lr": "nan-ish"}}, "optim.lr"),
        ({"steps": 2.5}, "steps"),
        ({"logging": {"tensorboard": "yes"}}, "logging.tensorboard"),
        ({"algorithm": {"num_generations": 1}}, "algorithm.num_generations"),       # G < 2
        ({"algorithm": {"joint_mode": "diagonal"}}, "algorithm.joint_mode"),
        ({"team": {"model": "/no/such/model/dir"}}, "team.model"),                  # missing model path
        ({"team": {"model": "./missing.gguf"}}, "team.model"),
        ({"team": {"agents": [{"name": "a", "model": "/nope"}, {"name": "b"}]}}, "team.agents[0].model"),
        ({"team": {"agents": [{"name": "a"}, {"name": "a"}]}}, "team.agents"),
        ({"team": {"agents": [{"model": "tiny"}]}}, "team.agents[0].name"),          # required field
        ({"team": {"agents": [{"name": "a", "sampling": {"temprature": 1}}]}}, "team.agents[0].sampling.temprature"),
        ({"team": {"sampling": {"top_p": 0}}}, "team.sampling.top_p"),
        ({"optim": {"betas": [0.9]}}, "optim.betas"),
        ({"eval": {"every_steps": -1}}, "eval.every_steps"),
        ({"eval": {"every_steps": "often"}}, "eval.every_steps"),
        ({"eval": {"items": 0}}, "eval.items"),
        ({"eval": {"samples": 0}}, "eval.samples"),
        ({"eval": {"seed": 1.5}}, "eval.seed"),
        ({"eval": {"every": 5}}, "eval.every"),
    ],
)
def test_bad_values_name_the_field(data, field):
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    message = str(err.value)
    assert message.startswith(field + ":"), message
    assert "\n" not in message


def test_held_out_evaluation_is_on_about_four_times_a_run_unless_set():
    config = config_from_dict({})
    assert (config.eval.every_steps, config.eval.items, config.eval.samples, config.eval.seed) == (None, 8, 2, 0)
    assert [config.eval.interval(steps) for steps in (1, 4, 8, 24, 60, 1000)] == [1, 1, 2, 6, 15, 250]
    assert config_from_dict({"eval": {"every_steps": 5}}).eval.interval(100) == 5
    assert config_from_dict({"eval": {"every_steps": 0}}).eval.interval(100) == 0  # off
    assert {"eval.every_steps", "eval.items", "eval.samples", "eval.seed"} <= {row[0] for row in describe_fields()}


def test_cli_reports_a_bad_config_in_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("algorithm:\n  num_generations: 1\n")
    result = subprocess.run([sys.executable, "-m", "teamrl.cli", "train", str(path)], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "teamrl: error: algorithm.num_generations: must be >= 2: a group-relative advantage needs at least "
        "two samples (got 1)"
    ]


def test_missing_config_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="must look like"):
        load_config(None, ["no_equals_sign"])


def test_every_shipped_preset_loads_and_validates():
    from teamrl.config import presets

    names = presets()
    assert {"tiny_digit_sum", "demo_tldr_cpu", "tldr_paper", "humaneval_2turn_paper"} <= set(names)
    for name in names:
        config = load_config(name)
        assert config.steps >= 1, name


def test_an_env_name_override_leaves_out_the_env_kwargs_the_file_wrote_for_its_own(caplog):
    # demo_tldr_cpu's env.kwargs (source, max_text_chars) are tldr's: digit_sum would refuse them.
    import logging

    from teamrl.envs.base import make_env

    with caplog.at_level(logging.WARNING, logger="teamrl.config"):
        config = load_config("demo_tldr_cpu", ["env.name=digit_sum"])
    assert config.env.kwargs == {}
    make_env(config.env.name, **config.env.kwargs)
    assert [record.getMessage() for record in caplog.records] == [
        "env.name=digit_sum: left out the config file's env.kwargs (source, max_text_chars), written for tldr; "
        "digit_sum's come from env.kwargs.FIELD=VALUE overrides"]
    # The new environment's own, in either order.
    for overrides in (["env.name=digit_sum", "env.kwargs.length=3"], ["env.kwargs.length=3", "env.name=digit_sum"]):
        assert load_config("demo_tldr_cpu", overrides).env.kwargs == {"length": 3}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="teamrl.config"):
        assert load_config("demo_tldr_cpu", ["env.name=tldr"]).env.kwargs == {"source": "aclsum", "max_text_chars": 500}
        assert load_config(None, ["env.name=digit_sum", "env.kwargs.length=3"]).env.kwargs == {"length": 3}
    assert not caplog.records  # nothing was left out


def test_an_algorithm_name_override_leaves_out_the_advantage_the_file_chose_for_magrpo(caplog):
    # docs/quickstart.md's `teamrl train tiny_digit_sum algorithm.name=marloo`: the preset says advantage: mean.
    import logging

    with caplog.at_level(logging.WARNING, logger="teamrl.config"):
        config = load_config("tiny_digit_sum", ["algorithm.name=marloo"])
    assert (config.algorithm.name, config.algorithm.advantage, config.algorithm.advantage_estimator) == \
        ("marloo", None, "rloo")
    assert [record.getMessage() for record in caplog.records] == [
        "algorithm.name=marloo: left out the config file's algorithm.advantage (mean); marloo's is rloo"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="teamrl.config"):
        said = load_config("tiny_digit_sum", ["algorithm.name=marloo", "algorithm.advantage=rloo"])
        assert said.algorithm.advantage == "rloo"
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="teamrl.config"):  # a critic reads no group estimator
        assert load_config("tiny_digit_sum", ["algorithm.name=iac"]).algorithm.advantage is None
    assert [record.getMessage() for record in caplog.records] == [
        "algorithm.name=iac: left out the config file's algorithm.advantage (mean): iac does not use it"]
    with pytest.raises(ConfigError, match="algorithm.name='marloo' is MAGRPO with advantage 'rloo'"):
        load_config("tiny_digit_sum", ["algorithm.name=marloo", "algorithm.advantage=mean"])  # said, so refused
