"""``teamrl eval`` from the command line: a run on tiny agents, config resolution, and one-line errors."""

from __future__ import annotations

import pytest

from teamrl.cli import main
from teamrl.evaluation.runner import eval_config


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["eval", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_eval_writes_the_table_and_the_report(tiny_eval, tmp_path, capsys):
    trained = tiny_eval.run_dir / "team"
    code, out, err = run_cli(
        capsys, "tiny_digit_sum", "--methods", f"concat,team:{trained}", "--max-items", "2", "--num-samples", "2",
        "--k", "1,2", "--out", str(tmp_path / "eval"), "--run-dir", str(tiny_eval.run_dir),
        "team.sampling.max_new_tokens=3", "team.training=lora")  # overrides after the options
    assert code == 0, err
    assert "| naive concatenation (untrained team) |" in out and f"| trained team ({trained}) |" in out
    assert f"report: {tmp_path / 'eval' / 'report.html'}" in out
    names = {path.name for path in (tmp_path / "eval").iterdir()}
    assert {"results.md", "results.csv", "results.json", "report.html", "methods.png", "reward_curve.png"} <= names


def test_the_target_is_a_config_a_preset_or_an_environment(tmp_path):
    config = eval_config("humaneval", ["team.sampling.max_new_tokens=8"], model="bundled")
    assert config.env.name == "humaneval" and config.team.model == "bundled"
    assert config.team.sampling.max_new_tokens == 8
    assert eval_config("demo_tldr_cpu").env.name == "tldr"
    assert eval_config("tiny_digit_sum", ["team.model=tiny"], model="bundled").team.model == "tiny"  # overrides win
    file = tmp_path / "eval.yaml"
    file.write_text("env: {name: tldr}\nteam: {model: tiny}\n")
    assert eval_config(str(file)).env.name == "tldr"


@pytest.mark.parametrize("argv, message", [
    (["digit_sum", "--methods", "concat,wizard"], "--methods: unknown method 'wizard'; use a comma-separated list of "
                                                  "single, single:MODEL, concat, sequential, discussion, team:PATH"),
    (["digit_sum", "--methods", "team:runs/missing/team"],
     "--methods: team:runs/missing/team: no saved team in 'runs/missing/team' (no team.json); give a directory "
     "written by Team.save_pretrained"),
    (["digit_sum", "--num-samples", "2", "--k", "1,3"],
     "--k: k=3 exceeds --num-samples 2; pass@k and accuracy@k need k <= n: lower --k or raise --num-samples to 3"),
    (["digit_sum", "--k", "one"], "--k: 'one' is not a comma-separated list of integers"),
    (["nowhere"], "ENV_OR_CONFIG: 'nowhere' is neither an environment (arxiv, build, coophumaneval, dataset, "
                  "digit_sum"),
    (["digit_sum", "team.sampling.max_new_tokens=0"], "team.sampling.max_new_tokens: must be >= 1"),
    (["digit_sum", "--methods", "concat", "--split", "test"], "--split: split must be 'train' or 'eval' (got 'test')"),
])
def test_bad_input_is_one_line_naming_the_value_and_exit_code_2(capsys, tmp_path, argv, message):
    code, out, err = run_cli(capsys, *argv, "--out", str(tmp_path / "never"))
    assert code == 2 and out == ""
    assert err.startswith("teamrl: error: ") and err.count("\n") == 1 and message in err
    assert not (tmp_path / "never").exists()


def test_a_run_dir_without_metrics_fails_before_anything_runs(capsys, tmp_path):
    code, out, err = run_cli(capsys, "digit_sum", "--run-dir", str(tmp_path), "--out", str(tmp_path / "never"))
    assert code == 2 and "--run-dir: " in err and "has no metrics.jsonl" in err and out == ""


def _tokens_per_answer(capsys, tiny_eval, tmp_path, *extra: str) -> float:
    import json

    out_dir = tmp_path / "eval"
    code, out, err = run_cli(capsys, "tiny_digit_sum", "--methods", f"team:{tiny_eval.run_dir / 'team'}",
                             "--max-items", "3", "--num-samples", "2", "--out", str(out_dir),
                             "team.sampling.max_new_tokens=64", *extra)
    assert code == 0, err
    return json.loads((out_dir / "results.json").read_text())["methods"][0]["metrics"]["tokens_per_answer"]


def test_a_saved_team_samples_with_its_own_settings_unless_told_otherwise(tiny_eval, tmp_path, capsys):
    # The team was trained and saved with max_new_tokens=4; the config asks for 64.
    assert _tokens_per_answer(capsys, tiny_eval, tmp_path) <= 2 * 4  # two agents, 4 tokens each at most
    assert _tokens_per_answer(capsys, tiny_eval, tmp_path, "--team-sampling", "config") > 2 * 4
