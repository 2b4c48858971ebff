"""A task that is a program: the user's own multi-agent code, trained unchanged.

A config names a function and the data it runs on::

    env:
      name: program
      kwargs:
        program: my_app:run        # module:function, imported from the config's folder or the working directory
        data: items.jsonl          # read as the dataset task reads it: a file, {split} files, a hub id, aclsum
    team:
      agents: [{name: planner}, {name: writer}]

``run(item, base_url)`` (a plain function or ``async def``) plays one episode of the program on ``item``: it calls
the agents through the OpenAI-compatible endpoint at ``base_url`` (``OpenAI(base_url=base_url, api_key="-")``), each
agent by its name as the model (``model="planner"``), as often and in whatever order it likes, and returns the
episode's joint reward: a number, a dict of named parts (summed) or a
:class:`~teamrl.rewards.base.RewardResult`. During training the endpoint is teamrl's gateway
(:class:`~teamrl.serve.gateway.Gateway`), which answers with each agent's current policy and records what it
sampled; afterwards ``teamrl serve RUN/team`` answers the same calls with the trained agents.

A program that reads ``OPENAI_BASE_URL`` instead of taking ``base_url`` works with ``base_url_variable:
OPENAI_BASE_URL``: while its episodes run, each episode's thread sees its own URL there (the variable is
process-wide, and the episodes run at once). It must build its client inside ``run``, not when its module is
imported. See docs/programs.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from contextlib import nullcontext
from typing import Any

from teamrl.envs.base import VOCABULARY_ITEMS, Environment, Item, Step, register_env
from teamrl.envs.checks import EnvironmentOutputError, checked_reward
from teamrl.envs.dataset import function_name, load_splits, locate_data, path_of, reward_result, user_function
from teamrl.rewards.base import RewardResult
from teamrl.user_code import user_code


class ProgramFault(EnvironmentOutputError):
    """An episode of a program task went wrong in a way no exception of the program says: it did not finish in time,
    or called what the endpoint refused (a model that is no agent of the team, a prompt over the context), even if
    it caught the error. One line naming the function, the item and the cause."""


@register_env("program")
class ProgramTask(Environment):
    """A multi-agent program as a task: ``program(item, base_url)`` runs one episode and returns its joint reward.

    Args:
        program: ``module:function`` (or, from Python, the function itself): ``run(item, base_url)``, plain or
            ``async``, returning a number, a dict of parts (summed) or a RewardResult.
        data, eval_split, train_split, id_field, num_train, num_eval, seed: the items, read exactly as the
            ``dataset`` task reads them (:class:`~teamrl.envs.dataset.DatasetTask`).
        agents: the agents' names, in seat order (default: ``team.agents``' names, filled in by training).
        timeout_s: an episode that has not returned after this many seconds stops the run, naming the item.
        max_reward: the largest joint reward of an episode (normalised returns divide by it).
        words: words the tiny test model must be able to write besides the items' (its vocabulary is the task's).
        base_url_variable: an environment variable the program reads its endpoint from (``OPENAI_BASE_URL``), set
            to each episode's URL in that episode's thread; empty: the program takes ``base_url``.
    """

    max_turns = 1
    joint_prompts = False

    def __init__(self, program: str | Callable[..., Any], data: str, *, eval_split: str | int | float = 0.1,
                 train_split: str = "train", agents: Sequence[str] = (), timeout_s: float = 300.0,
                 max_reward: float = 1.0, words: Sequence[str] = (), base_url_variable: str | None = None,
                 id_field: str = "id", num_train: int | None = None, num_eval: int | None = None, seed: int = 0):
        self.program = user_function(program, "env.kwargs.program")
        if self.program is None:
            raise ValueError("env.kwargs.program: give the program's function as module:function, e.g. my_app:run")
        _check_signature(self.program)
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s <= 0:
            raise ValueError(f"env.kwargs.timeout_s: must be a number of seconds > 0 (got {timeout_s!r})")
        if isinstance(words, str) or not all(isinstance(word, str) for word in words):
            raise ValueError(f"env.kwargs.words: give a list of words (got {words!r})")
        self.timeout_s = float(timeout_s)
        self.max_reward = float(max_reward)
        self.words = list(words)
        self.base_url_variable = base_url_variable or None
        self.agents: list[str] = []
        data = locate_data(data, train_split)
        self.splits = load_splits(data, eval_split, train_split, seed, num_train, num_eval, id_field)
        self._constructor_arguments = ((), {
            "program": path_of(self.program, "program"), "data": data, "eval_split": eval_split,
            "train_split": train_split, "agents": [], "timeout_s": timeout_s, "max_reward": max_reward,
            "words": self.words, "base_url_variable": self.base_url_variable, "id_field": id_field,
            "num_train": num_train, "num_eval": num_eval, "seed": seed})
        self.seat(agents)

    @property
    def program_name(self) -> str:
        """``module:function`` of the program, as errors name it."""
        return function_name(self.program)

    def seat(self, agents: Sequence[str]) -> None:
        """The team's agents, by name, in seat order: the models the program may call (a saved team records them)."""
        self.agents = list(agents)
        self.num_agents = len(self.agents)
        self._constructor_arguments[1]["agents"] = list(self.agents)

    def user_code(self) -> list[Callable[..., Any]]:
        return [self.program]

    def function_behind(self, method: str) -> str | None:
        return self.program_name if method == "play" else None

    def play(self, item: Item, base_url: str, on_start: Callable[[Callable[[], None]], None] | None = None,
             ) -> RewardResult:
        """One episode: the program run on ``item`` against ``base_url``; its joint reward, checked.

        ``on_start(cancel)``: called with a function that cancels an ``async`` program's episode (from another
        thread); a plain function's episode ends when its next call to a closed episode fails.

        Raises:
            UserCodeError: the program raised (its file:line named). EnvironmentOutputError: it returned something
                that is not a finite reward.
        """
        with user_code(self.program_name, item), self._endpoint_variable(base_url):
            if inspect.iscoroutinefunction(self.program):
                value = _run_async(self.program(item, base_url), on_start)
            else:
                value = self.program(item, base_url)
        return checked_reward(self, item, reward_result(value, self.program_name, item), "play")

    def observe(self, item: Item) -> list[str]:
        raise ValueError(f"{self.program_name} builds every prompt its agents see: a program task has no per-agent "
                         f"observations (the prompt-only baselines and the team model id need a task that has)")

    def joint_reward(self, item: Item, actions: Sequence[str], history: Sequence[Step] = ()) -> RewardResult:
        raise ValueError(f"{self.program_name} returns its episode's reward itself: a program task scores no joint "
                         f"action of its own")

    def vocabulary(self) -> list[str]:
        """For the word-level 'tiny' test model: every word of the items' text fields (not their ids), then
        :attr:`words`."""
        texts = [value for split in self.splits for item in list(self.items(split))[:VOCABULARY_ITEMS]
                 for key, value in item.items() if isinstance(value, str) and key != "id"]
        return list(dict.fromkeys([word for text in texts for word in text.split()] + self.words))

    def _endpoint_variable(self, base_url: str):
        return _thread_environ(self.base_url_variable, base_url) if self.base_url_variable else nullcontext()


