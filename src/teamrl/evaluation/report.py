"""What ``teamrl eval`` writes: results tables (Markdown, CSV, JSON), PNG plots and a self-contained HTML report.

Files in the output folder:

* ``results.md``: the results table (one row per method: normalised return, mean reward, pass@k,
  accuracy@k and tests passed for coding tasks, tokens and time per joint answer, tokens/s), the mean
  reward per level, the cooperation schemes of coding tasks, each saved team against every other method
  (the reward difference paired by item, its standard error and their ratio) and what each method is.
* ``results.csv``: one row per method, every metric in its own column.
* ``results.json``: the settings, the config, and per method its metrics and every joint action
  (what each agent saw and wrote, the reward and its parts).
* ``methods.png`` (normalised return and pass@k per method), ``schemes.png`` (coding tasks) and
  ``reward_curve.png`` (when a training run's ``metrics.jsonl`` is given).
* ``report.html``: all of the above in one file that needs nothing else: the plots are embedded as
  base64 images, and side-by-side sample joint actions of each method follow (all text HTML-escaped).
"""

from __future__ import annotations

import base64
import csv
import html
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from teamrl.evaluation.metrics import paired_difference
from teamrl.evaluation.plots import plot_methods, plot_reward_curve, plot_schemes
from teamrl.evaluation.runner import EvalResults, MethodResult

RESULTS_MD, RESULTS_CSV, RESULTS_JSON, REPORT_HTML = "results.md", "results.csv", "results.json", "report.html"
METHODS_PNG, SCHEMES_PNG, REWARD_CURVE_PNG = "methods.png", "schemes.png", "reward_curve.png"
#: Items whose joint actions the HTML report shows side by side (the first sample of each).
REPORT_ITEMS = 5
#: The results table's header colour in report.html (the screenshot test looks for it).
HEADER_COLOUR = "#1f4e79"


@dataclass(frozen=True)
class Column:
    """A column of a results table: its header, the metric it shows and how."""

    header: str
    metric: str
    fmt: str = ".3f"


def main_columns(results: EvalResults) -> list[Column]:
    """The results table's columns, in the paper's spirit: quality first, then cost."""
    columns = [Column("Norm. return", "normalised_return"), Column("Reward", "reward_mean"),
               Column("Reward std", "reward_std")]
    if results.is_code:
        columns += [Column(f"pass@{k}", f"pass@{k}") for k in results.ks]
        columns += [Column(f"acc@{k}", f"accuracy@{k}") for k in results.ks]
        columns.append(Column("Held tests passed", "tests_passed"))
    return columns + [Column("Tokens/answer", "tokens_per_answer", ".1f"),
                      Column("s/answer", "seconds_per_answer", ".2f"), Column("Tokens/s", "tokens_per_s", ".1f")]


def _prefixed_columns(results: EvalResults, prefix: str) -> list[Column]:
    """A column per metric named ``prefix``+NAME that any method has, in first-seen order."""
    names = dict.fromkeys(key for result in results.methods for key in result.metrics if key.startswith(prefix))
    return [Column(name.removeprefix(prefix), name) for name in names]


def tables(results: EvalResults) -> list[tuple[str, list[Column]]]:
    """(title, columns) of each table: the results, the reward per level, what the environment counted and the
    cooperation schemes of a task that names them (the coding tasks). Tables without a column (a reward with no
    parts) are left out."""
    results_title = "Results (pass@k, acc@k and tests passed count each problem's held tests, which no feedback " \
        "shows)" if results.is_code else "Results"
    sections = [(results_title, main_columns(results)),
                (f"Mean reward per level (max total {results.max_reward:g})", _prefixed_columns(results, "level/")),
                ("Mean counts per joint action (not part of the reward)", _prefixed_columns(results, "count/"))]
    sections.append(("Cooperation schemes (fraction of joint actions)",
                     [Column(column.header, column.metric, ".2f") for column in _prefixed_columns(results, "scheme/")]))
    return [(title, columns) for title, columns in sections if columns]


def table_rows(results: EvalResults, columns: Sequence[Column]) -> list[list[str]]:
    """One row per method: its title, then each column's value (a part a method never got counts 0)."""
    return [[result.method.title, *(format(result.metrics.get(column.metric, 0.0), column.fmt) for column in columns)]
            for result in results.methods]


def summary_line(results: EvalResults) -> str:
    """What was evaluated, in one line."""
    longer = sorted({r.num_turns for r in results.methods if r.num_turns > 1})
    episodes = (f"; saved teams play {' or '.join(map(str, longer))}-turn episodes scored by their return (every "
                f"turn's joint reward summed), the baselines answer once; the normalised return divides by the "
                f"largest return of an episode that long") if longer else ""
    return (f"{results.env_name}, split {results.split!r}: {results.num_items} items x {results.num_samples} "
            f"samples per method; the environment's joint reward (max {results.max_reward:g} a turn){episodes}; "
            f"seed {results.config.get('seed')}; model {results.config.get('team', {}).get('model')!r}.")


