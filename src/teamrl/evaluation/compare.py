"""``teamrl compare``: algorithms (or config variants) trained on one task under one training-time budget.

Every *contender* (a registered algorithm, :data:`~teamrl.algorithms.base.ALGORITHMS`, or a named set of config
overrides) trains on the same task, items, reward and seeds, for the same number of training minutes
(``minutes``: the sum of the steps' own time, evaluation not counted; the step under way when the budget
runs out finishes) or steps. Its team is scored on the held-out split at step 0 and then every
``eval_every_steps`` steps or ``eval_every_minutes`` training minutes and at the end, always on the same
draws (the evaluation samples with its own seed), so contenders differ only by what training did.

Each run is a process of its own (``python -m teamrl.evaluation.compare``): its peak memory (RSS) is its
own and one run cannot leak state into the next. ``OUT/results.json`` is rewritten after every run and a
re-run skips the runs already there, so a killed comparison continues where it stopped; a run killed part way
resumes from its last checkpoint (every ``checkpoint.save_every`` steps of its config) with its evaluations so
far, and ends as it would have uninterrupted (training's draws are seeded by step). Files in ``OUT``:

* ``results.md`` / ``results.csv``: per contender over seeds, the held-out return before and after (mean
  and standard error over seeds), the gain, the training minutes to +0.5 and +1.0, the steps, the cost per
  step and the peak memory; ``results.md`` also has each contender's return after training against the
  first one's (with the difference's standard error), the reward's parts (levels) before and after and
  each run's curve;
* ``results.json``: every run's settings, evaluations (with the standard error over items) and steps;
* ``curve.png``: held-out return against training minutes, each contender's seed mean and min..max band;
* ``report.html``: the tables and the plot in one self-contained file.

Runs started ``parallel`` at a time share the machine: their returns are what a run alone gets (training
is seeded and evaluation draws are fixed), but their minutes are not, so a budget in minutes compares
contenders fairly only when every run had the same share (all alone, or all ``parallel`` at a time with
``threads`` each, as the report says).
"""

from __future__ import annotations

import base64
import contextlib
import csv
import html
import json
import os
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from teamrl.algorithms.base import ALGORITHMS
from teamrl.config import TrainConfig, load_config
from teamrl.flags import option
from teamrl.registry import RegistryError
from teamrl.run_dir import METRICS_FILE, complete_checkpoints, read_records

RESULTS_JSON, RESULTS_MD, RESULTS_CSV, REPORT_HTML, CURVE_PNG = (
    "results.json", "results.md", "results.csv", "report.html", "curve.png")
#: In a run's directory: the spec it was started with, and its held-out evaluations so far (one JSON line
#: each), what a killed run resumes with.
RUN_SPEC_JSON, RUN_CURVE_JSONL = "compare_run.json", "compare_curve.jsonl"
#: Gains over the untrained team whose training minutes the tables report.
GAINS = (0.5, 1.0)


@dataclass(frozen=True)
class Contender:
    """What one line of the comparison trains: a name and the config overrides that make it."""

    name: str
    overrides: tuple[str, ...] = ()


def algorithm_contender(name: str, config: TrainConfig) -> Contender:
    """The contender that trains ``config`` (the task's, before any contender's overrides) with
    ``algorithm.name=name``.

    The config file's settings the algorithm does not read (MAGRPO's estimator for a critic, or for ``marloo``,
    which fixes its own) are left out when it loads with ``algorithm.name=NAME`` (:func:`~teamrl.config.load_config`);
    ``centralized`` gets one agent, the policy that writes every seat's part, with the team's token budget
    (the sum of its agents' ``max_new_tokens``), as the prompt-only ``single`` baseline has.
    """
    try:
        ALGORITHMS.resolve(name)
    except RegistryError:
        raise ValueError(f"--algorithms: unknown algorithm {name!r}; choose from {', '.join(ALGORITHMS)} "
                         f"(or give your own as module:Class)") from None
    overrides = [f"algorithm.name={name}"]
    if name == "centralized":
        budget = sum(agent.sampling.get("max_new_tokens", config.team.sampling.max_new_tokens)
                     for agent in config.team.agents)
        overrides.append(f"team.agents=[{{name: central, sampling: {{max_new_tokens: {budget}}}}}]")
    return Contender(name, tuple(overrides))


def parse_algorithms(text: str, config: TrainConfig) -> list[Contender]:
    """``--algorithms``: comma-separated names (:func:`algorithm_contender` each), or ``all`` registered ones."""
    names = list(ALGORITHMS) if text.strip() == "all" else [name.strip() for name in text.split(",") if name.strip()]
    return [algorithm_contender(name, config) for name in names]


