"""The block world (`build`): world rules, rewards computed by hand, items, observations, a short run."""

from __future__ import annotations

import math
import random

import pytest
import torch

from teamrl.envs import make_env
from teamrl.envs.base import Step
from teamrl.envs.build import BuildEnv, parse_commands
from teamrl.train import Trainer

# A 4 x 2 x 2 grid, two builders: builder 1 owns columns x 0-1, builder 2 x 2-3. Four target blocks.
ITEM = {"id": "hand", "target": [[0, 0, 0, "R"], [2, 0, 0, "R"], [3, 1, 0, "G"], [0, 0, 1, "G"]]}


def env(**kwargs):
    options = {"width": 4, "depth": 2, "height": 2, "num_types": 2, "num_blocks": 2, "num_train": 2,
               "num_eval": 1, "max_turns": 2}
    return BuildEnv(**{**options, **kwargs})


def step(build, actions, history=()):
    return Step(tuple(build.observe(ITEM)), tuple(actions), build.joint_reward(ITEM, actions, history))


def test_registered_by_name():
    assert isinstance(make_env("build", num_agents=3), BuildEnv)


def test_shaped_reward_is_iou_change_minus_waste():
    build = env()
    first = ["place 0 0 0 R\nplace 0 0 1 G", "place 2 0 0 R\nplace 3 0 0 G"]  # (3, 0, 0) is not in the target
    reward = build.joint_reward(ITEM, first)
    # 3 right cells / (4 target + 1 stray) = 0.6; one off-target block costs 0.1.
    assert reward.parts == pytest.approx({"progress": 0.6, "rejected": 0.0, "collisions": 0.0, "off_target": -0.1})
    assert reward.total == pytest.approx(0.5)
    assert reward.counts["iou"] == pytest.approx(0.6)
    assert build.individual_rewards(ITEM, first) == pytest.approx([2 / 4, 1 / 4 - 0.1])

    history = [step(build, first)]
    second = ["", "remove 3 0 0\nplace 3 1 0 G"]
    reward = build.joint_reward(ITEM, second, history)
    assert reward.total == pytest.approx(0.4)  # 0.6 -> 1.0, no waste: the episode sums to 1.0 - 0.1
    assert reward.counts["iou"] == 1.0
    assert build.individual_rewards(ITEM, second, history) == pytest.approx([0.0, 1 / 4])


def test_removing_and_placing_a_block_again_earns_nothing():
    build = env()
    history = [step(build, ["place 0 0 0 R", ""])]
    again = ["remove 0 0 0\nplace 0 0 0 R\nremove 0 0 0\nplace 0 0 0 R", ""]
    assert build.joint_reward(ITEM, again, history).total == pytest.approx(0.0)
    assert build.individual_rewards(ITEM, again, history) == pytest.approx([0.0, 0.0])


def test_sparse_reward_pays_final_iou_minus_all_waste_at_the_last_turn():
    build = env(sparse=True)
    first = ["place 0 0 0 R\nplace 0 0 1 G", "place 2 0 0 R\nplace 3 0 0 G"]
    assert build.joint_reward(ITEM, first).total == 0.0
    second = ["", "remove 3 0 0\nplace 3 1 0 G"]
    reward = build.joint_reward(ITEM, second, [step(build, first)])
    assert reward.parts == pytest.approx({"iou": 1.0, "waste": -0.1})
    assert reward.total == pytest.approx(0.9)
    assert build.max_reward == 1.0
    # The individual rewards are sparse too: 0, then each agent's shaped individual rewards summed
    # (test_shaped_reward_is_iou_change_minus_waste: [2/4, 1/4 - 0.1], then [0, 1/4]).
    assert build.individual_rewards(ITEM, first) == [0.0, 0.0]
    assert build.individual_rewards(ITEM, second, [step(build, first)]) == pytest.approx([2 / 4, 2 / 4 - 0.1])


def test_sparse_episodes_shorter_than_the_paying_turn_are_refused():
    build = env(sparse=True, max_turns=3)
    build.check_num_turns(3)
    with pytest.raises(ValueError, match=r"^algorithm.num_turns: sparse: true pays only at turn "
                                         r"env.kwargs.max_turns = 3, so a 2-turn episode earns 0 everywhere"):
        build.check_num_turns(2)
    with pytest.raises(ValueError, match="supports at most 3 turns"):
        build.check_num_turns(4)
    env(max_turns=3).check_num_turns(2)  # shaped: every turn pays


