"""MARLHF: multi-agent RL from a joint reward model learned from preferences between joint actions.

A step's rollout is MAGRPO's (:func:`teamrl.rollout.tree.sample_tree`); what is learned from it:

1. Preferences (:func:`~teamrl.algorithms.preferences.preference_pairs`): within each group of sibling
   joint actions, pairs (a^w, a^l) whose joint rewards r differ by more than ``preference.min_gap`` (ties
   give none): the group's best against its worst, or all such pairs (``preference.pairs``). The reward
   is the only use of the environment's reward a labelled step makes: it stands for the preference
   labels a person or a judge would give.
2. Reward model (:class:`RewardModel`): a scalar head on a causal LM's decoder, reading one text per joint
   action — every agent's observation and completion — at its last token: s_phi(o, a). It learns the
   Bradley-Terry likelihood of the pairs, P(a^w > a^l) = sigma(s_phi(o, a^w) - s_phi(o, a^l)), by minimising
   (:func:`~teamrl.algorithms.preferences.bradley_terry_loss`)

       L_RM = -mean_pairs log sigma(s_phi(o, a^w) - s_phi(o, a^l))

   with ``reward_model.epochs`` AdamW steps per labelled step (:meth:`MARLHF.train_reward_model`).
3. Phases: the first ``reward_model.steps`` steps label their rollout and train the reward model only
   (the agents do not move: their rollouts are the preference data of the policy RL starts from). Every
   later step trains the agents with MAGRPO (returns, Eq. 1's advantages, Eq. 2's update) on the learned
   reward r = s_phi(o, a) of every joint action in place of the environment's; every
   ``reward_model.refresh_every``-th of them (0: none) first labels its rollout and trains the reward
   model on it too (iterative preference refresh, as CoMLRL has), following the agents' distribution.

Every step logs the reward model's pairwise accuracy on the step's pairs *before* it trains on them
(``reward_model/accuracy``): on the steps it does not train on, it is its accuracy on unseen preferences.
The environment's reward keeps being logged as ``reward/*``, the learned reward's returns as ``return/*``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from teamrl.algorithms.advantages import rollout_metrics
from teamrl.algorithms.base import register_algorithm
from teamrl.algorithms.magrpo import MAGRPO, advantages
from teamrl.algorithms.preferences import bradley_terry_loss, pairwise_accuracy, preference_pairs
from teamrl.algorithms.update import UpdateStats, clip_gradients, micro_batches
from teamrl.checkpoint import AgentState
from teamrl.config import RewardModelConfig, TrainConfig, require
from teamrl.envs.base import Environment
from teamrl.rollout.tree import RolloutTree
from teamrl.team import load_base_model

if TYPE_CHECKING:
    from teamrl.algorithms.base import AgentBackend

#: The reward model's name in checkpoints (no agent may have it).
REWARD_MODEL = "reward_model"


class RewardModel(nn.Module):
    """s_phi(o, a): a causal LM's decoder (its own copy, all of it trained) and a linear head on the hidden
    state of a joint action's text at its last token."""

    def __init__(self, decoder: nn.Module, tokenizer, hidden_size: int):
        super().__init__()
        self.decoder = decoder
        self.head = nn.Linear(hidden_size, 1)
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "left"  # every text's last token at the last position

    @classmethod
    def from_config(cls, config: TrainConfig, env: Environment) -> RewardModel:
        """The model ``algorithm.reward_model.model`` names (default ``team.model``), on the team's device (the
        CPU under Ray: it lives in the driver)."""
        team = config.team
        device = "cpu" if config.distributed.backend == "ray" else team.device
        base, tokenizer = load_base_model(config.algorithm.reward_model.model or team.model, env, seed=config.seed,
                                          dtype=getattr(torch, team.dtype), device=device,
                                          onednn_linear=team.onednn_linear, trained_whole=True)
        model = cls(base.get_decoder(), tokenizer, base.config.hidden_size)
        return model.to(device).requires_grad_(True).eval()  # eval: no dropout, so scoring twice agrees

    def forward(self, texts: Sequence[str]) -> torch.Tensor:
        """(B,) the score of each text."""
        device = self.head.weight.device
        encoded = self.tokenizer(list(texts), return_tensors="pt", padding=True).to(device)
        mask = encoded["attention_mask"]
        hidden = self.decoder(input_ids=encoded["input_ids"], attention_mask=mask,
                              position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0)).last_hidden_state
        return self.head(hidden[:, -1].to(self.head.weight.dtype)).squeeze(-1).float()


