"""Agents and teams.

An :class:`Agent` is a causal-LM policy, its tokenizer, its role (how an observation becomes a prompt)
and its sampling settings. A :class:`Team` holds the agents and decides how their weights are kept:

* ``lora`` (default): agents that share a base model share one frozen copy of it, each with its own
  LoRA adapter — n agents for about one model's memory. The KL reference is the base with the
  adapter disabled, so no second model is needed.
* ``full``: every agent fine-tunes its own full copy (a frozen copy is kept as reference only when a
  KL penalty is asked for).
* heterogeneous: any agent may name its own base model (and so its own tokenizer), in either mode.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from teamrl.config import SamplingConfig, TeamConfig
from teamrl.envs.base import Environment
from teamrl.models.attention import use_grouped_attention
from teamrl.models.chat import render_chat, stop_token_ids
from teamrl.models.onednn import use_onednn_linears
from teamrl.models.precision import train_in_mixed_precision


@dataclass
class Agent:
    """One policy of the team and everything needed to prompt it and train it."""

    name: str
    model: nn.Module
    tokenizer: object
    sampling: SamplingConfig
    system_prompt: str | None = None
    use_chat_template: bool = True
    enable_thinking: bool | None = False
    """The chat template's ``enable_thinking`` option (Qwen3's thinking block); None: the template's default."""
    adapter: str | None = None
    """Name of this agent's LoRA adapter inside ``model`` (None when the agent owns ``model`` outright)."""
    reference_model: nn.Module | None = None
    """Frozen copy for the KL penalty under full fine-tuning (None under LoRA: the adapter is disabled)."""
    base_spec: str = ""
    parameters: list[nn.Parameter] = field(default_factory=list)
    """The parameters this agent trains (its adapter, or its whole model)."""

    def activate(self) -> None:
        """Route the shared model through this agent's adapter."""
        if self.adapter is not None:
            self.model.set_adapter(self.adapter)

    @contextlib.contextmanager
    def reference(self) -> Iterator[nn.Module]:
        """The frozen reference policy: the base with this agent's adapter disabled, or the kept copy."""
        if self.adapter is not None:
            self.activate()
            with self.model.disable_adapter():
                yield self.model
        else:
            if self.reference_model is None:
                raise RuntimeError(f"agent {self.name!r} has no reference model; "
                                   "build the team with need_reference=True")
            yield self.reference_model

    @property
    def eos_token_ids(self) -> list[int]:
        """Every token id that ends a completion: the tokenizer's eos, the generation config's and the token that
        closes an assistant turn in the chat template (:func:`~teamrl.models.chat.stop_token_ids`)."""
        return stop_token_ids(self.tokenizer, getattr(self.model, "generation_config", None))

    @property
    def uses_chat_template(self) -> bool:
        """Whether prompts go through the tokenizer's chat template."""
        return bool(self.use_chat_template and getattr(self.tokenizer, "chat_template", None))

    def prompt(self, observation: str) -> str:
        """The text the model is conditioned on: the chat template when there is one, else plain text."""
        if self.uses_chat_template:
            messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            messages.append({"role": "user", "content": observation})
            return render_chat(self.tokenizer, messages, self.enable_thinking)
        return f"{self.system_prompt}\n\n{observation}" if self.system_prompt else observation

    def save_adapter(self, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
        """Write this agent's LoRA adapter in PEFT's format (``adapter_model.safetensors`` and
        ``adapter_config.json``), loadable by ``PeftModel.from_pretrained`` and by vLLM. ``state_dict``: the
        model's weights to read it from, where the model's own are not whole (sharded by FSDP).

        ``base_model_name_or_path`` names the base as transformers loads it without teamrl
        (:func:`~teamrl.models.loading.loadable_reference`), the same for every agent on that base: PEFT
        itself records the base's name only for the first adapter added to it (later ones get null).
        """
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        from teamrl.models.loading import loadable_reference

        if self.adapter is None:
            raise ValueError(f"agent {self.name!r} has no LoRA adapter to save (it trains its full model)")
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        state = get_peft_model_state_dict(self.model, state_dict=state_dict, adapter_name=self.adapter)
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()},
                  str(target / "adapter_model.safetensors"))
        adapter_config = copy.copy(self.model.peft_config[self.adapter])  # the live one stays PEFT's
        if self.base_spec:  # an agent built outside Team.from_config/from_pretrained keeps what PEFT wrote
            adapter_config.base_model_name_or_path = loadable_reference(self.base_spec)
        adapter_config.save_pretrained(str(target))
        return target


