"""A block world: 2-4 agents place and remove blocks over several turns to match a target structure.

The world is a small 3-D grid (``width`` x ``depth`` x ``height``; z = 0 is the ground). Each item is a
target structure, a set of cells with a block type (a letter: R, G, B, Y, W), generated from a seed.
Every agent is responsible for part of the target: a band of columns split by x (``roles="region"``,
the default) or some of the block types (``roles="type"``, where a block of one agent often rests on
another agent's, so the order of the agents' work across turns matters).

**Command format.** An agent writes commands, one per line::

    place X Y Z TYPE
    remove X Y Z

Lines (split at newlines and ``;``) that start with ``place`` or ``remove`` (after a list marker such as
``-`` or ``1.``) hold commands; other lines are chatter and are ignored, so prose that mentions placing a
block costs nothing. In a command line, a command runs from its word to the next command word or the end
of the line (commas, brackets, quotes and backticks read as spaces, ``0R`` as ``0 R``; words after the
arguments are ignored), so ``place 0 0 0 R place 1 0 0 G`` on one line is two commands. The first ``max_commands``
commands of each agent count in a turn; later ones are ignored (listed in the feedback, no cost).

**World rules** (pure functions below, :func:`apply_command`). Commands are applied in seat order: all of
agent 0's, then agent 1's, and so on, each in the order written. A command is rejected, with a reason,
when its syntax is bad, a coordinate is out of bounds, the type is unknown, a ``place`` targets an
occupied cell (a *collision* when a teammate placed that block in this same turn), a ``place`` at z > 0
has nothing below it (floating), a ``remove`` finds an empty cell or a block on top of it.

**Reward.** IoU = (cells holding the target's type) / |target cells ∪ built cells|. Waste costs
``waste_cost`` (0.1) for each rejected command, each collision and each accepted block that is not in
the target with that type (``off_target``). Shaped (default): each turn pays the change of IoU during the
turn minus that turn's waste, so an episode's return is final IoU minus all waste, at most 1 (a per-turn
increment: ``turn_reward = "increment"``, so a team that early termination stops earns nothing after the
stop). Sparse (``sparse=True``): turns before the last one (turn ``max_turns``; set ``max_turns`` to the
run's ``algorithm.num_turns``: :meth:`BuildEnv.check_num_turns` refuses shorter episodes, which would earn
0) pay 0 and the last pays final IoU minus the waste of the whole episode (the same return, all at the
end). ``max_reward`` is 1.0 either way: no single turn, and no episode, can pay more.

**Individual rewards** (``algorithm.learners=individual``) charge each agent for what it did in a turn: its
correct blocks placed within its own part, less the correct blocks it removed anywhere (a teammate's too),
divided by the number of target blocks, minus the waste it caused: its rejected commands and off-target
blocks, and each collision in which it built outside its own part (the earlier builder when the cell is
the later one's part; otherwise the later builder, whose command was rejected). Sparse: each agent's sum
over the episode, paid at the last turn.

The prompt gives each agent the exact ``place`` lines of its part of the target in build order (lower
layers first), so an untrained model that copies a line already scores; after each turn it sees the
world's verdict on each of its commands, the team's progress, the lines still to build in its part and
``remove`` lines for the wrong blocks there.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from teamrl.envs.base import Environment, Item, Step, register_env, sparse_too_short
from teamrl.rewards.base import RewardResult

TYPES = ("R", "G", "B", "Y", "W")
TYPE_NAMES = {"red": "R", "green": "G", "blue": "B", "yellow": "Y", "white": "W"}
COMMANDS = ("place", "remove")
Cell = tuple[int, int, int]
World = dict[Cell, str]
"""What is built: cell -> block type."""

_SEPARATORS = re.compile(r"[,()\[\]`\"']")
_GLUED = re.compile(r"(\d)([A-Za-z])")
_MARKER = re.compile(r"[-*>]|\d+[.)]")


@dataclass(frozen=True)
class Command:
    """One parsed command: ``verb`` is 'place', 'remove' or '' (unparseable); ``text`` as written."""

    verb: str
    text: str
    cell: Cell | None = None
    block: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Record:
    """The world's verdict on one command of agent ``seat``: ``status`` is 'ok', 'wrong' (applied, but the
    block is not the target's), 'rejected' or 'ignored' (over the command limit)."""

    seat: int
    command: Command
    status: str
    reason: str = ""
    collided_with: int | None = None
    """A collision: the seat whose block, placed this turn, already filled the cell."""
    off_target: bool = False
    correct: bool = False
    removed_correct: bool = False

    @property
    def collision(self) -> bool:
        return self.collided_with is not None

    def line(self) -> str:
        """How the agent sees it: ``ok place 0 0 0 R``, ``rejected remove 1 1 1: nothing there``."""
        reason = f": {self.reason}" if self.reason else ""
        return f"{self.status} {self.command.text}{reason}"


