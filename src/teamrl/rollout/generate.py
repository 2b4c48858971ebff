"""Batched sampling with transformers, and the log-probs of completions under a policy.

One ``generate`` call covers every observation x G samples of an agent — or of several agents at
once when they share a LoRA base (:func:`generate_team`). A completion's loss
mask covers its tokens up to and including the first end-of-sequence token: prompt tokens, padding and
whatever follows EOS never enter the loss. Masks come from explicit lengths, never from looking for pad
or EOS inside the prompt (chat templates end every turn with the EOS token).

Sampling can be seeded per call (``seed=``): a call then draws from its own stream, seeded from
(run seed, step, turn, agent) by :func:`derive_seed`, so its tokens depend on its inputs alone — not on
what was sampled before it, nor on the process it runs in (a Ray actor samples exactly what this
process would).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import (Cache, DynamicCache, LogitsProcessor, LogitsProcessorList, PreTrainedTokenizerBase, StaticCache,
                          TopKLogitsWarper, TopPLogitsWarper)
from transformers.cache_utils import DynamicLayer, StaticLayer

from teamrl.models.attention import SharedPrefixCache, attending_through, shares_prefixes
from teamrl.models.kv_cache import cache_arg, cache_of
from teamrl.models.onednn import packed_weights
from teamrl.team import Agent, Team


@dataclass
class Generation:
    """An agent's completions for a batch of prompts, ``num_samples`` consecutive rows per prompt."""

    prompt_ids: torch.Tensor
    """(B, P) left-padded prompt token ids."""
    prompt_mask: torch.Tensor
    """(B, P) 1 on real prompt tokens."""
    completion_ids: torch.Tensor
    """(B, C) sampled token ids (positions after the completion's end hold padding)."""
    completion_mask: torch.Tensor
    """(B, C) 1 on tokens up to and including the first EOS: exactly the tokens that are trained."""
    sampling_logprobs: torch.Tensor
    """(B, C) log-prob of each sampled token under the temperature-scaled policy that sampled it (0 where masked)."""
    texts: list[str]
    """Decoded completions (special tokens dropped)."""

    @property
    def num_tokens(self) -> int:
        """Generated tokens that count (EOS included)."""
        return int(self.completion_mask.sum())

    def rows(self, start: int, stop: int) -> Generation:
        """Rows ``start:stop``, without the prompt padding columns that none of them needs."""
        mask = self.prompt_mask[start:stop]
        first = int(mask.any(dim=0).nonzero()[0]) if mask.any() else mask.shape[1]
        return Generation(self.prompt_ids[start:stop, first:], mask[:, first:], self.completion_ids[start:stop],
                          self.completion_mask[start:stop], self.sampling_logprobs[start:stop],
                          self.texts[start:stop])

    def trimmed(self) -> Generation:
        """The same rows without the completion positions after every row's end (they are never trained,
        and a forward pass over them is wasted work)."""
        width = int(self.completion_mask.sum(dim=1).max()) if self.completion_mask.numel() else 0
        return Generation(self.prompt_ids, self.prompt_mask, self.completion_ids[:, :width],
                          self.completion_mask[:, :width], self.sampling_logprobs[:, :width], self.texts)


class TeamSampler(Protocol):
    """Another engine that samples a team's completions (``Team.sampler``), e.g. vLLM on a GPU."""

    def generate_team(self, team: Team, prompts: Sequence[list[str]], num_samples: int, *,
                      seed: int | None = None) -> list[Generation]:
        """What :func:`generate_team` returns, laid out the same way; ``seed`` fixes the samples."""
        ...


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed that is a pure function of ``parts`` (e.g. run seed, step, turn, agent), the same in
    every process and Python version (``hash()`` is salted per process; a digest is not)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


@contextlib.contextmanager
def seeded(seed: int | None, device: torch.device | str = "cpu") -> Iterator[None]:
    """Run the block on torch's RNG (and ``device``'s, for a GPU) seeded with ``seed``, then give the caller
    its own RNG state back untouched. ``None``: run on the caller's RNG as it is."""
    if seed is None:
        yield
        return
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def completion_mask(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """1 on every token up to and including the first EOS of each row (every token if there is none)."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    # A token is kept while no EOS came strictly before it.
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return (eos_before == 0).long()


def encode_prompts(agent: Agent, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) left-padded prompt ids and their attention mask, as every sampling backend lays them out."""
    tokenizer = agent.tokenizer
    tokenizer.padding_side = "left"
    # A chat template already places the special tokens; plain text gets the tokenizer's own (e.g. BOS).
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not agent.uses_chat_template)
    return encoded["input_ids"], encoded["attention_mask"]


def decode_completions(tokenizer: PreTrainedTokenizerBase, completion_ids: torch.Tensor,
                       mask: torch.Tensor) -> list[str]:
    """The texts of the masked completion tokens (special tokens dropped, surrounding space stripped)."""
    texts = tokenizer.batch_decode(completion_ids * mask + tokenizer.pad_token_id * (1 - mask),
                                   skip_special_tokens=True)
    return [t.strip() for t in texts]


