"""MADPO: multi-agent direct preference optimisation, online, from each step's rollout.

A step's rollout is MAGRPO's (:func:`teamrl.rollout.tree.sample_tree`); what the agents learn from it:

1. Preferences (:func:`~teamrl.algorithms.preferences.preference_pairs`): within each group of sibling joint
   actions, pairs (a^w, a^l) whose returns differ by more than ``algorithm.preference.min_gap`` (ties give
   none); ``preference.pairs`` picks the group's best against its worst, or all such pairs. Multi-turn
   trees pair siblings at every turn by their returns; 'cross' joint actions pair like 'aligned' ones.
2. Log-ratios (:meth:`MADPO.learn`): every agent i's implicit reward of its part of each joint action,
   rho_i(a_i) = log pi_i(a_i | o_i) - log pi_ref_i(a_i | o_i), whole completions (token sums), its reference
   being its frozen start (the LoRA base with the adapter off, or the copy full fine-tuning keeps).
   Per pair, h_i = rho_i(a_i^w) - rho_i(a_i^l).
3. Loss, 'joint' coupling (default): DPO on the team's joint policy pi(a | o) = prod_i pi_i(a_i | o_i),
   whose log-ratio margin is H = sum_i h_i:

       L = -log sigma(beta * H)

   and agent i's gradient is that of L through its own h_i, the others' h_j constants of the step
   (their policies are not agent i's parameters). 'independent': each agent on its own margin alone,
   L_i = -log sigma(beta * h_i), as if its part alone explained the team's preference.
   Agent i's update minimises ``dpo`` (:func:`~teamrl.algorithms.losses.dpo_loss`) on its (preferred,
   rejected) rows, each pair carrying the offset of its margin that does not depend on agent i's weights:
   -(log pi_ref_i(a_i^w) - log pi_ref_i(a_i^l)), plus sum_{j != i} h_j under 'joint' coupling. Its
   ``num_iterations`` passes re-evaluate its own log-probs each time; the offsets stay those of the step.

CoMLRL 1.4.3's MADPO couples the agents the same way (the others' deltas detached) but drops the reference:
its "DPO" is -log sigma(beta * sum_i (log pi_i(a_i^w) - log pi_i(a_i^l))), with no pi_ref term, so nothing
keeps a policy near its start. It also builds its preferences once, offline, from the initial policy, and
ends each completion at the first pad token; docs/reports/comlrl-algorithms.md lists the differences.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from teamrl.algorithms.advantages import rollout_metrics
from teamrl.algorithms.base import TrainsTheAgentsOnly, register_algorithm
from teamrl.algorithms.losses import sequence_logprobs
from teamrl.algorithms.magrpo import advantages
from teamrl.algorithms.preferences import preference_pairs
from teamrl.algorithms.update import UpdateStats
from teamrl.config import TrainConfig, require
from teamrl.envs.base import Environment
from teamrl.rollout.generate import Generation
from teamrl.rollout.tree import RolloutTree

if TYPE_CHECKING:
    from teamrl.algorithms.base import AgentBackend


@register_algorithm("madpo", uses_reference=True)
class MADPO(TrainsTheAgentsOnly):
    """The learning half of a MADPO step (:class:`~teamrl.algorithms.base.Algorithm`): preference pairs of the
    rollout's joint actions, then every agent's DPO update through its backend."""

    #: DPO's loss on pairs replaces advantages: an estimator, its scaling and the critic's and reward model's
    #: settings are refused when set.
    ignores = ("advantage", "normalize_advantages", "critic", "reward_model")

    @staticmethod
    def check_config(config: TrainConfig) -> None:
        """What MADPO cannot run with (called when a config loads)."""
        algorithm = config.algorithm
        require(algorithm.learners == "joint", "algorithm.learners",
                "must be 'joint' with madpo: its preferences compare joint rewards", algorithm.learners)
        require(algorithm.kl_coef == 0, "algorithm.kl_coef",
                "must be 0 with madpo: DPO's beta already keeps each agent near its reference", algorithm.kl_coef)
        require(algorithm.logprob_aggregation == "token_sum", "algorithm.logprob_aggregation",
                "must be 'token_sum' with madpo: DPO compares whole completions' log-probs",
                algorithm.logprob_aggregation)

    def __init__(self, config: TrainConfig, env: Environment, agents: AgentBackend):
        self.config = config.algorithm

    def learn(self, tree: RolloutTree, agents: AgentBackend, seeds: Sequence[int]) -> dict[str, float]:
        config, num_agents = self.config, len(agents.names)
        per_agent, returns = advantages(tree, num_agents, config)  # the advantages only for rollout_metrics
        metrics = rollout_metrics(tree, returns, per_agent)
        pairs = {t: preference_pairs(turn_returns[..., 0], config.preference.pairs, config.preference.min_gap)
                 for t, turn_returns in enumerate(returns)}
        pairs = {t: turn_pairs for t, turn_pairs in pairs.items() if len(turn_pairs)}
        metrics["preference/pairs"] = float(sum(len(p) for p in pairs.values()))
        if not pairs:  # every group tied: no preference to learn from
            metrics.update({f"{name}/{key}": value for name in agents.names for key, value in
                            UpdateStats(1).result().items()})
            return metrics
        generations: list[list[Generation]] = [[] for _ in range(num_agents)]
        offsets: list[list[torch.Tensor]] = [[] for _ in range(num_agents)]
        margins = []
        for t, turn_pairs in pairs.items():
            turn = tree.turns[t]
            rows = [pair_rows(turn_pairs, turn.combos, i, config.num_generations) for i in range(num_agents)]
            policy = team_sequence_logprobs(turn.generations, agents.logprobs(turn.generations))
            reference = team_sequence_logprobs(turn.generations, agents.logprobs(turn.generations, reference=True))
            # h_i per pair: agent i's log-ratio of its preferred part minus that of its rejected part
            ratios = [p - r for p, r in zip(policy, reference)]
            h = torch.stack([ratio[won] - ratio[lost] for ratio, (won, lost) in zip(ratios, rows)])  # (n, P)
            margins.append(h)
            for i, (won, lost) in enumerate(rows):
                offset = reference[i][lost] - reference[i][won]
                if config.dpo.coupling == "joint":
                    offset = offset + h.sum(dim=0) - h[i]
                generations[i].append(paired_generation(turn.generations[i], won, lost))
                offsets[i].append(offset.repeat_interleave(2))  # the pair's offset in both of its rows
        metrics.update(dpo_metrics(torch.cat(margins, dim=1), config.dpo.beta, config.dpo.coupling))
        for name, stats in zip(agents.names, agents.update(generations, offsets, seeds, loss="dpo")):
            metrics.update({f"{name}/{key}": value for key, value in stats.items()})
        return metrics



def pair_rows(pairs: torch.Tensor, combos: torch.Tensor, agent: int,
              num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``agent``'s generation (G consecutive rows per group) holding its part of each pair's
    preferred and rejected joint action; ``pairs``: (P, 3) (group, preferred, rejected) joint-action indices."""
    group = pairs[:, 0] * num_samples
    return group + combos[pairs[:, 1], agent], group + combos[pairs[:, 2], agent]