@pytest.mark.parametrize("algorithm, agents", [({"num_turns": 2}, ["first", "second"]),
                                               ({"name": "centralized", "num_turns": 1}, ["central"])])
def test_training_refuses_a_sparse_world_that_pays_after_the_last_turn(tiny_config, algorithm, agents):
    config = tiny_config(env={"name": "build", "kwargs": {"sparse": True, "max_turns": 3, "num_train": 2,
                                                           "num_eval": 1}},
                         team={"agents": [{"name": name} for name in agents]}, algorithm=algorithm)
    with pytest.raises(ValueError, match=r"^algorithm.num_turns: sparse: true pays only at turn env.kwargs.max_turns"):
        Trainer(config)


def test_collision_when_two_builders_fill_one_cell():
    build = env()
    actions = ["place 2 0 0 R", "place 2 0 0 R"]  # builder 1 builds in builder 2's part, then builder 2 collides
    reward = build.joint_reward(ITEM, actions)
    assert reward.parts["collisions"] == pytest.approx(-0.1) and reward.parts["rejected"] == 0.0
    assert reward.total == pytest.approx(0.25 - 0.1)
    assert reward.counts["collisions"] == 1.0
    # Builder 1's block is right but outside its part: no individual credit, and the collision it caused by
    # building in builder 2's part is charged to it, not to builder 2, who only did its own part.
    assert build.individual_rewards(ITEM, actions) == pytest.approx([-0.1, 0.0])
    after = build.next_observations(ITEM, [step(build, actions)])
    assert "rejected place 2 0 0 R: collision, builder 1 placed a block there this turn" in after[1]


@pytest.mark.parametrize(("roles", "actions", "expected"), [
    # Builder 2 intrudes on builder 1's cell (0, 0, 0): builder 2, the later one, pays.
    ("region", ["place 0 0 0 R", "place 0 0 0 R"], [1 / 4, -0.1]),
    # A cell no one's part holds (not in the target): the later builder, whose command was rejected, pays; the
    # earlier one pays its off-target block.
    ("region", ["place 1 1 0 R", "place 1 1 0 G"], [-0.1, -0.1]),
    # By type (R: builder 1, G: builder 2): builder 1 puts an R where the target has builder 2's G, then builder 2
    # collides placing that G: builder 1 pays its wrong block and the collision.
    ("type", ["place 3 1 0 R", "place 3 1 0 G"], [-0.2, 0.0]),
])
def test_a_collision_is_charged_to_whoever_built_outside_its_part(roles, actions, expected):
    build = env(roles=roles)
    assert build.joint_reward(ITEM, actions).counts["collisions"] == 1.0
    assert build.individual_rewards(ITEM, actions) == pytest.approx(expected)


def test_removing_a_teammates_correct_block_costs_the_remover():
    # Builder 1 places its own correct block and builder 2 removes it in the same turn, every turn: the team
    # builds nothing. Builder 1 earns its block each turn, and builder 2 pays for each removal what it earned.
    build = env(max_turns=4)
    actions = ["place 0 0 0 R", "remove 0 0 0"]
    history, returns = [], [0.0, 0.0]
    for _ in range(4):
        assert build.individual_rewards(ITEM, actions, history) == pytest.approx([1 / 4, -1 / 4])
        returns = [total + r for total, r in zip(returns, build.individual_rewards(ITEM, actions, history))]
        history = [*history, step(build, actions, history)]
    assert returns == pytest.approx([1.0, -1.0])  # moved between the agents, made by neither: the team built 0
    assert sum(s.reward.total for s in history) == 0.0


def _random_episode(build, rng, turns):
    """A random episode of ``turns`` turns: its steps and each turn's individual rewards."""
    pool = [f"{verb} {x} {y} {z}" + (f" {rng.choice('RG')}" if verb == "place" else "")
            for verb in ("place", "remove") for x in range(4) for y in range(2) for z in range(2)]
    history, rewards = [], []
    for _ in range(turns):
        actions = ["\n".join(rng.choice(pool) for _ in range(rng.randint(0, 4))) for _ in range(2)]
        rewards.append(build.individual_rewards(ITEM, actions, history))
        history.append(step(build, actions, history))
    return history, rewards


