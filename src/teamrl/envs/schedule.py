"""A multi-turn planning task checked by code: 2-3 agents schedule a small week of meetings together.

Each item is a scheduling problem drawn from a seed: ``num_tasks`` meetings ``t1``, ``t2``... with a
duration in whole hours, the people who attend, an allowed window (days and start hours) and
precedence rules ("t1 before t3"). Every task belongs to one agent (task i to seat (i - 1) mod n); an
agent sees every task, but may only place its own.

Command format (documented in every prompt). An agent writes commands ``TASK DAY HOUR``, one per line
by convention (``t3 mon 10``: t3 starts Monday at 10:00). The parser reads the completion as words
(newlines, commas and semicolons separate like spaces; ``10:00`` reads as 10): a command starts at a
task id and takes the next two words as the day and the start hour. Words outside commands are
ignored (a model's chatter costs nothing). A command is rejected, with a reason in the next
observation, when its task id is not one of the item's (``t9``), its day or hour does not parse
(*malformed*), the task belongs to a teammate (*foreign*), or the agent already placed that task this
turn (*repeat*). Each rejected command costs ``penalty``; a turn's penalties are capped at
``max_penalty``. Accepted commands place or move the task; placements persist across turns.

The rules, pure functions of the item and the merged schedule (:func:`violations`):

- hours: a task starts at 9 or later and ends by 17;
- window: it starts on one of its allowed days, at one of its allowed hours;
- overlap: no person attends two tasks that overlap in time on the same day;
- order: for "A before B" with both placed, A ends before (or when) B starts, on the same day or an
  earlier one.

A task is *valid* when it is placed and no violation names it; a rule about an unplaced task is not
yet violated. Shaped reward (default) of a turn: the change in the share of the item's tasks that are
valid, minus that turn's penalties. Sparse reward: 0 until turn ``turns``, then the final share of
valid tasks minus the penalties of the whole episode; summed over an episode of ``turns`` turns the
two are equal (an episode shorter than ``turns`` would earn 0: :meth:`ScheduleEnv.check_num_turns` refuses it).
Individual rewards (``algorithm.learners=individual``): agent i's commands alone applied to the schedule the
previous turns left, scored on its own tasks, with its own penalties (sparse: 0 until turn ``turns``, then
its own share minus its own penalties of every turn).

Every item is feasible: it is drawn around a hidden valid schedule (each window contains the hidden
slot; each precedence rule holds in it). Train and eval items come from disjoint seeds (an eval item
equal to a train one is drawn again).

After each turn every agent sees its first observation, the merged schedule, the list of violated
rules, the share of valid tasks and the reasons its own commands were rejected. The first observation
lists each of the agent's tasks' allowed slots as ready-to-copy commands, so that an untrained model
that copies one line already places a task inside its window.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from teamrl.envs.base import Environment, Item, Step, register_env, sparse_too_short
from teamrl.rewards.base import RewardResult

DAYS = ("mon", "tue", "wed", "thu", "fri")
DAY_START, DAY_END = 9, 17
"""Working hours: a task starts at DAY_START or later and ends by DAY_END."""
PEOPLE = ("ann", "bob", "cat", "dan", "eve", "fay", "gus", "hal")
_TASK_ID = re.compile(r"t\d+")
_HOUR = re.compile(r"(\d{1,2})(?::00)?")
_STRIP = ",;.:!?*()[]{}`'\"-|"
"""Punctuation stripped from a word's ends before it is read (``t3,`` ``mon:`` ``**t3``)."""


@dataclass(frozen=True)
class Command:
    """One accepted command: ``task`` starts on ``day`` at ``hour``, written by agent ``seat``."""

    seat: int
    task: str
    day: str
    hour: int


@dataclass(frozen=True)
class Rejection:
    """A command the environment refused, and why (kind: malformed, unknown, foreign or repeat)."""

    seat: int
    text: str
    kind: str
    reason: str


# ------------------------------------------------------------------------------------------------
# The rules: pure functions of an item and a schedule ({task id: (day, hour)}).


def task_owner(item: Item, task_id: str, num_agents: int) -> int:
    """The seat that may place ``task_id``: task i belongs to seat (i - 1) mod num_agents."""
    index = [task["id"] for task in item["tasks"]].index(task_id)
    return index % num_agents


