"""Turn by turn: what a 2-turn writing team does with its second turn, from `teamrl eval`'s results.json.

    python benchmarks/turn_by_turn.py runs/keep-turns/seed0/results.json [more results.json ...]
    python benchmarks/turn_by_turn.py --paired WITH/results.json WITHOUT/results.json


For each method: the mean reward of turn 1 and of turn 2 (the state reward of the texts held after it), the
share of episodes whose second turn raised or lowered it, and how often each agent kept its text (answered
KEEP, with ``env.kwargs.keep``) or retyped it word for word; then the same split by the feedback the team read
after turn 1 (the reward's first level it missed, or "all met"). A team that uses the feedback keeps what met
every criterion and rewrites what did not; a team that ignores it rewrites at random, and its second turn
regresses to its mean: up after a bad first turn, down after a good one.

``--paired`` reads two evaluations of one team on the same items and seed, one of them with
``env.kwargs.feedback=false``: their first turns are the same texts (checked), so the difference of their
second turns is what the feedback itself is worth, episode by episode.
"""

from __future__ import annotations

import json
import re
import statistics
import sys

from teamrl.envs.writing import is_keep

#: The feedback's first words for each of the reward's levels (teamrl.rewards.writing.writing_feedback).
FEEDBACK_KINDS = (("all met", "meet every criterion"), ("length", " words; it needs"), ("length", "length ("),
                  ("ratio", "times as long"), ("distinct words", "different words"), ("level 4", "To improve"),
                  ("level 4", "Your part fits"))


def feedback_kind(observation: str) -> str:
    feedback = re.search(r"Feedback: (.*?)\n\nWrite", observation, re.S)
    text = feedback.group(1) if feedback else ""
    return next((kind for kind, marker in FEEDBACK_KINDS if marker in text), "other")


def episodes(method: dict) -> list[dict]:
    rows = []
    for sample in method["samples"]:
        first = sample["earlier_turns"][0]
        rows.append({
            "kind": feedback_kind(sample["observations"][0]),
            "turn1": first["reward"],
            "turn2": sample["reward"] - first["reward"],  # a sample's reward is its episode's return
            "kept": [is_keep(answer) for answer in sample["actions"]],
            "retyped": [now.strip() == before.strip() for now, before in zip(sample["actions"], first["actions"])],
        })
    return rows


def summary(rows: list[dict]) -> str:
    mean = statistics.fmean
    agents = range(len(rows[0]["kept"]))
    up, down = sum(r["turn2"] > r["turn1"] for r in rows), sum(r["turn2"] < r["turn1"] for r in rows)
    turn1, turn2 = mean(r["turn1"] for r in rows), mean(r["turn2"] for r in rows)
    return (f"n={len(rows):2d}  turn 1 {turn1:.2f}  turn 2 {turn2:.2f}  up {up:2d}  down {down:2d}"
            f"  kept {[sum(r['kept'][a] for r in rows) for a in agents]}"
            f"  retyped {[sum(r['retyped'][a] for r in rows) for a in agents]}")


def paired(with_path: str, without_path: str) -> None:
    runs = [json.load(open(path))["methods"][0]["samples"] for path in (with_path, without_path)]
    keyed = [{(sample["item"], sample["sample"]): sample for sample in samples} for samples in runs]
    if keyed[0].keys() != keyed[1].keys():
        sys.exit(f"{with_path} and {without_path} scored different episodes; evaluate both on the same items")
    gains = []
    for key, sample in keyed[0].items():
        other = keyed[1][key]
        if sample["earlier_turns"][0]["actions"] != other["earlier_turns"][0]["actions"]:
            sys.exit(f"{key}: the first turns differ, so the second turns are not paired (same seed and items?)")
        gains.append(sample["reward"] - other["reward"])  # same first turn: the difference is turn 2's
    se = statistics.stdev(gains) / len(gains) ** 0.5
    print(f"{with_path} vs {without_path}: turn 2 with feedback minus without {statistics.fmean(gains):+.3f} "
          f"± {se:.3f} over {len(gains)} paired episodes (higher {sum(g > 0 for g in gains)}, "
          f"lower {sum(g < 0 for g in gains)})")


def main(paths: list[str]) -> None:
    for path in paths:
        for method in json.load(open(path))["methods"]:
            rows = episodes(method)
            print(f"{path} {method['method']}\n  all            {summary(rows)}")
            for kind in dict.fromkeys(kind for kind, _ in FEEDBACK_KINDS):
                subset = [row for row in rows if row["kind"] == kind]
                if subset:
                    print(f"  {kind:14s} {summary(subset)}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    if sys.argv[1] == "--paired":
        paired(*sys.argv[2:4])
    else:
        main(sys.argv[1:])