@pytest.mark.parametrize("roles", ["region", "type"])
def test_individual_returns_add_up_to_at_most_the_teams_built_share(roles):
    # Every turn's individual rewards add up to at most (correct blocks placed in their placers' own parts - correct
    # blocks removed) / target blocks - the turn's waste: over an episode, at most the correct share at the end
    # minus the episode's waste. Collusion moves credit between agents; it cannot make any.
    build, rng = env(roles=roles, max_turns=3), random.Random(1)
    for _ in range(300):
        steps, rewards = _random_episode(build, rng, 3)
        world, turns = build.replay(ITEM, steps)
        correct = sum(world.get(cell) == block for cell, block in BuildEnv.target(ITEM).items())
        waste = sum(sum(build._waste_cost(records)) for records in turns)
        assert sum(map(sum, rewards)) <= correct / 4 + waste + 1e-9


@pytest.mark.parametrize(("action", "reason"), [
    ("place 9 0 0 R", "out of bounds"),
    ("place 0 -1 0 R", "out of bounds"),
    ("place 0 0 1 G", "floating, nothing below"),
    ("place 0 0 0 X", "unknown type X"),
    ("place 0 0 0 Y", "unknown type Y"),  # a real type, but this grid uses R and G only
    ("place 0 0", "bad syntax, write place X Y Z TYPE"),
    ("place a 0 0 R", "bad syntax, X Y Z must be whole numbers: place X Y Z TYPE"),
    ("remove 1 1 1", "nothing there"),
])
def test_invalid_commands_are_rejected_with_a_reason(action, reason):
    build = env()
    reward = build.joint_reward(ITEM, [action, ""])
    assert reward.total == pytest.approx(-0.1) and reward.parts["rejected"] == pytest.approx(-0.1)
    assert build.individual_rewards(ITEM, [action, ""]) == pytest.approx([-0.1, 0.0])
    feedback = build.next_observations(ITEM, [step(build, [action, ""])])[0]
    assert f"rejected {action}: {reason}" in feedback


def test_occupied_and_block_on_top():
    build = env()
    actions = ["place 0 0 0 R\nplace 0 0 0 G\nplace 0 0 1 G\nremove 0 0 0", ""]
    reward = build.joint_reward(ITEM, actions)
    assert reward.total == pytest.approx(0.5 - 0.2)  # 2 of 4 right, two rejections
    assert reward.counts["collisions"] == 0.0  # its own block: occupied, not a collision
    feedback = build.next_observations(ITEM, [step(build, actions)])[0]
    assert "rejected place 0 0 0 G: occupied" in feedback
    assert "rejected remove 0 0 0: a block is on top" in feedback


def test_command_cap_ignores_extra_commands_at_no_cost():
    build = env(max_commands=1)
    actions = ["place 0 0 0 R\nplace 0 0 1 G", ""]
    assert build.joint_reward(ITEM, actions).total == pytest.approx(0.25)
    feedback = build.next_observations(ITEM, [step(build, actions)])[0]
    assert "ignored place 0 0 1 G: over the limit of 1" in feedback


def test_parsing_is_lenient_about_layout_and_chatter():
    text = "Sure!\n`place 0 0 0 R` place (1, 0, 0) red; remove 1 0 0\n1. place 0 1 0 g extra\nI will place 2 0 0 R"
    commands = parse_commands(text)  # the last line is chatter: it does not start with a command
    assert [(c.verb, c.cell, c.block, c.error) for c in commands] == [
        ("place", (0, 0, 0), "R", None), ("place", (1, 0, 0), "R", None), ("remove", (1, 0, 0), None, None),
        ("place", (0, 1, 0), "G", None)]
    assert parse_commands("no commands here") == []
    assert [(c.cell, c.block) for c in parse_commands("1. place 0 3 0R")] == [((0, 3, 0), "R")]


def test_random_strings_never_crash():
    build = env(num_agents=3, num_types=3)
    rng = random.Random(0)
    alphabet = ["place", "remove", "PLACE", "0", "1", "-3", "99999999999999999999", "R", "x", "\n", " ", ",",
                "é", "1.5", "(", "`", "G", "B", "Y"]
    for _ in range(200):
        actions = ["".join(rng.choice(alphabet) + rng.choice(["", " "]) for _ in range(rng.randint(0, 30)))
                   for _ in range(3)]
        item = build.items()[0]
        reward = build.joint_reward(item, actions)
        history = [Step(tuple(build.observe(item)), tuple(actions), reward)]
        assert len(build.next_observations(item, history)) == 3
        assert len(build.individual_rewards(item, actions, history)) == 3
        assert reward.total <= 1.0