def parse_variant(text: str) -> Contender:
    """``"NAME: a=1 b=2"`` -> ``Contender("NAME", ("a=1", "b=2"))`` (overrides split like a shell line)."""
    name, sep, overrides = text.partition(":")
    name = name.strip()
    if not sep or not name or "/" in name:
        raise ValueError(f"--variant {text!r}: write it as 'NAME: field=value ...' (a name without '/')")
    return Contender(name, tuple(shlex.split(overrides)))


def parse_seeds(text: str) -> tuple[int, ...]:
    """``--seeds``: comma-separated integers (``"0,1,2"``)."""
    try:
        return tuple(int(seed) for seed in text.split(","))
    except ValueError:
        raise ValueError(f"--seeds: comma-separated integers, e.g. 0,1,2 (got {text!r})") from None


@dataclass(frozen=True)
class CompareSettings:
    """What every run of a comparison shares; each field with a flag is one of ``teamrl compare``'s."""

    config: str | None
    """Config file or preset; None: the defaults (with ``overrides`` naming the task)."""
    overrides: tuple[str, ...] = ()
    """Config overrides of every contender, applied before the contender's own."""
    seeds: tuple[int, ...] = option("training seeds, comma-separated (default: %(default)s)", "0,1,2",
                                    parse=parse_seeds)
    minutes: float = option("training minutes per run, evaluation not counted (0: no limit)", 0.0)
    steps: int = option("training steps per run, replacing the config's steps (0: keep them); a --minutes budget "
                        "ends a run early but never trains past them (learning-rate schedules are laid out over "
                        "them)", 0)
    eval_every_minutes: float = option("evaluate every M training minutes (0: off)", 0.0)
    eval_every_steps: int = option("evaluate every N steps (0: off); with neither, only at step 0 and at the end", 0)
    eval_items: int = option("held-out items per evaluation (the split's first ones)", 32)
    eval_samples: int = option("joint actions sampled per held-out item", 2)
    eval_seed: int = option("sampling seed of every held-out evaluation, apart from the training seed: every run is "
                            "scored on the same draws", 0)
    parallel: int = option("runs at a time (their minutes are then not a lone run's: see --help's docs)", 1)
    threads: int = option("torch threads per run (0: torch's default)", 0)

    def __post_init__(self) -> None:
        for name in ("minutes", "steps", "eval_every_steps", "eval_every_minutes", "threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 0 (got {getattr(self, name)})")
        for name in ("eval_items", "eval_samples", "parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1 (got {getattr(self, name)})")
        if not self.seeds:
            raise ValueError("--seeds: give at least one seed")


def run_key(contender: str, seed: int) -> str:
    """A run's name: its run directory under OUT and its key in results.json."""
    return f"{contender}-seed{seed}"


def run_spec(settings: CompareSettings, contender: Contender, seed: int, out: Path) -> dict[str, Any]:
    """Everything one run needs, as JSON (what the worker process gets, and what results.json keeps)."""
    spec = asdict(settings)
    del spec["seeds"]
    spec.update(overrides=list(settings.overrides), contender=contender.name,
                contender_overrides=list(contender.overrides), seed=seed,
                run_dir=str(out / run_key(contender.name, seed)))
    return spec


def check_contenders(settings: CompareSettings, contenders: Sequence[Contender]) -> None:
    """Load every contender's config before anything trains, so a bad field fails now, naming the contender.

    Raises:
        ValueError: two contenders share a name, or a contender's config is invalid.
    """
    names = [contender.name for contender in contenders]
    if len(set(names)) != len(names):
        raise ValueError(f"contenders must have different names (got {', '.join(names)})")
    for contender in contenders:
        try:
            load_config(settings.config, [*settings.overrides, *contender.overrides])
        except ValueError as err:
            raise ValueError(f"contender {contender.name!r}: {err}") from None


