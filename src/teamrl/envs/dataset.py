"""A task without writing a class: a dataset, one prompt template per agent and a reward function.

``env.name: dataset`` builds a :class:`DatasetTask` from its ``env.kwargs``::

    env:
      name: dataset
      kwargs:
        data: facts.jsonl                 # a local .jsonl/.json/.csv/.parquet, a "{split}" path, or a hub id
        eval_split: 0.2                   # held out: a fraction, a count, or a split's name ("test")
        prompts:                          # agent i's observation: its template over the item's fields
          - "Ask one question about this fact: {fact}"
          - "State the fact in one sentence: {fact}"
        reward: my_rewards:joint_reward   # module:function, imported from the config's folder or the cwd

The reward is a plain function, as TRL's are: ``reward(completions, item)`` (add a ``history``
parameter to see the earlier turns) returns a number, a dict of named parts (the reward is their sum)
or a :class:`~teamrl.rewards.base.RewardResult`. ``individual_reward(completions, item)`` returns one
number per agent (the independent-learner baseline). ``feedback(item, history)`` makes the task
multi-turn: it returns the text every agent sees after a turn (or one text per agent), and each
agent's next observation is its prompt, its previous answer and that text.

Items without an ``id`` field get one (``train-0``, ``eval-3``...). For a task that needs code beyond
this (its own observations per turn, batched grading), subclass :class:`~teamrl.envs.base.Environment`.
"""

from __future__ import annotations

import difflib
import inspect
import re
import string
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from teamrl.data import DataError, has_splits, holdout_split, load_records, source_kind
from teamrl.envs.base import Environment, Item, Step, register_env
from teamrl.envs.checks import EnvironmentOutputError, short_repr
from teamrl.imports import import_path_of, load_object, search_folders
from teamrl.rewards.base import RewardResult
from teamrl.user_code import user_code

_PART_LABEL = re.compile(r"^\s*\**Part (\d+)\s*:\**", re.MULTILINE | re.IGNORECASE)