def team_sequence_logprobs(generations: Sequence[Generation],
                           token_logprobs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per agent, the (B,) log-prob of each of its whole completions (from its tokens'), on the CPU."""
    return [sequence_logprobs(lp, gen.completion_mask.to(lp.device)).float().cpu()
            for gen, lp in zip(generations, token_logprobs)]


def paired_generation(gen: Generation, preferred: torch.Tensor, rejected: torch.Tensor) -> Generation:
    """``gen``'s rows as (preferred, rejected) pairs: rows preferred[0], rejected[0], preferred[1], ..."""
    order = torch.stack([preferred, rejected], dim=1).reshape(-1)
    index = order.to(gen.completion_ids.device)
    return Generation(gen.prompt_ids[index], gen.prompt_mask[index], gen.completion_ids[index],
                      gen.completion_mask[index], gen.sampling_logprobs[index], [gen.texts[r] for r in order.tolist()])


def dpo_metrics(margins: torch.Tensor, beta: float, coupling: str) -> dict[str, float]:
    """The step's DPO loss, accuracy and reward margin before the update, from the (n, P) per-agent log-ratio
    margins h_i of its pairs: 'joint' on H = sum_i h_i, 'independent' averaged over the agents' own h_i."""
    team = margins.sum(dim=0, keepdim=True) if coupling == "joint" else margins
    return {
        "dpo/loss": float(-F.logsigmoid(beta * team).mean()),
        "dpo/accuracy": float((team > 0).float().mean()),  # pairs whose implicit reward already prefers a^w
        "dpo/reward_margin": float(beta * margins.sum(dim=0).mean()),  # beta * H: the joint implicit reward margin
    }
