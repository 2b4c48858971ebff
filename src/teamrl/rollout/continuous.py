"""Continuous batching: one decoding loop for requests that come and go, every row through its own agent.

A program's agents are called one request at a time, from many episodes at once, each request whenever the
program gets to it. :class:`ContinuousBatcher` decodes every request in flight together: one forward pass per
decoding step for all the rows on one base model, each row through its own agent's LoRA adapter
(:class:`~teamrl.models.lora.RowAdapters`, as :func:`~teamrl.rollout.generate.generate` routes a team's rows),
and a request that arrives while others decode joins at the next step instead of waiting for the batch to end.
A row leaves as soon as it ends (its end-of-sequence token, a stop string, ``max_new_tokens``), and its caller
gets, exactly as sampled, the prompt's token ids, the completion's token ids and each token's log-prob under the
temperature-scaled policy that drew it (what training's :func:`~teamrl.algorithms.logprobs.token_logprobs`
recomputes): nothing is re-tokenised from text.

Why not transformers' own continuous batching (``generate_batch``, ``init_continuous_batching`` in 5.24): it runs
one model with one active adapter (a team's rows need one adapter each in the same pass), draws with
``torch.multinomial`` from one global stream (no per-request seed), records the log-prob after top-k/top-p
filtering (training's is before), and knows no stop strings. The loop here is small: the rows' keys and values sit
in per-layer buffers, right-aligned so that every row writes its next position in the same column
(:class:`_Slots`, no copy per step); a join or a departure copies the buffers once.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper
from transformers.cache_utils import Cache, DynamicLayer

from teamrl.config import SamplingConfig
from teamrl.models.kv_cache import cache_arg, cache_of
from teamrl.models.lora import RowAdapters
from teamrl.models.onednn import packed_weights
from teamrl.runtime import release_freed_memory
from teamrl.team import Agent, Team


@dataclass(frozen=True)
class TokenRequest:
    """One completion to sample: agent ``agent``'s continuation of ``prompt_ids``."""

    agent: int
    """The agent's index in the team."""
    prompt_ids: tuple[int, ...]
    sampling: SamplingConfig
    stop: tuple[str, ...] = ()
    """The completion ends where its text first contains one of these (the text returned stops before it)."""
    seed: int | None = None
    """Draws from a stream of its own seeded so (the same tokens for the same inputs); None: torch's global one."""
    ignore_eos: bool = False
    """Decode ``max_new_tokens`` tokens whatever is drawn (benchmarks' fixed-length requests, as vLLM's option)."""


@dataclass
class TokenCompletion:
    """What a request sampled, token for token."""

    agent: int
    prompt_ids: list[int]
    completion_ids: list[int]
    """Every token drawn, up to and including the end-of-sequence token or the one that completed a stop string."""
    logprobs: list[float]
    """log pi(token | everything before) under the temperature-scaled policy that drew it, one per completion id."""
    text: str
    """The completion's text (special tokens dropped, cut before a stop string)."""
    finish_reason: str
    """'stop' (an end-of-sequence token or a stop string) or 'length' (``max_new_tokens`` drawn)."""