def _check_signature(program: Callable[..., Any]) -> None:
    """The program takes (item, base_url), or says at load time what it should take."""
    try:
        inspect.signature(program).bind({}, "http://127.0.0.1/v1")
    except TypeError:
        raise ValueError(f"env.kwargs.program: {function_name(program)} must take two arguments, (item, base_url): "
                         f"the item to play and the endpoint to call the agents at") from None
    except ValueError:  # a builtin without a signature: called as it is
        pass


def _run_async(coroutine: Any, on_start: Callable[[Callable[[], None]], None] | None) -> Any:
    """Run an ``async`` program's episode on an event loop of this thread's own, cancellable from another thread."""
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(coroutine)
        if on_start is not None:
            on_start(lambda: loop.call_soon_threadsafe(task.cancel))
        try:
            return loop.run_until_complete(task)
        except asyncio.CancelledError:
            raise TimeoutError("the episode was cancelled when its time was up") from None
    finally:
        loop.close()


class _ThreadEnviron(MutableMapping):
    """``os.environ`` as each thread sees it: a thread may give some variables values of its own
    (:func:`_thread_environ`); everything else reads and writes the process's environment."""

    def __init__(self, environ: MutableMapping[str, str]):
        self.environ = environ
        self.local = threading.local()

    def _own(self) -> dict[str, str]:
        return getattr(self.local, "values", {})

    def __getitem__(self, key: str) -> str:
        own = self._own()
        return own[key] if key in own else self.environ[key]

    def __setitem__(self, key: str, value: str) -> None:
        self.environ[key] = value

    def __delitem__(self, key: str) -> None:
        del self.environ[key]

    def __iter__(self) -> Iterator[str]:
        return iter({**dict.fromkeys(self.environ), **dict.fromkeys(self._own())})

    def __len__(self) -> int:
        return len(set(self.environ) | set(self._own()))

    def copy(self) -> dict[str, str]:
        return dict(self)


_environ_lock = threading.Lock()


@contextlib.contextmanager
def _thread_environ(variable: str, value: str) -> Iterator[None]:
    """While open, ``os.environ[variable]`` reads ``value`` in this thread (and only here)."""
    with _environ_lock:
        if not isinstance(os.environ, _ThreadEnviron):
            # Wrapped, not replaced: every variable but this thread's own still reads and writes the real one.
            os.environ = _ThreadEnviron(os.environ)  # type: ignore[assignment]  # noqa: B003
    environ: _ThreadEnviron = os.environ  # type: ignore[assignment]
    before = environ._own()
    environ.local.values = {**before, variable: value}
    try:
        yield
    finally:
        environ.local.values = before
