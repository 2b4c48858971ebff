"""Rollouts with vLLM on a GPU (``rollout.backend: vllm``; extra ``[vllm]``).

:class:`~teamrl.backends.vllm.VLLMBackend` is the :class:`~teamrl.algorithms.base.AgentBackend` of agents
trained in this process and sampled by vLLM: its :class:`VLLMSampler` samples every rollout in place of
transformers' ``generate``
(:func:`~teamrl.rollout.generate.generate_team`, the same signature) and returns the same
:class:`~teamrl.rollout.generate.Generation` objects, so the rest of MAGRPO is unchanged.

* One vLLM engine per base model. At its first rollout the sampler exports the weights teamrl holds
  (the frozen base of LoRA agents, or a fully fine-tuned agent's model) to a temporary directory and
  starts an engine on it, so vLLM serves exactly those weights whatever the model spec was (a GGUF, the
  bundled model, a hub id). ``rollout.gpu_memory_utilization`` is the share of the GPU all engines take
  together: n engines get 1/n of it each (each engine checks at start-up that the GPU's free memory covers
  its own share, so two at the full share would not both start).
* LoRA agents that share a base share its engine, and all their requests go into one ``generate``
  call, each with its agent's adapter (vLLM batches mixed adapters).
* Weights are synced lazily, before the first rollout that follows a change: an agent whose trained
  parameters changed since the last push (an optimiser step, a checkpoint load, any in-place write)
  has its adapter written with PEFT to a fresh directory and registered under a new ``LoRARequest`` id
  (vLLM caches adapters by id, so a new id is what makes it load the new weights); a fully fine-tuned
  agent's weights are loaded into the engine's model with ``load_weights``. After a push the engine's
  prefix cache is reset: vLLM keys cached prompt blocks by their tokens, not by the weights that computed them.
* Prompts are tokenised by teamrl (:func:`~teamrl.rollout.generate.encode_prompts`) and completions
  decoded by teamrl, so vLLM never needs the tokenizer. Each request's vLLM seed is drawn from torch's
  RNG, so a run's seed fixes vLLM's samples as it fixes transformers' (up to vLLM's batch-dependent
  numerics).

How teamrl calls vLLM (the engine's, the requests' and the adapters' arguments) is built by the pure
functions :func:`engine_kwargs`, :func:`sampling_kwargs` and :func:`lora_request_kwargs`, which
``tests/rollout/test_vllm_contract.py`` checks against the installed vLLM's own classes and signatures.

The sampling log-probs are vLLM's (temperature applied, and top-k/top-p masking, which the transformers
backend does not apply to them); the trainer recomputes log-probs with its own forward pass, so these
only serve as diagnostics.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from teamrl.config import ConfigError, RolloutConfig, SamplingConfig, vllm_sleep_mode_rule
from teamrl.models.precision import compute_dtype
from teamrl.rollout.generate import Generation, completion_mask, decode_completions, derive_seed, encode_prompts, seeded
from teamrl.team import Agent, Team

log = logging.getLogger(__name__)

#: The ``max_lora_rank`` values vLLM accepts (its ``LoRAConfig``, 0.10.2 to 0.33; 0.33 also takes 1).
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


class _Logprob(Protocol):
    logprob: float


class CompletionLike(Protocol):
    """What teamrl reads of a vLLM ``CompletionOutput``."""

    token_ids: Sequence[int]
    logprobs: Sequence[Mapping[int, _Logprob]] | None


class RequestOutputLike(Protocol):
    """What teamrl reads of a vLLM ``RequestOutput``: its ``n`` completions."""

    outputs: Sequence[CompletionLike]


def generation_from_outputs(
    outputs: Sequence[RequestOutputLike],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    num_samples: int,
    eos_token_ids: list[int],
    tokenizer: Any,
    device: torch.device | str = "cpu",
) -> Generation:
    """The :class:`Generation` of vLLM's ``outputs`` for the (B, P) left-padded prompts, one output per prompt.

    Rows are laid out as :func:`~teamrl.rollout.generate.generate` lays them out: ``num_samples``
    consecutive rows per prompt, completions right-padded with the pad token. The mask covers each
    completion up to and including its first EOS and never a padding position; the sampling log-prob
    of each sampled token is read from vLLM's log-probs (0 where masked).
    """
    completions = [completion for output in outputs for completion in output.outputs]
    if len(completions) != prompt_ids.shape[0] * num_samples:
        raise ValueError(f"expected {num_samples} completions for each of {prompt_ids.shape[0]} prompts, "
                         f"got {len(completions)}")
    width = max((len(c.token_ids) for c in completions), default=0)
    ids = torch.full((len(completions), width), tokenizer.pad_token_id, dtype=torch.long)
    within = torch.zeros((len(completions), width), dtype=torch.long)
    logprobs = torch.zeros((len(completions), width))
    for row, completion in enumerate(completions):
        length = len(completion.token_ids)
        ids[row, :length] = torch.tensor(list(completion.token_ids), dtype=torch.long)
        within[row, :length] = 1
        if completion.logprobs is not None:
            logprobs[row, :length] = torch.tensor(
                [position[token].logprob for position, token in zip(completion.logprobs, completion.token_ids)])
    # A row shorter than the widest ended early: its padding is not part of it even when pad is not EOS.
    mask = completion_mask(ids, eos_token_ids) * within
    return Generation(
        prompt_ids=prompt_ids.repeat_interleave(num_samples, dim=0).to(device),
        prompt_mask=prompt_mask.repeat_interleave(num_samples, dim=0).to(device),
        completion_ids=ids.to(device),
        completion_mask=mask.to(device),
        sampling_logprobs=(logprobs * mask).to(device),
        texts=decode_completions(tokenizer, ids, mask),
    )


def export_model(agent: Agent, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the weights vLLM should serve for ``agent`` as a transformers directory.

    For a LoRA agent: its frozen base, without any adapter (PEFT's wrapped layers are saved under their
    original names). For a fully fine-tuned agent: its model as it is now. ``state_dict``: the agent's model's
    weights, where the model's own are not whole (sharded by FSDP; for a LoRA agent, its PeftModel's).
    """
    directory = Path(directory)
    state = state_dict
    model = agent.model
    if agent.adapter is not None:
        model = agent.model.get_base_model()
        # PEFT keeps the wrapped linear's own weight at `<module>.base_layer.weight`, next to its adapters.
        weights = (model.state_dict() if state_dict is None else
                   {name.removeprefix("base_model.model."): tensor for name, tensor in state_dict.items()})
        state = {name.replace(".base_layer.", "."): tensor for name, tensor in weights.items() if "lora_" not in name}
    model.save_pretrained(str(directory), state_dict=state)
    return directory