def _peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def cpu_info() -> dict[str, str]:
    """/proc/cpuinfo's fields (the last processor's, as the others'), e.g. ``model name``, ``cpu family``,
    ``model``, ``vendor_id``; empty where there is no /proc/cpuinfo (not Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {}
    return {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in lines if ":" in line)}


def machine() -> str:
    """The CPU (and GPU, if torch sees one) a run's minutes were measured on, its torch build and threads: a
    budget in minutes compares runs made on the same kind of machine only."""
    import platform

    import torch

    info = cpu_info()
    cpu = (f"{info['model name']} (family {info['cpu family']} model {info['model']})"
           if all(key in info for key in ("model name", "cpu family", "model"))
           else platform.processor() or platform.machine())
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu}, {os.cpu_count()} cores{gpu}, torch {torch.__version__} on {torch.get_num_threads()} thread(s)"


def item_standard_error(samples: Sequence[Mapping[str, Any]]) -> float:
    """Standard error of the held-out mean return over items: an item's joint actions are not independent of
    each other, so each item counts once, by its mean return (0 with fewer than two items)."""
    by_item: dict[Any, list[float]] = {}
    for sample in samples:
        by_item.setdefault(sample["item"], []).append(sample["reward"])
    means = [statistics.fmean(rewards) for rewards in by_item.values()]
    return statistics.stdev(means) / len(means) ** 0.5 if len(means) > 1 else 0.0


def resumable(spec: Mapping[str, Any]) -> bool:
    """Whether ``spec``'s run directory holds this very run, killed after a checkpoint: it then resumes there."""
    run_dir = Path(spec["run_dir"])
    try:
        started_with = json.loads((run_dir / RUN_SPEC_JSON).read_text())
    except (OSError, ValueError):
        return False
    return started_with == dict(spec) and bool(complete_checkpoints(run_dir))


def _step_record(metrics: Mapping[str, float]) -> dict[str, float]:
    """What results.json keeps of a training step's metrics."""
    return {key: value for key, value in metrics.items() if key.startswith(("reward/", "time/", "step"))}


def train_with_evaluations(spec: Mapping[str, Any]) -> dict[str, Any]:
    """One run, in this process: held-out evaluations at step 0 and on the schedule, training between.

    The run directory is a training run's (config, metrics.jsonl, samples, checkpoints every
    ``checkpoint.save_every`` steps and at the last) and holds the trained team (``team/``, for ``teamrl eval
    team:PATH``), the spec (``compare_run.json``) and the evaluations so far (``compare_curve.jsonl``). When it
    already holds this spec's run, killed after a checkpoint (:func:`resumable`), the run resumes from that
    checkpoint: its steps come back from metrics.jsonl (training time included), its evaluations up to the
    checkpoint's step from compare_curve.jsonl.
    """
    from teamrl.train import Trainer

    if spec["threads"]:
        import torch

        torch.set_num_threads(spec["threads"])
    overrides = [*spec["overrides"], *spec["contender_overrides"],
                 *([f"steps={spec['steps']}"] if spec["steps"] else []), f"seed={spec['seed']}",
                 f"run_dir={spec['run_dir']}", "logging.progress_bar=false",
                 "eval.every_steps=0"]  # the comparison's own schedule below evaluates instead of the trainer's
    config = load_config(spec["config"], overrides)
    every_steps, every_seconds = spec["eval_every_steps"], 60 * spec["eval_every_minutes"]
    budget = 60 * spec["minutes"] if spec["minutes"] else float("inf")
    run_dir = Path(spec["run_dir"])
    resume = resumable(spec)
    with Trainer(config, resume=resume) as trainer:  # holds the run directory until the run is over
        curve_path = run_dir / RUN_CURVE_JSONL
        if resume:  # the Trainer has cut metrics.jsonl back to the checkpoint's step
            steps = [_step_record(metrics) for metrics in read_records(run_dir / METRICS_FILE)]
            curve = [point for point in read_records(curve_path) if point["step"] <= trainer.step]
            print(f"  resumed at step {trainer.step} ({sum(step['time/step'] for step in steps) / 60:.2f} min of "
                  f"training, {len(curve)} evaluation(s) so far)", flush=True)
        else:
            steps, curve = [], []
            _write_atomically(run_dir / RUN_SPEC_JSON, json.dumps(dict(spec)))
        _write_atomically(curve_path, "".join(json.dumps(point) + "\n" for point in curve))

        def evaluate(train_seconds: float) -> None:
            began = time.perf_counter()
            metrics, samples = trainer.evaluate_with_samples(num_samples=spec["eval_samples"],
                                                             max_items=spec["eval_items"], seed=spec["eval_seed"])
            curve.append({"step": trainer.step, "train_seconds": train_seconds,
                          "eval_seconds": time.perf_counter() - began, "episodes": len(samples),
                          "reward/se": item_standard_error(samples), **metrics})
            with curve_path.open("a") as lines:
                lines.write(json.dumps(curve[-1]) + "\n")
            print(f"  step {trainer.step:3d}, {train_seconds / 60:5.2f} min of training: held-out "
                  f"{metrics['reward/mean']:.3f}", flush=True)

        def after_step(metrics: dict[str, float]) -> bool:
            steps.append(_step_record(metrics))
            train_seconds = sum(step["time/step"] for step in steps)
            last = curve[-1]
            out_of_budget = train_seconds >= budget
            due = ((every_steps and trainer.step - last["step"] >= every_steps)
                   or (every_seconds and train_seconds - last["train_seconds"] >= every_seconds))
            if due or out_of_budget or trainer.step >= config.steps:
                evaluate(train_seconds)
            return out_of_budget

        if not curve:
            evaluate(0.0)
        trainer.train(after_step=after_step)
        trainer.save_team()
        max_reward = trainer.env.max_return(config.algorithm.num_turns)  # of an episode: the held-out return's max
    return {"spec": dict(spec), "max_reward": max_reward, "curve": curve, "steps": steps,
            "peak_rss_bytes": _peak_rss_bytes(), "machine": machine()}