@torch.no_grad()
def generate(agent: Agent, prompts: list[str], num_samples: int, adapter_names: list[str] | None = None, *,
             seed: int | None = None) -> Generation:
    """Sample ``num_samples`` completions for every prompt in one batched ``generate`` call.

    ``adapter_names`` (one per prompt) runs several LoRA agents that share ``agent``'s base in the
    same batch, each row through its own adapter (:class:`_RowAdapters`); ``agent`` then only
    supplies the tokenizer and sampling settings. ``seed``: sample from a stream of its own (see
    :func:`seeded`) instead of torch's global one.
    """
    tokenizer = agent.tokenizer
    device = next(agent.model.parameters()).device
    prompt_ids, prompt_mask = (t.to(device) for t in encode_prompts(agent, prompts))
    sampling = agent.sampling
    sampler = _Sampler(sampling.temperature, sampling.top_k, sampling.top_p)
    if adapter_names is None:
        agent.activate()
        rows = _RowAdapters()
    else:
        rows = _RowAdapters.build(agent.model, adapter_names)
    agent.model.eval()
    row_names = None if adapter_names is None else [name for name in adapter_names for _ in range(num_samples)]
    with packed_weights(agent.model, rows=prompt_ids.shape[0] * num_samples), seeded(seed, device):
        cache = _shared_prefill(agent, prompt_ids, prompt_mask, num_samples, rows, adapter_names)
        shared = attending_through(cache) if isinstance(cache, SharedPrefixCache) else contextlib.nullcontext()
        with rows.route(row_names) as routing, shared:
            # Greedy decoding of the sampler's output: _Sampler has already drawn the token (see there why).
            out = agent.model.generate(
                **routing,
                input_ids=prompt_ids.repeat_interleave(num_samples, dim=0),
                attention_mask=prompt_mask.repeat_interleave(num_samples, dim=0),
                **cache_arg(cache),
                do_sample=False,
                max_new_tokens=sampling.max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=agent.eos_token_ids,
                logits_processor=LogitsProcessorList([sampler]),
            )
    completion_ids = out[:, prompt_ids.shape[1]:]
    mask = completion_mask(completion_ids, agent.eos_token_ids)
    logprobs = sampler.finish(out[:, -1]) * mask
    return Generation(
        prompt_ids=prompt_ids.repeat_interleave(num_samples, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(num_samples, dim=0),
        completion_ids=completion_ids,
        completion_mask=mask,
        sampling_logprobs=logprobs,
        texts=decode_completions(tokenizer, completion_ids, mask),
    )


def _shared_prefill(agent: Agent, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_samples: int,
                    rows: _RowAdapters, adapter_names: list[str] | None) -> Cache | None:
    """The key/value cache of every prompt but its last token, for ``num_samples`` rows per prompt: each
    distinct prompt is prefilled once, where ``generate()`` would prefill the same prompt ``num_samples``
    times; ``generate()`` then only runs the last prompt token. The rows share each prompt's keys and
    values (:class:`~teamrl.models.attention.SharedPrefixCache`) where the model can attend that way,
    else get copies of them. None where there is nothing to share."""
    if num_samples == 1 or prompt_ids.shape[1] == 1:
        return None
    cache = _prefill(agent.model, prompt_ids[:, :-1], prompt_mask[:, :-1], rows, adapter_names)
    if shares_prefixes(agent.model, cache):
        return SharedPrefixCache(cache, prompt_mask[:, :-1], num_samples, agent.sampling.max_new_tokens)
    return _repeated_preallocated(cache, num_samples, agent.model.config,
                                  prompt_ids.shape[1] + agent.sampling.max_new_tokens)


def _prefill(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, rows: _RowAdapters,
             adapter_names: list[str] | None) -> Cache:
    """The keys and values of left-padded prompts ``ids`` (one row each, laid out as ``ids``), each through its
    adapter. Where an agent's prompts share an opening of :data:`MIN_STEM_TOKENS` or more (the task's text
    in every turn-2 prompt: ~150 of ~300 tokens on the side-by-side benchmark), the opening runs once and
    each prompt only after it (:class:`PromptStem`); else all run in one pass."""
    names = adapter_names or [None] * ids.shape[0]
    groups: dict[str | None, list[int]] = {}
    for row, name in enumerate(names):
        groups.setdefault(name, []).append(row)
    openings = {name: _common_opening(ids[members], mask[members]) for name, members in groups.items()
                if len(members) > 1}
    if not any(len(opening) >= MIN_STEM_TOKENS for opening in openings.values()):
        return _prompt_pass(model, ids, mask, rows, adapter_names)
    parts = []
    for name, members in groups.items():
        index = torch.tensor(members, device=ids.device)
        opening = openings.get(name)
        routed = None if adapter_names is None else [name] * len(members)
        if opening is None or len(opening) < MIN_STEM_TOKENS:
            parts.append((index, _prompt_pass(model, ids[index], mask[index], rows, routed), None))
            continue
        with rows.route(routed[:1] if routed else None) as routing:
            stem = _run_stem(model, opening, **routing)
        if stem is None:  # not a plain full-attention cache (sliding windows, states): one pass after all
            return _prompt_pass(model, ids, mask, rows, adapter_names)
        rest_ids, rest_mask = stem.remainder(ids[index], mask[index])
        parts.append((index, _prompt_pass(model, rest_ids, rest_mask, rows, routed, stem), stem))
    layers = []
    for layer in range(len(parts[0][1].layers)):
        first = parts[0][1].layers[layer].keys
        keys = first.new_empty(ids.shape[0], first.shape[1], ids.shape[1], first.shape[3])
        values = torch.empty_like(keys)
        for index, part, stem in parts:
            own_keys, own_values = part.layers[layer].keys, part.layers[layer].values
            if stem is not None:
                where = _laid_out(mask[index], stem.length, own_keys.shape[2])
                where = where[:, None, :, None].expand(-1, own_keys.shape[1], -1, own_keys.shape[3])
                own_keys, own_values = own_keys.gather(2, where), own_values.gather(2, where)
            keys[index], values[index] = own_keys, own_values
        layers.append((keys, values))
    return DynamicCache(layers)


def _laid_out(mask: torch.Tensor, stem_length: int, cached: int) -> torch.Tensor:
    """(rows, columns of ``mask``): for prompts run as a stem and then the rest (``cached`` positions: the
    stem's, then the rest left-padded), the cached position each column of the left-padded prompts takes,
    so that the cache reads as one pass over them would have left it (padding columns take the first)."""
    lengths = mask.sum(dim=1, keepdim=True)
    token = torch.arange(mask.shape[1], device=mask.device)[None, :] - (mask.shape[1] - lengths)  # <0: padding
    return torch.where(token < stem_length, token.clamp(min=0), cached - lengths + token)


def _prompt_pass(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, rows: _RowAdapters,
                 row_names: list[str] | None, stem: PromptStem | None = None) -> Cache:
    past = 0 if stem is None else stem.length
    full_mask = torch.cat([mask.new_ones(mask.shape[0], past), mask], dim=1)
    with rows.route(row_names) as routing:
        return cache_of(model(
            input_ids=ids,
            attention_mask=full_mask,
            position_ids=(full_mask.cumsum(dim=1) - 1).clamp(min=0)[:, past:],
            **cache_arg(None if stem is None else stem.cache(ids.shape[0])),
            use_cache=True,
            logits_to_keep=1,
            **routing,
        ))


def _repeated_preallocated(cache: Cache, repeats: int, config, max_length: int) -> Cache:
    """``cache`` with each row repeated ``repeats`` times, in a :class:`~transformers.StaticCache` of
    ``max_length`` positions (filled one layer at a time, so only one layer's repeated copy is held
    besides it); ``cache`` itself, repeated, where its layers are not plain full-attention ones (sliding
    windows, states).

    A ``DynamicCache`` concatenates every layer's keys and values with the new position at every decoding
    step, copying the whole cache each time; a static one writes the new position in place. With 16 rows
    of ~150-token prompts on SmolLM2-135M that is ~20 ms of a ~150 ms decoding step, on 2 CPU cores.
    """
    static = StaticCache(config=config, max_cache_len=max_length)
    if (len(static.layers) != len(cache.layers) or not all(type(layer) is DynamicLayer for layer in cache.layers)
            or not all(type(layer) is StaticLayer for layer in static.layers)):
        cache.batch_repeat_interleave(repeats)
        return cache
    for index, layer in enumerate(cache.layers):
        static.update(layer.keys.repeat_interleave(repeats, dim=0), layer.values.repeat_interleave(repeats, dim=0),
                      index)
    return static


class _RowAdapters:
    """Runs every row of a batch through its own LoRA adapter of one shared base.

    PEFT's mixed-adapter batches (``adapter_names=``) gather each adapter's rows, run its two small
    matmuls per layer on them and scatter the results back: with two agents, a decoding step of 16 rows
    took 30% longer than through one adapter (260 vs 200 ms, SmolLM2-135M, 2 CPU cores). Here each layer's
    adapters are stacked instead, A matrices one above the other (r1 + r2 + ... rows) and scaled B
    matrices side by side, and the layer adds ``((x @ A.T) * mask) @ B.T``, where ``mask`` keeps each
    row's own adapter's block of the rank dimension: the same sum as each row through its own adapter,
    in two matmuls for the whole team. A team's rows, which come as equal consecutive blocks per adapter,
    take :func:`_add_low_rank_grouped` instead: per block, its own adapter only. While routing, each LoRA layer's forward is replaced by its base
    layer plus the stacked update (not PEFT's forward with the adapters disabled and a hook adding it:
    PEFT's ``disable_adapter`` alone took ~80 ms per call, checking every layer's status). Adapters this
    does not cover (DoRA and other variants, non-linear layers) keep PEFT's routing. Built with no model,
    it routes nothing (the model runs as it is).
    """

    def __init__(self, model: torch.nn.Module | None = None, names: Sequence[str] = (),
                 layers: Sequence[tuple[torch.nn.Module, torch.Tensor, torch.Tensor]] = ()):
        self.model, self.names, self.layers = model, list(names), list(layers)
        #: Every layer's adapters have one rank, so a layer's stacked weights split into equal blocks.
        self.uniform_rank = all(len({module.lora_A[n].weight.shape[0] for n in self.names}) == 1
                                for module, _, _ in self.layers)

    @classmethod
    def build(cls, model: torch.nn.Module, adapter_names: Sequence[str]) -> _RowAdapters:
        """The adapters named in ``adapter_names``, stacked per layer of ``model`` (or left to PEFT)."""
        names = list(dict.fromkeys(adapter_names))
        modules = plain_lora_layers(model, names)
        if modules is None:
            return cls(model)  # not a plain LoRA linear layer: PEFT routes every layer
        layers = [(module, torch.cat([module.lora_A[n].weight for n in names]),
                   torch.cat([module.lora_B[n].weight * module.scaling[n] for n in names], dim=1))
                  for module in modules]
        return cls(model, names, layers)

    @contextlib.contextmanager
    def route(self, row_names: Sequence[str] | None) -> Iterator[dict]:
        """While open, the model's forward runs row i through adapter ``row_names[i]``; yields the keyword
        arguments the forward call needs (PEFT's ``adapter_names`` where PEFT routes)."""
        if row_names is None or self.model is None:
            yield {}
            return
        if not self.layers:
            yield {"adapter_names": list(row_names)}
            return
        blocks = _equal_runs(row_names)
        count = len(self.names)
        if blocks is not None and self.uniform_rank:
            index = torch.tensor([self.names.index(n) for n in blocks])
            forwards = [functools.partial(  # (adapters, in, r) and (adapters, r, out) views of the stacked weights
                _grouped_forward, module, a.view(count, -1, a.shape[1]).transpose(1, 2)[index],
                b.view(b.shape[0], count, -1).permute(1, 2, 0)[index]) for module, a, b in self.layers]
        else:
            first_layer, stacked_a, _ = self.layers[0]
            ranks = [first_layer.lora_A[n].weight.shape[0] for n in self.names]
            rank_block = torch.repeat_interleave(torch.arange(count), torch.tensor(ranks))
            row_block = torch.tensor([self.names.index(n) for n in row_names])
            mask = (row_block[:, None] == rank_block[None, :]).to(stacked_a)[:, None, :]
            forwards = [functools.partial(_masked_forward, module, a, b, mask) for module, a, b in self.layers]
        for (module, _, _), forward in zip(self.layers, forwards):
            module.forward = forward
        try:
            yield {}
        finally:
            for module, _, _ in self.layers:
                del module.forward


def _masked_forward(layer: torch.nn.Module, stacked_a: torch.Tensor, stacked_b: torch.Tensor, mask: torch.Tensor,
                    x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return _add_low_rank(layer.base_layer(x, *args, **kwargs), x, stacked_a, stacked_b, mask)


def _grouped_forward(layer: torch.nn.Module, a_blocks: torch.Tensor, b_blocks: torch.Tensor, x: torch.Tensor,
                     *args, **kwargs) -> torch.Tensor:
    return _add_low_rank_grouped(layer.base_layer(x, *args, **kwargs), x, a_blocks, b_blocks)


def _equal_runs(row_names: Sequence[str]) -> list[str] | None:
    """The name of each block of rows, where the rows form consecutive blocks of one name and one size
    (as a team's rows do: each agent's prompts x samples in turn); else None."""
    runs = [(name, len(list(group))) for name, group in itertools.groupby(row_names)]
    return [name for name, _ in runs] if len({size for _, size in runs}) == 1 else None


def plain_lora_layers(model: torch.nn.Module, names: Sequence[str]) -> list[torch.nn.Module] | None:
    """Every LoRA layer of ``model``, or None where one is not a plain linear A/B pair for each of
    ``names`` (DoRA and other variants, embeddings, convolutions) or has adapters merged into its base
    weights: PEFT's own forward then runs them."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.lora.layer import LoraLayer

    layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    if any(type(module) is not LoraLinear or getattr(module, "lora_variant", None) or module.merged
           or any(n not in module.lora_A for n in names) for module in layers):
        return None
    return layers


def _add_low_rank(output: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  multiplier: torch.Tensor | float) -> torch.Tensor:
    """``output + ((x @ A.T) * multiplier) @ B.T``: the multiplier scales the rank-r product and the sum is
    fused into the second matmul (addmm), where PEFT's ``base(x) + B(A(x)) * scaling`` makes two more
    passes over the output-sized tensor (and one more in the backward): on 2 CPU cores those
    element-wise passes over (tokens x 1536) outputs cost more than the adapter's matmuls themselves."""
    low = (x.to(lora_a.dtype) @ lora_a.T) * multiplier
    if output.dtype != low.dtype:
        return output + (low @ lora_b.T).to(output.dtype)
    flat, low = output.reshape(-1, output.shape[-1]), low.reshape(-1, low.shape[-1])
    if not torch.is_grad_enabled():  # nothing else holds the base's fresh output: add in place
        return flat.addmm_(low, lora_b.T).view(output.shape)
    return torch.addmm(flat, low, lora_b.T).view(output.shape)


def _is_fused(layer: torch.nn.Module) -> bool:
    forward = vars(layer).get("forward")
    return isinstance(forward, functools.partial) and forward.func is _base_and_adapter


def _add_low_rank_grouped(output: torch.Tensor, x: torch.Tensor, a_blocks: torch.Tensor,
                          b_blocks: torch.Tensor) -> torch.Tensor:
    """``output + x_k @ A_k @ B_k`` for k equal, consecutive blocks of rows, block k through adapter k (the
    B blocks scaled): two batched matmuls, where the masked form (:func:`_add_low_rank`) runs every row
    through every adapter and masks. A 16-row decoding step's update of one layer took 12-16 against
    30-48 us, a prefill's of 4 x 180 tokens 170-290 against 310-700 us (SmolLM2-135M, 2 CPU cores)."""
    blocks = a_blocks.shape[0]
    low = torch.bmm(x.reshape(blocks, -1, x.shape[-1]).to(a_blocks.dtype), a_blocks)
    if output.dtype != low.dtype or torch.is_grad_enabled() or not output.is_contiguous():
        return output + torch.bmm(low, b_blocks).view(output.shape).to(output.dtype)
    output.view(blocks, -1, output.shape[-1]).baddbmm_(low, b_blocks)  # nothing else holds the fresh output
    return output


_this_thread = threading.local()


@contextlib.contextmanager
def adapter_in_this_thread(name: str) -> Iterator[None]:
    """While open, LoRA layers fused by :func:`active_adapter_fused` run adapter ``name`` for the calls this
    thread makes, whichever adapter the model has active: the agents of one base then update side by side,
    each on its own threads (:func:`teamrl.algorithms.magrpo.update_agents`)."""
    previous = getattr(_this_thread, "adapter", None)
    _this_thread.adapter = name
    try:
        yield
    finally:
        _this_thread.adapter = previous


def _base_and_adapter(layer: torch.nn.Module, name: str, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A plain LoRA layer's forward through adapter ``name`` (or this thread's, :func:`adapter_in_this_thread`),
    by :func:`_add_low_rank`.

    float32 adapters on a bfloat16 base run in bfloat16, as autocast runs them: the casts of the small A
    and B are differentiable (the float32 weights get the gradients), where casting every layer's input to
    float32 and its output back cost ~0.8 s of a ~8 s update (SmolLM2-135M, 2 CPU cores), and bfloat16
    GEMMs of a few hundred rows by rank 16 are 1.4-3x faster. (Decoding, 16 rows, keeps float32: there
    bfloat16's call overhead makes those GEMMs slower.)"""
    name = getattr(_this_thread, "adapter", None) or name
    return _add_low_rank(layer.base_layer(x, *args, **kwargs), layer.lora_dropout[name](x),
                         layer.lora_A[name].weight.to(x.dtype), layer.lora_B[name].weight.to(x.dtype),
                         layer.scaling[name])


@contextlib.contextmanager
def active_adapter_fused(model: torch.nn.Module) -> Iterator[bool]:
    """While open, each LoRA layer of ``model`` runs its one active adapter by :func:`_base_and_adapter`
    instead of PEFT's forward: the same function and gradients, with fewer passes over the layers'
    outputs. Models without plain LoRA layers, with several active adapters or with adapters disabled
    run as they are. Yields whether the layers are fused (here or by an enclosing call)."""
    from peft import PeftModel

    active = model.active_adapters if isinstance(model, PeftModel) else []
    layers = plain_lora_layers(model, active) if len(active) == 1 else None
    if not layers or any(layer.disable_adapters or _is_fused(layer) for layer in layers):
        # nothing to fuse, or an enclosing call (that will unfuse them) already did
        yield bool(layers) and all(_is_fused(layer) for layer in layers)
        return
    for layer in layers:
        layer.forward = functools.partial(_base_and_adapter, layer, active[0])
    try:
        yield True
    finally:
        for layer in layers:
            del layer.forward


def generate_team(team: Team, prompts: Sequence[list[str]], num_samples: int, *,
                  concurrent: bool = False, seed: int | None = None) -> list[Generation]:
    """Every agent's completions of its own prompts (``prompts[i]`` for agent i), in agent order.

    Agents that share one LoRA base and the same sampling settings run in ONE mixed-adapter ``generate``
    call, each row through its own adapter: each decoding step reads the base weights once for the
    whole team instead of once per agent. Agents on other models get a call each, one after the other
    (one RNG stream, so training is reproducible) or, with ``concurrent``, in parallel threads (torch
    releases the GIL in its kernels) as decentralised execution wants.

    A team with a :attr:`~teamrl.team.Team.sampler` (another engine, e.g. vLLM) is sampled by it instead.

    ``seed``: the call whose first agent is i samples under ``derive_seed(seed, i)`` — the seed a Ray agent
    actor gets for agent i (:mod:`teamrl.distributed`), so both sample the same tokens for the same team
    layout. Threads would share torch's one global RNG, hence not with ``concurrent``.
    """
    if team.sampler is not None:
        return team.sampler.generate_team(team, prompts, num_samples, seed=seed)
    groups: dict[int, list[int]] = {}
    for i, agent in enumerate(team):
        groups.setdefault(id(agent.model), []).append(i)
    if seed is not None and concurrent and len(groups) > 1:
        raise ValueError("generate_team: seeded sampling runs the agents one after another; drop concurrent or seed")

    def seed_of(first: int) -> int | None:
        return None if seed is None else derive_seed(seed, first)

    def run_group(indices: list[int]) -> dict[int, Generation]:
        agents = [team[i] for i in indices]
        shared_batch = len(agents) > 1 and all(a.adapter is not None for a in agents) and \
            all(a.sampling == agents[0].sampling for a in agents)
        if not shared_batch:
            return {i: generate(team[i], prompts[i], num_samples, seed=seed_of(i)) for i in indices}
        rows = [p for i in indices for p in prompts[i]]
        names = [team[i].adapter for i in indices for _ in prompts[i]]
        merged = generate(agents[0], rows, num_samples, adapter_names=names, seed=seed_of(indices[0]))
        out, start = {}, 0
        for i in indices:
            stop = start + len(prompts[i]) * num_samples
            out[i] = merged.rows(start, stop)
            start = stop
        return out

    results: dict[int, Generation] = {}
    if concurrent and len(groups) > 1:
        with ThreadPoolExecutor(max_workers=len(groups)) as pool:
            for part in pool.map(run_group, groups.values()):
                results.update(part)
    else:
        for indices in groups.values():
            results.update(run_group(indices))
    return [results[i] for i in range(len(team))]


class _Sampler(LogitsProcessor):
    """Draws each row's next token, and records the log-prob of each drawn token; ``generate`` runs greedy on
    its output, which is 0 at the drawn token and -inf elsewhere.

    transformers' own sampling (``torch.multinomial``) draws an exponential variate per row *and
    vocabulary entry* at every step: 16 rows x 49k entries took 21 ms a step here, against 2 ms for
    inverse-CDF sampling (one uniform per row, located in the cumulative probabilities). The log-prob
    recorded is under the temperature-scaled policy, before top-k/top-p (as ``token_logprobs`` computes it
    in training), holding one step of log-probs at a time: a step's token is only known at the next call
    (or from the final sequences). ``top_k``/``top_p`` filter with transformers' own warpers.
    """

    def __init__(self, temperature: float, top_k: int = 0, top_p: float = 1.0):
        self.temperature = temperature
        self.warpers = LogitsProcessorList(
            ([TopKLogitsWarper(top_k)] if top_k > 0 else []) + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else []))
        self.logprobs: list[torch.Tensor] = []
        self._pending: torch.Tensor | None = None

    def _record(self, tokens: torch.Tensor) -> None:
        if self._pending is not None:
            self.logprobs.append(self._pending.gather(1, tokens.unsqueeze(1)).squeeze(1))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._record(input_ids[:, -1])
        logits = scores.float() / self.temperature
        self._pending = torch.log_softmax(logits, dim=-1)
        probs = torch.softmax(self.warpers(input_ids, logits), dim=-1) if self.warpers else self._pending.exp()
        cumulative = probs.cumsum(dim=-1)
        draw = torch.rand(cumulative.shape[0], 1, device=cumulative.device) * cumulative[:, -1:]
        tokens = torch.searchsorted(cumulative, draw, right=True).clamp_(max=cumulative.shape[1] - 1)
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens, 0.0)

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """(B, C) log-probs, given the last sampled token of every row."""
        self._record(last_tokens)
        self._pending = None
        return torch.stack(self.logprobs, dim=1)


@dataclass
class PromptStem:
    """The opening tokens that every prompt of an agent's update shares (chat template, role, the task's
    text), run once per optimiser step (:func:`prompt_stem`).

    Each micro-batch attends to the stem's keys and values instead of running those tokens again. They are
    leaves of the autograd graph: the gradients the micro-batches leave on them add up, and
    :meth:`backward` carries the sum into the model, as if each micro-batch had run the stem itself. With
    two turns, an agent's turn-2 prompts repeat its turn-1 prompt's opening ahead of their own parts: ~150
    of ~300 tokens on the side-by-side benchmark (docs/performance.md).
    """

    ids: torch.Tensor
    """(S,) the shared tokens."""
    keys: list[torch.Tensor]
    """Per layer, (1, heads, S, head_dim): the leaves the micro-batches attend to."""
    values: list[torch.Tensor]
    outputs: list[torch.Tensor]
    """The stem pass's own keys then values, whose graph :meth:`backward` runs."""

    @property
    def length(self) -> int:
        return self.ids.shape[0]

    def leaves(self) -> list[torch.Tensor]:
        """Keys then values: what a micro-batch's gradient is taken with respect to, besides the weights."""
        return [*self.keys, *self.values]

    def cache(self, rows: int) -> DynamicCache:
        """A cache holding the stem for ``rows`` rows (views; each layer's first update copies them)."""
        return DynamicCache([(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1))
                             for k, v in zip(self.keys, self.values)])

    def remainder(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompts -> the same prompts after the stem, left-padded (padding ids zeroed)."""
        width, lengths = prompt_ids.shape[1], prompt_mask.sum(dim=1)
        offsets = torch.arange(self.length, device=prompt_ids.device)
        heads = prompt_ids.gather(1, ((width - lengths)[:, None] + offsets).clamp(max=width - 1))
        if bool((lengths <= self.length).any()) or not bool((heads == self.ids).all()):
            raise ValueError("token_logprobs: a prompt does not start with the stem's tokens and go on after them")
        rest = lengths - self.length
        keep = int(rest.max())
        mask = (torch.arange(keep, device=prompt_ids.device) >= keep - rest[:, None]).to(prompt_mask.dtype)
        return prompt_ids[:, width - keep:] * mask, mask

    def backward(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Carry the summed gradients of :meth:`leaves` through the stem pass into the model."""
        pairs = [(out, grad) for out, grad in zip(self.outputs, grads) if grad is not None]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])