def test_items_are_deterministic_supported_and_splits_disjoint():
    first, again, other = BuildEnv(seed=3), BuildEnv(seed=3), BuildEnv(seed=4)
    assert first.splits == again.splits and first.splits != other.splits
    assert len(first.items("train")) == 64 and len(first.items("eval")) == 16
    structures = {split: {tuple(map(tuple, item["target"])) for item in first.items(split)} for split in first.splits}
    assert not structures["train"] & structures["eval"]
    for item in first.items("train"):
        target = BuildEnv.target(item)
        assert 4 <= len(target) <= 8
        assert all(z == 0 or (x, y, z - 1) in target for x, y, z in target)  # every block is supported
        assert set(target.values()) <= {"R", "G", "B"}


def _copied(observations):
    """Each agent's reply when it copies the lines its observation ends on."""
    return [obs.split("Copy these lines exactly:\n")[1] if "Copy these" in obs else "" for obs in observations]


def _one_pass_in_seat_order(build, target):
    """(blocks built, blocks rejected as floating) when every seat places its part's blocks once, seat after seat,
    lower layers first: a block stands when the cell below it is built, by anyone, before it."""
    built, floating = set(), 0
    for seat in range(build.num_agents):
        for x, y, z in sorted((c for c, b in target.items() if build.owner(c, b) == seat), key=lambda c: (c[2], *c)):
            if z == 0 or (x, y, z - 1) in built:
                built.add((x, y, z))
            else:
                floating += 1
    return len(built), floating


def test_copying_the_prompt_lines_builds_the_target():
    waited = 0  # type-role items whose first turn left a block floating
    for num_agents, roles in [(2, "region"), (3, "region"), (4, "region"), (3, "type")]:
        build = BuildEnv(num_agents=num_agents, num_types=max(3, num_agents), roles=roles, num_train=5, num_eval=1)
        for item in build.items():
            observations = build.observe(item)
            assert len(observations) == num_agents
            total = build.joint_reward(item, _copied(observations)).total
            if roles == "region":
                assert total == pytest.approx(1.0)
                continue
            # Type roles: a block may rest on a later seat's block, and is then rejected as floating in the first
            # turn; copying each turn's feedback builds one more layer a turn, so `height` turns finish.
            target = build.target(item)
            built, floating = _one_pass_in_seat_order(build, target)
            assert total == pytest.approx(built / len(target) - build.waste_cost * floating)
            waited += floating > 0
            history = []
            for _ in range(build.size[2]):
                seen = build.next_observations(item, history) if history else observations
                history.append(Step(tuple(seen), tuple(_copied(seen)), build.joint_reward(item, _copied(seen),
                                                                                          history)))
            assert history[-1].reward.counts["iou"] == 1.0
            rejected = sum(s.reward.counts["rejected"] for s in history)
            assert sum(s.reward.total for s in history) == pytest.approx(1.0 - build.waste_cost * rejected)
    assert waited > 0


def test_type_roles_by_hand_a_block_on_a_later_seats_block_waits_a_turn():
    build = env(roles="type")  # R: builder 1, G: builder 2
    item = {"id": "typed", "target": [[0, 0, 0, "G"], [0, 0, 1, "R"], [1, 0, 0, "R"]]}
    first = _copied(build.observe(item))
    assert first == ["place 1 0 0 R\nplace 0 0 1 R", "place 0 0 0 G"]
    history = [Step(tuple(build.observe(item)), tuple(first), build.joint_reward(item, first))]
    assert history[0].reward.total == pytest.approx(2 / 3 - 0.1)  # R on (0, 0, 1) floats: G is not built yet
    second = _copied(build.next_observations(item, history))
    assert second == ["place 0 0 1 R", ""]
    assert build.joint_reward(item, second, history).total == pytest.approx(1 / 3)


def test_four_agents_own_one_column_each_and_type_roles():
    build = BuildEnv(num_agents=4)
    assert [build.owner((x, 0, 0), "R") for x in range(4)] == [0, 1, 2, 3]
    assert "You build columns x 2 in a 4 x 4 x 3 grid" in build.roles[2]
    by_type = BuildEnv(num_agents=3, roles="type", num_types=4)
    assert [by_type.owner((0, 0, 0), t) for t in "RGBY"] == [0, 1, 2, 0]
    assert "You build the blocks of type R Y in a" in by_type.roles[0]
    with pytest.raises(ValueError, match="num_agents"):
        BuildEnv(num_agents=5)
    with pytest.raises(ValueError, match="distinct structures"):
        BuildEnv(width=2, depth=1, height=1, num_blocks=1, num_types=1, num_train=2, num_eval=1)


