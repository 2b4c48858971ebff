"""A step's program episodes: the user's program run G times per item at once through the gateway, each agent's calls
as rows with their episode, and every way a program can fail said in one line naming the function, the item and the
cause, in the program's own terms (its file:line)."""

from __future__ import annotations

import json
import textwrap
import time
import uuid

import pytest

from teamrl.envs.checks import EnvironmentOutputError
from teamrl.envs.program import ProgramFault, ProgramTask
from teamrl.rollout.episodes import run_episodes
from teamrl.user_code import UserCodeError

pytest.importorskip("openai")

PROGRAMS = '''
import asyncio
import time

from openai import AsyncOpenAI, OpenAI


def client(base_url):
    return OpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=60)


def pipeline(item, base_url):
    """The planner once, then the writer item["writes"] times (0: never)."""
    agents = client(base_url)
    plan = agents.chat.completions.create(model="first", messages=[{"role": "user", "content": item["text"]}])
    for _ in range(item["writes"]):
        agents.chat.completions.create(model="second",
                                       messages=[{"role": "user", "content": plan.choices[0].message.content}])
    return {"plan": float(len(plan.choices[0].message.content.split())), "bonus": 1.0}


async def concurrent(item, base_url):
    async with AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=60) as agents:
        asks = [agents.chat.completions.create(model=name, messages=[{"role": "user", "content": item["text"]}])
                for name in ("first", "second")]
        answers = await asyncio.gather(*asks)
    return float(sum(len(answer.choices[0].message.content) for answer in answers))


def raises(item, base_url):
    raise ValueError("no plan for " + item["id"])


def hangs(item, base_url):
    time.sleep(60)


def misspells(item, base_url):
    try:
        client(base_url).chat.completions.create(model="frist", messages=[{"role": "user", "content": "3"}])
    except Exception:
        pass
    return 1.0


def misspells_and_raises(item, base_url):
    return client(base_url).chat.completions.create(model="frist", messages=[{"role": "user", "content": "3"}])


def not_a_number(item, base_url):
    return "good"


def not_finite(item, base_url):
    return float("nan")
'''


@pytest.fixture
def programs(tmp_path, monkeypatch):
    """The name of a module of programs beside this test's data file, importable as module:function."""
    module = f"programs_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(PROGRAMS))
    monkeypatch.syspath_prepend(str(tmp_path))
    items = [{"id": f"item{n}", "text": "3 4 5", "writes": n % 3} for n in range(6)]
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    return module


@pytest.fixture
def gateway(lora_team):
    from teamrl.serve.gateway import Gateway

    team = lora_team()
    gateways = []

    def start(task):
        task.seat([agent.name for agent in team])
        gateways.append(Gateway(team, task))
        gateways[-1].start()
        return gateways[-1]

    yield start
    for running in gateways:
        running.stop()


def _task(tmp_path, programs, name, **kwargs):
    return ProgramTask(f"{programs}:{name}", str(tmp_path / "items.jsonl"), eval_split=1, **kwargs)


def test_every_episode_runs_and_each_agents_calls_are_rows_of_their_episode(tmp_path, programs, gateway):
    task = _task(tmp_path, programs, "pipeline")
    items = list(task.items("train"))[:3]  # the writer is called 0, 1 and 2 times
    rollout = run_episodes(task, gateway(task), items, 2, seed=0)
    assert rollout.rewards.shape == (3, 2)
    assert [[episode.result.parts["bonus"] for episode in group] for group in rollout.episodes] == [[1.0] * 2] * 3
    planner, writer = rollout.generations
    assert rollout.episode_of_row[0].tolist() == [0, 1, 2, 3, 4, 5]  # one planner call per episode
    assert sorted(rollout.episode_of_row[1].tolist()) == [2, 3, 4, 4, 5, 5]  # item 0's episodes never call it
    assert planner.completion_ids.shape[0] == 6 and writer.completion_ids.shape[0] == 6
    # Each row is that call's own tokens: its text and its mask's length are what the episode recorded.
    for agent, generation in enumerate(rollout.generations):
        calls = [call.completion for group in rollout.episodes for episode in group for call in episode.calls
                 if call.agent == agent]
        assert sorted(generation.texts) == sorted(call.text for call in calls)
        assert sorted(generation.completion_mask.sum(1).tolist()) == sorted(len(c.completion_ids) for c in calls)


def test_an_async_program_runs_its_calls_concurrently(tmp_path, programs, gateway):
    task = _task(tmp_path, programs, "concurrent")
    rollout = run_episodes(task, gateway(task), list(task.items("train"))[:2], 2, seed=1)
    assert [len(episode.calls) for group in rollout.episodes for episode in group] == [2] * 4
    assert all(generation.completion_ids.shape[0] == 4 for generation in rollout.generations)


def test_a_program_that_raises_is_one_line_naming_it_the_item_and_its_own_line(tmp_path, programs, gateway):
    task = _task(tmp_path, programs, "raises")
    with pytest.raises(UserCodeError) as raised:
        run_episodes(task, gateway(task), list(task.items("train"))[:1], 2, seed=0)
    message = str(raised.value)
    assert message.startswith(f"{programs}:raises raised ValueError: no plan for item0 at ")
    assert f"{programs}.py:" in message and message.endswith("on item 'item0'") and "\n" not in message


def test_a_program_that_hangs_stops_at_its_timeout_naming_the_item(tmp_path, programs, gateway):
    task = _task(tmp_path, programs, "hangs", timeout_s=1)
    began = time.monotonic()
    with pytest.raises(ProgramFault, match=rf"^{programs}:hangs did not finish within 1 s on item 'item0' "
                                           r"\(env.kwargs.timeout_s\); it made 0 call"):
        run_episodes(task, gateway(task), list(task.items("train"))[:1], 2, seed=0)
    assert time.monotonic() - began < 10


def test_an_unknown_model_stops_the_run_even_when_the_program_caught_the_error(tmp_path, programs, gateway):
    task = _task(tmp_path, programs, "misspells")
    with pytest.raises(ProgramFault, match=rf"^{programs}:misspells called model 'frist', which is no agent of this "
                                           r"team \(first, second\) \(the program caught the error and went on\), on "
                                           r"item 'item0'$"):
        run_episodes(task, gateway(task), list(task.items("train"))[:1], 2, seed=0)
    task = _task(tmp_path, programs, "misspells_and_raises")
    with pytest.raises(ProgramFault, match=rf"called model 'frist', .* at .*{programs}.py:\d+, on item 'item0'$"):
        run_episodes(task, gateway(task), list(task.items("train"))[:1], 2, seed=0)


@pytest.mark.parametrize(("name", "what"), [("not_a_number", "returned 'good'"),
                                            ("not_finite", "returned a non-finite total")])
def test_a_reward_that_is_no_finite_number_is_refused_naming_the_function_and_item(tmp_path, programs, gateway,
                                                                                     name, what):
    task = _task(tmp_path, programs, name)
    with pytest.raises(EnvironmentOutputError, match=rf"^{programs}:{name} {what}.* item 'item0'"):
        run_episodes(task, gateway(task), list(task.items("train"))[:1], 2, seed=0)
