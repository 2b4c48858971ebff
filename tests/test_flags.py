"""Flags made from settings classes (teamrl.flags): every setting of ``teamrl eval`` and ``teamrl compare`` is a flag
whose help is the field's own, the flags' defaults are the settings' defaults, and a bad value is the settings' own
one-line error (exit 2), not argparse's."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Literal

import pytest

from teamrl.cli import build_parser, main
from teamrl.evaluation.compare import CompareSettings
from teamrl.evaluation.methods import EvalSettings
from teamrl.flags import add_flags, flagged_fields, from_flags, option


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return commands.choices[name]


@pytest.mark.parametrize(("command", "cls"), [("eval", EvalSettings), ("compare", CompareSettings)])
def test_every_setting_is_a_flag_with_the_fields_own_help(command, cls):
    options = {action.dest: action for action in _subparser(command)._actions}
    for f in flagged_fields(cls):
        assert f.name in options, f"{command} has no flag for {cls.__name__}.{f.name}"
        assert options[f.name].help == f.metadata["help"]


@pytest.mark.parametrize(("command", "cls", "given"), [
    ("eval", EvalSettings, {}),
    ("compare", CompareSettings, {"config": None}),
])
def test_the_flags_defaults_are_the_settings_defaults(command, cls, given):
    args = _subparser(command).parse_args(["tiny_digit_sum"])
    assert from_flags(cls, args, **given) == cls(**given)


def test_flag_texts_are_read_into_the_settings_values():
    args = _subparser("compare").parse_args(["tiny_digit_sum", "--seeds", "3,4", "--minutes", "2.5",
                                             "--eval-items", "8"])
    settings = from_flags(CompareSettings, args, config=None)
    assert (settings.seeds, settings.minutes, settings.eval_items) == ((3, 4), 2.5, 8)
    args = _subparser("eval").parse_args(["digit_sum", "--k", "3,1", "--num-samples", "3", "--methods", "concat",
                                          "--team-sampling", "config"])
    settings = from_flags(EvalSettings, args)
    assert settings.ks == (1, 3) and [m.spec for m in settings.methods] == ["concat"]
    assert settings.team_sampling == "config"


@pytest.mark.parametrize(("argv", "message"), [
    (["compare", "tiny_digit_sum", "--algorithms", "magrpo", "--seeds", "0,x"],
     "teamrl: error: --seeds: comma-separated integers, e.g. 0,1,2 (got '0,x')"),
    (["compare", "tiny_digit_sum", "--algorithms", "magrpo", "--eval-items", "0"],
     "teamrl: error: --eval-items: must be >= 1 (got 0)"),
    (["eval", "digit_sum", "--k", "2"],
     "teamrl: error: --k: k=2 exceeds --num-samples 1; pass@k and accuracy@k need k <= n: lower --k or raise "
     "--num-samples to 2"),
    (["eval", "digit_sum", "--methods", "concat,oracle"], "teamrl: error: --methods: unknown method 'oracle'"),
])
def test_a_bad_value_is_one_line_naming_the_flag(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_a_literal_field_takes_its_values_only_and_bools_are_switches():
    @dataclasses.dataclass
    class Settings:
        mode: Literal["fast", "exact"] = option("how", "fast")
        dry_run: bool = option("do nothing", False)
        label: str = "not a flag"

    parser = argparse.ArgumentParser()
    add_flags(parser, Settings)
    assert from_flags(Settings, parser.parse_args(["--mode", "exact", "--dry-run"])) == Settings("exact", True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "slow"])
    assert "--label" not in parser.format_help()