class Team:
    """The agents, in the environment's seat order."""

    def __init__(self, agents: Sequence[Agent]):
        self.agents = list(agents)

    def __len__(self) -> int:
        return len(self.agents)

    def prompts(self, observations: Sequence[Sequence[str]]) -> list[list[str]]:
        """Every agent's prompts: agent i's observations ``observations[i]``, each in its role."""
        return [[agent.prompt(o) for o in obs] for agent, obs in zip(self.agents, observations)]

    def __iter__(self) -> Iterator[Agent]:
        return iter(self.agents)

    def __getitem__(self, index: int) -> Agent:
        return self.agents[index]

    @classmethod
    def from_config(cls, config: TeamConfig, env: Environment, *, seed: int = 0, need_reference: bool = False) -> Team:
        """Load the base models and build the agents that ``config`` describes for ``env``'s seats."""
        if len(config.agents) != env.num_agents:
            raise ValueError(
                f"team.agents: {type(env).__name__} has {env.num_agents} seats but the team has "
                f"{len(config.agents)} agents"
            )
        dtype = getattr(torch, config.dtype)
        shared_bases: dict[str, tuple[nn.Module, object]] = {}
        agents = []
        for index, agent_cfg in enumerate(config.agents):
            spec = agent_cfg.model or config.model
            if config.training == "lora" and spec in shared_bases:
                model, tokenizer = shared_bases[spec]
            else:
                model, tokenizer = load_base_model(spec, env, seed=seed, dtype=dtype, device=config.device,
                                                   onednn_linear=config.onednn_linear,
                                                   trained_whole=config.training == "full")
            agent = Agent(
                name=agent_cfg.name,
                model=model,
                tokenizer=tokenizer,
                sampling=config.agent_sampling(index),
                system_prompt=agent_cfg.system_prompt or (env.roles[index] if index < len(env.roles) else None),
                use_chat_template=config.use_chat_template,
                enable_thinking=config.agent_enable_thinking(index),
                base_spec=spec,
            )
            if config.training == "lora":
                # Prefixed: PEFT mis-handles adapter names that are substrings of its own "lora_" prefix.
                agent.adapter = f"agent_{agent.name}"
                agent.model = add_adapter(model, agent.adapter, config)
                shared_bases[spec] = (agent.model, tokenizer)
            else:
                if need_reference:
                    agent.reference_model = copy.deepcopy(model).requires_grad_(False).eval()
                agent.parameters = [p for p in model.parameters() if p.requires_grad]
            agents.append(agent)
        for agent in agents:
            if agent.adapter is not None:
                # Agents sharing a base share one PeftModel; keep each agent's handle on the final wrapper.
                agent.model = shared_bases[agent.base_spec][0]
                marker = f".{agent.adapter}."
                agent.parameters = [p for n, p in agent.model.named_parameters() if marker in n and "lora_" in n]
        return cls(agents)

    def save_pretrained(self, directory: str | Path, metadata: dict | None = None, *,
                        state_dict_of: Callable[[nn.Module], dict[str, torch.Tensor]] | None = None) -> Path:
        """Save every agent (its adapter, or its full weights) and tokenizer, plus a ``team.json`` manifest.

        An adapter is saved in PEFT's format, so ``PeftModel.from_pretrained(base, directory/agent)``
        loads it with no teamrl code. ``metadata`` (e.g. the environment and seed the team was
        trained with) is stored in ``team.json`` for :meth:`from_pretrained`. ``state_dict_of(model)``: the
        weights to write for an agent's model, where the model's own are not whole (sharded by FSDP; for a LoRA
        model its adapters' entries suffice).
        """
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        manifest = []
        for agent in self.agents:
            target = root / agent.name
            target.mkdir(exist_ok=True)
            state_dict = None if state_dict_of is None else state_dict_of(agent.model)
            if agent.adapter is not None:
                agent.save_adapter(target, state_dict)
            else:
                agent.model.save_pretrained(str(target), state_dict=state_dict)
            agent.tokenizer.save_pretrained(str(target))
            manifest.append({
                "name": agent.name,
                "base_model": agent.base_spec,
                "kind": "lora" if agent.adapter is not None else "full",
                "system_prompt": agent.system_prompt,
                "use_chat_template": agent.use_chat_template,
                "enable_thinking": agent.enable_thinking,
                "sampling": asdict(agent.sampling),
            })
        (root / "team.json").write_text(json.dumps({**(metadata or {}), "agents": manifest}, indent=2))
        return root

    @classmethod
    def from_pretrained(cls, directory: str | Path, env: Environment | None = None, *, device: str = "cpu",
                        dtype: str = "float32") -> Team:
        """Load a team written by :meth:`save_pretrained`, ready for inference.

        LoRA agents are loaded onto one copy of each base they name (the base must still be loadable
        from its spec); fully fine-tuned agents from their own directories. ``env`` is only needed
        for a team on the 'tiny' test model (its vocabulary); by default the one in ``team.json``.
        """
        from peft import PeftModel

        from teamrl.envs.base import rebuild_env

        root = Path(directory)
        manifest_file = root / "team.json"
        if not manifest_file.is_file():
            raise ValueError(f"{root}: not a saved team (no team.json); give the directory save_pretrained wrote")
        manifest = json.loads(manifest_file.read_text())
        if env is None and "env" in manifest:
            env = rebuild_env(manifest["env"])
        torch_dtype = getattr(torch, dtype)
        bases: dict[str, nn.Module] = {}
        agents = []
        for entry in manifest["agents"]:
            path = root / entry["name"]
            if entry["kind"] == "full":
                model, tokenizer = load_base_model(str(path), env, seed=manifest.get("seed", 0),
                                                   dtype=torch_dtype, device=device)
                adapter = None
            else:
                adapter = f"agent_{entry['name']}"
                spec = entry["base_model"]
                if spec in bases:
                    model = bases[spec]
                    model.load_adapter(str(path), adapter_name=adapter)
                    tokenizer = next(a.tokenizer for a in agents if a.base_spec == spec)
                else:
                    base, tokenizer = load_base_model(spec, env, seed=manifest.get("seed", 0),
                                                      dtype=torch_dtype, device=device)
                    model = PeftModel.from_pretrained(base, str(path), adapter_name=adapter)
                    bases[spec] = model
            agents.append(Agent(
                name=entry["name"], model=model.eval(), tokenizer=tokenizer,
                sampling=SamplingConfig(**entry["sampling"]), system_prompt=entry["system_prompt"],
                use_chat_template=entry["use_chat_template"], adapter=adapter, base_spec=entry["base_model"],
                # A team saved before the option existed was trained with its template's default.
                enable_thinking=entry.get("enable_thinking"),
            ))
        return cls(agents)