#: A pass of its own costs about as much as this many prompt tokens run again (measured on 2 CPU cores);
#: shorter common openings run with each prompt.
MIN_STEM_TOKENS = 16


def prompt_stem(model: torch.nn.Module, generations: Sequence[Generation]) -> PromptStem | None:
    """The pass (through the active adapter) over the longest opening every prompt of ``generations``
    shares, leaving each at least one token of its own; None where sharing it saves nothing: under
    :data:`MIN_STEM_TOKENS`, a single distinct prompt, or a model whose cache is not plain full attention
    (sliding windows, states)."""
    opening: torch.Tensor | None = None
    distinct = set()
    for gen in generations:
        opening = _common_opening(gen.prompt_ids, gen.prompt_mask, opening)
        distinct.update(hashlib.sha1(row[mask.bool()].numpy().tobytes()).digest()
                        for row, mask in zip(gen.prompt_ids.cpu(), gen.prompt_mask.cpu()))
    if opening is None or opening.shape[0] < MIN_STEM_TOKENS or len(distinct) < 2:
        return None
    with active_adapter_fused(model):
        return _run_stem(model, opening)


def _common_opening(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                    reference: torch.Tensor | None = None) -> torch.Tensor:
    """The longest run of tokens that every left-padded prompt (and ``reference``, where given) starts with,
    leaving each prompt at least one token of its own."""
    lengths, width = prompt_mask.sum(dim=1), prompt_ids.shape[1]
    span = int(lengths.min()) - 1 if reference is None else min(int(lengths.min()) - 1, reference.shape[0])
    offsets = torch.arange(max(span, 0), device=prompt_ids.device)
    heads = prompt_ids.gather(1, (width - lengths)[:, None] + offsets)
    reference = heads[0] if reference is None else reference[:span]
    agree = (heads == reference).all(dim=0).long().cumprod(dim=0)
    return reference[:int(agree.sum())]


