"""The pure parts of benchmarks/comlrl_side_by_side.py: matched configs, medians, ratios, the table.

Runs without CoMLRL, torch models or the bundled model: the harness module imports only the standard
library.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from teamrl.config import config_from_dict

BENCHMARK = "comlrl_side_by_side"
HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / f"{BENCHMARK}.py"


@pytest.fixture(scope="module")
def harness(benchmark_script):
    return benchmark_script


@pytest.mark.parametrize("turns", [1, 2])
def test_both_configs_describe_the_same_work(harness, turns, tmp_path):
    spec = harness.RunSpec(turns=turns, steps=5, items=2, num_generations=4, max_new_tokens=64, lr=5e-6)
    ours = config_from_dict(harness.teamrl_config(spec, str(tmp_path), str(tmp_path / "run")))  # validates
    theirs = harness.comlrl_config(spec)

    assert ours.algorithm.num_generations == theirs["num_generations"] == 4
    assert ours.algorithm.num_turns == theirs["num_turns"] == turns
    assert ours.team.sampling.max_new_tokens == theirs["max_new_tokens"] == 64
    assert ours.team.sampling.temperature == theirs["temperature"]
    assert ours.team.sampling.top_p == theirs["top_p"]
    assert ours.team.sampling.top_k == theirs["top_k"] == 0  # 0 = off in both (CoMLRL's default is 50)
    assert ours.optim.lr == theirs["agent_learning_rate"] == 5e-6
    assert ours.team.training == "full"  # CoMLRL 1.4.3 has no LoRA
    assert ours.algorithm.joint_mode == theirs["joint_mode"] == "aligned"
    assert ours.algorithm.discount == theirs["discount"] == 1.0
    # the paper's mean baseline, no std normalisation, on both sides
    assert ours.algorithm.advantage == theirs["advantage_mode"] == "mean"
    assert theirs["advantage_normalization"] is False
    assert ours.algorithm.kl_coef == 0 and theirs["reference_kl_enabled"] is False
    assert ours.algorithm.early_termination_threshold is None and theirs["early_termination_threshold"] is None
    # CoMLRL: AdamW(params, lr) with torch defaults, no gradient clipping
    assert ours.optim.weight_decay == 0.01 and ours.optim.max_grad_norm is None
    assert ours.optim.lr_scheduler == "constant" and ours.optim.warmup_steps == 0
    assert ours.algorithm.num_iterations == 1
    # one update covers the same items: every tree node of `items` items
    assert ours.items_per_step == 2 and ours.steps == 5
    assert theirs["rollout_buffer_size"] == theirs["train_batch_size"] == 2 * (1 if turns == 1 else 1 + 4)
    assert theirs["eval_interval"] == 0


def test_the_lora_entrant_changes_only_teamrls_training_mode_and_learning_rate(harness, tmp_path):
    args = harness.parse_args(["--out", "x.json", "--teamrl-training", "full", "lora", "--lr", "5e-6"])
    spec = harness.spec_from_args(args, 1, 0)
    (full_name, _, full), (lora_name, lora_library, lora), (theirs_name, _, theirs) = harness.entrants(args, spec)
    assert (full_name, lora_name, lora_library, theirs_name) == ("teamrl", "teamrl-lora", "teamrl", "comlrl")
    assert full == theirs == spec
    ours_full = harness.teamrl_config(full, str(tmp_path), str(tmp_path / "run"))
    ours_lora = harness.teamrl_config(lora, str(tmp_path), str(tmp_path / "run"))
    config = config_from_dict(ours_lora)  # validates
    assert config.team.training == "lora" and config.team.lora.r == 16 and config.optim.lr == 2e-4
    ours_lora["team"].pop("lora")
    ours_lora["team"]["training"], ours_lora["optim"]["lr"] = "full", 5e-6
    assert ours_lora == ours_full  # nothing else differs
    only_lora = harness.parse_args(["--out", "x.json", "--teamrl-training", "lora"])
    assert [name for name, _, _ in harness.entrants(only_lora, spec)] == ["teamrl-lora", "comlrl"]


def test_a_lora_entrant_gets_its_own_rows_and_ratio(harness):
    runs = [_run("teamrl", 1, 0, 20.0, 6.0, [1.0], [1.5]), _run("teamrl-lora", 1, 0, 10.0, 1.0, [1.0], [1.4]),
            _run("comlrl", 1, 0, 40.0, 8.0, [1.0], [1.0])]
    block = harness.summarise(runs)["1-turn"]
    assert block["ratio"]["step_seconds"] == pytest.approx(0.5)
    assert block["ratio_lora"]["step_seconds"] == pytest.approx(0.25)
    assert block["ratio_lora"]["peak_rss_gb"] == pytest.approx(1 / 8)
    table = harness.markdown_table(harness.summarise(runs)).splitlines()
    assert [line.split("|")[2].strip() for line in table[2:]] == [
        "teamrl", "teamrl (LoRA)", "CoMLRL", "teamrl / CoMLRL", "teamrl (LoRA) / CoMLRL"]
    assert "| 1-turn | teamrl (LoRA) / CoMLRL |  | 0.25x |" in table[6]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_both_libraries_load_their_models_in_the_same_dtype(harness, dtype, tmp_path):
    args = harness.parse_args(["--out", "x.json", "--teamrl-training", "full", "lora"]
                              + ([] if dtype == "float32" else ["--dtype", dtype]))
    for _, library, spec in harness.entrants(args, harness.spec_from_args(args, 2, 0)):
        if library == "comlrl":
            assert harness.comlrl_model_config(spec) == {"dtype": dtype}
        else:
            assert config_from_dict(harness.teamrl_config(spec, str(tmp_path), str(tmp_path))).team.dtype == dtype


def test_joint_actions_count_every_turn_of_the_aligned_tree(harness):
    assert harness.joint_actions_per_step(harness.RunSpec(turns=1, items=2, num_generations=4)) == 8
    assert harness.joint_actions_per_step(harness.RunSpec(turns=2, items=2, num_generations=4)) == 2 * (4 + 16)


def test_spec_round_trips_through_json(harness):
    spec = harness.RunSpec(turns=2, steps=3, lr=1e-5, threads=1, eval_before=False)
    assert harness.RunSpec.from_json(spec.to_json()) == spec


def test_median_and_ratio_skip_missing_values(harness):
    assert harness.median([3.0, None, 1.0, 2.0]) == 2.0
    assert harness.median([None]) is None
    assert harness.ratio(3.0, 2.0) == 1.5
    assert harness.ratio(None, 2.0) is None and harness.ratio(1.0, 0.0) is None


def _run(library, turns, repeat, step_seconds, rss, before, after):
    return {"library": library, "turns": turns, "repeat": repeat, "step_seconds": step_seconds,
            "generation_seconds_per_step": step_seconds / 2, "update_seconds_per_step": step_seconds / 2,
            "joint_actions_per_second": 8 / step_seconds, "tokens_per_second": 400 / step_seconds,
            "peak_rss_gb": rss, "reward_before": before, "reward_after": after}


def test_summary_takes_medians_over_repeats_and_ratios_of_medians(harness):
    runs = [
        _run("teamrl", 1, 0, 10.0, 2.0, [1.0], [1.2]),
        _run("teamrl", 1, 1, 30.0, 2.2, None, [1.4]),
        _run("teamrl", 1, 2, 20.0, 2.1, None, [1.6]),
        _run("comlrl", 1, 0, 40.0, 7.0, [1.0], [1.1]),
        _run("comlrl", 1, 1, 50.0, 7.5, None, [1.3]),
        _run("comlrl", 1, 2, 60.0, 7.2, None, [1.2]),
    ]
    block = harness.summarise(runs)["1-turn"]
    assert block["teamrl"]["step_seconds"] == 20.0 and block["comlrl"]["step_seconds"] == 50.0
    assert block["teamrl"]["repeats"] == 3
    assert block["ratio"]["step_seconds"] == pytest.approx(0.4)
    assert block["ratio"]["joint_actions_per_second"] == pytest.approx(8 / 20 / (8 / 50))
    assert block["ratio"]["peak_rss_gb"] == pytest.approx(2.1 / 7.2)
    assert block["teamrl"]["reward_before"] == [1.0]  # evaluated once, in the first repeat
    assert block["teamrl"]["reward_after"] == [1.4] and block["comlrl"]["reward_after"] == [1.2]
    assert block["ratio"]["reward_after"] == [pytest.approx(1.4 / 1.2)]


def test_table_has_a_row_per_library_and_a_ratio_row_per_configuration(harness):
    runs = [_run("teamrl", 1, 0, 10.0, 2.0, [1.0], [1.5]), _run("comlrl", 1, 0, 40.0, 8.0, [1.0], [1.0]),
            _run("teamrl", 2, 0, 30.0, 2.5, [1.0, 1.1], [1.2, 1.3]),
            _run("comlrl", 2, 0, 90.0, 9.0, [1.0, 1.1], [1.0, 1.3])]
    table = harness.markdown_table(harness.summarise(runs)).splitlines()
    assert table[0].startswith("| configuration | library | runs | s/step |")
    assert len(table) == 2 + 2 * 3
    assert all(line.count("|") == table[0].count("|") for line in table)
    assert "| 1-turn | teamrl | 1 | 10.0 |" in table[2]
    assert "| 1-turn | teamrl / CoMLRL |  | 0.25x |" in table[4]
    assert "1.200 / 1.300" in table[5]  # multi-turn rewards read turn 1 / turn 2
    assert "1.20x / 1.00x" in table[7]


def test_a_missing_library_gives_no_ratio_row(harness):
    summary = harness.summarise([_run("teamrl", 1, 0, 10.0, 2.0, None, [1.0])])
    assert "ratio" not in summary["1-turn"]
    assert "–" in harness.markdown_table(summary)  # no pre-training reward: a dash, not a crash


def test_report_records_every_entrants_config_and_the_table(harness, tmp_path):
    args = harness.parse_args(["--out", str(tmp_path / "report.json"), "--turns", "2", "--steps", "3",
                               "--teamrl-training", "full", "lora"])
    assert args.repeats == 3 and args.num_generations == 4 and args.max_new_tokens == 64
    runs = [_run("teamrl", 2, 0, 30.0, 2.5, [1.0, 1.1], [1.2, 1.3])]
    table = harness.write_report(args, {"teamrl": "0", "comlrl": "1.4.3"}, tmp_path, runs)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["table"] == table and report["runs"] == runs
    configs = report["configs"]["2-turn"]
    assert configs["teamrl"]["algorithm"]["num_turns"] == configs["comlrl"]["num_turns"] == 2
    assert configs["teamrl"]["steps"] == configs["teamrl-lora"]["steps"] == 3
    assert (configs["teamrl"]["team"]["training"], configs["teamrl-lora"]["team"]["training"]) == ("full", "lora")


def test_bad_sizes_are_rejected_on_the_command_line(harness, capsys):
    with pytest.raises(SystemExit):
        harness.parse_args(["--out", "x.json", "--num-generations", "1"])
    assert "--num-generations must be >= 2" in capsys.readouterr().err


def test_the_worker_reports_trainings_own_peak_and_the_one_before_it(tmp_path):
    """With many evaluation episodes the shared evaluation, not training, can set a worker's peak RSS: the
    worker reports training's own peak (the kernel's peak reset on entry) and the peak before it, which
    the reset hides from ``wait4``. Here 600 MB are touched before training and 150 MB within it."""
    import os
    import subprocess

    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("no /proc/self/clear_refs (not Linux): the worker reports no training peak there")
    code = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from side_by_side_worker import training_memory
before = np.ones(600_000_000 // 8); del before
memory = {}
with training_memory(memory):
    inside = np.ones(150_000_000 // 8)
print(json.dumps(memory))
"""
    out = subprocess.run([sys.executable, "-c", code, str(HARNESS.parent)], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(HARNESS.parents[1] / "src")})
    memory = json.loads(out.stdout.strip().splitlines()[-1])
    assert memory["setup_peak_rss_gb"] >= memory["train_peak_rss_gb"] + 0.3
    assert memory["train_peak_rss_gb"] >= 0.15