VERSUS_TITLE = "Trained teams against each other method (paired by item)"
VERSUS_HEADERS = ("Team", "Against", "Norm. return difference", "SE", "Difference / SE")


def _normalised_returns_by_item(results: EvalResults, result: MethodResult) -> dict[Any, list[float]]:
    by_item: dict[Any, list[float]] = {}
    for sample in result.samples:
        by_item.setdefault(sample["item"], []).append(sample["reward"] / results.method_max_return(result))
    return by_item


def versus_rows(results: EvalResults) -> list[list[str]]:
    """Each saved team against every other method (its roles swapped and one agent in every role too): how much higher
    its mean normalised return is (each episode's return over the largest of an episode that long: a team's
    multi-turn episodes and a baseline's one answer on one scale), the standard error of that difference over
    items (:func:`~teamrl.evaluation.metrics.paired_difference`), and the ratio (above 2: the team is ahead by
    more than two standard errors). Empty without a team and another method."""
    teams = [result for result in results.methods if result.method.is_trained_team]
    others = [result for result in results.methods if not result.method.is_trained_team]
    rows = []
    for team in teams:
        for other in others:
            difference, se, _ = paired_difference(_normalised_returns_by_item(results, team),
                                                  _normalised_returns_by_item(results, other))
            ratio = f"{difference / se:+.1f}" if se > 0 else "-"
            rows.append([team.method.title, other.method.title, f"{difference:+.3f}", f"{se:.3f}", ratio])
    return rows


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured Markdown table (``|`` in a cell is escaped)."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"
    return "\n".join([line(headers), line(["---"] * len(headers)), *map(line, rows)])


def markdown_results(results: EvalResults, columns: Sequence[Column] | None = None) -> str:
    """A results table in Markdown: ``columns`` (default: the main ones) for every method."""
    columns = main_columns(results) if columns is None else columns
    return markdown_table(["Method", *(column.header for column in columns)], table_rows(results, columns))


def render_markdown(results: EvalResults) -> str:
    """``results.md``: the tables and what each method is."""
    parts = [f"# teamrl eval: {results.env_name}", summary_line(results)]
    for title, columns in tables(results):
        parts += [f"## {title}", markdown_results(results, columns)]
    versus = versus_rows(results)
    if versus:
        parts += [f"## {VERSUS_TITLE}", markdown_table(VERSUS_HEADERS, versus)]
    parts.append("## Methods")
    parts.append("\n".join(f"- **{r.method.title}** (`{r.method.spec}`): {r.description}"
                           for r in results.methods))
    return "\n\n".join(parts) + "\n"


def write_csv(results: EvalResults, path: Path) -> Path:
    """``results.csv``: one row per method, a column per metric (empty where a method lacks one)."""
    metrics = list(dict.fromkeys(key for result in results.methods for key in result.metrics))
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["method", "title", *metrics])
        for result in results.methods:
            writer.writerow([result.method.spec, result.method.title, *(result.metrics.get(m, "") for m in metrics)])
    return path


def results_record(results: EvalResults) -> dict[str, Any]:
    """``results.json``'s content."""
    return {
        "env": results.env_name, "split": results.split, "num_items": results.num_items,
        "num_samples": results.num_samples, "ks": list(results.ks), "max_reward": results.max_reward,
        "agents": results.agent_names, "config": results.config,
        "methods": [{"method": r.method.spec, "title": r.method.title, "description": r.description,
                     "num_turns": r.num_turns, "metrics": r.metrics, "samples": r.samples} for r in results.methods],
    }


def read_history(run_dir: str | Path) -> list[dict[str, float]]:
    """The per-step metrics of a training run (its ``metrics.jsonl``), for the reward curve.

    Raises:
        ValueError: the run directory has no ``metrics.jsonl``, or it holds no steps.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"--run-dir: {str(run_dir)!r} has no metrics.jsonl; give a training run directory "
                         f"(the run_dir of teamrl train), or leave --run-dir out")
    history = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not history:
        raise ValueError(f"--run-dir: {path} holds no training steps yet")
    return history


def write_plots(results: EvalResults, out_dir: Path, history: Sequence[Mapping[str, float]] | None = None
                ) -> dict[str, Path]:
    """The evaluation's PNG plots, by caption."""
    titles = [result.method.title for result in results.methods]
    series = {"normalised return": [result.metrics["normalised_return"] for result in results.methods]}
    if results.is_code:
        series.update({f"pass@{k}": [result.metrics[f"pass@{k}"] for result in results.methods] for k in results.ks})
    plots = {"Methods compared": plot_methods(titles, series, out_dir / METHODS_PNG,
                                              title=f"{results.env_name}: methods compared")}
    schemes = [column.header for column in _prefixed_columns(results, "scheme/")]
    if schemes:
        distributions = [{s: r.metrics.get(f"scheme/{s}", 0.0) for s in schemes} for r in results.methods]
        plots["Cooperation schemes"] = plot_schemes(titles, distributions, out_dir / SCHEMES_PNG)
    if history:
        plots["Training reward curve"] = plot_reward_curve(history, out_dir / REWARD_CURVE_PNG,
                                                           max_reward=results.max_return or results.max_reward,
                                                           num_turns=results.num_turns)
    return plots