def parse_commands(item: Item, seat: int, text: str, num_agents: int) -> tuple[list[Command], list[Rejection]]:
    """Agent ``seat``'s accepted commands and rejected ones in ``text`` (never raises on any string)."""
    words = [w.strip(_STRIP).lower() for w in re.split(r"[\s,;]+", text)]
    words = [w for w in words if w]
    known = {task["id"] for task in item["tasks"]}
    accepted: list[Command] = []
    rejected: list[Rejection] = []
    placed: set[str] = set()
    i = 0
    while i < len(words):
        if not _TASK_ID.fullmatch(words[i]):
            i += 1  # prose between commands is ignored
            continue
        task, day, hour = words[i], *(words[i + 1:i + 3] + ["", ""])[:2]
        shown = " ".join(w for w in (task, day, hour) if w)
        hour_match = _HOUR.fullmatch(hour)
        if task not in known:
            rejected.append(Rejection(seat, shown, "unknown", f"there is no task {task}"))
            i += 1
        elif day not in item["days"] or not hour_match or not 0 <= int(hour_match.group(1)) <= 23:
            rejected.append(Rejection(seat, shown, "malformed",
                                      f"write {task} DAY HOUR with DAY in {' '.join(item['days'])} and HOUR 0-23"))
            i += 1  # resynchronise on the next word: it may start a command
        elif task_owner(item, task, num_agents) != seat:
            rejected.append(Rejection(seat, shown, "foreign", f"{task} belongs to a teammate"))
            i += 3
        elif task in placed:
            rejected.append(Rejection(seat, shown, "repeat", f"{task} was already placed this turn"))
            i += 3
        else:
            placed.add(task)
            accepted.append(Command(seat, task, day, int(hour_match.group(1))))
            i += 3
    return accepted, rejected


def violations(item: Item, schedule: dict[str, tuple[str, int]]) -> list[tuple[str, tuple[str, ...]]]:
    """Every violated rule of ``schedule``: (message, the task ids it names), in a fixed order."""
    tasks = {task["id"]: task for task in item["tasks"]}
    day_index = {day: i for i, day in enumerate(item["days"])}
    found: list[tuple[str, tuple[str, ...]]] = []
    for tid, (day, hour) in schedule.items():
        task = tasks[tid]
        end = hour + task["duration"]
        if hour < DAY_START or end > DAY_END:
            found.append((f"{tid} at {day} {hour} is outside working hours {DAY_START}-{DAY_END}", (tid,)))
        elif day not in task["window_days"] or hour not in task["window_hours"]:
            found.append((f"{tid} at {day} {hour} is outside its allowed slots", (tid,)))
    placed = sorted(schedule, key=_task_number)
    for n, a in enumerate(placed):
        for b in placed[n + 1:]:
            (day_a, start_a), (day_b, start_b) = schedule[a], schedule[b]
            shared = sorted(set(tasks[a]["people"]) & set(tasks[b]["people"]))
            overlap = (day_a == day_b and start_a < start_b + tasks[b]["duration"]
                       and start_b < start_a + tasks[a]["duration"])
            if shared and overlap:
                found.append((f"{' '.join(shared)} double-booked by {a} and {b} on {day_a}", (a, b)))
    for a, b in item["before"]:
        if a in schedule and b in schedule:
            (day_a, start_a), (day_b, start_b) = schedule[a], schedule[b]
            if day_a == day_b:
                in_order = start_a + tasks[a]["duration"] <= start_b
            else:
                in_order = day_index[day_a] < day_index[day_b]
            if not in_order:
                found.append((f"{a} must end before {b} starts", (a, b)))
    return found


def valid_tasks(item: Item, schedule: dict[str, tuple[str, int]]) -> set[str]:
    """The placed tasks that no violated rule names."""
    broken = {tid for _, tids in violations(item, schedule) for tid in tids}
    return set(schedule) - broken


def _task_number(task_id: str) -> int:
    return int(task_id[1:])


# ------------------------------------------------------------------------------------------------
# Items.