def run_all(settings: CompareSettings, contenders: Sequence[Contender], out: str | Path,
            log: Callable[[str], None] = print) -> dict[str, list[dict[str, Any]]]:
    """Train every contender for every seed (``settings.parallel`` processes at a time), skipping the runs
    already in ``OUT/results.json``; returns each contender's runs in seed order.

    Raises:
        ValueError: a run already in results.json was made with other settings.
        RuntimeError: a run failed (the others still ran; its log is named).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / RESULTS_JSON
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    pending: list[tuple[str, dict[str, Any]]] = []
    for contender in contenders:
        for seed in settings.seeds:
            key, spec = run_key(contender.name, seed), run_spec(settings, contender, seed, out)
            if key in results:
                if results[key]["spec"] != spec:
                    raise ValueError(f"{results_path}: {key} was run with other settings; use another --out "
                                     f"(or another contender name)")
                log(f"{key}: already in {results_path}, skipped")
                continue
            pending.append((key, spec))
    environment = dict(os.environ, **({"OMP_NUM_THREADS": str(settings.threads)} if settings.threads else {}))
    running: list[tuple[str, subprocess.Popen, Path]] = []
    failed: list[str] = []
    try:
        with _sigterm_interrupts():
            _run_pending(pending, running, failed, results, results_path, out, settings, environment, log)
    except KeyboardInterrupt:
        # Each run stops at the end of the step under way, with a checkpoint the same command resumes from; the
        # workers have sessions of their own, so this is the one signal they get.
        log(f"stopping: {len(running)} run(s) under way save a checkpoint at the end of their step; the same "
            f"command resumes them")
        for _, process, _ in running:
            process.send_signal(signal.SIGTERM)
        for _, process, _ in running:
            process.wait()
        raise KeyboardInterrupt(f"compare stopped; the same command resumes it (finished runs: {results_path})") \
            from None
    if failed:
        raise RuntimeError(f"{len(failed)} run(s) failed: {', '.join(failed)} (logs in {out}); the runs that "
                           f"finished are in {results_path}, and a re-run trains only the missing ones")
    return {contender.name: [results[run_key(contender.name, seed)] for seed in settings.seeds]
            for contender in contenders}


def _run_pending(pending: list[tuple[str, dict[str, Any]]], running: list[tuple[str, subprocess.Popen, Path]],
                 failed: list[str], results: dict[str, Any], results_path: Path, out: Path,
                 settings: CompareSettings, environment: dict[str, str], log: Callable[[str], None]) -> None:
    """Runs the ``pending`` runs ``settings.parallel`` at a time, each a worker process; ``running``, ``failed``
    and ``results`` (written to ``results_path`` as each run ends) are updated as they go."""
    while pending or running:
        while pending and len(running) < settings.parallel:
            key, spec = pending.pop(0)
            result_file, log_path = out / f"{key}.result.json", out / f"{key}.log"
            if resumable(spec):
                log(f"{key}: resuming from its last checkpoint... (log {log_path})")
            else:  # killed before its first checkpoint, or another run's directory: start again
                shutil.rmtree(spec["run_dir"], ignore_errors=True)
                log(f"{key}: training... (log {log_path})")
            with log_path.open("a") as log_file:
                process = subprocess.Popen([sys.executable, "-m", "teamrl.evaluation.compare", json.dumps(spec),
                                            str(result_file), str(os.getpid())], stdout=log_file,
                                           stderr=subprocess.STDOUT, env=environment, start_new_session=True)
            running.append((key, process, result_file))
        time.sleep(0.5)
        for entry in [entry for entry in running if entry[1].poll() is not None]:
            running.remove(entry)
            key, process, result_file = entry
            if process.returncode != 0 or not result_file.exists():
                failed.append(key)
                log(f"{key}: failed (exit {process.returncode}); see {out / key}.log")
                continue
            results[key] = json.loads(result_file.read_text())
            result_file.unlink()
            _write_atomically(results_path, json.dumps(results, indent=1))
            curve = results[key]["curve"]
            log(f"{key}: held-out {curve[0]['reward/mean']:.3f} -> {curve[-1]['reward/mean']:.3f} "
                f"after {len(results[key]['steps'])} steps")


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """While active, SIGTERM interrupts like Ctrl-C (main thread only: elsewhere it keeps its usual effect)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


