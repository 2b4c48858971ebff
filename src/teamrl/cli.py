"""``teamrl`` command line: ``teamrl train CONFIG.yaml [key=value ...] [--resume]``, ``teamrl config``, ``teamrl envs``."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from teamrl.config import ConfigError, describe_fields, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="teamrl", description="Train teams of LLM agents with MAGRPO.")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train a team", description=(
        "Train a team with MAGRPO. Fields of the YAML config can be overridden with key=value, "
        "e.g. algorithm.num_generations=8 team.model=bundled. `teamrl config` lists every field."))
    train.add_argument("config", nargs="?",
                       help="YAML config file or a shipped preset's name (omit to start from the defaults)")
    train.add_argument("overrides", nargs="*", help="field=value overrides")
    train.add_argument("--resume", action="store_true", help="continue from the run directory's last checkpoint")

    gen = commands.add_parser("generate", help="run a saved team on new inputs (decentralised execution)",
                              description="Each agent answers its own prompt, concurrently; the joint output, "
                                          "its joint reward, tokens/s and latency are printed.")
    gen.add_argument("team", help="directory written by training (RUN_DIR/team)")
    gen.add_argument("--text", action="append", default=[], help="an input text (repeatable)")
    gen.add_argument("--input-file", help="JSONL file of items in the environment's format")
    gen.add_argument("--split", default=None, help="instead of inputs, run on this split of the environment")
    gen.add_argument("--limit", type=int, default=4, help="at most this many items from --split or --input-file")
    gen.add_argument("--max-new-tokens", type=int, default=None, help="override every agent's max_new_tokens")

    demo = commands.add_parser("demo", help="the main job: train a 2-agent team of the bundled model on a CPU",
                               description="Train two SmolLM2-135M-Instruct agents (LoRA on one shared base) with "
                                           "MAGRPO on TL;DR-style two-level summaries of ACL abstracts, offline, and "
                                           "show the held-out joint reward before and after.")
    demo.add_argument("overrides", nargs="*", help="field=value overrides of the demo config")
    demo.add_argument("--config", default=None, help="a config file instead of the built-in demo preset")

    commands.add_parser("config", help="list every config field with its default and meaning")
    commands.add_parser("envs", help="list the registered environments")
    commands.add_parser("presets", help="list the configs shipped with teamrl")

    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "demo":
            from teamrl.demo import run_demo

            return run_demo(args.config, args.overrides)
        if args.command == "config":
            for name, default, help_text in describe_fields():
                print(f"{name} = {default}")
                print(textwrap.indent(textwrap.fill(help_text, 96), "    "))
            return 0
        if args.command == "presets":
            from teamrl.config import PRESETS_DIR, presets

            for name in presets():
                first = (PRESETS_DIR / f"{name}.yaml").read_text().splitlines()[0].lstrip("# ")
                print(f"{name:24s} {first}")
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
    if config_path is not None and "=" in config_path:
        overrides.insert(0, config_path)  # `teamrl train key=value` with no file
        config_path = None
    config = load_config(config_path, overrides)
    trainer = Trainer(config)
    history = trainer.train(resume=args.resume)
    team_dir = trainer.save_team()
    if history:
        first, last = history[0], history[-1]
        print(f"joint reward: {first['reward/mean']:.3f} at step {first['step']} -> "
              f"{last['reward/mean']:.3f} at step {last['step']}")
    print(f"metrics: {trainer.run_dir / 'metrics.jsonl'}")
    print(f"team saved to: {team_dir}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from teamrl.inference import run_team
    from teamrl.team import Team

    team = Team.from_pretrained(args.team)
    manifest = json.loads((Path(args.team) / "team.json").read_text())
    if "env" not in manifest:
        raise ValueError(f"{args.team}: team.json names no environment to turn inputs into prompts")
    from teamrl.envs.base import make_env

    env = make_env(manifest["env"]["name"], **manifest["env"].get("kwargs", {}))
    if args.max_new_tokens:
        for agent in team:
            agent.sampling = dataclasses.replace(agent.sampling, max_new_tokens=args.max_new_tokens)
    if args.text:
        items = [{"id": f"input-{i}", "text": text} for i, text in enumerate(args.text)]
    elif args.input_file:
        from teamrl.data import load_records

        items = load_records(args.input_file, limit=args.limit)
    else:
        items = list(env.items(args.split or "eval"))[: args.limit]
    observations = [env.observe(item) for item in items]
    output = run_team(team, observations)
    for row, item in enumerate(items):
        actions = [texts[row] for texts in output.texts]
        reward = env.joint_reward(item, actions)
        print(f"=== {item.get('id', row)}  joint reward {reward.total:.3f}")
        for agent, text in zip(team, actions):
            print(f"--- {agent.name}\n{text}")
    print(f"{output.tokens} tokens in {output.seconds:.2f} s: {output.tokens_per_second:.1f} tokens/s, "
          f"{output.seconds / len(items):.2f} s per input (agents concurrently)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