def make_item(rng: random.Random, item_id: str, num_tasks: int, num_days: int, num_people: int,
              precedence_density: float, window_slack: int) -> Item:
    """One feasible problem, drawn around a hidden schedule that satisfies every rule it states."""
    days = list(DAYS[:num_days])
    people = list(PEOPLE[:num_people])
    tasks, hidden = [], {}
    for n in range(1, num_tasks + 1):
        for _ in range(100):  # rejection sampling: a slot and attendees that keep the hidden schedule valid
            duration = rng.choice((1, 1, 2))
            attendees = sorted(rng.sample(people, rng.choice((1, 2)) if num_people > 1 else 1))
            day, hour = rng.choice(days), rng.randint(DAY_START, DAY_END - duration)
            clash = any(day == d and hour < h + t["duration"] and h < hour + duration
                        and set(attendees) & set(t["people"]) for t, (d, h) in zip(tasks, hidden.values()))
            if not clash:
                break
        else:  # no clash-free slot found: a guest nobody else meets keeps the item feasible
            duration, day, hour, attendees = 1, days[0], DAY_START, [f"guest{n}"]
        lo = max(DAY_START, hour - rng.randint(0, window_slack))
        hi = min(DAY_END - duration, hour + rng.randint(0, window_slack))
        window_days = sorted({day, *([rng.choice(days)] if rng.random() < 0.5 else [])}, key=days.index)
        tasks.append({"id": f"t{n}", "duration": duration, "people": attendees,
                      "window_days": window_days, "window_hours": list(range(lo, hi + 1))})
        hidden[f"t{n}"] = (day, hour)
    before = []
    for a in tasks:
        for b in tasks:
            (day_a, start_a), (day_b, start_b) = hidden[a["id"]], hidden[b["id"]]
            in_order = days.index(day_a) < days.index(day_b) or (
                day_a == day_b and start_a + a["duration"] <= start_b)
            if in_order and rng.random() < precedence_density:
                before.append([a["id"], b["id"]])
    return {"id": item_id, "days": days, "tasks": tasks, "before": before,
            "solution": {tid: list(slot) for tid, slot in hidden.items()}}