def weights_version(agent: Agent) -> tuple[int, ...]:
    """A cheap fingerprint of ``agent``'s trained parameters that changes whenever any of them is written.

    Every in-place write to a tensor (an optimiser step, ``copy_`` from a checkpoint, ``normal_``) bumps
    its version counter, so comparing fingerprints tells whether the weights changed without reading them.
    """
    return tuple(p._version for p in agent.parameters)


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that fits adapters of rank ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"team.lora.r: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]} (got {rank})")


def engine_memory_share(total: float, num_engines: int) -> float:
    """Each engine's ``gpu_memory_utilization`` when ``num_engines`` share ``total`` (the config's field).

    vLLM's share is per engine, and each engine checks at start-up that the GPU's free memory covers its own share
    of the total: the second of two engines at 0.5 finds less than half free (the first holds half, training the
    rest) and fails. So the config's share is what the rollouts take together, whatever the team's layout.
    """
    return total / num_engines


def engine_kwargs(model_dir: str | Path, dtype: torch.dtype, *, gpu_memory_utilization: float, max_model_len: int,
                  sleep_mode: bool, lora_rank: int | None = None, num_adapters: int = 0) -> dict[str, Any]:
    """The arguments of ``vllm.LLM`` (fields of vLLM's ``EngineArgs``) for one engine serving ``model_dir``.

    ``lora_rank``: the largest adapter rank of the LoRA agents it serves (None: no adapters), ``num_adapters``
    their number; ``max_model_len`` 0 leaves the model's own limit.
    """
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,  # teamrl tokenises the prompts and decodes the completions
        "dtype": str(dtype).removeprefix("torch."),
        "gpu_memory_utilization": gpu_memory_utilization,
        "logprobs_mode": "processed_logprobs",  # the log-probs of the distribution actually sampled
        "enable_sleep_mode": sleep_mode,
    }
    if max_model_len:
        kwargs["max_model_len"] = max_model_len
    if lora_rank is not None:
        # Every agent's adapter is in every rollout batch, so all of them must fit at once.
        kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(lora_rank), max_loras=num_adapters,
                      max_cpu_loras=num_adapters)
    return kwargs


def sampling_kwargs(sampling: SamplingConfig, num_samples: int, stop_token_ids: list[int], seed: int) -> dict[str, Any]:
    """The arguments of one request's ``vllm.SamplingParams``: ``num_samples`` completions sampled as ``sampling``
    says, stopping at ``stop_token_ids``, from the random stream ``seed``."""
    return {
        "n": num_samples,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,  # 0 = off, in vLLM as in teamrl
        "max_tokens": sampling.max_new_tokens,
        "stop_token_ids": list(stop_token_ids),  # vLLM has no tokenizer to take EOS from
        "logprobs": 0,  # the sampled token's log-prob only
        "detokenize": False,
        "seed": seed,
    }


