"""Held-out evaluation during training (``config.eval``): when it runs, what it writes (eval.jsonl,
reward_curve.png, the command's summary), that training's own numbers do not change with it, and that a
resumed run evaluates each step once."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import yaml

from teamrl.cli import main
from teamrl.train import Trainer

PNG = b"\x89PNG\r\n\x1a\n"
#: What differs between two runs of the same training: the clock, the memory, and what follows from them.
UNTIMED = ("time/", "memory/", "tokens/per_second")


def _evaluations(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]


def _untimed(history: list[dict]) -> list[dict]:
    return [{key: value for key, value in metrics.items() if not key.startswith(UNTIMED)} for metrics in history]


def test_a_run_evaluates_at_step_zero_every_n_steps_and_at_its_last_step(tiny_config):
    config = tiny_config(steps=5, items_per_step=2, algorithm={"num_generations": 4},
                         eval={"every_steps": 2, "items": 3, "samples": 2, "seed": 7})
    with Trainer(config) as trainer:
        trainer.train()
        records = _evaluations(trainer.run_dir)
        assert [record["step"] for record in records] == [0, 2, 4, 5]
        assert records == trainer.evaluations
        for record in records:
            assert record["items"] == 3 and record["samples"] == 2 and record["seconds"] > 0
            assert 0 <= record["reward/mean"] <= 1 and record["reward/std"] >= 0 and "count/hits" in record
        # Trainer.evaluate's path, on eval.seed's draws: the final weights score the last line again.
        again = trainer.evaluate(num_samples=2, max_items=3, seed=7)
        assert {key: records[-1][key] for key in again} == again
    curve = trainer.run_dir / "reward_curve.png"
    assert curve.read_bytes()[:8] == PNG


def test_by_default_a_run_is_evaluated_about_four_times_after_step_zero(tiny_config):
    with Trainer(tiny_config(steps=8, items_per_step=1, algorithm={"num_generations": 2},
                             eval={"every_steps": None, "items": 2, "samples": 1})) as trainer:
        trainer.train()
    assert [record["step"] for record in _evaluations(trainer.run_dir)] == [0, 2, 4, 6, 8]


def test_training_is_the_same_with_and_without_held_out_evaluation(tiny_config, tmp_path):
    histories = {}
    for every in (1, 0):
        config = tiny_config(steps=3, items_per_step=2, algorithm={"num_generations": 4},
                             eval={"every_steps": every, "items": 4}, run_dir=str(tmp_path / f"every{every}"))
        with Trainer(config) as trainer:
            histories[every] = trainer.train()
    assert len(_evaluations(tmp_path / "every1")) == 4
    assert not (tmp_path / "every0" / "eval.jsonl").exists()
    assert _untimed(histories[1]) == _untimed(histories[0])


def test_a_resumed_run_drops_the_evaluations_after_its_checkpoint_and_evaluates_each_step_once(tiny_config):
    config = tiny_config(steps=4, items_per_step=2, algorithm={"num_generations": 4},
                         checkpoint={"save_every": 2, "keep_last": 3}, eval={"every_steps": 2, "items": 3})
    with Trainer(config) as trainer:
        trainer.train()
    run_dir = trainer.run_dir
    uninterrupted = _evaluations(run_dir)
    assert [record["step"] for record in uninterrupted] == [0, 2, 4]
    # As if killed while step 4's checkpoint was being written: its evaluation was logged, its checkpoint lost,
    # and each log's last line half written.
    shutil.rmtree(run_dir / "checkpoints" / "step_000004")
    for name in ("metrics.jsonl", "samples.jsonl", "eval.jsonl"):
        with (run_dir / name).open("a") as log:
            log.write('{"step": 5, "reward/me')
    with Trainer(config, resume=True) as resumed:
        assert [record["step"] for record in resumed.evaluations] == [0, 2]
        resumed.train()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in metrics] == [1, 2, 3, 4]
    records = _evaluations(run_dir)
    assert [record["step"] for record in records] == [0, 2, 4]  # step 2 (the checkpoint's) is not evaluated again
    assert [record["reward/mean"] for record in records] == [record["reward/mean"] for record in uninterrupted]
    with Trainer(config, resume=True) as finished:  # a run already done evaluates nothing more
        finished.train()
    assert [record["step"] for record in _evaluations(run_dir)] == [0, 2, 4]


def test_the_stopping_step_of_after_step_is_evaluated_and_resuming_goes_on_from_it(tiny_config):
    config = tiny_config(steps=4, items_per_step=2, algorithm={"num_generations": 4},
                         eval={"every_steps": 2, "items": 3})
    with Trainer(config) as trainer:
        trainer.train(after_step=lambda metrics: metrics["step"] == 3)
    assert [record["step"] for record in _evaluations(trainer.run_dir)] == [0, 2, 3]
    with Trainer(config, resume=True) as resumed:
        resumed.train()
    assert [record["step"] for record in _evaluations(trainer.run_dir)] == [0, 2, 3, 4]


def test_a_task_without_held_out_items_trains_with_one_warning(tiny_config, caplog):
    config = tiny_config(steps=2, items_per_step=1, algorithm={"num_generations": 2}, eval={"every_steps": 1},
                         env={"name": "digit_sum", "kwargs": {"targets": [9], "length": 4, "num_eval": 0}})
    with caplog.at_level(logging.WARNING, logger="teamrl.train"), Trainer(config) as trainer:
        assert len(trainer.train()) == 2
    warnings = [record.getMessage() for record in caplog.records if "held-out" in record.getMessage()]
    assert warnings == ["eval: DigitSumGame has no 'eval' items: training without held-out evaluation "
                        "(eval.every_steps=0 turns it off)"]
    assert not (trainer.run_dir / "eval.jsonl").exists() and (trainer.run_dir / "reward_curve.png").is_file()


def test_teamrl_train_prints_the_held_out_change_and_the_curve(tiny_config_data, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_config_data(steps=2, items_per_step=1, algorithm={"num_generations": 2},
                                                      eval={"every_steps": None, "items": 3, "samples": 2})))
    assert main(["train", str(config)]) == 0
    out = capsys.readouterr().out
    first, last = _evaluations(tmp_path / "run")[0], _evaluations(tmp_path / "run")[-1]
    assert (f"held-out joint reward (3 items x 2 samples): {first['reward/mean']:.3f} at step 0 -> "
            f"{last['reward/mean']:.3f} at step 2") in out
    assert f"reward curve: {tmp_path / 'run' / 'reward_curve.png'}" in out