@register_env("dataset")
class DatasetTask(Environment):
    """A task from a dataset, a prompt template per agent and a reward function (no class to write).

    Args:
        data: where the items come from: a local ``.jsonl``/``.json``/``.csv``/``.parquet`` file (a
            relative path is looked up in the working directory, then the config file's folder), a path
            with ``{split}`` naming one file per split, or a Hugging Face dataset id (the ``hub`` extra).
        prompts: one template per agent, in seat order (their number is the team's size), filled with
            the item's fields by ``str.format``: ``"Answer: {question}"``.
        reward: the joint reward, ``module:function`` (or, from Python, the function itself), called
            as ``reward(completions, item)`` (or with ``history=`` when it takes that parameter); returns
            a number, a dict of parts (summed) or a ``RewardResult``.
        eval_split: the held-out items: a split's name (sources with splits), a count (int) or a
            fraction (float in (0, 1)) of the training split drawn with ``seed``.
        train_split: the split training draws from, for sources with splits.
        roles: each agent's default system prompt, in seat order (empty: none).
        individual_reward: ``module:function`` returning one number per agent for
            ``algorithm.learners='individual'``; optional.
        feedback: ``module:function`` called as ``feedback(item, history)`` after each turn, returning one
            text for every agent or a list of one per agent; makes the task multi-turn. Optional.
        max_turns: the longest episode (default: 1 without ``feedback``, any with it).
        max_reward: the largest joint reward of one turn (normalised returns divide by it).
        id_field: the items' id field; items without one get ``SPLIT-INDEX``.
        num_train: keep at most this many training items; ``num_eval`` held-out ones.
        seed: the seed of the held-out draw.
    """

    def __init__(self, data: str, prompts: Sequence[str], reward: str | Callable[..., Any], *,
                 eval_split: str | int | float = 0.1, train_split: str = "train", roles: Sequence[str] = (),
                 individual_reward: str | Callable[..., Any] | None = None,
                 feedback: str | Callable[..., Any] | None = None, max_turns: int | None = None,
                 max_reward: float = 1.0, id_field: str = "id", num_train: int | None = None,
                 num_eval: int | None = None, seed: int = 0):
        if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError("env.kwargs.prompts: give a list of prompt templates, one per agent, e.g. "
                             "['Ask about: {fact}', 'Answer about: {fact}']")
        if roles and (len(roles) != len(prompts) or not all(isinstance(r, str) for r in roles)):
            raise ValueError(f"env.kwargs.roles: give one system prompt per agent ({len(prompts)}), got {roles!r}")
        self.num_agents = len(prompts)
        self.prompts = list(prompts)
        self.roles = tuple(roles)
        self.reward_fn = user_function(reward, "env.kwargs.reward")
        self.individual_fn = user_function(individual_reward, "env.kwargs.individual_reward")
        self.feedback_fn = user_function(feedback, "env.kwargs.feedback")
        self.max_turns = max_turns if max_turns is not None else (None if self.feedback_fn else 1)
        self.max_reward = float(max_reward)
        data = locate_data(data, train_split)
        self.splits = load_splits(data, eval_split, train_split, seed, num_train, num_eval, id_field)
        for split in self.splits:
            _check_templates(self.prompts, self.items(split), split)
        # What a saved team records to build this task again: names, not the functions themselves.
        self._constructor_arguments = ((), {
            "data": data, "prompts": self.prompts, "reward": path_of(self.reward_fn, "reward"),
            "eval_split": eval_split, "train_split": train_split, "roles": list(self.roles),
            "individual_reward": path_of(self.individual_fn, "individual_reward"),
            "feedback": path_of(self.feedback_fn, "feedback"), "max_turns": max_turns,
            "max_reward": max_reward, "id_field": id_field, "num_train": num_train, "num_eval": num_eval,
            "seed": seed})

    def user_code(self) -> list[Callable[..., Any]]:
        return [fn for fn in (self.reward_fn, self.individual_fn, self.feedback_fn) if fn is not None]

    def function_behind(self, method: str) -> str | None:
        function = {"joint_reward": self.reward_fn, "joint_rewards": self.reward_fn,
                    "individual_rewards": self.individual_fn, "individual_rewards_many": self.individual_fn,
                    "next_observations": self.feedback_fn}.get(method)
        return function_name(function) if function is not None else None

    def observe(self, item: Item) -> list[str]:
        return [prompt.format_map(item) for prompt in self.prompts]

    def single_agent_observation(self, item: Item) -> str:
        """Every agent's prompt as a numbered part of one answer (the ``single`` baseline of ``teamrl eval``)."""
        parts = "\n".join(f"Part {seat}: {prompt}" for seat, prompt in enumerate(self.observe(item), 1))
        return (f"Do all {self.num_agents} parts below. Start each answer on its own line with its label "
                f"(Part 1:, Part 2:, ...), and write nothing else.\n{parts}")

    def split_single_agent_output(self, item: Item, completion: str) -> list[str]:
        """The text after each ``Part i:`` label is agent i's part ('' for a part the answer lacks)."""
        pieces = _PART_LABEL.split(completion)
        answers = {int(label): text.strip() for label, text in zip(pieces[1::2], pieces[2::2])}
        return [answers.get(seat, "") for seat in range(1, self.num_agents + 1)]

    def joint_reward(self, item: Item, actions: Sequence[str], history: Sequence[Step] = ()) -> RewardResult:
        """The reward function's value as a RewardResult; whether it is a good one is checked where teamrl
        takes it (:mod:`teamrl.envs.checks`, whose errors name the function)."""
        return reward_result(_call(self.reward_fn, list(actions), item, history), function_name(self.reward_fn),
                             item)

    def individual_rewards(self, item: Item, actions: Sequence[str], history: Sequence[Step] = ()) -> list[float]:
        if self.individual_fn is None:
            return super().individual_rewards(item, actions, history)
        return _call(self.individual_fn, list(actions), item, history)

    def next_observations(self, item: Item, history: Sequence[Step]) -> list[str]:
        if self.feedback_fn is None:
            return super().next_observations(item, history)
        with user_code(function_name(self.feedback_fn), item):
            texts = self.feedback_fn(item, list(history))
        if isinstance(texts, str):
            texts = [texts] * self.num_agents
        if (not isinstance(texts, (list, tuple)) or len(texts) != self.num_agents
                or not all(isinstance(text, str) for text in texts)):
            return texts  # refused where teamrl takes the observations, naming the feedback function
        return [f"{first}\n\nYour previous answer:\n{own}\n\nFeedback:\n{text}"
                for first, own, text in zip(self.observe(item), history[-1].actions, texts)]


def reward_result(value: Any, function: str, item: Item) -> RewardResult:
    """What a user's reward ``function`` returned for ``item`` as a RewardResult: a number, a dict of named parts
    (summed) or a RewardResult; anything else is an EnvironmentOutputError naming the function and the item. (Whether
    its numbers are finite is checked where teamrl takes it: :mod:`teamrl.envs.checks`.)"""
    if isinstance(value, RewardResult):
        return value
    if isinstance(value, dict) and _all_numbers(value.values()):
        return RewardResult(sum(value.values()), {str(part): float(v) for part, v in value.items()})
    if _all_numbers([value]):
        return RewardResult(float(value))
    raise EnvironmentOutputError(f"{function} returned {short_repr(value)} for item {item.get('id')!r}; it must "
                                 f"return a number, a dict of numbers or a RewardResult")