def load_base_model(spec: str, env: Environment, *, seed: int, dtype: torch.dtype, device: str,
                    onednn_linear: bool = True, trained_whole: bool = False):
    """Load a base model and tokenizer from a model spec (see ``TeamConfig.model``); ``onednn_linear``: see
    :attr:`TeamConfig.onednn_linear`. ``trained_whole``: every weight will train (full fine-tuning), so a 16-bit
    ``dtype`` is the compute dtype and the weights are kept in float32
    (:func:`~teamrl.models.precision.train_in_mixed_precision`)."""
    if spec == "tiny":
        from teamrl.models.tiny import tiny_model_and_tokenizer

        words = env.vocabulary()
        if not words:
            raise ValueError(f"team.model: the 'tiny' test model knows only the words of its task, and "
                             f"{type(env).__name__}.vocabulary() gave none (by default it reads the roles and the "
                             f"items' observations); return the words its agents may write, or use another model")
        model, tokenizer = tiny_model_and_tokenizer(words, seed=seed)
    else:
        from teamrl.models.loading import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(spec, dtype=str(dtype).removeprefix("torch."), device=device)
    model = model.to(device=device, dtype=dtype)
    mixed = trained_whole and dtype != torch.float32
    if mixed:
        train_in_mixed_precision(model, dtype)
    if torch.device(device).type == "cpu":
        use_grouped_attention(model)
        if onednn_linear and not mixed:  # under autocast oneDNN's layers run as nn.Linear: nothing to gain
            use_onednn_linears(model)
    return model, tokenizer


def add_adapter(model: nn.Module, adapter: str, config: TeamConfig) -> nn.Module:
    """A LoRA adapter named ``adapter`` (``config.lora``'s settings) on ``model``: added beside the adapters of a
    ``PeftModel``, or wrapping a plain model whose own weights are then frozen. The model to use from then on."""
    from peft import LoraConfig, PeftModel, get_peft_model

    lora = LoraConfig(
        r=config.lora.r,
        lora_alpha=config.lora.alpha,
        lora_dropout=config.lora.dropout,
        target_modules=config.lora.target_modules,
        task_type="CAUSAL_LM",
    )
    if isinstance(model, PeftModel):
        model.add_adapter(adapter, lora)
        return model
    for param in model.parameters():
        param.requires_grad_(False)
    return get_peft_model(model, lora, adapter_name=adapter)