#: A run's settings that differ between the runs of one comparison; the others must match for a fair table.
RUN_OWN_SETTINGS = ("contender", "contender_overrides", "seed", "run_dir")


def finished_runs(out: str | Path, names: Sequence[str] = ()) -> dict[str, list[dict[str, Any]]]:
    """The runs ``OUT/results.json`` holds so far, per contender in seed order, whatever seeds each has: the
    report of a comparison still running or cut short (``teamrl compare --report-only``). ``names`` picks
    contenders and their order; by default every contender, in the order its first run finished.

    Raises:
        ValueError: no results.json, a named contender without a finished run, or runs made with other
            settings (another budget or evaluation), which one table must not mix.
    """
    results_path = Path(out) / RESULTS_JSON
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    if not results:
        raise ValueError(f"{results_path}: no finished runs there yet; give the --out of a comparison")
    runs: dict[str, list[dict[str, Any]]] = {}
    for run in results.values():
        runs.setdefault(run["spec"]["contender"], []).append(run)
    if names:
        missing = [name for name in names if name not in runs]
        if missing:
            raise ValueError(f"{results_path}: no finished run of {', '.join(missing)} (it has "
                             f"{', '.join(runs) or 'none'})")
        runs = {name: runs[name] for name in names}
    shared = lambda spec: {key: value for key, value in spec.items() if key not in RUN_OWN_SETTINGS}  # noqa: E731
    chosen = [run["spec"] for mine in runs.values() for run in mine]
    for spec in chosen:
        differing = sorted(key for key in shared(spec).keys() | shared(chosen[0]).keys()
                           if spec.get(key) != chosen[0].get(key))
        if differing:
            raise ValueError(f"{results_path}: {run_key(spec['contender'], spec['seed'])} and "
                             f"{run_key(chosen[0]['contender'], chosen[0]['seed'])} differ in {', '.join(differing)}; "
                             f"one table compares runs made with the same settings (pick contenders with --algorithms)")
    return {name: sorted(mine, key=lambda run: run["spec"]["seed"]) for name, mine in runs.items()}


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


# -- what the runs say -------------------------------------------------------------------------------

def reward_at(run: Mapping[str, Any], seconds: float) -> float:
    """The run's held-out return at ``seconds`` of training: linear between the evaluations around it, the last
    evaluation's after it. Seeds evaluate at different minutes (their steps take different times), so their
    mean at one minute needs each seed's value there, not its last evaluation's, which would make the mean
    jump at every seed's evaluation."""
    points = [(point["train_seconds"], point["reward/mean"]) for point in run["curve"]]
    if seconds >= points[-1][0]:
        return points[-1][1]
    (t0, r0), (t1, r1) = next((a, b) for a, b in zip(points, points[1:]) if b[0] > seconds)
    return r0 + (r1 - r0) * (max(seconds, t0) - t0) / (t1 - t0)


def minutes_to_gain(run: Mapping[str, Any], gain: float) -> float | None:
    """Training minutes at the first evaluation whose return is ``gain`` above step 0's; None if never."""
    start = run["curve"][0]["reward/mean"]
    return next((point["train_seconds"] / 60 for point in run["curve"] if point["reward/mean"] - start >= gain), None)


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (0 for a single value)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0)


@dataclass(frozen=True)
class Summary:
    """One contender over its seeds (see :func:`summarise`)."""

    contender: str
    seeds: int
    before: float
    after: float
    after_se: float
    """Standard error over seeds; with one seed, over that run's held-out items."""
    gain: float
    gain_se: float
    """Standard error over seeds (0 for one seed)."""
    min_gain: float
    minutes_to: dict[float, list[float | None]] = field(default_factory=dict)
    """Per gain of :data:`GAINS`, each seed's training minutes to it (None: not reached)."""
    steps: float = 0.0
    seconds_per_step: float = 0.0
    train_minutes: float = 0.0
    peak_memory_gib: float = 0.0