def labels(step: int, settings: RewardModelConfig) -> bool:
    """Whether ``step`` (0-based) labels its rollout's preferences and trains the reward model on them: each of
    the first ``settings.steps``, then every ``settings.refresh_every``-th step that trains the agents."""
    rl_step = step - settings.steps + 1  # 1 at the first step that trains the agents
    return rl_step < 1 or (settings.refresh_every > 0 and rl_step % settings.refresh_every == 0)


def paired(texts: Sequence[str], preferred: torch.Tensor, rejected: torch.Tensor,
           ) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """The texts some pair (``preferred[k]``, ``rejected[k]``, indices into ``texts``) reads, in order, and
    the pairs as indices into those."""
    used = torch.unique(torch.cat([preferred, rejected]))  # sorted
    return ([texts[i] for i in used.tolist()], torch.searchsorted(used, preferred),
            torch.searchsorted(used, rejected))


def joint_action_text(observations: Sequence[str], actions: Sequence[str]) -> str:
    """What the reward model reads of one joint action: each agent's observation, then its completion."""
    return "\n".join(f"{observation}\n{action}" for observation, action in zip(observations, actions))


@register_algorithm("marlhf")
class MARLHF:
    """The learning half of a MARLHF step (:class:`~teamrl.algorithms.base.Algorithm`): the reward model's
    training on the step's preferences, then MAGRPO on its rewards (see the module's docstring)."""

    #: MAGRPO on a learned reward: the critic's and DPO's settings are refused when set.
    ignores = ("critic", "dpo")

    @staticmethod
    def check_config(config: TrainConfig) -> None:
        """What MARLHF cannot run with (called when a config loads)."""
        require(config.algorithm.learners == "joint", "algorithm.learners",
                "must be 'joint' with marlhf: its preferences compare joint rewards", config.algorithm.learners)

    def __init__(self, config: TrainConfig, env: Environment, agents: AgentBackend):
        if REWARD_MODEL in agents.names:
            raise ValueError(f"team.agents: no agent may be named {REWARD_MODEL!r} with marlhf: its checkpoints "
                             "keep the reward model under that name")
        self.config = config.algorithm
        self.reward_model = RewardModel.from_config(config, env)
        optim = config.optim
        self.optimizer = torch.optim.AdamW(self.reward_model.parameters(), lr=self.config.reward_model.lr,
                                           betas=tuple(optim.betas), weight_decay=optim.weight_decay)
        self.max_grad_norm = optim.max_grad_norm
        self.micro_batch_size = optim.micro_batch_size
        self.magrpo = MAGRPO(config, env, agents)
        self.step = 0
        """Steps learned so far (which phase a step is in)."""

    def learn(self, tree: RolloutTree, agents: AgentBackend, seeds: Sequence[int]) -> dict[str, float]:
        texts, preferred, rejected = [], [], []
        for turn in tree.turns:
            num_joint = len(turn.combos)
            pairs = preference_pairs(turn.rewards[..., 0], self.config.preference.pairs,
                                     self.config.preference.min_gap)
            first = len(texts) + pairs[:, 0] * num_joint  # index of the group's first joint action's text
            preferred.append(first + pairs[:, 1])
            rejected.append(first + pairs[:, 2])
            texts += [joint_action_text(turn.observations[e], turn.joint_action(e, m))
                      for e in range(len(turn.parents)) for m in range(num_joint)]
        preferred, rejected = torch.cat(preferred), torch.cat(rejected)
        labelled = labels(self.step, self.config.reward_model)
        collecting = self.step < self.config.reward_model.steps  # the agents wait
        # The reward model reads long texts, so it scores only what the step uses: the texts in a pair for
        # its accuracy and training, every text only for the rewards of a step that trains the agents.
        paired_texts, paired_w, paired_l = paired(texts, preferred, rejected)
        scores = None if labelled or collecting else self.scores(texts)
        if scores is None:
            before = self.scores(paired_texts)
            chosen, beaten = before[paired_w], before[paired_l]
        else:
            chosen, beaten = scores[preferred], scores[rejected]
        metrics = {
            "reward_model/pairs": float(len(preferred)),
            "reward_model/accuracy": pairwise_accuracy(chosen, beaten),
            "reward_model/loss": float(bradley_terry_loss(chosen, beaten)),
            "reward_model/trained": float(labelled),
        }
        if labelled and len(preferred):
            self.train_reward_model(paired_texts, paired_w, paired_l)
        if collecting:
            per_agent, returns = advantages(tree, len(agents.names), self.config)
            metrics.update(rollout_metrics(tree, returns, per_agent))
            metrics.update({f"{name}/{key}": value for name in agents.names for key, value in
                            UpdateStats(1).result().items()})
        else:
            scores = self.scores(texts) if scores is None else scores
            learned, start = dataclasses.replace(tree, turns=[]), 0
            for turn in tree.turns:
                size = turn.rewards.shape[0] * turn.rewards.shape[1]
                rewards = scores[start:start + size].view(*turn.rewards.shape[:2], 1)
                learned.turns.append(dataclasses.replace(turn, rewards=rewards))
                start += size
            metrics.update(self.magrpo.learn(learned, agents, seeds))
            metrics["reward_model/score_mean"] = float(scores.mean())
        self.step += 1
        return metrics

    def scores(self, texts: Sequence[str]) -> torch.Tensor:
        """(N,) the reward model's score of each text, without gradients, ``optim.micro_batch_size`` at a time."""
        with torch.no_grad():
            return torch.cat([torch.empty(0), *(self.reward_model(texts[start:stop]).cpu()
                                                for start, stop in micro_batches(len(texts), self.micro_batch_size))])

    def train_reward_model(self, texts: Sequence[str], preferred: torch.Tensor, rejected: torch.Tensor) -> None:
        """``reward_model.epochs`` AdamW steps on the Bradley-Terry loss of the pairs (``preferred[k]``,
        ``rejected[k]``) of ``texts``.

        The loss reads the scores alone, so its gradient is sum_k dL/ds_k * grad s_k: with the dL/ds_k of
        scores computed without gradients, each micro-batch of texts backpropagates its scores weighted by
        them — the whole loss's gradient, one micro-batch in memory at a time.
        """
        for _ in range(self.config.reward_model.epochs):
            scores = self.scores(texts).requires_grad_()
            (weights,) = torch.autograd.grad(bradley_terry_loss(scores[preferred], scores[rejected]), scores)
            self.optimizer.zero_grad(set_to_none=True)
            for start, stop in micro_batches(len(texts), self.micro_batch_size):
                if weights[start:stop].any():  # a text in no pair has no gradient
                    batch_weights = weights[start:stop].to(self.reward_model.head.weight.device)
                    (self.reward_model(texts[start:stop]) * batch_weights).sum().backward()
            clip_gradients(list(self.reward_model.parameters()), self.max_grad_norm, "the reward model")
            self.optimizer.step()

    def states(self) -> dict[str, AgentState]:
        parameters = {name: value.detach().contiguous().cpu() for name, value in self.reward_model.state_dict().items()}
        return {REWARD_MODEL: AgentState(parameters, {"optimizer": self.optimizer.state_dict(), "step": self.step})}

    def load_states(self, states: dict[str, AgentState], source: str | Path) -> None:
        state = states[REWARD_MODEL]
        try:
            self.reward_model.load_state_dict(state.parameters)
        except RuntimeError as err:
            raise ValueError(f"checkpoint {source} does not match the reward model (algorithm.reward_model.model "
                             f"changed?): {err}") from None
        self.optimizer.load_state_dict(state.optim["optimizer"])
        self.step = int(state.optim["step"])