def parse_commands(text: str) -> list[Command]:
    """The commands of one agent's completion, in the order written (see the module docstring)."""
    commands = []
    for line in re.split(r"[\n;]", str(text)):
        words = _GLUED.sub(r"\1 \2", _SEPARATORS.sub(" ", line)).split()  # "0R" reads as "0 R"
        while words and _MARKER.fullmatch(words[0]):  # list markers: "-", "*", "1.", "2)", ">"
            words = words[1:]
        if not words or words[0].lower() not in COMMANDS:
            continue  # chatter: prose that merely mentions placing a block is not a command
        starts = [i for i, word in enumerate(words) if word.lower() in COMMANDS]
        for start, end in zip(starts, [*starts[1:], len(words)]):
            commands.append(_parse_one(words[start].lower(), words[start + 1:end]))
    return commands


def _parse_one(verb: str, args: list[str]) -> Command:
    arity = 4 if verb == "place" else 3
    text = " ".join([verb, *args[:arity]])
    usage = "place X Y Z TYPE" if verb == "place" else "remove X Y Z"
    if len(args) < arity:
        return Command(verb, text, error=f"bad syntax, write {usage}")
    try:
        cell = tuple(int(a) for a in args[:3])
    except ValueError:
        return Command(verb, text, error=f"bad syntax, X Y Z must be whole numbers: {usage}")
    block = None
    if verb == "place":
        word = args[3]
        block = TYPE_NAMES.get(word.lower(), word.upper())
        if block not in TYPES:
            return Command(verb, text, cell=cell, error=f"unknown type {word}")
    return Command(verb, text, cell=cell, block=block)


def _in_bounds(cell: Cell, size: Cell) -> bool:
    return all(0 <= c < n for c, n in zip(cell, size))


def apply_command(world: World, command: Command, size: Cell, types: Sequence[str]) -> str | None:
    """Apply ``command`` to ``world`` in place; the reason it is rejected, or None when it was applied."""
    if command.error:
        return command.error
    if command.block is not None and command.block not in types:
        return f"unknown type {command.block}"
    x, y, z = command.cell
    if not _in_bounds(command.cell, size):
        return "out of bounds"
    if command.verb == "place":
        if (x, y, z) in world:
            return "occupied"
        if z > 0 and (x, y, z - 1) not in world:
            return "floating, nothing below"
        world[(x, y, z)] = command.block
    else:
        if (x, y, z) not in world:
            return "nothing there"
        if (x, y, z + 1) in world:
            return "a block is on top"
        del world[(x, y, z)]
    return None


