"""Returns, group-relative advantages and joint-action bookkeeping of MAGRPO, against hand-computed numbers.

Every expected value below is worked out by hand in the comment next to it; none is recomputed with the
library's own formula.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from teamrl.algorithms import magrpo
from teamrl.algorithms.advantages import (
    ADVANTAGES,
    absorbing_factor,
    agent_advantages,
    best_of_others,
    leave_one_out,
    mean_baseline,
    no_baseline,
    rollout_metrics,
    sample_advantages,
    std_normalised,
    tree_returns,
)
from teamrl.config import AlgorithmConfig
from teamrl.envs import make_env
from teamrl.rewards.base import RewardResult
from teamrl.rollout.tree import RolloutTree, Turn, joint_action_combos, sample_tree


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, t(expected), atol=atol, rtol=0)


# --------------------------------------------------------------------------------------------------
# advantage modes over the last dimension
# --------------------------------------------------------------------------------------------------


def test_registered_modes():
    assert {"mean", "std", "rloo", "none", "max"} <= set(ADVANTAGES)


def test_mean_baseline_hand_computed():
    # R = [1, 2, 3, 6], mean 3 -> A = [-2, -1, 0, 3]
    close(mean_baseline(t([1, 2, 3, 6])), [-2, -1, 0, 3])
    # each row is its own group: [10, 20] -> mean 15
    close(mean_baseline(t([[1, 2, 3, 6], [10, 20, 15, 15]])), [[-2, -1, 0, 3], [-5, 5, 0, 0]])


def test_std_uses_unbiased_std_plus_eps():
    # R = [1, 3]: deviations -1, +1; unbiased var = (1 + 1) / (2 - 1) = 2, std = sqrt(2) = 1.41421356
    # A = +-1 / (1.41421356 + 1e-4) = +-0.70705678   (the biased std 1 would give +-0.9999)
    close(std_normalised(t([1, 3])), [-0.7070567847, 0.7070567847], atol=1e-6)
    # R = [1, 2, 3, 6]: deviations -2, -1, 0, 3; unbiased var = (4 + 1 + 0 + 9) / 3 = 14/3, std = 2.16024690
    # A = dev / 2.16034690
    close(std_normalised(t([1, 2, 3, 6])), [-0.9257772446, -0.4628886223, 0.0, 1.3886658669], atol=1e-6)


def test_std_of_a_constant_group_is_zero_not_nan():
    # all equal: 0 / (0 + eps) = 0
    out = std_normalised(t([5, 5, 5]))
    assert torch.isfinite(out).all()
    close(out, [0, 0, 0])


def test_std_eps_is_used():
    # R = [1, 3] with eps = 0.5: +-1 / (1.41421356 + 0.5) = +-1 / 1.91421356 = +-0.52240775
    close(std_normalised(t([1, 3]), eps=0.5), [-0.5224077499, 0.5224077499], atol=1e-6)


def test_rloo_hand_computed():
    # R = [1, 2, 3, 6]; mean of the others: 11/3, 10/3, 9/3, 6/3
    # A = 1 - 11/3, 2 - 10/3, 3 - 3, 6 - 2 = -8/3, -4/3, 0, 4
    close(leave_one_out(t([1, 2, 3, 6])), [-8 / 3, -4 / 3, 0.0, 4.0])
    # G = 2: A = R_g - R_other: [1, 3] -> [-2, 2]
    close(leave_one_out(t([1, 3])), [-2, 2])


def test_none_is_the_raw_return_and_a_copy():
    returns = t([1, 2, 3, 6])
    out = no_baseline(returns)
    close(out, [1, 2, 3, 6])
    out += 100
    close(returns, [1, 2, 3, 6])  # the caller's returns are not modified through the advantage


def test_max_baseline_is_the_best_of_the_other_returns():
    # R = [1, 2, 4, 3]: best of the others is 4, 4, 3 (the runner-up, for the best sample itself), 4
    # A = 1 - 4, 2 - 4, 4 - 3, 3 - 4 = -3, -2, 1, -1: only the sample that beats every sibling goes up
    close(best_of_others(t([1, 2, 4, 3])), [-3, -2, 1, -1])
    # CoMLRL's R - max(R) (its own sample counted) would give [-3, -2, 0, -1]: the best sample never goes up.
    # G = 2: A = R_g - R_other, as RLOO: [1, 3] -> [-2, 2]
    close(best_of_others(t([1, 3])), [-2, 2])
    # each row is its own group: [5, 0, 2] -> best of the others 2, 5, 5 -> [3, -5, -3]
    close(best_of_others(t([[1, 2, 4, 3], [5, 0, 2, 2]])), [[-3, -2, 1, -1], [3, -5, -3, -3]])


def test_max_baseline_ties_for_the_best_get_zero():
    # R = [4, 4, 1]: each 4's best other is the other 4 -> 0; the 1's is 4 -> -3
    close(best_of_others(t([4, 4, 1])), [0, 0, -3])
    close(best_of_others(t([2, 2])), [0, 0])


def test_max_baseline_needs_two_returns():
    with pytest.raises(ValueError, match="at least 2 returns"):
        best_of_others(t([[3.0]]))


@pytest.mark.parametrize(("mode", "expected"), [
    ("mean", [[-2, -1, 3], [-1, -1, 2]]),            # R - 3 ; R - 1
    ("rloo", [[-3, -1.5, 4.5], [-1.5, -1.5, 3]]),    # 3/2 times the mean baseline's
    ("none", [[1, 2, 6], [0, 0, 3]]),
    ("max", [[-5, -4, 4], [-3, -3, 3]]),             # R - best of the others: 1 - 6, 2 - 6, 6 - 2 ; 0 - 3, 0 - 3, 3 - 0
])
def test_sample_advantages_aligned_groups_the_joint_actions_of_each_point(mode, expected):
    # (E=2, M=G=3) aligned: a group is the 3 joint actions of one expansion point, and every agent's
    # sample g is joint action g. Point 0: returns [1, 2, 6] (mean 3); point 1: [0, 0, 3] (mean 1).
    returns = t([[1, 2, 6], [0, 0, 3]])
    combos = joint_action_combos(2, 3, "aligned")
    for agent in range(2):
        close(sample_advantages(returns, combos, agent, 3, mode), expected)


def test_sample_advantages_unknown_mode():
    with pytest.raises(ValueError, match=r"algorithm\.advantage: unknown advantage estimator .median.; "
                                         r"registered: mean, std, rloo, none, max"):
        sample_advantages(torch.zeros(1, 2), joint_action_combos(2, 2, "aligned"), 0, 2, "median")


# --------------------------------------------------------------------------------------------------
# returns over the tree
# --------------------------------------------------------------------------------------------------


def test_tree_returns_one_turn_is_the_reward():
    rewards = t([[[1.0], [2.0]], [[0.5], [0.0]]])
    out = tree_returns([rewards], [torch.arange(2)], discount=0.7)
    assert len(out) == 1
    close(out[0], rewards.tolist())
    assert out[0].data_ptr() != rewards.data_ptr()


@pytest.mark.parametrize(
    ("discount", "expected_turn1"),
    [
        # children means: node (item0, g0) 4, (item0, g1) 2, (item1, g0) 2, (item1, g1) 3
        # gamma = 1  : [[1+4, 2+2], [0+2, 1+3]]
        (1.0, [[5, 4], [2, 4]]),
        # gamma = 0.5: [[1+2, 2+1], [0+1, 1+1.5]]
        (0.5, [[3, 3], [1, 2.5]]),
    ],
)
def test_tree_returns_two_aligned_turns(discount, expected_turn1):
    # 2 items, G = 2 aligned: turn 1 has E=2 points x M=2 joint actions; each of the 4 joint actions
    # grows a node with G=2 children at turn 2 (flat parent index e * M + m).
    turn1 = t([[[1], [2]], [[0], [1]]])
    turn2 = t([[[3], [5]], [[0], [4]], [[2], [2]], [[6], [0]]])
    out = tree_returns([turn1, turn2], [torch.arange(2), torch.tensor([0, 1, 2, 3])], discount)
    close(out[0].squeeze(-1), expected_turn1)
    close(out[1], turn2.tolist())  # leaves: R = r
    close(turn1.squeeze(-1), [[1, 2], [0, 1]])  # inputs untouched


def test_tree_returns_early_termination_makes_the_stopped_joint_actions_absorbing():
    # Two turns, gamma = 0.5. Turn-1 joint actions (item0, g0) (reward 1) and (item1, g1) (reward 3) were
    # stopped; the other two (flat indices 1 and 2) grew the expansion points of turn 2.
    turn1 = t([[[1], [2]], [[0], [3]]])
    turn2 = t([[[3], [5]], [[2], [2]]])
    stopped = [torch.tensor([[True, False], [False, True]]), torch.zeros(2, 2, dtype=torch.bool)]
    out = tree_returns([turn1, turn2], [torch.arange(2), torch.tensor([1, 2])], 0.5, stopped, num_turns=2)
    # stopped at turn 1 of 2: r * (1 + .5) -> 1.5 and 4.5 (valued as plain leaves they would keep 1 and 3)
    # expanded: flat 1 = (item0, g1): 2 + .5 * mean(3, 5) = 4; flat 2 = (item1, g0): 0 + .5 * mean(2, 2) = 1
    close(out[0].squeeze(-1), [[1.5, 4], [1, 4.5]])
    close(out[1], turn2.tolist())


def test_absorbing_factor_counts_the_reward_once_per_remaining_turn():
    assert absorbing_factor(1, 0.3) == 1.0           # the last turn: the reward itself
    assert absorbing_factor(2, 1.0) == 2.0           # 1 + 1
    assert absorbing_factor(3, 0.5) == 1.75          # 1 + 0.5 + 0.25
    assert absorbing_factor(3, 0.5, "increment") == 1.0  # progress is paid once; staying adds nothing
    with pytest.raises(ValueError, match="turns_left"):
        absorbing_factor(0, 1.0)
    with pytest.raises(ValueError, match="turn_reward: 'state' or 'increment'"):
        absorbing_factor(2, 1.0, "sparse")


def test_a_stopped_increment_is_worth_its_progress_never_more_than_finishing():
    # One item, G = 2, gamma = 1, three turns, shaped progress rewards (increments) that add up to at most 1.
    # Joint action 0 builds half (0.5) and stops at turn 1; joint action 1 builds half too, then the other half
    # at turn 2 (0.5 each child), and nothing at turn 3 (the node of turn-2 flat 0 grew; flat 1 stopped at 0.5).
    turn1 = t([[[0.5], [0.5]]])
    turn2 = t([[[0.5], [0.5]]])
    turn3 = t([[[0.0], [0.0]]])
    stopped = [torch.tensor([[True, False]]), torch.tensor([[False, True]]), torch.zeros(1, 2, dtype=torch.bool)]
    parents = [torch.arange(1), torch.tensor([1]), torch.tensor([0])]
    increments = tree_returns([turn1, turn2, turn3], parents, 1.0, stopped, 3, turn_reward="increment")
    # the half-built stop: 0.5; the finished episode: 0.5 + mean(0.5 + 0, 0.5) = 1.0 (= max_reward)
    close(increments[0].squeeze(-1), [[0.5, 1.0]])
    close(increments[1].squeeze(-1), [[0.5, 0.5]])
    # Read as state values the same numbers repeat: the half-built stop 0.5 * 3 = 1.5, above finishing.
    states = tree_returns([turn1, turn2, turn3], parents, 1.0, stopped, 3)
    close(states[0].squeeze(-1), [[1.5, 0.5 + (0.5 + 0.5 * 2) / 2]])


def _issue_example():
    # Issue #22: G = 4, gamma = 1, two turns, turn-1 rewards [4, 2, 1, 3]; the 4 met the threshold (3.8)
    # and was not expanded. The other three grew a node each (flat indices 1, 2, 3) whose 4 children
    # have mean rewards 2.5, 1.25 and 3.5.
    turn1 = t([[[4], [2], [1], [3]]])
    turn2 = t([[[2], [3], [2], [3]], [[1], [1.5], [1], [1.5]], [[3], [4], [3], [4]]])
    parents = [torch.arange(1), torch.tensor([1, 2, 3])]
    stopped = [torch.tensor([[True, False, False, False]]), torch.zeros(3, 4, dtype=torch.bool)]
    return [turn1, turn2], parents, stopped


def test_issue_example_a_stopped_leaf_valued_as_r_pushes_the_solved_action_down():
    rewards, parents, _ = _issue_example()
    old = tree_returns(rewards, parents, 1.0)  # the stopped joint action as a plain leaf, R = r
    # R = [4, 2 + 2.5, 1 + 1.25, 3 + 3.5] = [4, 4.5, 2.25, 6.5], mean 4.3125
    close(old[0].squeeze(-1), [[4, 4.5, 2.25, 6.5]])
    advantages = mean_baseline(old[0].squeeze(-1))
    close(advantages, [[-0.3125, 0.1875, -2.0625, 2.1875]])  # the issue's [-0.31, 0.19, -2.06, 2.19]
    assert advantages[0, 0] < 0


def test_issue_example_a_stopped_joint_action_is_absorbing_and_gets_the_highest_advantage():
    rewards, parents, stopped = _issue_example()
    new = tree_returns(rewards, parents, 1.0, stopped, num_turns=2)
    # stopped at turn 1 of 2: R = 4 * (1 + 1) = 8 ; the others unchanged: [8, 4.5, 2.25, 6.5], mean 5.3125
    close(new[0].squeeze(-1), [[8, 4.5, 2.25, 6.5]])
    advantages = mean_baseline(new[0].squeeze(-1))
    close(advantages, [[2.6875, -0.8125, -3.0625, 1.1875]])
    assert int(advantages.argmax()) == 0
    close(new[1], rewards[1].tolist())  # the last turn's joint actions are ordinary leaves


def test_stopping_early_is_worth_exactly_continuing_at_the_same_reward():
    # One item, G = 2, gamma = 0.5, three turns. Joint action 0 reaches reward 2 and stops at turn 1;
    # joint action 1 also earns 2 and goes on earning 2 on every later turn.
    turn1 = t([[[2], [2]]])
    turn2 = t([[[2], [2]]])               # the node grown from flat 1
    turn3 = t([[[2], [2]], [[2], [2]]])   # nodes grown from turn-2 flat 0 and 1
    stopped = [torch.tensor([[True, False]]), torch.zeros(1, 2, dtype=torch.bool), torch.zeros(2, 2, dtype=torch.bool)]
    out = tree_returns([turn1, turn2, turn3], [torch.arange(1), torch.tensor([1]), torch.tensor([0, 1])], 0.5,
                       stopped, num_turns=3)
    # continuing: turn 3 R = 2 ; turn 2 R = 2 + .5 * 2 = 3 ; turn 1 R = 2 + .5 * 3 = 3.5
    # stopped at turn 1: 2 * (1 + .5 + .25) = 3.5 -> the same, so the advantages are 0
    close(out[0].squeeze(-1), [[3.5, 3.5]])
    close(mean_baseline(out[0].squeeze(-1)), [[0.0, 0.0]])


def test_a_joint_action_stopped_at_turn_2_of_3_keeps_its_reward_for_two_turns():
    # One item, G = 2, gamma = 0.5: turn-2 joint action 1 (reward 4) stopped; both channels scaled alike.
    turn1 = t([[[0, 0], [1, 1]]])
    turn2 = t([[[1, 0], [4, 2]]])  # grown from turn-1 flat 0; flat 1 of turn 1 is a plain leaf of the tree
    turn3 = t([[[2, 2], [0, 0]]])  # grown from turn-2 flat 0
    stopped = [torch.zeros(1, 2, dtype=torch.bool), torch.tensor([[False, True]]), torch.zeros(1, 2, dtype=torch.bool)]
    out = tree_returns([turn1, turn2, turn3], [torch.arange(1), torch.tensor([0]), torch.tensor([0])], 0.5,
                       stopped, num_turns=3)
    # turn 2: flat 0: 1 + .5 * mean(2, 0) = 1.5 (channel 1: 0 + .5 * 1 = 0.5) ; flat 1: 4 * 1.5 = 6 (2 * 1.5 = 3)
    close(out[1], [[[1.5, 0.5], [6, 3]]])
    # turn 1: flat 0: 0 + .5 * mean(1.5, 6) = 1.875 (0 + .5 * mean(.5, 3) = 0.875) ; flat 1: not stopped, R = r
    close(out[0], [[[1.875, 0.875], [1, 1]]])


def test_tree_returns_values_stopped_actions_to_the_horizon_when_the_tree_ends_early():
    # Every turn-1 joint action stopped: the tree has one turn, the horizon is 3, gamma = 1.
    out = tree_returns([t([[[1], [3]]])], [torch.arange(1)], 1.0, [torch.tensor([[True, True]])], num_turns=3)
    close(out[0].squeeze(-1), [[3, 9]])


def test_tree_returns_rejects_inconsistent_termination():
    turn1, turn2 = t([[[1], [2]]]), t([[[3], [5]]])
    parents = [torch.arange(1), torch.tensor([0])]
    no_stop = [torch.zeros(1, 2, dtype=torch.bool), torch.zeros(1, 2, dtype=torch.bool)]
    with pytest.raises(ValueError, match="num_turns"):
        tree_returns([turn1, turn2], parents, 1.0, no_stop, num_turns=1)
    with pytest.raises(ValueError, match="terminated: one mask per turn"):
        tree_returns([turn1, turn2], parents, 1.0, no_stop[:1], num_turns=2)
    with pytest.raises(ValueError, match=r"terminated\[0\]: shape"):
        tree_returns([turn1, turn2], parents, 1.0, [torch.zeros(2, 1, dtype=torch.bool), no_stop[1]], num_turns=2)
    with pytest.raises(ValueError, match="stopped joint action has children"):
        tree_returns([turn1, turn2], parents, 1.0, [torch.tensor([[True, False]]), no_stop[1]], num_turns=2)


def test_tree_returns_three_turns_propagates_returns_not_rewards():
    # one item, G = 2, gamma = 0.5
    turn1 = t([[[1], [0]]])
    turn2 = t([[[0], [0]], [[1], [1]]])                       # parents: turn-1 flat 0, 1
    turn3 = t([[[2], [4]], [[0], [0]], [[1], [1]], [[0], [2]]])  # parents: turn-2 flat 0..3
    out = tree_returns([turn1, turn2, turn3],
                       [torch.arange(1), torch.tensor([0, 1]), torch.tensor([0, 1, 2, 3])], 0.5)
    # turn 2: 0 + .5 * 3 = 1.5 ; 0 + .5 * 0 = 0 ; 1 + .5 * 1 = 1.5 ; 1 + .5 * 1 = 1.5
    close(out[1].squeeze(-1), [[1.5, 0.0], [1.5, 1.5]])
    # turn 1: 1 + .5 * mean(1.5, 0) = 1.375 ; 0 + .5 * mean(1.5, 1.5) = 0.75
    close(out[0].squeeze(-1), [[1.375, 0.75]])


def test_tree_returns_two_reward_channels():
    # K = 2 (individual learners): each channel is backed up on its own.
    turn1 = t([[[1, 0], [0, 1]]])
    turn2 = t([[[1, 2], [3, 4]], [[0, 0], [2, 6]]])
    out = tree_returns([turn1, turn2], [torch.arange(1), torch.tensor([0, 1])], 1.0)
    # node 0 children means: [2, 3] ; node 1: [1, 3]
    close(out[0], [[[3, 3], [1, 4]]])


# --------------------------------------------------------------------------------------------------
# joint actions
# --------------------------------------------------------------------------------------------------


def test_joint_action_combos_aligned():
    assert joint_action_combos(2, 3, "aligned").tolist() == [[0, 0], [1, 1], [2, 2]]
    assert joint_action_combos(3, 2, "aligned").tolist() == [[0, 0, 0], [1, 1, 1]]


def test_joint_action_combos_cross_order():
    assert joint_action_combos(2, 3, "cross").tolist() == [
        [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2], [2, 0], [2, 1], [2, 2],
    ]
    assert joint_action_combos(3, 2, "cross").tolist() == [
        [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1], [1, 0, 0], [1, 0, 1], [1, 1, 0], [1, 1, 1],
    ]


def test_joint_action_combos_unknown_mode():
    with pytest.raises(ValueError, match="joint_mode"):
        joint_action_combos(2, 2, "pairwise")


def test_agent_advantages_aligned_is_identity():
    joint = t([[0.5, -1.0, 0.5], [3.0, 2.0, -5.0]])  # (E=2, M=G=3)
    combos = joint_action_combos(2, 3, "aligned")
    for agent in range(2):
        close(agent_advantages(joint, combos, agent, 3), joint.tolist())


def test_agent_advantages_cross_2x2():
    # combos (g0, g1): (0,0) (0,1) (1,0) (1,1) with joint advantages 4, 2, -2, -4
    joint = t([[4, 2, -2, -4]])
    combos = joint_action_combos(2, 2, "cross")
    close(agent_advantages(joint, combos, 0, 2), [[3, -3]])   # g0=0: (4+2)/2 ; g0=1: (-2-4)/2
    close(agent_advantages(joint, combos, 1, 2), [[1, -1]])   # g1=0: (4-2)/2 ; g1=1: (2-4)/2


def test_agent_advantages_cross_3x3_two_points():
    # point 0: joint advantage of (g0, g1) = matrix [[-4,-3,-2],[-1,0,1],[2,3,4]] (row g0, column g1)
    # point 1: matrix [[1,0,0],[0,0,0],[0,0,-1]]
    joint = t([[-4, -3, -2, -1, 0, 1, 2, 3, 4], [1, 0, 0, 0, 0, 0, 0, 0, -1]])
    combos = joint_action_combos(2, 3, "cross")
    # agent 0 = row means ; agent 1 = column means
    close(agent_advantages(joint, combos, 0, 3), [[-3, 0, 3], [1 / 3, 0, -1 / 3]])
    close(agent_advantages(joint, combos, 1, 3), [[-1, 0, 1], [1 / 3, 0, -1 / 3]])


# --------------------------------------------------------------------------------------------------
# end to end through magrpo.advantages on a hand-built rollout tree
# --------------------------------------------------------------------------------------------------


def make_turn(rewards, parents, combos, num_agents: int, num_samples: int, terminated=None) -> Turn:
    rewards = t(rewards)
    points = rewards.shape[0]
    generations = [SimpleNamespace(completion_ids=torch.zeros(points * num_samples, 3, dtype=torch.long),
                                   texts=[""] * (points * num_samples)) for _ in range(num_agents)]
    return Turn(
        parents=torch.tensor(parents),
        items=[{"id": str(e)} for e in range(points)],
        histories=[() for _ in range(points)],
        observations=[["obs"] * num_agents for _ in range(points)],
        generations=generations,
        combos=combos,
        results=[RewardResult(float(r)) for r in rewards[..., 0].reshape(-1)],
        rewards=rewards,
        terminated=torch.zeros(rewards.shape[:2], dtype=torch.bool) if terminated is None else torch.tensor(terminated),
    )


def run_advantages(turns, num_agents: int, **config):
    tree = RolloutTree(turns=turns)
    per_agent, returns = magrpo.advantages(tree, num_agents, AlgorithmConfig(**config))
    assert len(per_agent) == num_agents
    assert all(len(per_turn) == len(turns) for per_turn in per_agent)
    return per_agent, returns


def test_end_to_end_aligned_one_turn_mean():
    # 2 items, G = 3, 2 agents aligned. item 0 rewards [1, 2, 6] (mean 3); item 1 [0, 0, 3] (mean 1).
    combos = joint_action_combos(2, 3, "aligned")
    turn = make_turn([[[1], [2], [6]], [[0], [0], [3]]], [0, 1], combos, 2, 3)
    per_agent, returns = run_advantages([turn], 2, num_generations=3, joint_mode="aligned", advantage="mean")
    for agent in range(2):  # centralised: both agents get the same A_g for their g-th completion
        close(per_agent[agent][0], [-2, -1, 3, -1, -1, 2])
    close(returns[0].squeeze(-1), [[1, 2, 6], [0, 0, 3]])


@pytest.mark.parametrize(("name", "expected"), [
    ("magrpo", [-2, -1, 3]),           # R - mean = R - 3
    ("mareinforce", [1, 2, 6]),        # the raw return
    ("marloo", [-3, -1.5, 4.5]),       # R - mean of the others: 1 - 4, 2 - 3.5, 6 - 1.5
    ("maremax", [-5, -4, 4]),          # R - best of the others: 1 - 6, 2 - 6, 6 - 2
])
def test_end_to_end_each_algorithm_name_uses_its_estimator(name, expected):
    # 1 item, G = 3, 2 agents aligned, rewards [1, 2, 6]; every agent's g-th completion gets A_g.
    turn = make_turn([[[1], [2], [6]]], [0], joint_action_combos(2, 3, "aligned"), 2, 3)
    per_agent, _ = run_advantages([turn], 2, name=name, num_generations=3)
    for agent in range(2):
        close(per_agent[agent][0], expected)


def test_end_to_end_aligned_one_turn_std():
    # one item, G = 2: rewards [1, 3] -> +-1 / (sqrt(2) + 1e-4)
    combos = joint_action_combos(2, 2, "aligned")
    turn = make_turn([[[1], [3]]], [0], combos, 2, 2)
    per_agent, _ = run_advantages([turn], 2, num_generations=2, advantage="std")
    for agent in range(2):
        close(per_agent[agent][0], [-0.7070567847, 0.7070567847], atol=1e-6)


@pytest.mark.parametrize(
    ("mode", "agent0", "agent1"),
    [
        # rewards (g0, g1): (0,0)=5 (0,1)=3 (1,0)=1 (1,1)=-1, mean 2 -> joint A = [3, 1, -1, -3]
        # agent 0: [(3+1)/2, (-1-3)/2] = [2, -2] ; agent 1: [(3-1)/2, (1-3)/2] = [1, -1]
        ("mean", [2, -2], [1, -1]),
        # std: the same over the joint actions' spread: unbiased std of [5, 3, 1, -1] = sqrt(20/3) = 2.58198890
        # -> agent 0: +-2 / (2.58198890 + 1e-4) = +-0.77456667 ; agent 1: +-1 / 2.58208890 = +-0.38728334
        ("std", [0.7745666704, -0.7745666704], [0.3872833352, -0.3872833352]),
        # rloo leaves the sample out, so over each agent's samples, valued by their mean return over the partner's:
        # agent 0: [(5+3)/2, (1-1)/2] = [4, 0] -> [4 - 0, 0 - 4] ; agent 1: [(5+1)/2, (3-1)/2] = [3, 1] -> [2, -2]
        # (rloo over the M = 4 joint actions, 4/3 * [3, 1, -1, -3], would give agent 0 [8/3, -8/3]: the other
        # joint action of its own sample in the baseline shrinks it)
        ("rloo", [4, -4], [2, -2]),
        # max: likewise; G = 2, so the best of the other samples is the other one, as rloo
        ("max", [4, -4], [2, -2]),
        # none: joint A = [5, 3, 1, -1] -> agent 0: [4, 0] ; agent 1: [3, 1]
        ("none", [4, 0], [3, 1]),
    ],
)
def test_end_to_end_cross_one_turn(mode, agent0, agent1):
    combos = joint_action_combos(2, 2, "cross")
    turn = make_turn([[[5], [3], [1], [-1]]], [0], combos, 2, 2)
    per_agent, _ = run_advantages([turn], 2, num_generations=2, joint_mode="cross", advantage=mode)
    close(per_agent[0][0], agent0)
    close(per_agent[1][0], agent1)


def test_end_to_end_cross_three_agents():
    # n = 3, G = 2: reward of (g0, g1, g2) = 4 g0 + 2 g1 + g2 = 0..7 in combo order, mean 3.5
    # joint A = [-3.5, -2.5, ..., 3.5]
    # agent 0, g0 = 0: combos 0..3 -> mean(-3.5, -2.5, -1.5, -0.5) = -2 ; g0 = 1 -> +2
    # agent 1, g1 = 0: combos 0,1,4,5 -> mean(-3.5, -2.5, 0.5, 1.5) = -1 ; +1
    # agent 2, g2 = 0: combos 0,2,4,6 -> mean(-3.5, -1.5, 0.5, 2.5) = -0.5 ; +0.5
    combos = joint_action_combos(3, 2, "cross")
    turn = make_turn([[[float(r)] for r in range(8)]], [0], combos, 3, 2)
    per_agent, _ = run_advantages([turn], 3, num_generations=2, joint_mode="cross", advantage="mean")
    close(per_agent[0][0], [-2, 2])
    close(per_agent[1][0], [-1, 1])
    close(per_agent[2][0], [-0.5, 0.5])


def test_maremax_cross_gives_samples_equally_good_over_their_partners_the_same_advantage():
    # G = 2, n = 2; reward of (agent 0's sample, agent 1's sample): (0,0)=1 (0,1)=0 (1,0)=2 (1,1)=3.
    # Agent 1's samples are worth (1+2)/2 = 1.5 and (0+3)/2 = 1.5 over agent 0's: equally good, advantage 0
    # each (R - the best of the other joint actions, averaged, gave them -1.5 and -1: the best joint action
    # (1,1) counted against sample 0 and, through the runner-up, for sample 1). Agent 0's: 0.5 and 2.5 ->
    # 0.5 - 2.5 and 2.5 - 0.5.
    turn = make_turn([[[1], [0], [2], [3]]], [0], joint_action_combos(2, 2, "cross"), 2, 2)
    per_agent, _ = run_advantages([turn], 2, name="maremax", num_generations=2, joint_mode="cross")
    close(per_agent[0][0], [-2, 2])
    close(per_agent[1][0], [0, 0])


@pytest.mark.parametrize(("mode", "agent0", "agent1"), [
    # Returns R[g0][g1] = [[0, 3, 0], [6, 0, 0], [0, 0, 3]]. Each sample's mean return over the partner's 3:
    # agent 0 (rows) [1, 2, 1], agent 1 (columns) [2, 1, 1].
    # max: minus the best of the agent's other samples: agent 0 [1 - 2, 2 - 1, 1 - 2]; agent 1 [2 - 1, 1 - 2, 1 - 2]
    ("max", [-1, 1, -1], [1, -1, -1]),
    # rloo: minus their mean: agent 0 [1 - 1.5, 2 - 1, 1 - 1.5]; agent 1 [2 - 1, 1 - 1.5, 1 - 1.5]
    ("rloo", [-0.5, 1, -0.5], [1, -0.5, -0.5]),
])
def test_leave_the_sample_out_baselines_in_cross_mode_compare_an_agents_own_samples(mode, agent0, agent1):
    turn = make_turn([[[0], [3], [0], [6], [0], [0], [0], [0], [3]]], [0], joint_action_combos(2, 3, "cross"), 2, 3)
    per_agent, _ = run_advantages([turn], 2, num_generations=3, joint_mode="cross", advantage=mode)
    close(per_agent[0][0], agent0)
    close(per_agent[1][0], agent1)


@pytest.mark.parametrize(("num_agents", "num_samples", "num_actions"), [(2, 3, 3), (3, 3, 2)])
@pytest.mark.parametrize("mode", ["max", "rloo", "none", "mean"])
def test_cross_mode_advantages_are_unbiased_over_every_possible_draw(num_agents, num_samples, num_actions, mode):
    """A sample's advantage A_g gives an unbiased policy gradient iff, for every action a sample g may draw,
    E[A_g | sample g is a] = w Q(a) - c, with Q(a) the expected reward of a against the partners' policies
    and w, c the same for every a: E[grad log pi(a)] = 0 removes c, leaving w times the gradient of E[R].
    w = 1 for a baseline of the other samples only (rloo, max; none has none); the mean baseline counts
    the sample's own 1/G share: w = (G-1)/G. Checked exactly, over every draw of every agent's G samples
    from random policies over a few actions and a random reward table."""
    weight = (num_samples - 1) / num_samples if mode == "mean" else 1.0
    generator = torch.Generator().manual_seed(7)
    policies = torch.rand(num_agents, num_actions, generator=generator) + 0.1
    policies /= policies.sum(dim=1, keepdim=True)
    table = torch.rand((num_actions,) * num_agents, generator=generator)
    # every draw: draws[d, i, g] is the action agent i's sample g holds; each draw is one expansion point
    draws = torch.tensor(list(itertools.product(range(num_actions), repeat=num_agents * num_samples)))
    draws = draws.view(-1, num_agents, num_samples)
    probability = policies[torch.arange(num_agents).view(1, -1, 1), draws].flatten(1).prod(dim=1)  # (D,)
    combos = joint_action_combos(num_agents, num_samples, "cross")
    actions = torch.stack([draws[:, i, combos[:, i]] for i in range(num_agents)], dim=-1)  # (D, M, n)
    returns = table[tuple(actions.unbind(-1))]  # (D, M)
    for agent in range(num_agents):
        # Q(a): the table's mean over the other agents' actions, each drawn from its policy
        q = table.movedim(agent, 0)
        for other in reversed([j for j in range(num_agents) if j != agent]):
            q = q @ policies[other]
        advantages = sample_advantages(returns, combos, agent, num_samples, mode)  # (D, G)
        for g in range(num_samples):
            holds = torch.nn.functional.one_hot(draws[:, agent, g], num_actions).to(probability.dtype)  # (D, A)
            conditional = (probability * advantages[:, g]) @ holds / (probability @ holds)  # E[A_g | a], (A,)
            offset = weight * q - conditional
            torch.testing.assert_close(offset, offset.mean().expand(num_actions), atol=1e-5, rtol=0)


def _two_turn_tree():
    # one item, G = 2, 2 agents aligned. Turn 1 rewards [1, 2]; each joint action grows a node:
    # node 0 children rewards [3, 5], node 1 children rewards [0, 4].
    combos = joint_action_combos(2, 2, "aligned")
    turn1 = make_turn([[[1], [2]]], [0], combos, 2, 2)
    turn2 = make_turn([[[3], [5]], [[0], [4]]], [0, 1], combos, 2, 2)
    return [turn1, turn2]


def test_end_to_end_aligned_two_turns_mean():
    per_agent, returns = run_advantages(_two_turn_tree(), 2, num_generations=2, num_turns=2, advantage="mean")
    # R1 = [1 + 4, 2 + 2] = [5, 4] -> A1 = [0.5, -0.5]
    # turn 2 groups: [3, 5] -> [-1, 1] ; [0, 4] -> [-2, 2]
    close(returns[0].squeeze(-1), [[5, 4]])
    for agent in range(2):
        close(per_agent[agent][0], [0.5, -0.5])
        close(per_agent[agent][1], [-1, 1, -2, 2])


def test_end_to_end_aligned_two_turns_std():
    per_agent, _ = run_advantages(_two_turn_tree(), 2, num_generations=2, num_turns=2, advantage="std")
    # R1 = [5, 4]: dev +-0.5, unbiased std sqrt(0.5) -> +-0.5 / (0.70710678 + 1e-4) = +-0.70700680
    # [3, 5]: +-1 / (sqrt 2 + 1e-4) = +-0.70705678 ; [0, 4]: +-2 / (sqrt 8 + 1e-4) = +-0.70708178
    for agent in range(2):
        close(per_agent[agent][0], [0.7070067953, -0.7070067953], atol=1e-6)
        close(per_agent[agent][1], [-0.7070567847, 0.7070567847, -0.7070817821, 0.7070817821], atol=1e-6)


def test_end_to_end_aligned_two_turns_none_discounted():
    per_agent, returns = run_advantages(_two_turn_tree(), 2, num_generations=2, num_turns=2,
                                        advantage="none", discount=0.5)
    # R1 = [1 + .5 * 4, 2 + .5 * 2] = [3, 3]
    for agent in range(2):
        close(per_agent[agent][0], [3, 3])
        close(per_agent[agent][1], [3, 5, 0, 4])


def test_end_to_end_early_termination():
    # turn-1 joint action 1 (reward 2) terminated: turn 2 has one node grown from flat index 0.
    combos = joint_action_combos(2, 2, "aligned")
    turn1 = make_turn([[[1], [2]]], [0], combos, 2, 2, terminated=[[False, True]])
    turn2 = make_turn([[[3], [5]]], [0], combos, 2, 2)
    per_agent, returns = run_advantages([turn1, turn2], 2, num_generations=2, num_turns=2, advantage="rloo")
    # R1 = [1 + mean(3, 5), 2 * 2 (absorbing over both turns)] = [5, 4] -> rloo (G=2: R_g - R_other) = [1, -1]
    # turn 2: [3, 5] -> [-2, 2]
    close(returns[0].squeeze(-1), [[5, 4]])
    for agent in range(2):
        close(per_agent[agent][0], [1, -1])
        close(per_agent[agent][1], [-2, 2])


# --------------------------------------------------------------------------------------------------
# the rollout records which joint actions early termination stopped
# --------------------------------------------------------------------------------------------------


def scripted_sampler(rows_per_turn):
    """A SampleFn whose agent i writes rows_per_turn[call][i][g] as its g-th sample at every expansion point."""
    calls = iter(rows_per_turn)

    def sample(observations, num_samples, seed):
        rows = next(calls)
        points = len(observations[0])
        return [SimpleNamespace(texts=list(rows[i]) * points,
                                completion_ids=torch.zeros(points * num_samples, 1, dtype=torch.long))
                for i in range(len(observations))]

    return sample


# digit_sum, target 9, two digits: "4 5" + "5 4" sums exactly (reward 1.0); "0 0" + "0 0" earns 0.1.
EXACT = (("4 5", "0 0"), ("5 4", "0 0"))


def test_rollout_records_terminated_joint_actions_and_returns_treat_them_as_absorbing():
    env = make_env("digit_sum", targets=[9], length=2, num_train=1, num_eval=1)
    config = AlgorithmConfig(num_generations=2, num_turns=3, early_termination_threshold=1.0, advantage="mean")
    # Every turn: joint action 0 is exact (1.0, meets the threshold), joint action 1 is not (0.1).
    tree = sample_tree(scripted_sampler([EXACT] * 3), env, env.items("train"), config)
    assert [turn.terminated.tolist() for turn in tree.turns] == [[[True, False]], [[True, False]], [[False, False]]]
    assert [turn.parents.tolist() for turn in tree.turns] == [[0], [1], [1]]  # only joint action 1 grew
    per_agent, returns = magrpo.advantages(tree, 2, config)
    # turn 3 (last, ordinary leaves): [1, 0.1]
    # turn 2: stopped at turn 2 of 3 -> 1 * 2 = 2 ; continued -> 0.1 + mean(1, 0.1) = 0.65
    # turn 1: stopped at turn 1 of 3 -> 1 * 3 = 3 ; continued -> 0.1 + mean(2, 0.65) = 1.425
    close(returns[2].squeeze(-1), [[1, 0.1]])
    close(returns[1].squeeze(-1), [[2, 0.65]])
    close(returns[0].squeeze(-1), [[3, 1.425]])
    close(per_agent[0][0], [0.7875, -0.7875])  # (3 - 1.425) / 2
    metrics = rollout_metrics(tree, returns, per_agent)
    assert [metrics[f"turn{t}/terminated"] for t in (1, 2, 3)] == [1.0, 1.0, 0.0]
    assert metrics["return/turn1/mean"] == pytest.approx((3 + 1.425) / 2)


def test_rollout_that_stops_every_joint_action_values_them_to_the_horizon():
    env = make_env("digit_sum", targets=[9], length=2, num_train=1, num_eval=1)
    config = AlgorithmConfig(num_generations=2, num_turns=2, early_termination_threshold=1.0)
    both_exact = (("4 5", "4 5"), ("5 4", "5 4"))
    tree = sample_tree(scripted_sampler([both_exact]), env, env.items("train"), config)
    assert len(tree.turns) == 1 and tree.turns[0].terminated.tolist() == [[True, True]]
    _, returns = magrpo.advantages(tree, 2, config)
    close(returns[0].squeeze(-1), [[2, 2]])  # 1.0 on both turns of the horizon


def test_end_to_end_individual_learners_use_their_own_channel():
    # K = 2 channels, G = 2 aligned: channel 0 rewards [1, 3] -> [-1, 1]; channel 1 [0, 4] -> [-2, 2]
    combos = joint_action_combos(2, 2, "aligned")
    turn = make_turn([[[1, 0], [3, 4]]], [0], combos, 2, 2)
    per_agent, _ = run_advantages([turn], 2, num_generations=2, learners="individual", advantage="mean")
    close(per_agent[0][0], [-1, 1])
    close(per_agent[1][0], [-2, 2])
