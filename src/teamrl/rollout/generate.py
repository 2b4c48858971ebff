"""Batched sampling with transformers: every agent's G completions of each of its prompts.

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
import hashlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from transformers import (
    Cache,
    DynamicCache,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedTokenizerBase,
    StaticCache,
    StoppingCriteria,
    StoppingCriteriaList,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.cache_utils import DynamicLayer, StaticLayer

from teamrl.models.attention import SharedPrefixCache, attending_through, shares_prefixes
from teamrl.models.kv_cache import cache_arg, cache_of
from teamrl.models.lora import RowAdapters
from teamrl.models.onednn import packed_weights
from teamrl.models.stem import PromptStem, common_opening, long_enough, run_stem
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
             seed: int | None = None, should_stop: Callable[[], bool] | None = None,
             compile: bool = False) -> Generation:
    """Sample ``num_samples`` completions for every prompt in one batched ``generate`` call.

    ``adapter_names`` (one per prompt) runs several LoRA agents that share ``agent``'s base in the
    same batch, each row through its own adapter (:class:`RowAdapters`); ``agent`` then only
    supplies the tokenizer and sampling settings. ``seed``: sample from a stream of its own (see
    :func:`seeded`) instead of torch's global one. ``should_stop``: asked after every decoding step; True ends
    the call there (the server's way to drop work nobody waits for any more), every row as it stands.

    ``compile``: let transformers compile the decoding step. With a static cache (what this hands it for
    ``num_samples`` > 1 on a GPU) transformers wraps the model's forward in ``torch.compile`` on CUDA by itself,
    which costs minutes on the first call and recompiles as batch and prompt shapes change; so by default this
    asks for no compilation (``disable_compile``), on every device alike (``rollout.compile``,
    docs/performance.md#compiling-the-decoding-step).
    """
    tokenizer = agent.tokenizer
    device = next(agent.model.parameters()).device
    prompt_ids, prompt_mask = (t.to(device) for t in encode_prompts(agent, prompts))
    sampling = agent.sampling
    sampler = _Sampler(sampling.temperature, sampling.top_k, sampling.top_p)
    if adapter_names is None:
        agent.activate()
        rows = RowAdapters()
    else:
        rows = RowAdapters.build(agent.model, adapter_names)
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
                stopping_criteria=StoppingCriteriaList([] if should_stop is None else [_StopWhen(should_stop)]),
                disable_compile=not compile,
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
                    rows: RowAdapters, adapter_names: list[str] | None) -> Cache | None:
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


def _prefill(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, rows: RowAdapters,
             adapter_names: list[str] | None) -> Cache:
    """The keys and values of left-padded prompts ``ids`` (one row each, laid out as ``ids``), each through its
    adapter. Where an agent's prompts share an opening of :data:`~teamrl.models.stem.MIN_STEM_TOKENS` or
    more (the task's text in every turn-2 prompt, about half of it), the opening runs once and each prompt
    only after it (:class:`~teamrl.models.stem.PromptStem`); else all run in one pass."""
    names = adapter_names or [None] * ids.shape[0]
    groups: dict[str | None, list[int]] = {}
    for row, name in enumerate(names):
        groups.setdefault(name, []).append(row)
    openings = {name: common_opening(ids[members], mask[members]) for name, members in groups.items()
                if len(members) > 1}
    if not any(long_enough(opening) for opening in openings.values()):
        return _prompt_pass(model, ids, mask, rows, adapter_names)
    parts = []
    for name, members in groups.items():
        index = torch.tensor(members, device=ids.device)
        opening = openings.get(name)
        routed = None if adapter_names is None else [name] * len(members)
        if opening is None or not long_enough(opening):
            parts.append((index, _prompt_pass(model, ids[index], mask[index], rows, routed), None))
            continue
        with rows.route(routed[:1] if routed else None) as routing:
            stem = run_stem(model, opening, **routing)
        if stem is None:  # not a plain full-attention cache (sliding windows, states): one pass after all
            return _prompt_pass(model, ids, mask, rows, adapter_names)
        rest_ids, rest_mask = stem.remainder(ids[index], mask[index])
        parts.append((index, _prompt_pass(model, rest_ids, rest_mask, rows, routed, stem), stem))
    layers = []
    for layer in range(len(parts[0][1].layers)):
        first = parts[0][1].layers[layer]  # keys and values each in its own dtype (they differ under autocast)
        keys = first.keys.new_empty(ids.shape[0], first.keys.shape[1], ids.shape[1], first.keys.shape[3])
        values = first.values.new_empty(ids.shape[0], first.values.shape[1], ids.shape[1], first.values.shape[3])
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


def _prompt_pass(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, rows: RowAdapters,
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
    step, copying the whole cache each time; a static one writes the new position in place (about a
    seventh of a decoding step: docs/reports/step-time.md, "Third round").
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


def generate_team(team: Team, prompts: Sequence[list[str]], num_samples: int, *,
                  concurrent: bool = False, seed: int | None = None,
                  should_stop: Callable[[], bool] | None = None, compile: bool = False) -> list[Generation]:
    """Every agent's completions of its own prompts (``prompts[i]`` for agent i), in agent order.

    Agents that share one LoRA base and the same sampling settings run in ONE mixed-adapter ``generate``
    call, each row through its own adapter: each decoding step reads the base weights once for the
    whole team instead of once per agent. Agents on other models get a call each, one after the other
    (one RNG stream, so training is reproducible) or, with ``concurrent``, in parallel threads (torch
    releases the GIL in its kernels) as decentralised execution wants.

    ``seed``: the call whose first agent is i samples under ``derive_seed(seed, i)`` — the seed a Ray agent
    actor gets for agent i (:mod:`teamrl.backends.ray`), so both sample the same tokens for the same team
    layout. Threads would share torch's one global RNG, hence not with ``concurrent``. ``should_stop`` and
    ``compile``: see :func:`generate`; with ``compile`` the models run one after another even when
    ``concurrent`` (two threads compiling at once would each wait on, and may break, torch.compile's one
    process-wide state).
    """
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
            return {i: generate(team[i], prompts[i], num_samples, seed=seed_of(i), should_stop=should_stop,
                                compile=compile) for i in indices}
        rows = [p for i in indices for p in prompts[i]]
        names = [team[i].adapter for i in indices for _ in prompts[i]]
        merged = generate(agents[0], rows, num_samples, adapter_names=names, seed=seed_of(indices[0]),
                          should_stop=should_stop, compile=compile)
        out, start = {}, 0
        for i in indices:
            stop = start + len(prompts[i]) * num_samples
            out[i] = merged.rows(start, stop)
            start = stop
        return out

    results: dict[int, Generation] = {}
    if concurrent and len(groups) > 1 and not compile:
        with ThreadPoolExecutor(max_workers=len(groups)) as pool:
            for part in pool.map(run_group, groups.values()):
                results.update(part)
    else:
        for indices in groups.values():
            results.update(run_group(indices))
    return [results[i] for i in range(len(team))]


def sample_team(team: Team, observations: Sequence[list[str]], num_samples: int, seed: int, *,
                compile: bool = False) -> list[Generation]:
    """For every agent i of ``team``, ``num_samples`` completions of each of its own observations
    ``observations[i]``, prompted in its role, the tokens fixed by ``seed``: the team's
    :data:`~teamrl.rollout.tree.SampleFn` in this process (``functools.partial(sample_team, team)``), and the local
    backend's :meth:`~teamrl.algorithms.base.AgentBackend.sample` (``compile``: ``rollout.compile``, see
    :func:`generate`)."""
    return generate_team(team, team.prompts(observations), num_samples, seed=seed, compile=compile)


class _StopWhen(StoppingCriteria):
    """Ends a ``generate`` call, every row at once, as soon as ``should_stop()`` says so."""

    def __init__(self, should_stop: Callable[[], bool]):
        self.should_stop = should_stop

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), bool(self.should_stop()), dtype=torch.bool, device=input_ids.device)


class _Sampler(LogitsProcessor):
    """Draws each row's next token, and records the log-prob of each drawn token; ``generate`` runs greedy on
    its output, which is 0 at the drawn token and -inf elsewhere.

    transformers' own sampling (``torch.multinomial``) draws an exponential variate per row *and
    vocabulary entry* at every step, about ten times the cost of inverse-CDF sampling (one uniform per
    row, located in the cumulative probabilities; docs/reports/step-time.md, "Second round"). The log-prob
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