def _run_stem(model: torch.nn.Module, ids: torch.Tensor, **forward_kwargs) -> PromptStem | None:
    """The pass over stem tokens ``ids`` (one row; ``forward_kwargs`` route it to an adapter); None where
    the model's cache is not plain full attention."""
    out = model(input_ids=ids[None], position_ids=torch.arange(ids.shape[0], device=ids.device)[None],
                use_cache=True, logits_to_keep=1, **forward_kwargs)
    cache = cache_of(out)
    if not all(type(layer) is DynamicLayer for layer in cache.layers):
        return None
    outputs = [layer.keys for layer in cache.layers] + [layer.values for layer in cache.layers]
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in outputs]
    half = len(leaves) // 2
    return PromptStem(ids, leaves[:half], leaves[half:], outputs)


def token_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    stem: PromptStem | None = None,
) -> torch.Tensor:
    """(B, C) log-prob of each completion token under ``model`` (temperature-scaled).

    Masked completion tokens are excluded from attention, and positions are counted over real tokens
    only, so the numbers match what the model computed while sampling with left padding.

    Rows that share a prompt (the G samples of a group) share its forward pass: each distinct prompt
    runs once, its key/value cache is copied to its rows (differentiably, so the prompt's gradient is
    the sum over its rows, as in G separate passes), and only the completions run per row. With
    prompts much longer than completions this is close to G times less work. With a ``stem`` (whose
    tokens every prompt starts with), the prompts run only after it, attending to its keys and values.

    The last completion token is never fed to the model (nothing is trained on what it predicts), so the
    logits computed are exactly the ones scored: no (tokens x vocabulary) slice or copy of them is made.
    """
    past = 0
    if stem is not None:
        prompt_ids, prompt_mask = stem.remainder(prompt_ids, prompt_mask)
        past = stem.length
    unique_prompts, row_prompt = torch.unique(torch.cat([prompt_ids, prompt_mask], dim=1), dim=0,
                                              return_inverse=True)
    num_prompt, num_completion = prompt_ids.shape[1], completion_ids.shape[1]
    attention_mask = torch.cat([prompt_mask.new_ones(prompt_mask.shape[0], past), prompt_mask,
                                completion_mask[:, :-1]], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)[:, past:]
    with active_adapter_fused(model):
        if unique_prompts.shape[0] == prompt_ids.shape[0]:  # nothing shared: one pass over prompt + completion
            logits = model(
                input_ids=torch.cat([prompt_ids, completion_ids[:, :-1]], dim=1),
                attention_mask=attention_mask,
                position_ids=position_ids,
                **cache_arg(stem.cache(prompt_ids.shape[0]) if stem else None),
                logits_to_keep=num_completion,
            ).logits
            return _ChosenLogProbs.apply(logits, completion_ids, temperature)
        num_unique = unique_prompts.shape[0]
        prefix = model(
            input_ids=unique_prompts[:, :num_prompt],
            attention_mask=torch.cat([attention_mask[:num_unique, :past], unique_prompts[:, num_prompt:]], dim=1),
            position_ids=position_ids[:, :num_prompt][_first_rows(row_prompt, num_unique)],
            **cache_arg(stem.cache(num_unique) if stem else None),
            use_cache=True,
            logits_to_keep=1,  # the prompt's last position predicts the first completion token
        )
        first = _ChosenLogProbs.apply(prefix.logits[row_prompt], completion_ids[:, :1], temperature)
        if num_completion == 1:
            return first
        cache = cache_of(prefix)
        cache.reorder_cache(row_prompt)
        rest = model(
            input_ids=completion_ids[:, :-1],
            attention_mask=attention_mask,
            position_ids=position_ids[:, num_prompt:],
            **cache_arg(cache),
            logits_to_keep=num_completion - 1,
        ).logits
        return torch.cat([first, _ChosenLogProbs.apply(rest, completion_ids[:, 1:], temperature)], dim=1)