def _all_numbers(values: Any) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def user_function(spec: str | Callable[..., Any] | None, field: str) -> Callable[..., Any] | None:
    if spec is None or callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"{field}: give module:function, e.g. my_rewards:score (got {spec!r})")
    function = load_object(spec, field)
    if not callable(function):
        raise ValueError(f"{field}: {spec!r} is a {type(function).__name__}, not a function")
    return function


def path_of(function: Callable[..., Any] | None, field: str) -> str | None:
    if function is None:
        return None
    path = import_path_of(function)
    if path is None:  # a lambda or a function in __main__: fine for this process, not for a saved team
        return f"<{field}: {function_name(function)} cannot be imported by name; define it in a module>"
    return path


def function_name(function: Callable[..., Any]) -> str:
    return import_path_of(function) or getattr(function, "__qualname__", repr(function))


def _call(function: Callable[..., Any], completions: list[str], item: Item, history: Sequence[Step]) -> Any:
    """``function(completions, item)``, the user's reward function, with ``history=`` when it takes that."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the two plain arguments
        parameters = {}
    takes_history = "history" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    with user_code(function_name(function), item):
        return function(completions, item, history=list(history)) if takes_history else function(completions, item)


def locate_data(data: str, train_split: str) -> str:
    """``data`` as an absolute path when it is a local file found in the working directory or a config's
    folder (so a saved team reads the same file from anywhere); other sources unchanged."""
    if not isinstance(data, str) or not data:
        raise ValueError(f"env.kwargs.data: give a file path or a Hugging Face dataset id (got {data!r})")
    if source_kind(data) != "file" or Path(data).expanduser().is_absolute():
        return data
    folders = search_folders()[::-1]  # the working directory first, then the configs' folders
    wanted = data.replace("{split}", train_split)
    for folder in folders:
        if (folder / wanted).exists():
            return str(folder / data)
    nearby = sorted({str(path.relative_to(folder)) for folder in folders if folder.is_dir()
                     for path in folder.glob(f"*{Path(wanted).suffix}") if path.is_file()})
    close = difflib.get_close_matches(wanted, nearby, n=1)
    raise ValueError(f"env.kwargs.data: no file {wanted!r} in the working directory or the config file's folder "
                     f"(looked in {', '.join(map(str, dict.fromkeys(folders)))}); give its path, absolute or relative "
                     f"to one of those{f'; did you mean {close[0]!r}?' if close else ''}")


def load_splits(data: str, eval_split: str | int | float, train_split: str, seed: int, num_train: int | None,
                 num_eval: int | None, id_field: str) -> dict[str, list[Item]]:
    try:
        if has_splits(data):
            train = load_records(data, train_split)
            if isinstance(eval_split, str):
                held_out = load_records(data, eval_split)
            else:
                train, held_out = holdout_split(train, eval_split, seed)
        else:
            if isinstance(eval_split, str):
                raise DataError(f"{data} is one file without named splits: give eval_split a count (16) or a "
                                f"fraction (0.1), or name one file per split with {{split}} in the path")
            train, held_out = holdout_split(load_records(data), eval_split, seed)
    except DataError as err:
        raise ValueError(f"env.kwargs.data: {err}") from None
    splits = {"train": train[:num_train], "eval": held_out[:num_eval]}
    if id_field == "id":
        return splits
    # Environment.items gives "SPLIT-INDEX" to an item whose id is still missing.
    return {split: [{**item, "id": item.get(id_field)} for item in items] for split, items in splits.items()}


def _check_templates(prompts: Sequence[str], items: Sequence[Item], split: str) -> None:
    """Every field a template names is in every item: a missing one fails now, naming the item."""
    for seat, prompt in enumerate(prompts):
        try:
            fields = {name.split(".")[0].split("[")[0] for _, name, _, _ in string.Formatter().parse(prompt) if name}
        except ValueError as err:
            raise ValueError(f"env.kwargs.prompts[{seat}]: not a valid template ({err}); write fields as "
                             f"{{field}} and literal braces as {{{{ }}}}") from None
        for item in items:
            missing = sorted(fields - set(item))
            if missing:
                raise ValueError(f"env.kwargs.prompts[{seat}]: {split} item {item.get('id')!r} has no field "
                                 f"{missing[0]!r} (its fields: {', '.join(item)})")
