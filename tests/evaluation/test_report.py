"""What ``teamrl eval`` writes: the tables (Markdown, CSV, JSON), the plots and the self-contained HTML report."""

from __future__ import annotations

import base64
import csv
import dataclasses
import json
import re

import pytest

from teamrl.envs import make_env
from teamrl.envs.code_schemes import SCHEMES
from teamrl.evaluation.baselines import Episode, MethodOutput
from teamrl.evaluation.heldout import method_metrics
from teamrl.evaluation.methods import Method
from teamrl.evaluation.report import (
    REPORT_ITEMS,
    main_columns,
    read_history,
    render_html,
    render_markdown,
    table_rows,
    versus_rows,
    write_report,
)
from teamrl.evaluation.runner import EvalResults, MethodResult
from teamrl.rewards.base import RewardResult

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def written(tiny_eval, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    return out, write_report(tiny_eval.results, out, read_history(tiny_eval.run_dir))


def code_results() -> EvalResults:
    """Two methods' made-up results on two HumanEval problems (nothing generated or run)."""
    env = make_env("humaneval", eval_size=2, limit=4)
    items = env.items("eval")
    main = ("```python\ndef {0}(*args):\n    try:\n        return aux(*args)\n"
            "    except Exception:\n        return len(args)\n```")
    methods = []
    for spec, passed in (("concat", 1.0), ("discussion", 0.0)):
        episodes = [Episode(item, ["obs a", "obs b"], ["def aux(*args):\n    return args\n",
                                                      main.format(item["entry_point"])]) for item in items]
        rewards = [RewardResult(3.0 * passed + 0.5, {"syntax": 0.5}, {"tests_passed": passed * len(item["tests"]),
                                                                       "tests_total": float(len(item["tests"]))})
                   for item in items]
        metrics = method_metrics(env, MethodOutput(episodes, 40, 2.0), rewards, 1, (1,))
        samples = [{"item": e.item["id"], "sample": 0, "actions": e.actions, "reward": r.total, "parts": r.parts,
                    "scheme": "fallback"} for e, r in zip(episodes, rewards)]
        methods.append(MethodResult(Method(spec, spec), metrics, samples))
    return EvalResults("humaneval", "eval", 2, 1, (1,), env.max_reward, True, ["helper", "main"], methods,
                       {"seed": 0, "team": {"model": "tiny"}})


def test_every_file_is_written(written):
    out, files = written
    assert {path.name for path in out.iterdir()} == {"results.md", "results.csv", "results.json", "report.html",
                                                     "methods.png", "reward_curve.png"}
    assert set(files) == {path.name for path in out.iterdir()}
    for name in ("methods.png", "reward_curve.png"):
        assert (out / name).read_bytes()[:8] == PNG and (out / name).stat().st_size > 10_000


def test_the_markdown_table_has_one_row_per_method(tiny_eval, written):
    out, _ = written
    text = (out / "results.md").read_text()
    results = tiny_eval.results
    header = "| Method | Norm. return | Reward | Reward std | Tokens/answer | s/answer | Tokens/s |"
    # digit_sum's reward has no parts, only counts (hits, digit pairs): those never sit under "max total 1"
    assert header in text and "## Mean counts per joint action (not part of the reward)" in text
    assert "## Mean reward per level" not in text
    for result, cells in zip(results.methods, table_rows(results, main_columns(results))):
        assert "| " + " | ".join(cells) + " |" in text
        assert f"**{result.method.title}** (`{result.method.spec}`): {result.method.description}" in text
    tables = text.split("## Trained teams against")[0]  # after it, methods are also named as a team's opponents
    assert tables.count(f"| {results.methods[0].method.title} |") == 2  # the results and the counts table


def test_each_trained_team_is_set_against_every_other_method_paired_by_item(tiny_eval, written):
    results = tiny_eval.results
    teams = [r for r in results.methods if r.method.team_dir is not None]
    others = [r for r in results.methods if r.method.team_dir is None]
    rows = versus_rows(results)
    assert [(row[0], row[1]) for row in rows] == [(t.method.title, o.method.title) for t in teams for o in others]
    # the difference is the difference of the two methods' normalised returns (every item has the same number of
    # samples)
    for row, (team, other) in zip(rows, [(t, o) for t in teams for o in others]):
        assert float(row[2]) == pytest.approx(team.metrics["normalised_return"] - other.metrics["normalised_return"],
                                              abs=1e-3)
        assert float(row[3]) >= 0
    out, files = written
    assert "## Trained teams against each other method (paired by item)" in files["results.md"].read_text()
    assert "Trained teams against each other method" in files["report.html"].read_text()
    no_team = dataclasses.replace(results, methods=others)
    assert versus_rows(no_team) == [] and "paired by item" not in render_markdown(no_team)


def test_a_teams_multi_turn_episodes_and_a_baselines_one_answer_are_compared_on_one_scale(tmp_path):
    # Coding rewards score a state (max 4 a turn): a saved team's 2-turn episodes return up to 8, a baseline's one
    # answer up to 4. Item a: 6 of 8 against 3 of 4 (0.75 each); item b: 6 of 8 against 2 of 4 (0.75 - 0.5).
    team_dir = tmp_path / "team"
    team = MethodResult(Method(f"team:{team_dir}", None, team_dir=team_dir), {},
                        [{"item": item, "reward": 6.0} for item in "ab"], num_turns=2, max_return=8.0)
    concat = MethodResult(Method("concat", "concat"), {}, [{"item": "a", "reward": 3.0}, {"item": "b", "reward": 2.0}])
    results = EvalResults("humaneval", "eval", 2, 1, (1,), 4.0, True, ["helper", "main"], [team, concat],
                          num_turns=2, max_return=8.0)
    assert versus_rows(results)[0][2] == "+0.125"  # not the raw reward difference, +3.5
    assert "saved teams play 2-turn episodes scored by their return" in render_markdown(results)


def test_csv_and_json_hold_every_metric_and_sample(tiny_eval, written):
    out, _ = written
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [row["method"] for row in rows] == [r.method.spec for r in tiny_eval.results.methods]
    for row, result in zip(rows, tiny_eval.results.methods):
        assert float(row["normalised_return"]) == pytest.approx(result.metrics["normalised_return"])
    record = json.loads((out / "results.json").read_text())
    assert record["env"] == "digit_sum" and record["num_samples"] == 2 and record["ks"] == [1, 2]
    assert record["config"]["team"]["model"] == "tiny"
    for method, result in zip(record["methods"], tiny_eval.results.methods):
        assert method["method"] == result.method.spec and method["metrics"] == result.metrics
        assert len(method["samples"]) == 6
        assert {"observations", "actions", "reward", "parts"} <= set(method["samples"][0])


def test_the_html_report_is_self_contained_and_escapes_model_text(tiny_eval, written):
    out, files = written
    page = (out / "report.html").read_text()
    images = re.findall(r'<img src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 2 and all(base64.b64decode(image)[:8] == PNG for image in images)
    assert not re.search(r'(src|href)="(?!data:)', page)  # nothing to fetch
    for result in tiny_eval.results.methods:
        assert result.method.title in page
    assert page.count("<h3>Item ") == min(REPORT_ITEMS, tiny_eval.results.num_items)

    first = tiny_eval.results.methods[0]
    samples = [{**sample, "actions": ["<script>alert(1)</script>", "a & b"]} for sample in first.samples]
    hostile = dataclasses.replace(tiny_eval.results, methods=[dataclasses.replace(first, samples=samples)])
    page = render_html(hostile, {})
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "a &amp; b" in page
    assert "<img" not in page


def test_coding_results_add_pass_at_k_the_schemes_table_and_plot(tmp_path):
    results = code_results()
    text = render_markdown(results)
    assert "| pass@1 | acc@1 | Held tests passed |" in text
    assert "## Cooperation schemes (fraction of joint actions)" in text
    assert "## Results (pass@k, acc@k and tests passed count each problem's held tests" in text
    assert "| " + " | ".join(SCHEMES) + " |" in text
    # normalised return 3.5 / 4, mean reward 3.5 (std 0), every test passed: pass@1 = acc@1 = 1
    assert "| naive concatenation (untrained team) | 0.875 | 3.500 | 0.000 | 1.000 | 1.000 | 1.000 |" in text
    assert "| one-round discussion | 0.125 | 0.500 | 0.000 | 0.000 | 0.000 | 0.000 |" in text
    files = write_report(results, tmp_path)
    assert "schemes.png" in files and files["schemes.png"].read_bytes()[:8] == PNG
    assert "reward_curve.png" not in files
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 2 and "(fallback)" in page


def test_a_run_directory_without_metrics_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--run-dir: .* has no metrics.jsonl"):
        read_history(tmp_path)