def apply_turn(world: World, actions: Sequence[str], target: World, size: Cell, types: Sequence[str],
               max_commands: int) -> tuple[World, list[Record]]:
    """The world after one turn (a new dict; ``world`` is untouched) and a record per command.

    Agents act in seat order; a ``place`` into a cell a teammate filled in this same turn is a collision.
    """
    world = dict(world)
    placed_by: dict[Cell, int] = {}  # this turn's blocks and who placed them, to tell collisions
    records = []
    for seat, action in enumerate(actions):
        for index, command in enumerate(parse_commands(action)):
            if index >= max_commands:
                records.append(Record(seat, command, "ignored", f"over the limit of {max_commands}"))
                continue
            removed = world.get(command.cell) if command.verb == "remove" else None
            reason = apply_command(world, command, size, types)
            if reason is not None:
                other = placed_by.get(command.cell) if command.verb == "place" else None
                collided_with = other if reason == "occupied" and other is not None and other != seat else None
                if collided_with is not None:
                    reason = f"collision, builder {other + 1} placed a block there this turn"
                records.append(Record(seat, command, "rejected", reason, collided_with=collided_with))
                continue
            if command.verb == "place":
                placed_by[command.cell] = seat
                correct = target.get(command.cell) == command.block
                records.append(Record(seat, command, "ok" if correct else "wrong",
                                      "" if correct else "not in the target", off_target=not correct,
                                      correct=correct))
            else:
                placed_by.pop(command.cell, None)
                records.append(Record(seat, command, "ok", removed_correct=target.get(command.cell) == removed))
    return world, records


def iou(world: World, target: World) -> float:
    """Cells holding the target's type over the union of target and built cells (1.0: done)."""
    union = len(set(world) | set(target))
    return sum(1 for cell, block in target.items() if world.get(cell) == block) / union if union else 1.0


def waste(records: Sequence[Record]) -> tuple[int, int, int]:
    """Rejected commands (not collisions), collisions and off-target blocks among ``records``."""
    rejected = sum(1 for r in records if r.status == "rejected" and not r.collision)
    collisions = sum(1 for r in records if r.collision)
    off_target = sum(1 for r in records if r.off_target)
    return rejected, collisions, off_target


def generate_target(rng: random.Random, size: Cell, num_blocks: int, types: Sequence[str]) -> World:
    """A random supported structure of ``num_blocks`` blocks: each block sits on the ground or on another."""
    width, depth, height = size
    target: World = {}
    while len(target) < num_blocks:
        free = [(x, y, z) for x in range(width) for y in range(depth) for z in range(height)
                if (x, y, z) not in target and (z == 0 or (x, y, z - 1) in target)]
        if not free:
            break
        target[rng.choice(free)] = rng.choice(list(types))
    return target


def _order(cell: Cell) -> tuple[int, int, int]:
    x, y, z = cell
    return (z, x, y)  # lower layers first: copying the lines in order never places a floating block


def _reply(lines: Sequence[str]) -> str:
    """The end of every prompt: the exact lines to write, so that copying them scores."""
    if not lines:
        return "Your part is done: reply with nothing."
    return "Copy these lines exactly:\n" + "\n".join(lines)


def _place_line(cell: Cell, block: str) -> str:
    return f"place {cell[0]} {cell[1]} {cell[2]} {block}"