class TokenEngine:
    """What a caller sees of an engine that samples requests arriving at any time, one thread running the models:
    :meth:`submit` a :class:`TokenRequest`, get a future of its :class:`TokenCompletion`. The transformers backend's
    is :class:`ContinuousBatcher`, vLLM's :class:`~teamrl.rollout.vllm_continuous.VLLMTokenEngine`; a subclass
    runs a busy period (:meth:`_run_busy`: until nothing is waiting or in flight, taking in what arrives meanwhile).
    Weights must not change while a request is in flight: :meth:`wait_idle` before updating them (each busy period
    reads them afresh)."""

    thread_name = "teamrl-token-engine"

    def __init__(self, team: Team, *, max_rows: int = 64):
        if max_rows < 1:
            raise ValueError(f"max_rows: must be >= 1 (got {max_rows})")
        self.team, self.max_rows = team, max_rows
        self._queue: queue.Queue[_Row | None] = queue.Queue()
        self._waiting: list[_Row] = []
        self._thread: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._idle_lock = threading.Lock()  # a submit never slips between the worker's last look and its idle flag
        self._tokenizer_locks = {id(agent.tokenizer): threading.Lock() for agent in team}
        self._rows: dict[int, _Row] = {}

    # ------------------------------------------------------------------------------------------ the callers' side

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Finish the requests in flight, then end the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None

    def submit(self, request: TokenRequest) -> Future[TokenCompletion]:
        """Queue ``request``; its future gets the :class:`TokenCompletion` (or the error that stopped it).
        Cancelling the future drops the request, at the next step if it is decoding."""
        if self._thread is None:
            raise RuntimeError(f"the {type(self).__name__} is not running")
        agent = self.team[request.agent]
        row = _Row(request, agent, Future(), generator=_generator(request.seed))
        self._rows[id(row.future)] = row
        row.future.add_done_callback(lambda done: self._rows.pop(id(done), None))
        with self._idle_lock:
            self._idle.clear()
            self._queue.put(row)
        return row.future

    def cancel(self, future: Future) -> None:
        """Drop the request behind ``future`` (one :meth:`submit` returned): it stops at the next step, and its future
        is cancelled."""
        row = self._rows.get(id(future))
        if row is not None:
            row.dropped = True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is queued or decoding (True), or ``timeout`` seconds passed (False)."""
        return self._idle.wait(timeout)

    def encode(self, agent: Agent, text: str) -> list[int]:
        """``text``'s token ids as ``agent``'s prompts are encoded for training
        (:func:`~teamrl.rollout.generate.encode_prompts`: a chat template places its own special tokens, plain text
        gets the tokenizer's), under the lock this thread decodes with: a fast tokenizer is not used by two threads
        at once."""
        with self._tokenizer_locks[id(agent.tokenizer)]:
            return list(agent.tokenizer(text, add_special_tokens=not agent.uses_chat_template)["input_ids"])

    @property
    def queued(self) -> int:
        return self._queue.qsize() + len(self._waiting)

    # ------------------------------------------------------------------------------------------ the worker's side

    def _in_flight(self) -> list[_Row]:
        """The rows decoding now."""
        raise NotImplementedError

    def _run_busy(self, stopping: bool) -> bool:
        """Sample until nothing is waiting or in flight; whether the stop sentinel came meanwhile."""
        raise NotImplementedError

    def _went_idle(self) -> None:
        """Nothing is waiting or in flight any more (the busy period's end, or a failed one)."""

    def _work(self) -> None:
        stopping = False
        while True:
            busy = bool(self._waiting) or bool(self._in_flight())
            if not busy:
                self._went_idle()
                with self._idle_lock:
                    if self._queue.empty():
                        self._idle.set()
                if stopping:
                    return
            stopping = self._drain(block=not busy) or stopping
            if not self._waiting and not self._in_flight():
                continue
            try:
                stopping = self._run_busy(stopping)
            except Exception as err:  # no caller may be left waiting, whatever failed
                for row in self._waiting + self._in_flight():
                    if not row.future.done():
                        row.future.set_exception(err)
                self._waiting = []
                self._went_idle()
            release_freed_memory()  # else fragmented arenas grow the process step after step

    def _drain(self, block: bool) -> bool:
        """Move queued rows to the waiting list; whether the stop sentinel came."""
        stop = False
        try:
            item = self._queue.get() if block else self._queue.get_nowait()
            while True:
                if item is None:
                    stop = True
                elif item.future.set_running_or_notify_cancel():
                    self._waiting.append(item)
                item = self._queue.get_nowait()
        except queue.Empty:
            pass
        return stop

    def _finish_reason(self, row: _Row) -> str | None:
        """'stop', 'length' or None (the row goes on); sets ``row.text``."""
        ended = row.tokens[-1] in row.eos and not row.request.ignore_eos
        with self._tokenizer_locks[id(row.agent.tokenizer)]:
            row.text = row.agent.tokenizer.decode(row.tokens, skip_special_tokens=True)
        for stop in row.request.stop:
            cut = row.text.find(stop)
            if cut >= 0:
                row.text = row.text[:cut]
                return "stop"
        row.text = row.text.strip()
        if ended:
            return "stop"
        return "length" if len(row.tokens) >= row.request.sampling.max_new_tokens else None

    def _complete(self, row: _Row, finish: str) -> None:
        row.future.set_result(TokenCompletion(row.request.agent, list(row.request.prompt_ids), row.tokens,
                                              row.logprobs, row.text, finish))


class ContinuousBatcher(TokenEngine):
    """The one thread that runs a team's transformers models for requests arriving at any time
    (:meth:`~TokenEngine.submit`).

    Each decoding step runs every row in flight on a base model in one forward pass; rows submitted meanwhile are
    prefilled (identical prompts of one agent once) and join at the next step; at most ``max_rows`` rows decode
    at once per base, the others wait their turn.
    """

    thread_name = "teamrl-continuous-batcher"

    def __init__(self, team: Team, *, max_rows: int = 64):
        super().__init__(team, max_rows=max_rows)
        self._batches: dict[int, _Batch] = {}
        self._prompts: dict[int, tuple[tuple, _PromptCache]] = {}
        """Per base model: the prompts prefilled lately, with the state of the weights they were computed with."""
        self.steps = 0
        """Decoding steps run so far (every base's step counts once)."""
        self.prefilled_tokens = 0
        """Prompt tokens run so far (those of an opening an earlier prompt shared are not run again)."""

    def _in_flight(self) -> list[_Row]:
        return [row for batch in self._batches.values() for row in batch.rows]

    def _went_idle(self) -> None:
        self._batches = {}

    def _run_busy(self, stopping: bool) -> bool:
        with torch.no_grad(), self._busy_period():
            return self._decode_while_busy(stopping)

    def _decode_while_busy(self, stopping: bool) -> bool:
        """Admit, step and retire until nothing is in flight (rows arriving meanwhile join); whether to stop after."""
        while self._waiting or any(batch.rows for batch in self._batches.values()):
            self._admit()
            for batch in self._batches.values():
                if batch.rows:
                    batch.step()
                    self.steps += 1
                    self._retire(batch)
            stopping = self._drain(block=False) or stopping
        return stopping

    @contextlib.contextmanager
    def _busy_period(self):
        """While requests are in flight: the base weights packed for decoding and each base's adapters stacked as
        they are now (they do not change until the team is idle again)."""
        with contextlib.ExitStack() as stack:
            for agent in {id(agent.model): agent for agent in self.team}.values():
                agent.model.eval()
                stack.enter_context(packed_weights(agent.model, rows=self.max_rows))
            self._adapters = {}
            for model_id, agents in _by_model(self.team).items():
                names = [agent.adapter for agent in agents if agent.adapter is not None]
                self._adapters[model_id] = RowAdapters.build(agents[0].model, names) if names else RowAdapters()
                weights = _weights_state(agents[0].model)
                if self._prompts.get(model_id, (None,))[0] != weights:  # trained since: the cached keys are stale
                    self._prompts[model_id] = (weights, _PromptCache())
            try:
                yield
            finally:
                for batch in self._batches.values():
                    batch.unroute()

    def _admit(self) -> None:
        """Prefill the waiting rows that fit (``max_rows`` per base) and have them join their base's batch."""
        joining: dict[int, list[_Row]] = {}
        still_waiting = []
        for row in self._waiting:
            if row.gone:
                continue
            model_id = id(row.agent.model)
            batch = self._batches.get(model_id)
            room = self.max_rows - (len(batch.rows) if batch else 0) - len(joining.get(model_id, ()))
            if room > 0:
                joining.setdefault(model_id, []).append(row)
            else:
                still_waiting.append(row)
        self._waiting = still_waiting
        for model_id, rows in joining.items():
            batch = self._batches.setdefault(model_id, _Batch(rows[0].agent.model, self._adapters[model_id],
                                                              self._prompts[model_id][1]))
            self.prefilled_tokens += batch.join(rows)
            self._retire(batch)  # a row may end with its first token

    def _retire(self, batch: _Batch) -> None:
        """Hand every finished (or cancelled) row its result and take it out of ``batch``."""
        keep = []
        for index, row in enumerate(batch.rows):
            if row.gone:
                continue
            finish = self._finish_reason(row)
            if finish is None:
                keep.append(index)
                continue
            self._complete(row, finish)
        if len(keep) < len(batch.rows):
            batch.keep(keep)


@dataclass
class _Row:
    """A request in the batcher: what it sampled so far."""

    request: TokenRequest
    agent: Agent
    future: Future
    generator: torch.Generator | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    dropped: bool = False
    """Its caller went away (:meth:`ContinuousBatcher.cancel`)."""

    @property
    def gone(self) -> bool:
        """Whether nobody waits for this row any more (cancelled before it started, or dropped since)."""
        if self.dropped and not self.future.done():
            self.future.set_exception(CancelledError())
        return self.future.cancelled() or self.dropped

    def __post_init__(self) -> None:
        self.eos = set(self.agent.eos_token_ids)


class _Batch:
    """The rows decoding on one base model, and their keys and values."""

    def __init__(self, model: torch.nn.Module, adapters: RowAdapters, prompts: _PromptCache):
        self.model, self.adapters = model, adapters
        self.rows: list[_Row] = []
        self.cache: Cache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        """(rows, columns used) 1 where a row has a token: rows are right-aligned, every row's next at column n."""
        self._route = contextlib.ExitStack()
        self._routing: dict | None = None
        self._routed: list[str | None] = []
        self.prompts = prompts
        """The keys and values of the prompts prefilled lately, for later prompts that open alike."""

    def join(self, rows: list[_Row]) -> int:
        """Prefill ``rows`` and add them, their first tokens drawn: each distinct prompt of an agent once, and only
        the part after the longest opening a prompt prefilled earlier (with the same weights) shares with it (the G
        episodes of an item send their first prompt at about the same time, not in one step). Returns the prompt
        tokens it ran."""
        device = next(self.model.parameters()).device
        keys = [(row.agent.adapter, row.request.prompt_ids) for row in rows]
        distinct = list(dict.fromkeys(keys))
        self.unroute()
        fresh = [key for key in distinct if self.prompts.longest(*key)[0] == 0]
        prefilled = dict(zip(fresh, self._prefill(fresh, device))) if fresh else {}
        ran = sum(len(ids) for _, ids in fresh)
        for key in distinct:
            if key not in prefilled:
                shared, opening = self.prompts.longest(*key)
                prefilled[key] = self._prefill_after(key, shared, opening)
                ran += len(key[1]) - shared
            self.prompts.add(*key, prefilled[key][0])
        width = max(len(ids) for _, ids in distinct)
        layers = [(torch.cat([_left_pad_keys(prefilled[key][0][layer][0], width) for key in keys]),
                   torch.cat([_left_pad_keys(prefilled[key][0][layer][1], width) for key in keys]))
                  for layer in range(len(prefilled[distinct[0]][0]))]
        mask = torch.stack([_right_aligned_ones(len(ids), width, device) for _, ids in keys])
        self._append(layers, mask)
        self.rows += rows
        _draw(rows, torch.cat([prefilled[key][1] for key in keys]))
        self._group_by_adapter()
        return ran

    def _prefill(self, prompts: list[tuple[str | None, tuple[int, ...]]], device: torch.device,
                 ) -> list[tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]]:
        """Each of ``prompts`` (adapter, ids) run in one left-padded pass: its (1, heads, length, dim) keys and values
        per layer, and its (1, vocabulary) last logits."""
        width = max(len(ids) for _, ids in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for r, (_, prompt) in enumerate(prompts):
            ids[r, width - len(prompt):] = torch.tensor(prompt, device=device)
            mask[r, width - len(prompt):] = 1
        with self.adapters.route(self._names([name for name, _ in prompts])) as routing:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                             **cache_arg(DynamicCache()), use_cache=True, logits_to_keep=1, **routing)
        layers = cache_of(out).layers
        return [([(layer.keys[r:r + 1, :, width - len(prompt):], layer.values[r:r + 1, :, width - len(prompt):])
                  for layer in layers], out.logits[r:r + 1, -1]) for r, (_, prompt) in enumerate(prompts)]

    def _prefill_after(self, key: tuple[str | None, tuple[int, ...]], length: int,
                       opening: list[tuple[torch.Tensor, torch.Tensor]],
                       ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """``key``'s prompt run after the keys and values of its first ``length`` tokens (``opening``)."""
        name, prompt = key
        rest = torch.tensor([prompt[length:]], device=opening[0][0].device)
        past = DynamicCache([(keys[:, :, :length], values[:, :, :length]) for keys, values in opening])
        with self.adapters.route(self._names([name])) as routing:
            out = self.model(input_ids=rest, position_ids=torch.arange(length, len(prompt), device=rest.device)[None],
                             **cache_arg(past), use_cache=True, logits_to_keep=1, **routing)
        return [(layer.keys, layer.values) for layer in cache_of(out).layers], out.logits[:, -1]

    def step(self) -> None:
        """One decoding step for every row: each row's last token in, its next token drawn."""
        device = self.mask.device
        tokens = torch.tensor([[row.tokens[-1]] for row in self.rows], device=device)
        positions = self.mask.sum(dim=1, keepdim=True)
        self.mask = torch.cat([self.mask, torch.ones_like(positions)], dim=1)
        out = self.model(input_ids=tokens, attention_mask=self.mask, position_ids=positions,
                         **cache_arg(self.cache), use_cache=True, **self._routed_rows())
        _draw(self.rows, out.logits[:, -1])

    def _routed_rows(self) -> dict:
        """Route each row through its adapter: set up once for as long as the rows stay the same (building a route
        stacks every layer's adapters, a tenth of a step), the keyword arguments the forward call needs."""
        names = [row.agent.adapter for row in self.rows]
        if self._routing is None or names != self._routed:
            self.unroute()
            self._routing = self._route.enter_context(self.adapters.route(self._names(names)))
            self._routed = names
        return self._routing

    def unroute(self) -> None:
        """The model's layers back as they are outside this batch's decoding steps."""
        self._route.close()
        self._routing = None

    def keep(self, indices: list[int]) -> None:
        """Only rows ``indices`` go on; columns no remaining row uses are dropped."""
        self.rows = [self.rows[i] for i in indices]
        if not self.rows:
            self.unroute()
            self.cache, self.mask = None, torch.zeros(0, 0, dtype=torch.long)
            return
        which = torch.tensor(indices, device=self.mask.device)
        mask = self.mask.index_select(0, which)
        first = int(mask.any(dim=0).nonzero()[0])
        self.mask = mask[:, first:]
        for layer in self.cache.layers:
            layer.select(which, first)

    def _group_by_adapter(self) -> None:
        """Reorder the rows so that each adapter's are consecutive: a decoding step then runs each adapter once on its
        block of rows (:class:`~teamrl.models.lora.RowAdapters`), not once per run of rows."""
        order = sorted(range(len(self.rows)), key=lambda r: self.rows[r].agent.adapter or "")
        if order == list(range(len(self.rows))):
            return
        which = torch.tensor(order, device=self.mask.device)
        self.rows = [self.rows[r] for r in order]
        self.mask = self.mask.index_select(0, which)
        for layer in self.cache.layers:
            layer.select(which, 0)

    def _names(self, adapters: Sequence[str | None]) -> list[str] | None:
        return None if self.adapters.model is None else list(adapters)

    def _append(self, layers: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> None:
        """Add rows whose keys and values are ``layers`` (right-aligned, ``mask`` marking their tokens)."""
        if self.cache is None:
            self.cache = Cache(layers=[_Slots(keys, values) for keys, values in layers])
            self.mask = mask
            return
        width = max(self.mask.shape[1], mask.shape[1])
        self.mask = torch.cat([_left_pad(self.mask, width), _left_pad(mask, width)])
        for layer, (keys, values) in zip(self.cache.layers, layers):
            layer.stack(keys, values, width)


class _Slots(DynamicLayer):
    """A cache layer whose keys and values sit in a buffer with room to grow: a decoding step writes its column in
    place, where :class:`~transformers.cache_utils.DynamicLayer` concatenates (copies the whole cache) every step.
    ``keys``/``values`` are views of the columns in use."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.device, self.is_initialized = keys.device, True
        self._place([keys], [values], keys.shape[2])

    def _place(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], width: int) -> None:
        """Hold the rows of ``keys``/``values`` (stacked in order), each right-aligned to ``width`` columns, in fresh
        buffers with :data:`HEADROOM` columns to spare."""
        rows = sum(part.shape[0] for part in keys)
        shape = (rows, keys[0].shape[1], width + HEADROOM, keys[0].shape[3])
        self._keys, self._values = keys[0].new_zeros(shape), values[0].new_zeros(shape)
        start = 0
        for key_part, value_part in zip(keys, values):
            stop, columns = start + key_part.shape[0], key_part.shape[2]
            self._keys[start:stop, :, width - columns:width] = key_part
            self._values[start:stop, :, width - columns:width] = value_part
            start = stop
        self._use(width)

    def _use(self, used: int) -> None:
        self.used = used
        self.keys, self.values = self._keys[:, :, :used], self._values[:, :, :used]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        new = key_states.shape[2]
        if self.used + new > self._keys.shape[2]:
            self._place([self.keys], [self.values], self.used)
        self._keys[:, :, self.used:self.used + new] = key_states
        self._values[:, :, self.used:self.used + new] = value_states
        self._use(self.used + new)
        return self.keys, self.values

    def select(self, rows: torch.Tensor, first_column: int) -> None:
        """Keep ``rows``, from column ``first_column`` on."""
        self._place([self.keys.index_select(0, rows)[:, :, first_column:]],
                    [self.values.index_select(0, rows)[:, :, first_column:]], self.used - first_column)

    def stack(self, keys: torch.Tensor, values: torch.Tensor, width: int) -> None:
        """Add rows ``keys``/``values`` below the ones held, both right-aligned to ``width`` columns."""
        self._place([self.keys, keys], [self.values, values], width)


class _PromptCache:
    """Prompts prefilled lately (their keys and values, by adapter and token ids), at most :data:`PROMPT_CACHE_TOKENS`
    tokens of them, the least recently used dropped first."""

    def __init__(self):
        self.entries: dict[tuple[str | None, tuple[int, ...]], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def longest(self, adapter: str | None, ids: tuple[int, ...]) -> tuple[int, list | None]:
        """The most tokens of ``ids`` (all but the last: its logits are needed) a cached prompt of ``adapter`` opens
        with, and that prompt's keys and values; (0, None) below :data:`MIN_REUSED_TOKENS`."""
        best, found = 0, None
        for name, cached in self.entries:
            if name != adapter:
                continue
            shared = _common_prefix(cached, ids, len(ids) - 1)
            if shared > best:
                best, found = shared, (name, cached)
        if best < MIN_REUSED_TOKENS:
            return 0, None
        self.entries[found] = self.entries.pop(found)  # most recently used last
        return best, self.entries[found]

    def add(self, adapter: str | None, ids: tuple[int, ...], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.entries.pop((adapter, ids), None)
        self.entries[(adapter, ids)] = [(keys.clone(), values.clone()) for keys, values in layers]
        while sum(len(key[1]) for key in self.entries) > PROMPT_CACHE_TOKENS and len(self.entries) > 1:
            self.entries.pop(next(iter(self.entries)))


def _weights_state(model: torch.nn.Module) -> tuple:
    """What changes when ``model``'s weights do: every parameter's storage and in-place version counter (an optimiser
    step, a checkpoint loaded into them)."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


#: Prompt tokens whose keys and values a batch keeps for later prompts that open alike (about 0.4 GB for a
#: SmolLM2-135M-sized model); a prompt opening shorter than MIN_REUSED_TOKENS alike is prefilled whole.
PROMPT_CACHE_TOKENS = 8192
MIN_REUSED_TOKENS = 8

#: Columns a rebuilt cache buffer keeps free for the next decoding steps (a full one is rebuilt with as many more).
HEADROOM = 64


def _left_pad_keys(keys: torch.Tensor, width: int) -> torch.Tensor:
    """(1, heads, length, dim) ``keys`` with zero positions on the left up to ``width``."""
    pad = keys.new_zeros(keys.shape[0], keys.shape[1], width - keys.shape[2], keys.shape[3])
    return torch.cat([pad, keys], dim=2)


def _right_aligned_ones(length: int, width: int, device: torch.device) -> torch.Tensor:
    mask = torch.zeros(width, dtype=torch.long, device=device)
    mask[width - length:] = 1
    return mask


def _left_pad(mask: torch.Tensor, width: int) -> torch.Tensor:
    """``mask`` with zero columns on the left up to ``width``."""
    return torch.cat([mask.new_zeros(mask.shape[0], width - mask.shape[1]), mask], dim=1)


def _draw(rows: Sequence[_Row], logits: torch.Tensor) -> None:
    """Draw each row's next token from its (rows, vocabulary) ``logits`` under its own sampling settings, recording
    the token and its log-prob under the temperature-scaled policy (before top-k/top-p, as training computes it),
    by inverse-CDF sampling with one uniform per row (its own stream, or torch's)."""
    temperatures = torch.tensor([row.request.sampling.temperature for row in rows], device=logits.device)
    scaled = logits.float() / temperatures[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    probs = logprobs.exp()
    for (top_k, top_p), members in itertools.groupby(
            sorted(range(len(rows)), key=lambda r: _filters(rows[r])), key=lambda r: _filters(rows[r])):
        if top_k == 0 and top_p >= 1.0:
            continue
        members = torch.tensor(list(members), device=logits.device)
        warpers = LogitsProcessorList(([TopKLogitsWarper(top_k)] if top_k > 0 else [])
                                      + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else []))
        probs[members] = torch.softmax(warpers(None, scaled[members]), dim=-1)
    cumulative = probs.cumsum(dim=-1)
    uniforms = torch.cat([torch.rand(1, generator=row.generator) for row in rows]).to(logits.device)
    tokens = torch.searchsorted(cumulative, (uniforms * cumulative[:, -1])[:, None], right=True)
    tokens = tokens.clamp_(max=cumulative.shape[1] - 1).squeeze(1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    for row, token, logprob in zip(rows, tokens.tolist(), chosen.tolist()):
        row.tokens.append(token)
        row.logprobs.append(logprob)


def _filters(row: _Row) -> tuple[int, float]:
    return row.request.sampling.top_k, row.request.sampling.top_p


def _generator(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed)


def _by_model(team: Team) -> dict[int, list[Agent]]:
    groups: dict[int, list[Agent]] = {}
    for agent in team:
        groups.setdefault(id(agent.model), []).append(agent)
    return groups