def test_next_observations_show_feedback_progress_todo_and_removals():
    build = env()
    first = ["place 0 0 0 R", "place 2 0 0 R\nplace 3 0 0 G\nplace 2 0 1 X"]
    builder1, builder2 = build.next_observations(ITEM, [step(build, first)])
    assert "Turn 2. Your last commands:\nok place 0 0 0 R\n" in builder1
    assert "Team progress: 2 of 4 target blocks built." in builder1
    assert builder1.endswith("Copy these lines exactly:\nplace 0 0 1 G")
    assert "ok place 2 0 0 R\nwrong place 3 0 0 G: not in the target\nrejected place 2 0 1 X: unknown type X" \
        in builder2
    # The wrong block's removal comes before the placement that needs its cell cleared.
    assert builder2.endswith("Copy these lines exactly:\nremove 3 0 0\nplace 3 1 0 G")


def test_vocabulary_has_the_command_words():
    words = set(env().vocabulary())
    assert {"place", "remove", "R", "G", "0", "3", "rejected"} <= words


@pytest.mark.slow
@pytest.mark.parametrize("num_agents, algorithm", [
    (3, {"joint_mode": "aligned"}),
    (4, {"joint_mode": "cross", "max_joint_actions": 6, "normalize_advantages": "agent"}),
])
def test_two_step_run_with_three_and_four_agents_and_two_turns(tiny_config, num_agents, algorithm):
    config = tiny_config(env={"name": "build", "kwargs": {"num_agents": num_agents, "max_turns": 2,
                                                           "num_train": 4, "num_eval": 2}},
                         team={"agents": [{"name": f"b{i}"} for i in range(num_agents)],
                               "sampling": {"max_new_tokens": 10}},
                         algorithm={"num_turns": 2, "num_generations": 2, **algorithm}, items_per_step=1, steps=2)
    history = Trainer(config).train()
    assert [metrics["step"] for metrics in history] == [1, 2]
    assert all(math.isfinite(metrics["loss"]) for metrics in history)
    # Cross mode with 4 agents would be 2^4 = 16 joint actions per node; the cap samples 6.
    joint = 6 if algorithm["joint_mode"] == "cross" else 2
    assert history[-1]["turn1/joint_actions"] == joint and history[-1]["turn2/joint_actions"] == joint * joint


def test_single_agent_answer_is_split_by_whose_part_each_command_touches():
    build = env()
    assert build.single_agent_observation(ITEM).splitlines()[1:] == [
        "place 0 0 0 R", "place 2 0 0 R", "place 3 1 0 G", "place 0 0 1 G"]
    answer = "Sure:\nplace 3 1 0 G\nplace 0 0 0 R\nremove 2 0 0\nplace 9 0 0 R\nplace 0 0 1 G\nplace 1 0"
    assert build.split_single_agent_output(ITEM, answer) == [
        "place 0 0 0 R\nplace 9 0 0 R\nplace 0 0 1 G\nplace 1 0", "place 3 1 0 G\nremove 2 0 0"]
    # The single agent's copy of every line scores what a team's copies score: the whole target.
    whole = build.split_single_agent_output(ITEM, build.single_agent_observation(ITEM))
    assert build.joint_reward(ITEM, whole).total == pytest.approx(1.0)
    # By type, a remove goes to the seat of the target's block at that cell.
    typed = env(roles="type")
    assert typed.split_single_agent_output(ITEM, "remove 3 1 0\nplace 1 1 0 R") == ["place 1 1 0 R", "remove 3 1 0"]
    assert "whole structure" in build.single_agent_role


def test_the_centralized_policy_plays_build_through_the_same_hooks():
    from teamrl.envs.centralized import CentralizedEnv

    central = CentralizedEnv(env())
    assert central.joint_reward(ITEM, [central.observe(ITEM)[0]]).total == pytest.approx(1.0)


