"""Specialisation checks of a trained team in ``teamrl eval``: its agents' weights swapped between seats and each
agent in every seat, each seat keeping its own prompt; the report holds the trained team against both."""

from __future__ import annotations

import pytest
import torch

from teamrl.evaluation.methods import EvalSettings, parse_methods
from teamrl.evaluation.report import versus_rows
from teamrl.evaluation.runner import run_evaluation, seat_weights, with_weights_of
from teamrl.rollout.generate import sample_team
from teamrl.team import Team


def test_the_specs_expand_every_role_into_one_method_per_agent(tiny_eval):
    team_dir = tiny_eval.run_dir / "team"
    methods = parse_methods(f"team:{team_dir},swapped:{team_dir},every-role:{team_dir}")
    assert [(m.spec, m.seats, m.is_trained_team) for m in methods] == [
        (f"team:{team_dir}", None, True), (f"swapped:{team_dir}", "swapped", False),
        (f"every-role:{team_dir}@first", "first", False), (f"every-role:{team_dir}@second", "second", False)]
    assert methods[1].title == f"trained team, roles swapped ({team_dir})"
    assert methods[3].title == f"trained agent second in every role ({team_dir})"
    assert [m.spec for m in parse_methods(f"every-role:{team_dir}@second")] == [f"every-role:{team_dir}@second"]
    with pytest.raises(ValueError, match=r"--methods: every-role:.*@third: the saved team has no agent 'third' "
                                         r"\(it has first, second\)"):
        parse_methods(f"every-role:{team_dir}@third")


def test_a_seat_runs_another_agents_weights_on_its_own_prompt(lora_team):
    team = lora_team()
    team[0].system_prompt, team[1].system_prompt = "You write the first part.", "You write the second part."
    assert seat_weights(team, "swapped") == [1, 0] and seat_weights(team, "second") == [1, 1]
    swapped = with_weights_of(team, seat_weights(team, "swapped"))
    assert [agent.name for agent in swapped] == ["second@first", "first@second"]
    assert [agent.system_prompt for agent in swapped] == [team[0].system_prompt, team[1].system_prompt]
    assert [agent.sampling for agent in swapped] == [team[0].sampling, team[1].sampling]
    assert [agent.adapter for agent in swapped] == [team[1].adapter, team[0].adapter]
    observations = [["1 2 3"], ["4 5 6"]]
    # Seat 0 of the swapped team samples exactly as agent 1 would on seat 0's prompt; not as agent 0 does.
    on_seat_0 = Team([swapped[0]])
    by_agent_1 = Team([with_weights_of(team, [1, 0])[0]])
    assert torch.equal(sample_team(on_seat_0, observations[:1], 4, 7)[0].completion_ids,
                       sample_team(by_agent_1, observations[:1], 4, 7)[0].completion_ids)
    own = sample_team(Team([team[0]]), observations[:1], 4, 7)[0]
    theirs = sample_team(on_seat_0, observations[:1], 4, 7)[0]
    assert torch.equal(own.prompt_ids, theirs.prompt_ids)  # the same prompt...
    assert not torch.equal(own.completion_ids, theirs.completion_ids)  # ...answered by other weights


def test_the_report_holds_the_trained_team_against_its_swapped_and_single_agent_teams(tiny_eval):
    team_dir = tiny_eval.run_dir / "team"
    methods = parse_methods(f"team:{team_dir},swapped:{team_dir},every-role:{team_dir}")
    results = run_evaluation(tiny_eval.config, EvalSettings(tuple(methods), max_items=3, num_samples=2))
    titles = [result.method.title for result in results.methods]
    assert len(titles) == 4
    rows = versus_rows(results)
    assert [row[:2] for row in rows] == [[titles[0], other] for other in titles[1:]]
    trained, swapped = results.methods[0], results.methods[1]
    assert [s["item"] for s in trained.samples] == [s["item"] for s in swapped.samples]  # the same items, paired
    assert trained.samples != swapped.samples  # other weights answer
