"""``teamrl`` command line: ``teamrl train CONFIG.yaml [key=value ...] [--resume]``, ``teamrl config``, ``teamrl envs``."""

from __future__ import annotations

import argparse
import sys
import textwrap

from teamrl.config import ConfigError, describe_fields, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="teamrl", description="Train teams of LLM agents with MAGRPO.")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train a team", description=(
        "Train a team with MAGRPO. Fields of the YAML config can be overridden with key=value, "
        "e.g. algorithm.num_generations=8 team.model=bundled. `teamrl config` lists every field."))
    train.add_argument("config", nargs="?", help="YAML config file (omit to start from the defaults)")
    train.add_argument("overrides", nargs="*", help="field=value overrides")
    train.add_argument("--resume", action="store_true", help="continue from the run directory's last checkpoint")

    commands.add_parser("config", help="list every config field with its default and meaning")
    commands.add_parser("envs", help="list the registered environments")

    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "config":
            for name, default, help_text in describe_fields():
                print(f"{name} = {default}")
                print(textwrap.indent(textwrap.fill(help_text, 96), "    "))
            return 0
        if args.command == "envs":
            from teamrl.envs import ENVIRONMENTS

            for name, factory in sorted(ENVIRONMENTS.items()):
                summary = (factory.__doc__ or "").strip().splitlines()[0] if factory.__doc__ else ""
                print(f"{name:16s} {summary}")
            return 0
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"teamrl: error: {err}", file=sys.stderr)
        return 2
    return 1


def _train(args: argparse.Namespace) -> int:
    from teamrl.train import Trainer

    overrides = list(args.overrides)
    config_path = args.config
    if config_path is not None and "=" in config_path and not config_path.endswith((".yaml", ".yml")):
        overrides.insert(0, config_path)  # `teamrl train key=value` with no file
        config_path = None
    config = load_config(config_path, overrides)
    trainer = Trainer(config)
    history = trainer.train(resume=args.resume)
    team_dir = trainer.team.save_pretrained(trainer.run_dir / "team")
    if history:
        first, last = history[0], history[-1]
        print(f"joint reward: {first['reward/mean']:.3f} at step {first['step']} -> "
              f"{last['reward/mean']:.3f} at step {last['step']}")
    print(f"metrics: {trainer.run_dir / 'metrics.jsonl'}")
    print(f"team saved to: {team_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