def lora_request_kwargs(name: str, lora_id: int, path: str | Path) -> dict[str, Any]:
    """The arguments of the ``vllm.lora.request.LoRARequest`` that serves the adapter saved at ``path``.

    ``lora_id`` must be new for every version of an adapter: vLLM caches adapters by id (and >= 1, vLLM's rule).
    """
    return {"lora_name": name, "lora_int_id": lora_id, "lora_path": str(path)}


@dataclass
class _Engine:
    llm: Any
    """The ``vllm.LLM``."""
    asleep: bool = False


class VLLMSampler:
    """Samples a team's rollouts with vLLM, keeping each engine in sync with the agents' weights.

    One sampler serves one team (it remembers agents by name); :class:`~teamrl.backends.vllm.VLLMBackend` holds one for
    ``rollout.backend: vllm``. Needs the ``vllm`` package and an NVIDIA GPU.
    """

    def __init__(self, config: RolloutConfig, workdir: str | Path | None = None):
        self.config = config
        self._vllm = _import_vllm()
        self.root = Path(tempfile.mkdtemp(prefix="teamrl-vllm-", dir=workdir))
        """Exported models and adapter versions; removed when the sampler is garbage-collected or at exit."""
        weakref.finalize(self, shutil.rmtree, self.root, True)
        self._engines: dict[int, _Engine] = {}
        self._pushed: dict[str, tuple[int, ...]] = {}
        self._adapters: dict[str, Any] = {}
        self._lora_ids = itertools.count(1)

    def generate_team(self, team: Team, prompts: Sequence[list[str]], num_samples: int, *,
                      seed: int | None = None,
                      state_of: Callable[[torch.nn.Module], dict[str, torch.Tensor]] | None = None,
                      ) -> list[Generation]:
        """Every agent's ``num_samples`` completions of its prompts (``prompts[i]`` for agent i), in agent order.

        Agents that share a model (LoRA on one base) are sampled in one ``generate`` call of its engine.
        Each request's vLLM seed is drawn from torch's RNG, seeded with ``seed`` when given. ``state_of(model)``:
        the whole weights of an agent's model, where its own are sharded (FSDP gathers them on every rank
        before rank 0 samples): what an engine starts from and what a push sends.
        """
        groups, memory_share = self.engine_groups(team)
        results: dict[int, Generation] = {}
        for indices in groups:
            agents = [team[i] for i in indices]
            state = None if state_of is None else state_of(agents[0].model)
            engine = self.ready_engine(team, indices, memory_share, state)
            encoded = [encode_prompts(agent, prompts[i]) for i, agent in zip(indices, agents)]
            requests, params, adapters = [], [], []
            with seeded(None if seed is None else derive_seed(seed, indices[0])):
                for agent, (ids, mask) in zip(agents, encoded):
                    for row_ids, row_mask in zip(ids, mask):
                        requests.append({"prompt_token_ids": row_ids[row_mask.bool()].tolist()})
                        params.append(self.sampling_params(agent.sampling, num_samples, agent.eos_token_ids,
                                                           seed=int(torch.randint(2**31 - 1, ()))))
                        adapters.append(self.adapter_request(agent))
            outputs = engine.llm.generate(requests, params, use_tqdm=False,
                                          lora_request=adapters if agents[0].adapter is not None else None)
            self.rest(engine)
            start = 0
            for i, agent, (ids, mask) in zip(indices, agents, encoded):
                stop = start + ids.shape[0]
                results[i] = generation_from_outputs(outputs[start:stop], ids, mask, num_samples,
                                                     agent.eos_token_ids, agent.tokenizer,
                                                     next(agent.model.parameters()).device)
                start = stop
        return [results[i] for i in range(len(team))]

    def engine_groups(self, team: Team) -> tuple[list[list[int]], float]:
        """The team's agents grouped by the engine that serves them (the indices of the agents that share a model),
        and each engine's share of the GPU."""
        groups: dict[int, list[int]] = {}
        for i, agent in enumerate(team):
            groups.setdefault(id(agent.model), []).append(i)
        if self.config.sleep_between_rollouts and len(groups) > 1:
            # Before any engine starts: vLLM would assert when the second sleep-mode engine starts.
            raise ConfigError(f"rollout.sleep_between_rollouts: {vllm_sleep_mode_rule(len(groups))} (got True)")
        return list(groups.values()), engine_memory_share(self.config.gpu_memory_utilization, len(groups))

    def ready_engine(self, team: Team, indices: list[int], memory_share: float,
                     state: dict[str, torch.Tensor] | None = None) -> _Engine:
        """The engine of the agents ``team[indices]`` (one model), started, awake and serving their weights as
        they are now (read from ``state``, their model's whole weights, where given)."""
        agents = [team[i] for i in indices]
        engine = self._engine(id(agents[0].model), agents, memory_share, state)
        if engine.asleep:
            engine.llm.wake_up()
            engine.asleep = False
        self._sync(engine, agents, state)
        return engine

    def rest(self, engine: _Engine) -> None:
        """Put ``engine`` to sleep between rollouts where ``rollout.sleep_between_rollouts`` asks for it."""
        if self.config.sleep_between_rollouts:
            engine.llm.sleep(level=1)  # level 1 keeps the weights in CPU memory: no reload on wake-up
            engine.asleep = True

    def adapter_request(self, agent: Agent) -> Any:
        """The ``LoRARequest`` serving ``agent``'s adapter as last pushed (None: a model without adapters)."""
        return self._adapters.get(agent.name) if agent.adapter is not None else None

    def sampling_params(self, sampling: SamplingConfig, num_samples: int, stop_token_ids: list[int], seed: int,
                        **extra: Any) -> Any:
        """vLLM's ``SamplingParams`` for one request (:func:`sampling_kwargs`, with vLLM's own ``extra`` fields)."""
        return self._vllm.SamplingParams(**sampling_kwargs(sampling, num_samples, stop_token_ids, seed), **extra)

    # ----------------------------------------------------------------------------------------------
    def _engine(self, key: int, agents: list[Agent], memory_share: float,
                state: dict[str, torch.Tensor] | None = None) -> _Engine:
        """The engine serving ``agents``' shared model, started on first use with ``memory_share`` of the GPU
        (from ``state``, the model's whole weights, where given)."""
        if key in self._engines:
            return self._engines[key]
        first = agents[0]
        lora_rank = None
        if first.adapter is not None:
            lora_rank = max(agent.model.peft_config[agent.adapter].r for agent in agents)
        dtype = getattr(torch, self.config.engine_dtype(str(compute_dtype(first.model)).removeprefix("torch.")))
        kwargs = engine_kwargs(
            export_model(first, self.root / f"model-{len(self._engines)}", state), dtype,
            gpu_memory_utilization=memory_share, max_model_len=self.config.max_model_len,
            sleep_mode=self.config.sleep_between_rollouts, lora_rank=lora_rank, num_adapters=len(agents))
        with _in_process_engine():
            engine = _Engine(self._vllm.LLM(**kwargs))
        if first.adapter is None:
            self._pushed[first.name] = weights_version(first)  # the engine starts from its current weights
        self._engines[key] = engine
        return engine

    def _sync(self, engine: _Engine, agents: list[Agent], state: dict[str, torch.Tensor] | None = None) -> None:
        """Push the weights of every agent in ``agents`` that changed since its last push (read from ``state``, their
        model's whole weights, where given), then reset the engine's prefix cache if anything was pushed."""
        pushed = False
        for agent in agents:
            version = weights_version(agent)
            if self._pushed.get(agent.name) == version:
                continue
            if agent.adapter is not None:
                self._adapters[agent.name] = self._publish_adapter(agent, state)
            else:
                weights = agent.model.state_dict() if state is None else state
                engine.llm.apply_model(lambda model, weights=weights: model.load_weights(weights=weights.items()))
            self._pushed[agent.name] = version
            pushed = True
        if pushed:
            # vLLM's prefix cache keys the prompt blocks it keeps by their tokens (and adapter), not by the weights
            # that computed them, and only sleep() clears it: after load_weights it would serve the old weights'
            # keys and values. (A new adapter id has new keys already; the old version's entries are dead weight.)
            # Older vLLMs return None; False means blocks were in use and nothing was reset.
            if engine.llm.reset_prefix_cache() is False:
                raise RuntimeError("vLLM could not reset its prefix cache after a weight push (blocks in use)")

    def _publish_adapter(self, agent: Agent, state: dict[str, torch.Tensor] | None = None) -> Any:
        """Write ``agent``'s adapter (from ``state``, its model's whole weights, where given) to a fresh directory
        and return the ``LoRARequest`` that serves it."""
        from vllm.lora.request import LoRARequest

        lora_id = next(self._lora_ids)
        name = f"{agent.name}-v{lora_id}"
        path = agent.save_adapter(self.root / name, state)
        previous = self._adapters.get(agent.name)
        if previous is not None:
            shutil.rmtree(previous.lora_path, ignore_errors=True)  # its id is never requested again
        return LoRARequest(**lora_request_kwargs(name, lora_id, path))


def _import_vllm() -> Any:
    """The ``vllm`` module, or an ImportError that says how to install it."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError('the vLLM rollout backend needs vllm: pip install "teamrl[vllm]" (NVIDIA GPU only)') \
            from err
    return vllm


@contextlib.contextmanager
def _in_process_engine() -> Iterator[None]:
    """Start vLLM's engine core in this process (as TRL's colocated mode does), so pushing weights is a
    plain call into its model instead of pickling them to another process."""
    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous
