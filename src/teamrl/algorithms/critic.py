"""A learned value function of text, V(x), for the actor-critic algorithms (:mod:`teamrl.algorithms.actor_critic`).

A critic is a causal LM's decoder with a linear **value head** on the last hidden state of the input's
last token: V(x) = w . h_L(x)[-1] + b, one output per reward channel it predicts. The last token because
in a causal LM it is the only position that has attended to the whole input (a mean over positions
would mix in states that saw only a prefix of it); the head reads the decoder's final, normed hidden
state, so no vocabulary projection is computed. The head starts at zero: V = 0 everywhere before the
first update, whatever the base.

The decoder is trained the way the team is (``team.training``): under ``lora`` the critic is its own
adapter, on the team's shared base when that base is in this process (no second copy of it) and on a
copy of its own otherwise; under ``full`` it fine-tunes a copy of its base model. Which base:
``algorithm.critic.model`` (e.g. a smaller model), or by default the team's (:func:`build_critics`).

Its loss (:func:`value_loss`) is the mean squared error to the value targets, PPO-clipped around the
values the critic gave before the step's update; it has its own AdamW and learning rate
(``algorithm.critic.lr``), the agents' schedule, gradient clipping and micro-batches, and its state goes
into the run's checkpoints as an agent's does (:class:`~teamrl.checkpoint.AgentState`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from teamrl.algorithms.update import clip_gradients, make_optimizer, micro_batches
from teamrl.checkpoint import AgentState, agent_state, restore_agent_state
from teamrl.team import Team, add_adapter, load_base_model

if TYPE_CHECKING:
    from teamrl.algorithms.base import AgentBackend
    from teamrl.config import TrainConfig
    from teamrl.envs.base import Environment


def value_loss(values: torch.Tensor, old_values: torch.Tensor, targets: torch.Tensor, clip: float | None,
               normalizer: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped squared error of one micro-batch of states, summed and divided by ``normalizer``.

    Per state s, joint action m and channel k, with V_clip = V_old + clamp(V - V_old, -clip, clip):

        loss = max((V(s) - y_{s,m})^2, (V_clip(s) - y_{s,m})^2)        (clip None: (V(s) - y_{s,m})^2)

    PPO's value clipping: once a pass has moved V more than ``clip`` away from the value it had when the
    rollout was scored, the clipped term (constant in V) is the larger one wherever moving further would
    help, and the state stops pulling V on. On the first pass V = V_old and it is the plain squared error.

    Args:
        values: (S, K) V of the states (with grad).
        old_values: (S, K) their values before this step's update (no grad).
        targets: (S, M, K) the value target of each joint action taken from each state.
        clip: the clip range, in reward units; None = no clipping.
        normalizer: the number of target entries in the whole update, so that micro-batches add up to its mean.
    Returns:
        the loss, and ``clip_fraction``: the share of entries whose clipped term is the larger one.
    """
    values, old_values = values.unsqueeze(1), old_values.unsqueeze(1)
    error = (values - targets) ** 2
    clipped_fraction = 0.0
    if clip is not None:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped_error = (clipped - targets) ** 2
        clipped_fraction = float((clipped_error > error).float().mean())
        error = torch.maximum(error, clipped_error)
    return error.sum() / normalizer, {"clip_fraction": clipped_fraction}


class ValueModel(nn.Module):
    """A causal LM's decoder and a linear value head on its last position: (B, T) ids -> (B, K) values."""

    def __init__(self, backbone: nn.Module, outputs: int):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.config.hidden_size, outputs, device=next(backbone.parameters()).device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from peft import PeftModel

        model = self.backbone.get_base_model() if isinstance(self.backbone, PeftModel) else self.backbone
        # Left padding: every row's last position is its last real token; positions count real tokens only.
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=(attention_mask.cumsum(dim=1) - 1).clamp(min=0)).last_hidden_state
        return self.head(hidden[:, -1].float())


@dataclasses.dataclass
class Critic:
    """One value function: its model, tokenizer and optimiser. ``name`` names it in checkpoints and metrics."""

    name: str
    model: ValueModel
    tokenizer: Any
    parameters: list[nn.Parameter]
    """What it trains: its adapter (or whole decoder) and its head."""
    optimizer: torch.optim.Optimizer
    scheduler: Any
    adapter: str | None = None
    """Its LoRA adapter's name in ``model.backbone`` (None when it fine-tunes its whole decoder)."""

    @contextlib.contextmanager
    def _routed(self) -> Iterator[None]:
        """Run the (maybe shared) base through this critic's adapter, then give it back as it was: the
        agents' adapter active and trainable, this one frozen."""
        if self.adapter is None:
            yield
            return
        backbone = self.model.backbone
        previous = backbone.active_adapter
        backbone.set_adapter(self.adapter)
        try:
            yield
        finally:
            backbone.set_adapter(previous)

    def _encode(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        self.tokenizer.padding_side = "left"
        encoded = self.tokenizer(list(texts), return_tensors="pt", padding=True)
        device = self.model.head.weight.device
        return encoded["input_ids"].to(device), encoded["attention_mask"].to(device)

    def values(self, texts: Sequence[str], micro_batch_size: int = 0) -> torch.Tensor:
        """(S, K) V of each text, without gradients, ``micro_batch_size`` texts per forward pass (0: all)."""
        self.model.eval()
        with torch.no_grad(), self._routed():
            return torch.cat([self.model(*self._encode(texts[start:stop]))
                              for start, stop in micro_batches(len(texts), micro_batch_size)])

    def fit(self, texts: Sequence[str], old_values: torch.Tensor, targets: torch.Tensor, *, num_iterations: int,
            value_clip: float | None, micro_batch_size: int = 0, max_grad_norm: float | None = None,
            ) -> dict[str, float]:
        """``num_iterations`` optimiser steps on :func:`value_loss` over states ``texts`` (values
        ``old_values`` (S, K) before this update, targets (S, M, K)); the mean loss, clip fraction and
        gradient norm over the steps."""
        normalizer = float(targets.numel())
        totals = {"loss": 0.0, "clip_fraction": 0.0, "grad_norm": 0.0}
        batches = [(self._encode(texts[start:stop]), start, stop)
                   for start, stop in micro_batches(len(texts), micro_batch_size)]
        self.model.train()
        with self._routed():
            for _ in range(num_iterations):
                self.optimizer.zero_grad(set_to_none=True)
                for inputs, start, stop in batches:
                    loss, stats = value_loss(self.model(*inputs), old_values[start:stop], targets[start:stop],
                                             value_clip, normalizer)
                    loss.backward()
                    totals["loss"] += float(loss.detach()) / num_iterations
                    totals["clip_fraction"] += stats["clip_fraction"] * (stop - start) / len(texts) / num_iterations
                totals["grad_norm"] += clip_gradients(self.parameters, max_grad_norm,
                                                      f"critic {self.name!r}") / num_iterations
                self.optimizer.step()
                self.scheduler.step()
        self.model.eval()
        return totals

    def state(self) -> AgentState:
        """Its trained parameters and optimiser and schedule state, for a checkpoint."""
        return agent_state(self, self.optimizer, self.scheduler)

    def load_state(self, state: AgentState, source: str | Path) -> None:
        """Resume from :meth:`state`'s entry, read from checkpoint ``source``."""
        restore_agent_state(self, self.optimizer, self.scheduler, state, source)


def build_critics(specs: Sequence[tuple[str, str, int]], config: TrainConfig, env: Environment,
                  agents: AgentBackend) -> list[Critic]:
    """A critic per ``(name, base model spec, outputs)``, trained as the team is (``team.training``).

    Under LoRA every critic is an adapter named after it, and critics share a base with each other and
    with the team's LoRA agents in this process wherever the spec is the same (agents in Ray actors share
    nothing with this process: there the critics load their own base). Under full fine-tuning each
    critic fine-tunes its own copy.
    """

    lora = config.team.training == "lora"
    team = getattr(agents, "team", None)
    bases: dict[str, tuple[nn.Module, Any]] = {}
    if lora and isinstance(team, Team):
        bases = {agent.base_spec: (agent.model, agent.tokenizer) for agent in team if agent.adapter is not None}
    critics = []
    for name, spec, outputs in specs:
        if spec in bases:
            backbone, tokenizer = bases[spec]
        else:
            backbone, tokenizer = load_base_model(spec, env, seed=config.seed, dtype=getattr(torch, config.team.dtype),
                                                  device=config.team.device, onednn_linear=config.team.onednn_linear,
                                                  trained_whole=not lora)
        adapter = None
        if lora:
            adapter = name.replace(".", "_")  # PEFT's module names are dotted paths
            backbone = add_adapter(backbone, adapter, config.team)
            bases[spec] = (backbone, tokenizer)
            marker = f".{adapter}."
            trained = [p for n, p in backbone.named_parameters() if marker in n and "lora_" in n]
        else:  # the decoder V reads, not the vocabulary projection it never uses
            trained = [p for p in backbone.base_model.parameters() if p.requires_grad]
        model = ValueModel(backbone, outputs)
        parameters = [*trained, *model.head.parameters()]
        optimizer, scheduler = make_optimizer(parameters, config, config.algorithm.critic.lr)
        critics.append(Critic(name, model, tokenizer, parameters, optimizer, scheduler, adapter))
    return critics