def _scripted_sampler(pool):
    """A SampleFn that writes commands from ``pool``, drawn from a stream seeded by the observation and seed."""
    import zlib

    import torch

    from teamrl.rollout.generate import Generation

    def sample(observations, num_samples, seed):
        generations = []
        for seat, seen in enumerate(observations):  # agent seat's observations, one per expansion point
            texts = []
            for observation in seen:
                rng = random.Random(zlib.crc32(f"{seed}|{seat}|{observation}".encode()))
                texts += [rng.choice(pool) for _ in range(num_samples)]
            rows = len(texts)
            ones = torch.ones(rows, 1, dtype=torch.long)
            generations.append(Generation(ones, ones, ones, ones, torch.zeros(rows, 1), texts))
        return generations

    return sample


@pytest.mark.parametrize("estimator", ["mean", "rloo"])
def test_with_discount_one_monte_carlo_advantages_are_the_same_shaped_or_sparse(estimator):
    # Shaped and sparse returns from a node differ by what its history earned, which its siblings share; a
    # group-relative baseline takes it out. So MAGRPO's update is the same on both variants when gamma = 1.
    from teamrl.algorithms.magrpo import advantages
    from teamrl.config import AlgorithmConfig
    from teamrl.rollout.tree import sample_tree

    pool = ["place 0 0 0 R", "place 2 0 0 R\nplace 3 1 0 G", "place 0 0 1 G", "remove 0 0 0", "place 9 0 0 R",
            "place 1 1 0 G", "chatter"]

    def run(sparse, discount):
        build = env(max_turns=3, sparse=sparse)
        config = AlgorithmConfig(num_generations=3, num_turns=3, discount=discount, advantage=estimator)
        tree = sample_tree(_scripted_sampler(pool), build, [ITEM], config, seed=5)
        per_agent, returns = advantages(tree, 2, config)
        return torch.cat([torch.cat(turns) for turns in per_agent]), returns

    shaped, shaped_returns = run(False, 1.0)
    sparse, sparse_returns = run(True, 1.0)
    assert shaped.abs().sum() > 0
    assert not all(torch.equal(a, b) for a, b in zip(shaped_returns[1:], sparse_returns[1:]))  # returns differ
    assert torch.allclose(shaped, sparse, atol=1e-6)  # advantages do not
    assert not torch.allclose(run(False, 0.5)[0], run(True, 0.5)[0], atol=1e-6)  # with discounting they do


def test_early_termination_values_a_stop_at_what_was_built_never_above_finishing():
    # Two joint actions of turn 1 (aligned, G = 2), 3 turns, stop at a reward of 0.5. Joint action 0: builder 1
    # builds its half (0.5) and stops. Joint action 1: builder 1 places one block (0.25); at turn 2 both finish
    # (+0.75) and stop. The reward is a per-turn increment, so a stop earns nothing after it: the half-built stop
    # is worth 0.5 and the finished episode 1.0. Repeating the stopped rewards (as for a state value) would value
    # the half-built stop at 0.5 * 3 = 1.5, above finishing and above max_reward.
    from teamrl.algorithms.advantages import rollout_metrics
    from teamrl.algorithms.magrpo import advantages
    from teamrl.config import AlgorithmConfig
    from teamrl.rollout.generate import Generation
    from teamrl.rollout.tree import sample_tree

    def sample(observations, num_samples, seed):
        replies = {(0, True): ["place 0 0 0 R\nplace 0 0 1 G", "place 0 0 0 R"], (1, True): ["", ""],
                   (0, False): ["place 0 0 1 G"] * 2, (1, False): ["place 2 0 0 R\nplace 3 1 0 G"] * 2}
        generations = []
        for seat, seen in enumerate(observations):
            texts = [text for obs in seen for text in replies[seat, not obs.startswith("Turn")]]
            ones = torch.ones(len(texts), 1, dtype=torch.long)
            generations.append(Generation(ones, ones, ones, ones, torch.zeros(len(texts), 1), texts))
        return generations

    build = env(max_turns=3)
    assert build.turn_reward == "increment"
    config = AlgorithmConfig(num_generations=2, num_turns=3, early_termination_threshold=0.5)
    tree = sample_tree(sample, build, [ITEM], config)
    assert [turn.rewards.flatten().tolist() for turn in tree.turns] == [[0.5, 0.25], [0.75, 0.75]]
    assert tree.turns[0].terminated.tolist() == [[True, False]] and tree.turns[1].terminated.all()
    per_agent, returns = advantages(tree, 2, config)
    assert returns[0].flatten().tolist() == [0.5, 1.0]
    assert per_agent[0][0].tolist() == [-0.25, 0.25]  # finishing beats stopping half-built
    assert rollout_metrics(tree, returns, per_agent)["reward/episode/mean"] == 0.75