def summarise(name: str, runs: Sequence[Mapping[str, Any]]) -> Summary:
    """A contender's runs: held-out return before/after and its gain (mean, standard error over seeds), the
    training minutes to each gain, mean steps, median seconds per step, mean training minutes, peak memory."""
    before = [run["curve"][0]["reward/mean"] for run in runs]
    after = [run["curve"][-1]["reward/mean"] for run in runs]
    gains = [a - b for a, b in zip(after, before)]
    after_mean, after_se = mean_and_se(after)
    if len(runs) == 1:
        after_se = runs[0]["curve"][-1].get("reward/se", 0.0)
    step_seconds = [step["time/step"] for run in runs for step in run["steps"]]
    return Summary(
        contender=name, seeds=len(runs), before=statistics.fmean(before), after=after_mean, after_se=after_se,
        gain=mean_and_se(gains)[0], gain_se=mean_and_se(gains)[1], min_gain=min(gains),
        minutes_to={gain: [minutes_to_gain(run, gain) for run in runs] for gain in GAINS},
        steps=statistics.fmean(len(run["steps"]) for run in runs),
        seconds_per_step=statistics.median(step_seconds) if step_seconds else 0.0,
        train_minutes=statistics.fmean(run["curve"][-1]["train_seconds"] / 60 for run in runs),
        peak_memory_gib=max(run.get("peak_rss_bytes", 0) for run in runs) / 2**30)


def _minutes_cell(minutes: Sequence[float | None]) -> str:
    """Mean minutes over the seeds that reached the gain, and how many did: ``4.2 (3/3)``; ``-`` if none."""
    reached = [m for m in minutes if m is not None]
    return f"{statistics.fmean(reached):.1f} ({len(reached)}/{len(minutes)})" if reached else "-"


SUMMARY_HEADERS = ("contender", "seeds", "before", "after ± SE", "gain ± SE", "worst gain",
                   *(f"min to +{gain:g}" for gain in GAINS), "steps", "train min", "s/step", "peak GiB")


def summary_rows(summaries: Sequence[Summary]) -> list[list[str]]:
    """The summary table's cells (:data:`SUMMARY_HEADERS`), one row per contender."""
    return [[s.contender, str(s.seeds), f"{s.before:.3f}", f"{s.after:.3f} ± {s.after_se:.3f}",
             f"{s.gain:+.3f}" + (f" ± {s.gain_se:.3f}" if s.seeds > 1 else ""), f"{s.min_gain:+.3f}",
             *(_minutes_cell(s.minutes_to[gain]) for gain in GAINS), f"{s.steps:.1f}", f"{s.train_minutes:.2f}",
             f"{s.seconds_per_step:.1f}", f"{s.peak_memory_gib:.2f}"] for s in summaries]


def return_difference(summary: Summary, reference: Summary) -> tuple[float, float] | None:
    """``summary``'s held-out return after training minus ``reference``'s, and the standard error of that
    difference, sqrt(SE_a^2 + SE_b^2) (Welch's: the two contenders' seeds are independent); None unless both
    have at least two seeds. The returns after the same budget, not the gains: a contender that starts
    elsewhere (centralised training's single policy) is judged by where it ends; for contenders that start
    alike, it is the difference of their gains."""
    if summary.seeds < 2 or reference.seeds < 2:
        return None
    return summary.after - reference.after, (summary.after_se**2 + reference.after_se**2) ** 0.5


AGAINST_HEADERS = ("contender", "after - reference's", "± SE", "in SEs")


def against_reference_caption(reference: str) -> str:
    return (f"Each contender's held-out return after training against {reference}'s (difference of the seed "
            f"means; SE of the difference = sqrt(SE_a^2 + SE_b^2); contenders with one seed are left out). With "
            f"3 seeds each and alike spreads, 2.8 SEs is the two-sided 5% level (Welch's t with 4 degrees of "
            f"freedom; unlike spreads leave fewer and raise it); a difference within 2 SEs is not told apart from "
            f"seed noise.")


def against_reference_rows(summaries: Sequence[Summary]) -> list[list[str]]:
    """The first contender is the reference; one row per other contender whose difference has an SE."""
    reference, *others = summaries
    rows = []
    for summary in others:
        difference = return_difference(summary, reference)
        if difference is not None:
            value, se = difference
            rows.append([summary.contender, f"{value:+.3f}", f"{se:.3f}", f"{value / se:+.1f}" if se else "-"])
    return rows


PARTS_CAPTION = "The reward's parts, held-out mean over seeds, at step 0 -> at the end:"

CURVE_HEADERS = ("run", "held-out return at each evaluation (step: return)", "final ± SE (items)",
                 *(f"min to +{gain:g}" for gain in GAINS))