@register_env("build")
class BuildEnv(Environment):
    """Agents place and remove blocks over several turns to build a target structure together.

    Args:
        num_agents: 2-4 builders.
        width, depth, height: the grid (x, y, z).
        num_blocks: blocks per target, an int or ``[min, max]``.
        num_types: how many block types (of R G B Y W) targets use.
        roles: ``"region"`` (agent i builds a band of columns split by x) or ``"type"`` (agent i places
            the types i, i + num_agents, ...).
        max_commands: commands per agent per turn that count.
        max_turns: episode length (the sparse reward is paid at this turn).
        sparse: pay the reward only at the last turn.
        waste_cost: cost of each rejected command, collision and off-target block.
        num_train, num_eval: items per split (distinct structures, no structure in both).
        seed: seed of the item generator.
    """

    max_reward = 1.0
    turn_reward = "increment"

    def __init__(self, num_agents: int = 2, width: int = 4, depth: int = 4, height: int = 3,
                 num_blocks: int | Sequence[int] = (4, 8), num_types: int = 3, roles: str = "region",
                 max_commands: int = 8, max_turns: int = 4, sparse: bool = False, waste_cost: float = 0.1,
                 num_train: int = 64, num_eval: int = 16, seed: int = 0):
        if not 2 <= num_agents <= 4:
            raise ValueError(f"env.kwargs.num_agents: must be 2-4 (got {num_agents})")
        if min(width, depth, height) < 1 or width > 10 or depth > 10 or height > 10:
            raise ValueError(f"env.kwargs: width, depth, height must be 1-10 (got {width}, {depth}, {height})")
        if roles not in ("region", "type"):
            raise ValueError(f"env.kwargs.roles: 'region' or 'type' (got {roles!r})")
        if not 1 <= num_types <= len(TYPES):
            raise ValueError(f"env.kwargs.num_types: must be 1-{len(TYPES)} (got {num_types})")
        if roles == "region" and width < num_agents:
            raise ValueError(f"env.kwargs.width: region roles need width >= num_agents (got {width})")
        if roles == "type" and num_types < num_agents:
            raise ValueError(f"env.kwargs.num_types: type roles need num_types >= num_agents (got {num_types})")
        if max_commands < 1:
            raise ValueError(f"env.kwargs.max_commands: must be >= 1 (got {max_commands})")
        low, high = (num_blocks, num_blocks) if isinstance(num_blocks, int) else tuple(num_blocks)
        if not 1 <= low <= high:
            raise ValueError(f"env.kwargs.num_blocks: an int or [min, max] with 1 <= min <= max (got {num_blocks})")
        self.num_agents = num_agents
        self.size = (width, depth, height)
        self.types = TYPES[:num_types]
        self.role_kind = roles
        self.max_commands = max_commands
        self.max_turns = max_turns
        self.sparse = sparse
        self.waste_cost = waste_cost
        # The rules go in the system prompt, so that each observation can stay short and end on the lines
        # to copy: a 135M model copies a short prompt's lines far more often than a long one's.
        self.roles = tuple(self._header(seat) for seat in range(num_agents))
        self.splits = self._generate(seed, (low, high), num_train, num_eval)

    def check_num_turns(self, num_turns: int, field: str = "algorithm.num_turns") -> None:
        super().check_num_turns(num_turns, field)
        if self.sparse and num_turns < self.max_turns:
            raise ValueError(sparse_too_short(field, num_turns, self.max_turns, "max_turns"))

    # ------------------------------------------------------------------------------------------ items

    def _generate(self, seed: int, blocks: tuple[int, int], num_train: int, num_eval: int) -> dict:
        """Items from one seeded stream; a structure seen before is skipped, so the splits are disjoint."""
        rng = random.Random(seed)
        seen, items = set(), []
        attempts = 0
        while len(items) < num_train + num_eval and attempts < 100 * (num_train + num_eval):
            attempts += 1
            target = generate_target(rng, self.size, rng.randint(*blocks), self.types)
            key = tuple(sorted(target.items()))
            if key in seen:
                continue
            seen.add(key)
            items.append([[*cell, block] for cell, block in sorted(target.items(), key=lambda kv: _order(kv[0]))])
        if len(items) < num_train + num_eval:
            raise ValueError(f"env.kwargs: this grid and num_blocks give only {len(items)} distinct structures, "
                             f"fewer than num_train + num_eval = {num_train + num_eval}")
        train, held = items[:num_train], items[num_train:]
        return {"train": [{"id": f"train-{i}", "target": t} for i, t in enumerate(train)],
                "eval": [{"id": f"eval-{i}", "target": t} for i, t in enumerate(held)]}

    @staticmethod
    def target(item: Item) -> World:
        return {(x, y, z): block for x, y, z, block in item["target"]}

    def owner(self, cell: Cell, block: str) -> int:
        """The seat responsible for a block of type ``block`` at ``cell``."""
        if self.role_kind == "type":
            return self.types.index(block) % self.num_agents if block in self.types else -1
        return cell[0] * self.num_agents // self.size[0]

    def part(self, seat: int) -> str:
        """Agent ``seat``'s responsibility, in words."""
        if self.role_kind == "type":
            return "the blocks of type " + " ".join(t for t in self.types if self.owner((0, 0, 0), t) == seat)
        columns = [x for x in range(self.size[0]) if self.owner((x, 0, 0), "") == seat]
        return f"columns x {columns[0]}" + (f" to {columns[-1]}" if len(columns) > 1 else "")

    # ------------------------------------------------------------------------------------------ world

    def replay(self, item: Item, history: Sequence[Step]) -> tuple[World, list[list[Record]]]:
        """The world after ``history`` (from empty) and each turn's records."""
        world: World = {}
        turns = []
        for step in history:
            world, records = self.turn(item, world, step.actions)
            turns.append(records)
        return world, turns

    def turn(self, item: Item, world: World, actions: Sequence[str]) -> tuple[World, list[Record]]:
        return apply_turn(world, actions, self.target(item), self.size, self.types, self.max_commands)

    def _waste_cost(self, records: Sequence[Record]) -> tuple[float, float, float]:
        return tuple(0.0 - self.waste_cost * n for n in waste(records))

    def joint_reward(self, item: Item, actions: Sequence[str], history: Sequence[Step] = ()) -> RewardResult:
        target = self.target(item)
        before, past = self.replay(item, history)
        after, records = self.turn(item, before, actions)
        rejected, collisions, off_target = self._waste_cost(records)
        final_iou = iou(after, target)
        counts = {"iou": final_iou, "correct_blocks": float(sum(after.get(c) == b for c, b in target.items())),
                  "target_blocks": float(len(target)),
                  "accepted": float(sum(r.status in ("ok", "wrong") for r in records)),
                  "rejected": float(sum(r.status == "rejected" for r in records)),
                  "collisions": float(sum(r.collision for r in records))}
        if self.sparse:
            if len(history) + 1 < (self.max_turns or 1):
                return RewardResult(0.0, {}, counts)
            episode_waste = sum(sum(self._waste_cost(turn)) for turn in [*past, records])
            return RewardResult(final_iou + episode_waste, {"iou": final_iou, "waste": episode_waste}, counts)
        parts = {"progress": final_iou - iou(before, target), "rejected": rejected, "collisions": collisions,
                 "off_target": off_target}
        return RewardResult(sum(parts.values()), parts, counts)

    def individual_rewards(self, item: Item, actions: Sequence[str], history: Sequence[Step] = ()) -> list[float]:
        """Each agent's reward for what it did this turn (:meth:`own_rewards`); with ``sparse`` the sum of its
        turns' rewards, paid at turn ``max_turns`` (0 before), as the joint reward is."""
        before, past = self.replay(item, history)
        _, records = self.turn(item, before, actions)
        if not self.sparse:
            return self.own_rewards(item, records)
        if len(history) + 1 < self.max_turns:
            return [0.0] * self.num_agents
        return [sum(turns) for turns in zip(*(self.own_rewards(item, turn) for turn in [*past, records]))]

    def own_rewards(self, item: Item, records: Sequence[Record]) -> list[float]:
        """Agent i's reward for one turn's ``records``: (its correct blocks placed in its own part, less every
        correct block it removed, in any part) / target blocks, minus the waste it caused: its rejected
        commands, its off-target blocks and the collisions it is charged (:meth:`charged_seat`).

        Removing a teammate's correct block costs the remover what placing it earned the teammate, so credit
        only moves between agents, it is never made: over an episode the agents' rewards add up to at most
        (correct blocks at the end) / target blocks minus the episode's waste, and removing and placing a
        block again earns nothing."""
        target = self.target(item)
        blocks, wasted = [0] * self.num_agents, [0] * self.num_agents
        for record in records:
            cell = record.command.cell
            if record.correct and self.owner(cell, target[cell]) == record.seat:
                blocks[record.seat] += 1
            if record.removed_correct:
                blocks[record.seat] -= 1
            if record.collision:
                wasted[self.charged_seat(target, record)] += 1
            elif record.status == "rejected" or record.off_target:
                wasted[record.seat] += 1
        return [count / len(target) - self.waste_cost * waste for count, waste in zip(blocks, wasted)]

    def charged_seat(self, target: World, collision: Record) -> int:
        """Who a collision is charged to: the agent that built outside its own part. When the cell holds a
        target block of the later builder's part (the one rejected), the earlier builder intruded there;
        otherwise the later one did (the cell is the earlier builder's, a third agent's or no one's)."""
        cell = collision.command.cell
        responsible = self.owner(cell, target[cell]) if cell in target else None
        return collision.collided_with if responsible == collision.seat else collision.seat

    # ------------------------------------------------------------------------------------ observations

    def _header(self, seat: int) -> str:
        width, depth, height = self.size
        return (f"You are builder {seat + 1} of a team of {self.num_agents}. You write only commands. You build "
                f"{self.part(seat)} in a {width} x {depth} x {height} grid (x y z; z 0 is the ground, a block "
                f"needs a block below it). A command is place or remove, then x y z, then the type "
                f"({' '.join(self.types)}) for place; at most {self.max_commands}, one per line.")

    def _own_lines(self, seat: int, blocks: World) -> list[str]:
        return [_place_line(cell, block) for cell, block in sorted(blocks.items(), key=lambda kv: _order(kv[0]))
                if self.owner(cell, block) == seat]

    def observe(self, item: Item) -> list[str]:
        target = self.target(item)
        observations = []
        for seat in range(self.num_agents):
            lines = self._own_lines(seat, target)
            observations.append(_reply(lines))
        return observations

    def next_observations(self, item: Item, history: Sequence[Step]) -> list[str]:
        target = self.target(item)
        world, turns = self.replay(item, history)
        missing = {cell: block for cell, block in target.items() if world.get(cell) != block}
        correct = sum(1 for cell, block in target.items() if world.get(cell) == block)
        observations = []
        for seat in range(self.num_agents):
            own = [r.line() for r in turns[-1] if r.seat == seat]
            # Wrong blocks are their placer's part to remove: by region, any wrong block in its columns; by
            # type, the wrong blocks of its own types.
            wrong = sorted(cell for cell, block in world.items() if target.get(cell) != block
                           and self.owner(cell, block) == seat)
            todo = self._own_lines(seat, missing)
            parts = [f"Turn {len(history) + 1}. Your last commands:\n" + ("\n".join(own) or "none"),
                     f"Team progress: {correct} of {len(target)} target blocks built."]
            # Removals first: a wrong block must go before the right one can take its cell.
            removals = [f"remove {x} {y} {z}" for x, y, z in sorted(wrong, key=lambda c: -c[2])]
            parts.append(_reply(removals + todo))
            observations.append("\n".join(parts))
        return observations

    # --- prompt-only baselines and the centralised policy ------------------------------------------

    @property
    def single_agent_role(self) -> str:
        width, depth, height = self.size
        return (f"You are a builder. You write only commands. You build the whole structure in a {width} x {depth} "
                f"x {height} grid (x y z; z 0 is the ground, a block needs a block below it). A command is place "
                f"or remove, then x y z, then the type ({' '.join(self.types)}) for place; at most "
                f"{self.max_commands * self.num_agents}, one per line.")

    def single_agent_observation(self, item: Item) -> str:
        blocks = sorted(self.target(item).items(), key=lambda kv: _order(kv[0]))
        return _reply([_place_line(cell, block) for cell, block in blocks])

    def split_single_agent_output(self, item: Item, completion: str) -> list[str]:
        """Each command goes to the seat whose part it touches (a remove: the seat of the target's block there,
        or of its column when the target has none); one that names no valid cell or type goes to seat 0, where
        it is rejected and costs what a team's would. Within a seat the written order is kept; across seats the
        world applies them in seat order, as it does a team's."""
        target = self.target(item)
        parts: list[list[str]] = [[] for _ in range(self.num_agents)]
        for command in parse_commands(completion):
            seat = 0
            if command.error is None and command.cell is not None and _in_bounds(command.cell, self.size):
                block = command.block or target.get(command.cell, "")
                seat = max(self.owner(command.cell, block), 0)
            parts[seat].append(command.text)
        return ["\n".join(lines) for lines in parts]

    def vocabulary(self) -> list[str]:
        numbers = [str(n) for n in range(max(*self.size, self.num_agents, self.max_commands) + 1)]
        words = ("place remove ok wrong rejected ignored nothing none bad syntax out of bounds occupied collision "
                 "floating below there on top unknown type Turn Team progress").split()
        return sorted(set(numbers) | set(self.types) | set(words) | set(super().vocabulary() or ()))