class _ChosenLogProbs(torch.autograd.Function):
    """``log_softmax(logits / temperature).gather(-1, tokens)``, a few rows of logits at a time.

    The (tokens x vocabulary) log-softmax is never held, and the backward writes
    ``(one_hot - softmax) * grad / temperature`` straight into the logits' gradient. Autograd's
    log_softmax + gather would allocate the log-softmax, a zero-filled gradient for the gather and the
    log-softmax's own gradient: three passes over ~50 MB per 4 x 64 completion tokens on a 49k
    vocabulary, each slower on 2 CPU cores than the whole of this.
    """

    #: About 4 MB of float32 logits at a time, so that each block's passes stay in cache.
    BLOCK_BYTES = 4 << 20

    @staticmethod
    def _blocks(flat: torch.Tensor) -> Iterator[slice]:
        rows = max(1, _ChosenLogProbs.BLOCK_BYTES // (4 * flat.shape[-1]))
        return (slice(start, start + rows) for start in range(0, flat.shape[0], rows))

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        flat, index = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1, 1)
        chosen = torch.empty(index.shape, dtype=torch.float32, device=logits.device)
        log_normalizer = torch.empty_like(chosen)  # logsumexp of each row of logits / temperature
        for block in _ChosenLogProbs._blocks(flat):
            scaled = flat[block].float() if temperature == 1.0 else flat[block].float() / temperature
            chosen[block] = torch.log_softmax(scaled, dim=-1).gather(1, index[block])
            log_normalizer[block] = scaled.gather(1, index[block]) - chosen[block]
        ctx.save_for_backward(logits, tokens, log_normalizer)
        ctx.temperature = temperature
        return chosen.view(tokens.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, tokens, log_normalizer = ctx.saved_tensors
        flat, index = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1, 1)
        grad = grad.reshape(-1, 1).float() / ctx.temperature
        grad_logits = torch.empty_like(flat)
        for block in _ChosenLogProbs._blocks(flat):
            out = grad_logits[block] if flat.dtype == torch.float32 else None
            if ctx.temperature == 1.0:
                shifted = torch.sub(flat[block].float(), log_normalizer[block], out=out)
            else:
                shifted = torch.div(flat[block].float(), ctx.temperature, out=out).sub_(log_normalizer[block])
            softmax = shifted.exp_()
            block_grad = softmax.mul_(-grad[block]).scatter_add_(1, index[block], grad[block])
            if out is None:
                grad_logits[block] = block_grad
        return grad_logits.view(logits.shape), None, None


def _first_rows(row_group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """For each group, the index of one row that belongs to it."""
    rows = torch.arange(row_group.shape[0], device=row_group.device)
    return torch.empty(num_groups, dtype=torch.long, device=row_group.device).scatter_(0, row_group, rows)