def curve_rows(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[list[str]]:
    """One row per run: its evaluations, its final return with the standard error over items, minutes to gains."""
    rows = []
    for name, mine in runs.items():
        for run in mine:
            last = run["curve"][-1]
            rows.append([run_key(name, run["spec"]["seed"]),
                         ", ".join(f"{p['step']}: {p['reward/mean']:.2f}" for p in run["curve"]),
                         f"{last['reward/mean']:.3f} ± {last.get('reward/se', 0.0):.3f}",
                         *("-" if m is None else f"{m:.1f}" for m in (minutes_to_gain(run, g) for g in GAINS))])
    return rows


#: An evaluation's numbers that are not one of the reward's parts (``reward/PART``).
NOT_PARTS = ("reward/mean", "reward/std", "reward/se")


def reward_parts(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """The reward's parts (levels) the runs' evaluations report, ``reward/PART`` -> ``PART``, first seen first."""
    names = {key.removeprefix("reward/"): None for mine in runs.values() for run in mine for point in run["curve"]
             for key in point if key.startswith("reward/") and key not in NOT_PARTS}
    return list(names)


def parts_rows(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[list[str]]:
    """Per contender, each reward part's mean over seeds at step 0 and at the end: ``0.40 -> 0.86``."""
    parts = reward_parts(runs)
    rows = []
    for name, mine in runs.items():
        cells = []
        for part in parts:
            ends = [(run["curve"][0].get(f"reward/{part}"), run["curve"][-1].get(f"reward/{part}")) for run in mine]
            ends = [(before, after) for before, after in ends if before is not None and after is not None]
            cells.append(f"{statistics.fmean(b for b, _ in ends):.2f} -> {statistics.fmean(a for _, a in ends):.2f}"
                         if ends else "-")
        rows.append([name, *cells])
    return rows


def _markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    return "\n".join(["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
                      *("| " + " | ".join(row) + " |" for row in rows)])


def describe(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """The line above the tables: the task, the budget, the evaluation, how runs shared the machine."""
    spec = next(iter(runs.values()))[0]["spec"]
    max_reward = next(iter(runs.values()))[0]["max_reward"]
    budget = " and ".join(part for part in (f"{spec['minutes']:g} training minutes" if spec["minutes"] else "",
                                            f"{spec['steps']} steps" if spec["steps"] else "") if part)
    sharing = f"{spec['parallel']} runs at a time" if spec["parallel"] > 1 else "one run at a time"
    threads = f", {spec['threads']} torch thread(s) each" if spec["threads"] else ""
    config = " ".join([spec["config"] or "(defaults)", *spec["overrides"]])
    machines: dict[str, list[str]] = {}
    for name, mine in runs.items():
        for run in mine:
            machines.setdefault(run.get("machine", "not recorded"), []).append(run_key(name, run["spec"]["seed"]))
    on = (f" Machine: {next(iter(machines))}." if len(machines) == 1 else
          " Machines (minutes compare only within one): " + "; ".join(
              f"{where}: {', '.join(keys)}" for where, keys in machines.items()) + ".")
    return (f"Config: {config}. Budget per run: "
            f"{budget or 'the config steps'} (evaluation not counted). Held-out joint return (max {max_reward:g}) on "
            f"{spec['eval_items']} items x {spec['eval_samples']} samples (evaluation seed {spec['eval_seed']}); "
            f"SE = standard error over seeds (over held-out items for one seed). Runs: {sharing}{threads}.{on}")


def contender_lines(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """What each contender is: its name and its own config overrides."""
    return [f"{name}: {' '.join(mine[0]['spec']['contender_overrides']) or '(the config as it is)'}"
            for name, mine in runs.items()]


def render_markdown(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """results.md: the summary per contender, the reward's parts before and after, then each run's curve."""
    summaries = [summarise(name, mine) for name, mine in runs.items()]
    contenders = "".join(f"- {line}\n" for line in contender_lines(runs))
    parts = reward_parts(runs)
    levels = ([PARTS_CAPTION, "", _markdown_table(("contender", *parts), parts_rows(runs)), ""] if parts else [])
    against = against_reference_rows(summaries)
    differences = ([against_reference_caption(summaries[0].contender), "", _markdown_table(AGAINST_HEADERS, against),
                    ""] if against else [])
    return "\n".join([describe(runs), "", contenders, _markdown_table(SUMMARY_HEADERS, summary_rows(summaries)), "",
                      *differences, *levels, _markdown_table(CURVE_HEADERS, curve_rows(runs)), ""])


def write_csv(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: Path) -> None:
    """results.csv: one row per contender, one column per number of the summary."""
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["contender", "seeds", "before", "after", "after_se", "gain", "gain_se", "min_gain",
                         *(f"minutes_to_{gain:g}" for gain in GAINS), "steps", "train_minutes",
                         "seconds_per_step", "peak_memory_gib"])
        for name, mine in runs.items():
            s = summarise(name, mine)
            reached = [[m for m in s.minutes_to[gain] if m is not None] for gain in GAINS]
            writer.writerow([s.contender, s.seeds, s.before, s.after, s.after_se, s.gain, s.gain_se, s.min_gain,
                             *(statistics.fmean(r) if len(r) == s.seeds else "" for r in reached),
                             s.steps, s.train_minutes, s.seconds_per_step, s.peak_memory_gib])


def plot_curves(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: Path) -> Path:
    """curve.png: held-out return against training minutes; each contender's seed mean, band min..max."""
    from teamrl.evaluation.plots import _pyplot, _save

    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name, mine in runs.items():
        ends = sorted({point["train_seconds"] for run in mine for point in run["curve"]})
        values = [[reward_at(run, t) for run in mine] for t in ends]
        minutes = [t / 60 for t in ends]
        seeds = f"{len(mine)} seed{'s' if len(mine) > 1 else ''}"
        line, = axes.plot(minutes, [statistics.fmean(v) for v in values], label=f"{name} ({seeds})")
        axes.fill_between(minutes, [min(v) for v in values], [max(v) for v in values], alpha=0.2,
                          color=line.get_color())
    axes.set_xlabel("training minutes (evaluation excluded)")
    axes.set_ylabel("held-out joint return")
    axes.legend()
    axes.grid(alpha=0.3)
    return _save(figure, path)


def render_html(runs: Mapping[str, Sequence[Mapping[str, Any]]], plot: Path) -> str:
    """report.html: the tables and the plot (embedded), self-contained; every text HTML-escaped."""
    from teamrl.evaluation.report import _STYLE, _html_table

    summaries = [summarise(name, mine) for name, mine in runs.items()]
    against = against_reference_rows(summaries)
    parts = reward_parts(runs)
    image = base64.b64encode(plot.read_bytes()).decode("ascii")
    escaped = lambda rows: [[html.escape(cell) for cell in row] for row in rows]  # noqa: E731
    body = "\n".join([
        "<h1>teamrl compare</h1>", f"<p>{html.escape(describe(runs))}</p>",
        "<ul>" + "".join(f"<li><code>{html.escape(line)}</code></li>" for line in contender_lines(runs)) + "</ul>",
        "<h2>Per contender</h2>", _html_table(SUMMARY_HEADERS, escaped(summary_rows(summaries))),
        *([f"<h2>Against {html.escape(summaries[0].contender)}</h2>",
           f"<p>{html.escape(against_reference_caption(summaries[0].contender))}</p>",
           _html_table(AGAINST_HEADERS, escaped(against))] if against else []),
        f'<figure><img src="data:image/png;base64,{image}" alt="held-out return against training minutes">'
        "<figcaption>Held-out joint return against training minutes (seed mean, band min..max)</figcaption></figure>",
        *([f"<h2>Reward parts</h2><p>{html.escape(PARTS_CAPTION)}</p>",
           _html_table(("contender", *parts), escaped(parts_rows(runs)))] if parts else []),
        "<h2>Per run</h2>", _html_table(CURVE_HEADERS, escaped(curve_rows(runs)))])
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>teamrl compare</title>'
            f"<style>{_STYLE}</style></head><body>\n{body}\n</body></html>\n")


def write_report(runs: Mapping[str, Sequence[Mapping[str, Any]]], out: str | Path) -> dict[str, Path]:
    """results.md, results.csv, curve.png and report.html in ``out`` (results.json is :func:`run_all`'s)."""
    out = Path(out)
    (out / RESULTS_MD).write_text(render_markdown(runs))
    write_csv(runs, out / RESULTS_CSV)
    plot = plot_curves(runs, out / CURVE_PNG)
    (out / REPORT_HTML).write_text(render_html(runs, plot))
    return {name: out / name for name in (RESULTS_MD, RESULTS_CSV, RESULTS_JSON, CURVE_PNG, REPORT_HTML)}


def _worker(argv: Sequence[str]) -> None:
    """``python -m teamrl.evaluation.compare SPEC_JSON RESULT_JSON [PARENT_PID]``: one run, its result written to
    a file; it gets SIGTERM (stops at the end of its step, with a checkpoint) if ``teamrl compare`` dies."""
    spec_json, result_json, *parent = argv
    if parent:
        _stop_with_parent(int(parent[0]))
    Path(result_json).write_text(json.dumps(train_with_evaluations(json.loads(spec_json))))


def _stop_with_parent(parent: int) -> None:
    """SIGTERM to this process when ``parent`` ends, however it ends (Linux's PR_SET_PDEATHSIG; elsewhere the
    run goes on alone, as before)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        set_parent_death_signal = 1  # PR_SET_PDEATHSIG
        libc.prctl(set_parent_death_signal, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent ended before the signal was asked for
        os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    _worker(sys.argv[1:])
