"""The prompt-only baselines on two tiny agents and digit_sum: what each agent is prompted with, how the
joint action is formed, and what the baselines count."""

from __future__ import annotations

import pytest

from teamrl.envs import make_env
from teamrl.evaluation import baselines
from teamrl.evaluation.baselines import BASELINES
from teamrl.inference import run_team
from teamrl.team import Team

NUM_SAMPLES = 2


@pytest.fixture(scope="module")
def env():
    return make_env("digit_sum", targets=[9], length=4, num_eval=3)


@pytest.fixture
def team(tiny_config, env):
    return Team.from_config(tiny_config().team, env, seed=0)


@pytest.fixture
def calls(monkeypatch):
    """Every ``run_team`` call the baselines make: (agents, observations, num_samples, texts)."""
    recorded = []

    def recording(team, observations, num_samples=1):
        output = run_team(team, observations, num_samples)
        recorded.append((list(team), observations, num_samples, output.texts))
        return output

    monkeypatch.setattr(baselines, "run_team", recording)
    return recorded


def test_the_four_baselines_are_registered_by_name():
    assert {"single", "concat", "sequential", "discussion"} <= set(BASELINES)
    assert all(BASELINES[name].__doc__ for name in BASELINES)


def test_concat_runs_every_agent_on_its_own_observation_in_one_call(env, team, calls):
    items = env.items("eval")
    output = BASELINES["concat"](env, team, items, NUM_SAMPLES)
    [(agents, observations, num_samples, texts)] = calls
    assert agents == list(team) and num_samples == NUM_SAMPLES
    assert observations == [env.observe(item) for item in items]
    assert len(output.episodes) == len(items) * NUM_SAMPLES
    for row, episode in enumerate(output.episodes):
        assert episode.item is items[row // NUM_SAMPLES]
        assert episode.observations == env.observe(episode.item)
        assert episode.actions == [texts[0][row], texts[1][row]]
    assert output.tokens > 0 and output.seconds > 0


def test_sequential_shows_agent_2_the_answer_of_agent_1(env, team, calls):
    items = env.items("eval")
    output = BASELINES["sequential"](env, team, items, NUM_SAMPLES)
    (first_agents, first_seen, _, first_texts), (second_agents, second_seen, _, second_texts) = calls
    assert first_agents == [team[0]] and second_agents == [team[1]]
    assert [row[0] for row in first_seen] == [env.observe(item)[0] for item in items for _ in range(NUM_SAMPLES)]
    for row, episode in enumerate(output.episodes):
        answer = first_texts[0][row]
        expected = env.teammates_observation(episode.item, 1, env.observe(episode.item)[1], [(0, answer)])
        assert second_seen[row] == [expected] and episode.observations[1] == expected
        assert expected.startswith(f"target {episode.item['target']} partner ")
        assert episode.actions == [answer, second_texts[0][row]]


def test_discussion_revises_after_seeing_the_partners_first_answer(env, team, calls):
    items = env.items("eval")
    output = BASELINES["discussion"](env, team, items, NUM_SAMPLES)
    (first_agents, first_seen, first_n, first_texts), (second_agents, second_seen, second_n, second_texts) = calls
    assert first_agents == second_agents == list(team) and (first_n, second_n) == (NUM_SAMPLES, 1)
    assert first_seen == [env.observe(item) for item in items]
    for row, episode in enumerate(output.episodes):
        mine, partner = first_texts[0][row], first_texts[1][row]
        assert episode.trace["first_answers"] == [mine, partner]
        assert second_seen[row][0] == env.teammates_observation(episode.item, 0, env.observe(episode.item)[0],
                                                                [(1, partner)], own=mine)
        assert second_seen[row][1] == env.teammates_observation(episode.item, 1, env.observe(episode.item)[1],
                                                                [(0, mine)], own=partner)
        assert episode.observations == second_seen[row]
        assert episode.actions == [second_texts[0][row], second_texts[1][row]]  # the revised answers


def test_single_agent_writes_everything_from_one_prompt_and_its_answer_is_split(env, team, calls):
    items = env.items("eval")
    output = BASELINES["single"](env, team, items, NUM_SAMPLES)
    [(agents, observations, num_samples, texts)] = calls
    [agent] = agents
    assert agent.model is team[0].model and agent.system_prompt == env.single_agent_role
    assert agent.sampling.max_new_tokens == 2 * team[0].sampling.max_new_tokens  # the whole team's budget
    assert agent.sampling.temperature == team[0].sampling.temperature and team[0].name != "single"
    assert observations == [[env.single_agent_observation(item)] for item in items] and num_samples == NUM_SAMPLES
    for row, episode in enumerate(output.episodes):
        assert episode.trace["completion"] == texts[0][row]
        assert episode.actions == env.split_single_agent_output(episode.item, texts[0][row])
        assert episode.observations == [env.single_agent_observation(episode.item)]
