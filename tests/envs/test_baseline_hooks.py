"""The environments' hooks for the prompt-only baselines: the single-agent prompt, splitting a single
agent's answer into the joint action the joint reward takes, and showing an agent its teammates' answers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from teamrl.envs import make_env

POSTS = str(Path(__file__).parent / "data" / "posts.jsonl")
FAST_LIMITS = {"test_timeout_s": 1.0, "program_timeout_s": 3.0, "cpu_time_s": 1, "memory_bytes": 256 << 20}

# HumanEval/0, has_close_elements(numbers, threshold), solved by one model as aux + main.
SINGLE_SOLUTION = (
    "Sure, here is the code:\n```python\nfrom typing import List\n\n\ndef aux(numbers, threshold):\n"
    "    return sorted(numbers)\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
    "    ordered = aux(numbers, threshold)\n"
    "    return any(b - a < threshold for a, b in zip(ordered, ordered[1:]))\n```\nprint('done')\n"
)


@pytest.fixture(scope="module")
def humaneval():
    env = make_env("humaneval", sandbox_workers=2, sandbox_limits=FAST_LIMITS)
    yield env
    env.close()


@pytest.mark.parametrize("name", ["tldr", "arxiv"])
def test_writing_single_prompt_asks_for_both_parts_as_two_paragraphs(name):
    env = make_env(name, source=POSTS, eval_size=3)
    item = env.items("eval")[0]
    prompt = env.single_agent_observation(item)
    assert item["text"] in prompt and "two paragraphs separated by a blank line" in prompt
    assert all(f"Paragraph {seat}: {instruction}" in prompt for seat, instruction in enumerate(env.instructions, 1))
    assert env.single_agent_role and len(env.output_names) == 2


def test_writing_split_gives_the_first_paragraph_to_agent_0_and_the_rest_to_agent_1():
    env = make_env("tldr", source=POSTS, eval_size=3)
    item = env.items("eval")[0]
    answer = "Paragraph 1: The landlord kept the deposit.\n\n  \nParagraph 2: First, he claimed stains.\n\nHowever, ..."
    assert env.split_single_agent_output(item, answer) == [
        "The landlord kept the deposit.", "First, he claimed stains.\n\nHowever, ..."]
    assert env.split_single_agent_output(item, "Only one paragraph here.") == ["Only one paragraph here.", ""]
    assert env.split_single_agent_output(item, "   ") == ["", ""]


def test_default_teammates_observation_shows_own_and_partner_answers_with_their_names():
    env = make_env("tldr", source=POSTS, eval_size=3)
    item = env.items("eval")[0]
    detailed = env.observe(item)[1]
    after = env.teammates_observation(item, 1, detailed, [(0, "SHORT SUMMARY")])
    assert after.startswith(detailed)
    assert "Your teammate's one-sentence summary:\nSHORT SUMMARY" in after
    assert "Write your answer so that it fits" in after and "Your first answer" not in after
    revised = env.teammates_observation(item, 0, env.observe(item)[0], [(1, "LONG")], own="MINE")
    assert "Your first answer:\nMINE" in revised and "Your teammate's detailed summary:\nLONG" in revised
    assert revised.index("MINE") < revised.index("LONG") and "Revise your answer" in revised


def test_coding_single_prompt_asks_for_aux_and_the_entry_point(humaneval):
    item = humaneval.items("eval")[0]
    prompt = humaneval.single_agent_observation(item)
    assert item["problem"] in prompt
    assert f"`{item['entry_point']}({item['parameters']})`" in prompt and f"`aux({item['parameters']})`" in prompt
    assert "aux" in humaneval.single_agent_role


def test_coding_split_gives_aux_to_the_helper_and_the_entry_point_to_main(humaneval):
    item = humaneval.items("eval")[0]
    helper, main = humaneval.split_single_agent_output(item, SINGLE_SOLUTION)
    assert "def aux" in helper and "def has_close_elements" not in helper and "print" not in helper
    assert "def has_close_elements" in main and "def aux" not in main
    assert helper.startswith("from typing import List") and main.startswith("from typing import List")
    assert humaneval.split_single_agent_output(item, "no code at all") == ["", ""]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_a_correct_single_agent_answer_earns_what_the_team_would(humaneval):
    item = humaneval.items("eval")[0]
    reward = humaneval.joint_reward(item, humaneval.split_single_agent_output(item, SINGLE_SOLUTION))
    assert reward.counts["tests_passed"] == reward.counts["tests_total"] > 0
    # The same split as test_coding_envs' team: every held test but one credited to aux (issue #51).
    assert reward.total == pytest.approx(1.5 + 1.0 + 1.5 * 4 / 5) and reward.total < humaneval.max_reward


def test_digit_sum_single_agent_writes_both_rows_and_sees_its_partner_in_game_words():
    env = make_env("digit_sum", targets=[9], length=3)
    item = env.items("eval")[0]
    assert env.single_agent_observation(item) == "target 9 first second"
    assert env.split_single_agent_output(item, "1 2 3 8 7 6 5") == ["1 2 3", "8 7 6"]
    assert env.joint_reward(item, env.split_single_agent_output(item, "1 2 3 8 7 6")).total == 1.0
    assert env.teammates_observation(item, 1, "ignored", [(0, "1 x 3")]) == "target 9 partner 1 ? 3 second"
    assert env.teammates_observation(item, 0, "ignored", [(1, "8 7 6")], own="4 4") == \
        "target 9 partner 8 7 6 you 4 4 first"
    words = set(env.vocabulary())
    assert all(word in words for word in env.teammates_observation(item, 0, "", [(1, "8")], own="").split())
