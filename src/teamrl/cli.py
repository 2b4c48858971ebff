"""``teamrl`` command line: ``teamrl train CONFIG.yaml [key=value ...] [--resume | --overwrite]``,
``teamrl generate``, ``teamrl serve``, ``teamrl demo``, ``teamrl eval ENV_OR_CONFIG``, ``teamrl compare ENV_OR_CONFIG``,
``teamrl plot RUN_DIR``, ``teamrl presets``, ``teamrl config``, ``teamrl envs``.

Each subcommand is a function that adds its parser (:data:`SUBCOMMANDS`) and one that runs it
(``set_defaults(run=...)``); the flags of ``teamrl eval`` and ``teamrl compare`` that are settings are made from their
settings classes (:mod:`teamrl.flags`: each one's help is written once, beside the field). Only what a command needs
is imported, when it runs: ``--help``, ``presets``, ``config`` and ``envs`` never import torch or transformers
(seconds on their own).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import textwrap
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from teamrl import __version__
from teamrl.config import ConfigError, describe_fields, load_config
from teamrl.evaluation.compare import CompareSettings
from teamrl.evaluation.methods import EvalSettings
from teamrl.flags import add_flags, from_flags
from teamrl.run_dir import ADVISE_FLAGS
from teamrl.runtime import quiet_libraries, use_threads

if TYPE_CHECKING:
    from teamrl.envs.base import Environment, Item


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in arg and not arg.startswith("-") for arg in extra):
        args.overrides += extra  # overrides after an option: argparse leaves positionals there unparsed
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "verbose", True):
        quiet_libraries()
    if getattr(args, "torch_threads", None) is not None and args.torch_threads < 1:
        parser.error(f"--threads: must be >= 1 (got {args.torch_threads})")
    advising_flags = ADVISE_FLAGS.set(True)  # what a message says to do, it says in this command's flags
    try:
        return args.run(args)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        from teamrl.user_code import raised_in_user_code, traceback_wanted

        if traceback_wanted(getattr(args, "verbose", False)):
            traceback.print_exc()
        elif raised_in_user_code(err):
            err = f"{err} (--verbose or TEAMRL_TRACEBACK=1 shows the traceback)"
        print(f"teamrl: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # training's TrainingInterrupted says what was saved and how to resume
        print(f"teamrl: {str(err) or 'interrupted'}", file=sys.stderr)
        return getattr(err, "exit_code", 128 + signal.SIGINT)
    except BrokenPipeError:  # `teamrl presets | head`: the reader has all it wanted
        # Python would report the pipe again when it flushes stdout at exit: point stdout at nothing first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    finally:
        ADVISE_FLAGS.reset(advising_flags)


def build_parser() -> argparse.ArgumentParser:
    """The ``teamrl`` parser: a subcommand per :data:`SUBCOMMANDS` entry, each running its own function."""
    parser = argparse.ArgumentParser(prog="teamrl", description="Train teams of LLM agents with MAGRPO and its family.")
    parser.add_argument("--version", action="version", version=f"teamrl {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    # What the commands that load models share.
    loads_models = argparse.ArgumentParser(add_help=False)
    loads_models.add_argument("--verbose", action="store_true",
                              help="keep the libraries' own output (transformers' progress bars, warnings)")
    # What the commands that run models in this process share (compare's --threads is its runs' own).
    runs_models_here = argparse.ArgumentParser(add_help=False)
    runs_models_here.add_argument("--threads", dest="torch_threads", type=int, default=None,
                                  help="torch threads (default: torch's, one per core); on a machine other work "
                                       "keeps busy, fewer run faster")
    parents = {"loads_models": [loads_models], "runs_models": [loads_models, runs_models_here], "none": []}
    for add_subcommand in SUBCOMMANDS:
        add_subcommand(commands, parents)
    return parser


Parents = dict[str, list[argparse.ArgumentParser]]


def _add_train(commands: argparse._SubParsersAction, parents: Parents) -> None:
    train = commands.add_parser("train", parents=parents["runs_models"], help="train a team", description=(
        "Train a team (MAGRPO, or the algorithm.name given). Fields of the YAML config can be overridden "
        "with key=value, e.g. algorithm.num_generations=8 team.model=bundled. `teamrl config` lists every field. "
        "Ctrl-C (or SIGTERM) stops at the end of the step under way, saves a checkpoint and prints the "
        "command that resumes."))
    train.add_argument("config", nargs="?",
                       help="YAML config file or a shipped preset's name (omit to start from the defaults)")
    train.add_argument("overrides", nargs="*", help="field=value overrides")
    existing_run = train.add_mutually_exclusive_group()
    existing_run.add_argument("--resume", action="store_true",
                              help="continue the run in run_dir from its newest readable checkpoint")
    existing_run.add_argument("--overwrite", action="store_true",
                              help="replace the run in run_dir (its metrics, samples, checkpoints and team)")
    train.set_defaults(run=_train)


def _add_generate(commands: argparse._SubParsersAction, parents: Parents) -> None:
    gen = commands.add_parser("generate", parents=parents["runs_models"],
                              help="run a saved team on new inputs (decentralised execution)",
                              description="Each agent answers its own prompt, concurrently; the joint output, "
                                          "its joint reward, tokens/s and latency are printed. An input whose "
                                          "prompt does not fit the model's context is refused.")
    gen.add_argument("team", help="directory written by training (RUN_DIR/team)")
    gen.add_argument("--text", action="append", default=[], help="an input text (repeatable)")
    gen.add_argument("--input-file", help="JSONL file of items in the environment's format")
    gen.add_argument("--split", default=None, help="instead of inputs, run on this split of the environment")
    gen.add_argument("--limit", type=int, default=4, help="at most this many items from --split or --input-file")
    gen.add_argument("--max-new-tokens", type=int, default=None, help="override every agent's max_new_tokens")
    gen.set_defaults(run=_generate)


def _add_serve(commands: argparse._SubParsersAction, parents: Parents) -> None:
    serve = commands.add_parser(
        "serve", parents=parents["runs_models"],
        help="serve a saved team on an OpenAI-compatible HTTP API",
        description="Serve a saved team: POST /v1/chat/completions with model TEAM (the agents answer the last user "
                    "message's input, each its own observation, concurrently; the parts joined) or TEAM/AGENT or "
                    "AGENT (one agent chats: what a program trained by teamrl calls), streaming included; POST "
                    "/v1/completions (an agent continues a prompt); GET /v1/models, /health, /metrics. Concurrent "
                    "requests are batched. SIGTERM or Ctrl-C: requests in flight finish, new ones are refused, exit 0. "
                    "docs/serving.md#serve.")
    serve.add_argument("team", help="directory written by training (RUN_DIR/team)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: %(default)s, this machine only; 0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: %(default)s; 0: any free one)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' (default: $TEAMRL_API_KEY if set, else no key)")
    serve.add_argument("--name", default=None,
                       help="the team's model id (default: the folder's name, or its run's when it is 'team')")
    serve.add_argument("--batch-window-ms", type=float, default=10.0,
                       help="requests arriving within this window share one generate call per base model "
                            "(default: %(default)s; 0: no batching)")
    serve.add_argument("--batching", choices=("window", "continuous"), default="window",
                       help="'window': requests arriving within --batch-window-ms share a generate call; 'continuous': "
                            "a request joins the rows decoding at the next step and leaves when it ends (default: "
                            "%(default)s); docs/serving.md#batching")
    serve.add_argument("--max-batch", type=int, default=32,
                       help="most requests in one generate call; with --batching continuous, most rows decoding at "
                            "once (default: 32)")
    serve.add_argument("--max-body-bytes", type=int, default=1_000_000,
                       help="larger request bodies get 413 (default: %(default)s)")
    serve.add_argument("--device", default="cpu", help="where the models run, e.g. cuda (default: %(default)s)")
    serve.add_argument("--dtype", default="float32", help="model precision, e.g. bfloat16 (default: %(default)s)")
    serve.add_argument("--max-new-tokens", type=int, default=None,
                       help="replace every agent's max_new_tokens: the most a request's max_tokens gets")
    serve.add_argument("--vllm-url", default=None,
                       help="generate on this vLLM server (e.g. http://127.0.0.1:8001/v1, one LoRA adapter per agent "
                            "named as the agent) instead of in-process; docs/serving.md#serving-on-a-gpu-with-vllm")
    serve.add_argument("--vllm-timeout", type=float, default=300.0,
                       help="seconds to wait for vLLM's answer before a 504 (default: %(default)s)")
    serve.add_argument("--access-log", action="store_true", help="log every request (uvicorn's access log)")
    serve.set_defaults(run=_serve)


def _add_demo(commands: argparse._SubParsersAction, parents: Parents) -> None:
    demo = commands.add_parser("demo", parents=parents["runs_models"],
                               help="the main job: train a 2-agent team of the bundled model on a CPU",
                               description="Train two SmolLM2-135M-Instruct agents (LoRA on one shared base) with "
                                           "MAGRPO on TL;DR-style two-level summaries of ACL abstracts, offline, and "
                                           "show the held-out joint reward before and after.")
    demo.add_argument("overrides", nargs="*", help="field=value overrides of the demo config")
    demo.add_argument("--config", default=None, help="a config file instead of the built-in demo preset")
    demo.add_argument("--eval-items", type=int, default=32, help="held-out items scored before and after training")
    demo.add_argument("--eval-samples", type=int, default=2, help="joint actions sampled per held-out item")
    demo.add_argument("--eval-seed", type=int, default=0,
                      help="sampling seed of the held-out evaluation (kept apart from the training seed)")
    demo.add_argument("--overwrite", action="store_true", help="replace an earlier run in the demo's run_dir")
    demo.set_defaults(run=_demo)


def _add_eval(commands: argparse._SubParsersAction, parents: Parents) -> None:
    evaluate = commands.add_parser(
        "eval", parents=parents["runs_models"],
        help="compare prompt-only baselines and trained teams on a task",
        description="Run each method on the same items with the same sampling settings and seed, score it with "
                    "the environment's joint reward, and write results.md/.csv/.json, PNG plots and report.html.")
    evaluate.add_argument("target", metavar="ENV_OR_CONFIG",
                          help="an environment's name (see `teamrl envs`), a YAML config file or a preset's name")
    evaluate.add_argument("overrides", nargs="*", help="field=value overrides of the config, e.g. "
                                                       "team.sampling.max_new_tokens=64")
    add_flags(evaluate, EvalSettings)
    evaluate.add_argument("--model", default=None, help="base model of every agent (sets team.model), e.g. bundled")
    evaluate.add_argument("--out", default=None, help="output folder (default: RUN_DIR/eval of the config)")
    evaluate.add_argument("--run-dir", default=None, help="a training run directory: adds its reward curve "
                                                          "(metrics.jsonl) to the report")
    evaluate.set_defaults(run=_eval)


def _add_compare(commands: argparse._SubParsersAction, parents: Parents) -> None:
    compare = commands.add_parser(
        "compare", parents=parents["loads_models"], help="train several algorithms on one task under one budget",
        description="Train every algorithm (or config variant) on the same task, items, reward and seeds for the "
                    "same training minutes or steps, scoring held-out joint return at step 0, on a schedule and "
                    "at the end on the same draws. Writes results.md/.csv/.json, curve.png (return against "
                    "training minutes) and report.html; each run is its own process (its peak memory its own), "
                    "and a re-run skips the runs results.json already has and resumes a run killed part way from "
                    "its last checkpoint; Ctrl-C stops each run under way at the end of its step, with a "
                    "checkpoint (docs/evaluation.md#teamrl-compare).")
    compare.add_argument("target", metavar="ENV_OR_CONFIG",
                         help="an environment's name, a YAML config file or a preset's name, e.g. demo_tldr_cpu")
    compare.add_argument("overrides", nargs="*", help="field=value overrides of every contender's config")
    compare.add_argument("--algorithms", default="",
                         help="comma-separated algorithms (algorithm.name's values: docs/algorithm.md#algorithms), one "
                              "contender each, or all")
    compare.add_argument("--variant", action="append", default=[],
                         help="a contender of config overrides, 'NAME: field=value ...' (repeatable)")
    add_flags(compare, CompareSettings)
    compare.add_argument("--out", default=None, help="output folder (default: runs/compare-ENV_OR_CONFIG)")
    compare.add_argument("--report-only", action="store_true",
                         help="train nothing: write the report of the runs OUT/results.json holds so far, each "
                              "contender with the seeds it has (of --algorithms/--variant if given, else all)")
    compare.set_defaults(run=_compare)


def _add_plot(commands: argparse._SubParsersAction, parents: Parents) -> None:
    plot = commands.add_parser(
        "plot", help="draw a training run's reward curve",
        description="Plot a run's training joint reward per step (metrics.jsonl) and its held-out evaluations "
                    "(eval.jsonl, when the run has them) to a PNG; a run in progress shows its steps so far.")
    plot.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of a teamrl train run")
    plot.add_argument("--out", default=None, help="the PNG to write (default: RUN_DIR/reward_curve.png)")
    plot.set_defaults(run=_plot)


def _add_export(commands: argparse._SubParsersAction, parents: Parents) -> None:
    export = commands.add_parser(
        "export", parents=parents["loads_models"],
        help="export a saved team for plain transformers/peft, with model cards",
        description="Write per agent a folder plain transformers/peft load without teamrl (a Hugging Face repo: "
                    "README.md model card, weights, tokenizer, generation_config.json with its sampling settings), "
                    "and the team's card OUT/README.md. --format peft: LoRA adapters referring to their base, saved "
                    "once in OUT/base; merged: each adapter merged into a full checkpoint. docs/serving.md#export.")
    export.add_argument("team", help="directory written by training (RUN_DIR/team)")
    export.add_argument("--out", required=True, help="the folder to write (new or empty)")
    export.add_argument("--format", choices=("peft", "merged"), default="peft",
                        help="peft: LoRA adapters + OUT/base; merged: a full checkpoint per agent "
                             "(default: %(default)s)")
    export.add_argument("--base-path", default=None,
                        help="--format peft: what each adapter's base_model_name_or_path says, exactly (a hub id or "
                             "path where the base will be); default: OUT/base's absolute path")
    export.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out")
    export.set_defaults(run=_export)


def _add_listings(commands: argparse._SubParsersAction, parents: Parents) -> None:
    commands.add_parser("config", help="list every config field with its default and meaning").set_defaults(run=_config)
    commands.add_parser("envs", help="list the registered environments").set_defaults(run=_envs)
    commands.add_parser("presets", help="list the configs shipped with teamrl").set_defaults(run=_presets)


def _train(args: argparse.Namespace) -> int:
    from teamrl.run_dir import CURVE_FILE, METRICS_FILE
    from teamrl.train import Trainer

    overrides = list(args.overrides)
    config_path = args.config
    if config_path is not None and "=" in config_path:
        overrides.insert(0, config_path)  # `teamrl train key=value` with no file
        config_path = None
    config = load_config(config_path, overrides)
    use_threads(args.torch_threads)
    with Trainer(config, resume=args.resume, overwrite=args.overwrite) as trainer:
        history = trainer.train()
        team_dir = trainer.save_team()
    if history:
        first, last = history[0], history[-1]
        print(f"joint reward: {first['reward/mean']:.3f} at step {first['step']} -> "
              f"{last['reward/mean']:.3f} at step {last['step']}")
    if trainer.evaluations:
        first, last = trainer.evaluations[0], trainer.evaluations[-1]
        print(f"held-out joint reward ({last['items']} items x {last['samples']} samples): "
              f"{first['reward/mean']:.3f} at step {first['step']} -> {last['reward/mean']:.3f} at step {last['step']}")
    print(f"reward curve: {trainer.run_dir / CURVE_FILE}")
    print(f"metrics: {trainer.run_dir / METRICS_FILE}")
    print(f"team saved to: {team_dir}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from teamrl.evaluation.compare import (
        CompareSettings,
        check_contenders,
        finished_runs,
        parse_algorithms,
        parse_variant,
        run_all,
    )
    from teamrl.evaluation.runner import task_source

    out = Path(args.out or f"runs/compare-{Path(args.target).stem}")
    config, task = task_source(args.target)
    base = load_config(config, [*task, *args.overrides])
    contenders = [*parse_algorithms(args.algorithms, base), *(parse_variant(text) for text in args.variant)]
    if args.report_only:
        return _print_report(finished_runs(out, [contender.name for contender in contenders]), out)
    if not contenders:
        raise ValueError("give --algorithms NAME,NAME... or --variant 'NAME: field=value ...' (or both)")
    settings = from_flags(CompareSettings, args, config=config, overrides=(*task, *args.overrides))
    check_contenders(settings, contenders)
    try:
        runs = run_all(settings, contenders, out)
    except RuntimeError as err:
        print(f"teamrl: error: {err}", file=sys.stderr)
        return 1
    return _print_report(runs, out)


def _plot(args: argparse.Namespace) -> int:
    from teamrl.evaluation.plots import plot_run

    print(f"reward curve: {plot_run(args.run_dir, args.out)}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from teamrl.demo import run_demo

    use_threads(args.torch_threads)
    return run_demo(args.config, args.overrides, eval_items=args.eval_items, eval_samples=args.eval_samples,
                    eval_seed=args.eval_seed, overwrite=args.overwrite)


def _config(args: argparse.Namespace) -> int:
    for name, default, help_text in describe_fields():
        print(f"{name} = {default}")
        print(textwrap.indent(textwrap.fill(help_text, 96), "    "))
    return 0


def _presets(args: argparse.Namespace) -> int:
    from teamrl.config import preset_summary, presets

    width = max(map(len, presets())) + 2
    for name in presets():
        print(textwrap.fill(preset_summary(name), 110, initial_indent=f"{name:{width}}",
                            subsequent_indent=" " * width, break_on_hyphens=False))
    return 0


def _envs(args: argparse.Namespace) -> int:
    from teamrl.envs import ENVIRONMENTS
    from teamrl.imports import ENVIRONMENT_GROUP, entry_point, entry_point_names

    installed = {name: entry_point(ENVIRONMENT_GROUP, name) for name in entry_point_names(ENVIRONMENT_GROUP)}
    for name, factory in sorted({**ENVIRONMENTS, **installed}.items()):
        summary = (factory.__doc__ or "").strip().splitlines()[0] if factory.__doc__ else ""
        print(f"{name:16s} {summary}")
    print("Your own: env.name=module:Class (docs/environments.md)")
    return 0


def _print_report(runs: dict, out: Path) -> int:
    from teamrl.evaluation.compare import write_report

    files = write_report(runs, out)
    print((out / "results.md").read_text())
    print("Written: " + ", ".join(str(path) for path in files.values()))
    return 0


def _export(args: argparse.Namespace) -> int:
    from teamrl.export import export_team

    out = export_team(args.team, args.out, format=args.format, base_path=args.base_path, overwrite=args.overwrite)
    for folder in sorted(path for path in out.iterdir() if path.is_dir()):
        print(f"{folder}/")
    print(f"model card: {out / 'README.md'}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from teamrl.evaluation.report import markdown_results, read_history, write_report
    from teamrl.evaluation.runner import eval_config, run_evaluation

    settings = from_flags(EvalSettings, args)
    config = eval_config(args.target, args.overrides, args.model)
    history = read_history(args.run_dir) if args.run_dir else None
    use_threads(args.torch_threads)
    results = run_evaluation(config, settings, log=lambda message: print(message, flush=True))
    files = write_report(results, args.out or Path(config.run_dir) / "eval", history)
    print(markdown_results(results))
    print(f"report: {files['report.html']}  (tables: results.md, results.csv, results.json)")
    return 0


def _generate(args: argparse.Namespace) -> int:
    import dataclasses

    from teamrl.envs.base import saved_team_task
    from teamrl.envs.checks import checked_reward

    manifest, env = saved_team_task(args.team)
    env_name = manifest["env"]["name"]
    if args.text:
        source, labels = "--text", [f"--text {i}" for i in range(1, len(args.text) + 1)]
        items = [{"id": f"input-{i}", "text": text} for i, text in enumerate(args.text, 1)]
    elif args.input_file:
        from teamrl.data import load_records

        items = load_records(args.input_file, limit=args.limit)
        source, labels = "--input-file", [f"--input-file item {i}" for i in range(1, len(items) + 1)]
    else:
        split = args.split or "eval"
        items = list(env.items(split))[: args.limit]
        source, labels = "--split", [f"--split {split} item {item.get('id', i)}" for i, item in enumerate(items)]
    observations = _observations(env, env_name, items, source)

    # The inputs are good: only now load the models.
    from teamrl.inference import run_team
    from teamrl.team import Team

    use_threads(args.torch_threads)
    team = Team.from_pretrained(args.team, env)
    if args.max_new_tokens:
        for agent in team:
            agent.sampling = dataclasses.replace(agent.sampling, max_new_tokens=args.max_new_tokens)
    output = run_team(team, observations, labels=labels)
    for row, item in enumerate(items):
        actions = [texts[row] for texts in output.texts]
        reward = checked_reward(env, item, env.joint_reward(item, actions))
        print(f"=== {item.get('id', row)}  joint reward {reward.total:.3f}")
        for agent, text in zip(team, actions):
            print(f"--- {agent.name}\n{text}")
    print(f"{output.tokens} tokens in {output.seconds:.2f} s: {output.tokens_per_second:.1f} tokens/s, "
          f"{output.seconds / len(items):.2f} s per input (agents concurrently)")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import os

    try:
        from teamrl.serve.app import create_app, serve
    except ImportError as err:
        raise ValueError(f"teamrl serve needs FastAPI and uvicorn ({err}); pip install 'teamrl[serve]'") from None

    use_threads(args.torch_threads)
    app = create_app(args.team, name=args.name, api_key=args.api_key or os.environ.get("TEAMRL_API_KEY") or None,
                     batch_window_ms=args.batch_window_ms, max_batch=args.max_batch,
                     max_body_bytes=args.max_body_bytes, device=args.device, dtype=args.dtype,
                     max_new_tokens=args.max_new_tokens, vllm_url=args.vllm_url, vllm_timeout_s=args.vllm_timeout,
                     batching=args.batching)
    served = app.state.served

    def listening(url: str) -> None:
        print(f"teamrl serve: {', '.join(served.model_ids())} on {url}/v1", flush=True)

    return serve(app, args.host, args.port, access_log=args.access_log,
                 log_level="info" if args.verbose else "warning", on_listening=listening)


def _observations(env: Environment, env_name: str, items: list[Item], source: str) -> list[list[str]]:
    """Each item's observations; an item without a field the task reads is named with what it needs."""
    from teamrl.envs.checks import first_observations
    from teamrl.user_code import missing_field

    try:
        return first_observations(env, items)
    except (KeyError, ValueError) as raised:
        err = missing_field(raised)
        if err is None:
            raise
        fields = ", ".join(env.items("eval")[0])
        hint = ("free text will not do: run it on --split eval, or on --input-file with JSONL items that have "
                "those fields") if source == "--text" else "give every item those fields"
        raise ValueError(f"{source}: {env_name} needs items with the field {err} (its own items have: {fields}); "
                         f"{hint}") from None


#: Every subcommand, in ``teamrl --help``'s order: each adds its parser and the function that runs it.
SUBCOMMANDS = (_add_train, _add_generate, _add_serve, _add_demo, _add_eval, _add_compare, _add_plot, _add_export,
               _add_listings)


if __name__ == "__main__":
    sys.exit(main())