@register_env("schedule")
class ScheduleEnv(Environment):
    """2-3 agents place their meetings over several turns so that the merged schedule breaks no rule.

    Args:
        num_agents: agents in the team (2-4); task i belongs to seat (i - 1) mod num_agents.
        num_tasks: meetings per item (difficulty); ``num_days``, ``num_people`` (fewer people: more clashes).
        precedence_density: chance that a pair of tasks in order in the hidden schedule gets an
            "A before B" rule (difficulty).
        window_slack: how many hours each task's allowed start window extends around its hidden slot.
        turns: the episode's length (the env's ``max_turns``; the sparse reward pays at this turn).
        sparse: reward only at turn ``turns`` (the final share of valid tasks minus all penalties).
        penalty: cost of each rejected command; ``max_penalty`` caps one turn's penalties.
        num_train, num_eval: items per split; ``seed``: the items' seed (train and eval from disjoint seeds).
    """

    max_reward = 1.0
    turn_reward = "increment"

    def __init__(self, num_agents: int = 2, num_tasks: int = 4, num_days: int = 2, num_people: int = 3,
                 precedence_density: float = 0.3, window_slack: int = 1, turns: int = 4, sparse: bool = False,
                 penalty: float = 0.05, max_penalty: float = 0.5, num_train: int = 256, num_eval: int = 32,
                 seed: int = 0):
        if not 2 <= num_agents <= 4:
            raise ValueError(f"env.kwargs.num_agents: must be 2-4 (got {num_agents})")
        if num_tasks < num_agents:
            raise ValueError(f"env.kwargs.num_tasks: at least one task per agent (got {num_tasks})")
        if not 1 <= num_days <= len(DAYS) or not 1 <= num_people <= len(PEOPLE):
            raise ValueError(f"env.kwargs: num_days must be 1-{len(DAYS)}, num_people 1-{len(PEOPLE)}")
        if turns < 1:
            raise ValueError(f"env.kwargs.turns: must be >= 1 (got {turns})")
        self.num_agents = num_agents
        # The role asks for bare command lines: a small untrained model follows a system prompt's format
        # more often than an instruction at the end of a long task.
        self.roles = tuple(f"You are scheduler {seat + 1} of {num_agents}. You reply only with schedule lines "
                           f"TASK DAY HOUR, like: t1 mon 9" for seat in range(num_agents))
        self.max_turns = turns
        self.turns, self.sparse = turns, sparse
        self.penalty, self.max_penalty = penalty, max_penalty
        knobs = (num_tasks, num_days, num_people, precedence_density, window_slack)
        train = [make_item(random.Random(f"schedule-{seed}-train-{i}"), f"train-{i}", *knobs)
                 for i in range(num_train)]
        seen = {_signature(item) for item in train}
        evals = []
        for i in range(num_eval):
            for attempt in range(100):  # an eval item identical to a train item is drawn again
                item = make_item(random.Random(f"schedule-{seed}-eval-{i}-{attempt}"), f"eval-{i}", *knobs)
                if _signature(item) not in seen:
                    break
            evals.append(item)
        self.splits = {"train": train, "eval": evals}

    def check_num_turns(self, num_turns: int, field: str = "algorithm.num_turns") -> None:
        super().check_num_turns(num_turns, field)
        if self.sparse and num_turns < self.turns:
            raise ValueError(sparse_too_short(field, num_turns, self.turns, "turns"))

    # --- state --------------------------------------------------------------------------------

    def apply_turn(self, item: Item, schedule: dict[str, tuple[str, int]], actions: Sequence[str],
                   seats: Sequence[int] | None = None) -> tuple[dict[str, tuple[str, int]], list[Rejection]]:
        """The schedule after the agents ``seats`` (all by default) wrote ``actions``, and the rejections."""
        schedule = dict(schedule)
        rejected: list[Rejection] = []
        for seat in range(self.num_agents) if seats is None else seats:
            accepted, refused = parse_commands(item, seat, actions[seat], self.num_agents)
            rejected += refused
            for command in accepted:  # each agent only moves its own tasks, so agents never overwrite each other
                schedule[command.task] = (command.day, command.hour)
        return schedule, rejected

    def replay(self, item: Item,
               history: Sequence[Step]) -> tuple[dict[str, tuple[str, int]], list[list[Rejection]]]:
        """The schedule the turns of ``history`` left, and each turn's rejected commands."""
        schedule: dict[str, tuple[str, int]] = {}
        turns = []
        for step in history:
            schedule, rejected = self.apply_turn(item, schedule, step.actions)
            turns.append(rejected)
        return schedule, turns

    def _penalty(self, rejected: int) -> float:
        return min(self.max_penalty, self.penalty * rejected)

    def _share(self, item: Item, schedule: dict[str, tuple[str, int]], tasks: set[str] | None = None) -> float:
        valid = valid_tasks(item, schedule)
        return len(valid if tasks is None else valid & tasks) / len(item["tasks"])

    # --- rewards ------------------------------------------------------------------------------

    def joint_reward(self, item: Item, actions: Sequence[str], history: Sequence[Step] = ()) -> RewardResult:
        before, past = self.replay(item, history)
        after, rejected = self.apply_turn(item, before, actions)
        penalty = self._penalty(len(rejected))
        share_before, share_after = self._share(item, before), self._share(item, after)
        counts = {"valid_tasks": float(len(valid_tasks(item, after))), "placed_tasks": float(len(after)),
                  "violations": float(len(violations(item, after))), "rejected_commands": float(len(rejected))}
        if self.sparse:
            if len(history) + 1 < self.turns:
                return RewardResult(0.0, {"progress": 0.0, "penalty": 0.0}, counts)
            total_penalty = sum(self._penalty(len(turn)) for turn in past) + penalty
            return RewardResult(share_after - total_penalty, {"progress": share_after, "penalty": -total_penalty},
                                counts)
        progress = share_after - share_before
        return RewardResult(progress - penalty, {"progress": progress, "penalty": -penalty}, counts)

    def individual_rewards(self, item: Item, actions: Sequence[str], history: Sequence[Step] = ()) -> list[float]:
        """Agent i's own commands alone on the schedule the previous turns left, scored on its own tasks (the
        share of the item's tasks that are its own and valid). Shaped: the change of that share minus its own
        penalties of the turn. Sparse: 0 until turn ``turns``, then the share minus its own penalties of every
        turn of the episode (as the sparse joint reward counts every turn's penalties)."""
        if self.sparse and len(history) + 1 < self.turns:
            return [0.0] * self.num_agents
        before, past = self.replay(item, history)
        rewards = []
        for seat in range(self.num_agents):
            own = {t["id"] for t in item["tasks"] if task_owner(item, t["id"], self.num_agents) == seat}
            after, rejected = self.apply_turn(item, before, actions, seats=[seat])
            penalty = self._penalty(len(rejected))
            if self.sparse:
                earlier = sum(self._penalty(sum(r.seat == seat for r in turn)) for turn in past)
                rewards.append(self._share(item, after, own) - earlier - penalty)
            else:
                rewards.append(self._share(item, after, own) - self._share(item, before, own) - penalty)
        return rewards

    # --- observations -------------------------------------------------------------------------

    def observe(self, item: Item) -> list[str]:
        return [self._brief(item, seat) for seat in range(self.num_agents)]

    def _brief(self, item: Item, seat: int) -> str:
        mine = [t for t in item["tasks"] if task_owner(item, t["id"], self.num_agents) == seat]
        others = [t for t in item["tasks"] if task_owner(item, t["id"], self.num_agents) != seat]
        lines = [f"Plan meetings on {' '.join(item['days'])} between {DAY_START} and {DAY_END}. "
                 f"You are scheduler {seat + 1} of {self.num_agents}.",
                 "Your meetings (only you place them), each with its allowed lines:"]
        for task in mine:
            slots = " | ".join(f"{task['id']} {day} {hour}" for day in task["window_days"]
                               for hour in task["window_hours"])
            lines.append(f"{_describe(task)}. Allowed: {slots}")
        lines.append("Teammates' meetings (do not place them):")
        lines += [f"{_describe(task)}" for task in others]
        rules = [f"{a} before {b}" for a, b in item["before"]]
        lines.append("Rules: nobody in two meetings at once" + "".join(f"; {r}" for r in rules) + ".")
        # Ending on ready command lines (each meeting's first allowed slot) is what lets an untrained small
        # model score: it tends to continue or echo the last lines it read.
        lines.append("Reply with one line per meeting of yours, TASK DAY HOUR, and nothing else. For example:")
        lines += [f"{task['id']} {task['window_days'][0]} {task['window_hours'][0]}" for task in mine]
        return "\n".join(lines)

    def next_observations(self, item: Item, history: Sequence[Step]) -> list[str]:
        schedule, turns = self.replay(item, history)
        rejected = turns[-1]
        broken = violations(item, schedule)
        placed = " | ".join(f"{t['id']} {' '.join(map(str, schedule[t['id']]))}" if t["id"] in schedule
                            else f"{t['id']} unplaced" for t in item["tasks"])
        status = [f"After turn {len(history)}: schedule {placed}",
                  "Broken rules: " + ("; ".join(message for message, _ in broken) or "none"),
                  f"Valid: {len(valid_tasks(item, schedule))} of {len(item['tasks'])} meetings."]
        observations = []
        for seat in range(self.num_agents):
            own = [r for r in rejected if r.seat == seat]
            refused = "; ".join(f"{r.text} ({r.reason})" for r in own) or "none"
            observations.append("\n".join([self._brief(item, seat), *status, f"Your rejected lines: {refused}",
                                           "Write lines to place or move your meetings."]))
        return observations

    # --- prompt-only baselines ----------------------------------------------------------------

    single_agent_role = "You place every meeting."

    def single_agent_observation(self, item: Item) -> str:
        slots = "\n".join(f"{_describe(t)}. Allowed: " + " | ".join(
            f"{t['id']} {d} {h}" for d in t["window_days"] for h in t["window_hours"]) for t in item["tasks"])
        rules = "".join(f"; {a} before {b}" for a, b in item["before"])
        return (f"Plan meetings on {' '.join(item['days'])} between {DAY_START} and {DAY_END}.\n{slots}\n"
                f"Rules: nobody in two meetings at once{rules}.\nWrite one line per meeting: TASK DAY HOUR")

    def split_single_agent_output(self, item: Item, completion: str) -> list[str]:
        """Each command goes to the seat that owns its task (the rest is dropped)."""
        words = [w.strip(_STRIP).lower() for w in re.split(r"[\s,;]+", completion)]
        parts: list[list[str]] = [[] for _ in range(self.num_agents)]
        known = {t["id"] for t in item["tasks"]}
        for i, word in enumerate(words):
            if word in known:
                parts[task_owner(item, word, self.num_agents)].append(" ".join(words[i:i + 3]))
        return ["\n".join(lines) for lines in parts]

    def vocabulary(self) -> list[str]:
        tasks = {t["id"] for split in self.splits.values() for item in split for t in item["tasks"]}
        words = [*sorted(tasks, key=_task_number), *DAYS, *map(str, range(DAY_START, DAY_END + 1)), *PEOPLE]
        return list(dict.fromkeys(words + (super().vocabulary() or [])))


def _describe(task: dict) -> str:
    hours = "hour" if task["duration"] == 1 else "hours"
    return f"{task['id']}: {task['duration']} {hours} with {' '.join(task['people'])}"


def _signature(item: Item) -> str:
    return repr((item["days"], item["tasks"], item["before"]))