_STYLE = f"""
body {{ font-family: sans-serif; margin: 24px; color: #222; background: #fff; }}
table {{ border-collapse: collapse; margin: 8px 0 24px; }}
th, td {{ border: 1px solid #bbb; padding: 4px 8px; text-align: right; vertical-align: top; }}
th {{ background: {HEADER_COLOUR}; color: #fff; }}
td:first-child, th:first-child {{ text-align: left; }}
table.samples td, table.samples th {{ text-align: left; max-width: 420px; }}
pre {{ white-space: pre-wrap; word-break: break-word; margin: 0; font-size: 12px; }}
img {{ max-width: 100%; border: 1px solid #ddd; }}
figure {{ margin: 0 0 24px; }}
"""


def _html_table(headers: Sequence[str], rows: Sequence[Sequence[str]], css_class: str = "") -> str:
    """A table of plain-text ``headers`` (escaped here) and ``rows`` of cells that are already HTML."""
    head = "".join(f"<th>{html.escape(header)}</th>" for header in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="{css_class}"><tr>{head}</tr>{body}</table>'


def _samples_html(results: EvalResults) -> str:
    """Each of the first :data:`REPORT_ITEMS` items' first joint action, one column per method."""
    sections = []
    first_samples = [[s for s in result.samples if s["sample"] == 0] for result in results.methods]
    for row in range(min(REPORT_ITEMS, results.num_items)):
        samples = [samples[row] for samples in first_samples]
        rows = [[f"<b>{html.escape(name)}</b>", *(f"<pre>{html.escape(s['actions'][seat])}</pre>" for s in samples)]
                for seat, name in enumerate(results.agent_names)]
        rows.append(["<b>joint reward</b>", *(f"{s['reward']:.3f}" + (f" ({html.escape(s['scheme'])})"
                                                                      if "scheme" in s else "") for s in samples)])
        sections.append(f"<h3>Item {html.escape(str(samples[0]['item']))}</h3>"
                        + _html_table(["Agent", *(r.method.title for r in results.methods)], rows, "samples"))
    return "\n".join(sections)


def render_html(results: EvalResults, plots: Mapping[str, Path]) -> str:
    """``report.html``: self-contained (plots embedded as base64 PNG), every text HTML-escaped."""
    parts = [f"<h1>teamrl eval: {html.escape(results.env_name)}</h1>", f"<p>{html.escape(summary_line(results))}</p>"]
    for title, columns in tables(results):
        parts += [f"<h2>{html.escape(title)}</h2>",
                  _html_table(["Method", *(c.header for c in columns)],
                              [[html.escape(cell) for cell in row] for row in table_rows(results, columns)])]
    versus = versus_rows(results)
    if versus:
        parts += [f"<h2>{html.escape(VERSUS_TITLE)}</h2>",
                  _html_table(VERSUS_HEADERS, [[html.escape(cell) for cell in row] for row in versus])]
    for caption, path in plots.items():
        data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
        parts.append(f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(caption)}">'
                     f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    parts.append("<h2>Methods</h2><dl>" + "".join(
        f"<dt><b>{html.escape(r.method.title)}</b> (<code>{html.escape(r.method.spec)}</code>)</dt>"
        f"<dd>{html.escape(r.description)}</dd>" for r in results.methods) + "</dl>")
    parts += ["<h2>Sample joint outputs (first sample of each item)</h2>", _samples_html(results)]
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>teamrl eval: '
            f"{html.escape(results.env_name)}</title><style>{_STYLE}</style></head><body>\n"
            + "\n".join(parts) + "\n</body></html>\n")


def write_report(results: EvalResults, out_dir: str | Path,
                 history: Sequence[Mapping[str, float]] | None = None) -> dict[str, Path]:
    """Write every file (see the module docstring) into ``out_dir``; returns their paths by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS_MD).write_text(render_markdown(results))
    write_csv(results, out / RESULTS_CSV)
    (out / RESULTS_JSON).write_text(json.dumps(results_record(results), indent=2))
    plots = write_plots(results, out, history)
    (out / REPORT_HTML).write_text(render_html(results, plots))
    names = [RESULTS_MD, RESULTS_CSV, RESULTS_JSON, REPORT_HTML]
    return {**{name: out / name for name in names}, **{path.name: path for path in plots.values()}}
