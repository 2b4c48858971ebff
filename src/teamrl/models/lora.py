"""LoRA kernels for teams of adapters on one shared base model.

PEFT runs one adapter per forward pass (or gathers and scatters rows for mixed-adapter batches). A team
of LoRA agents on one base wants more: every row of a sampling batch through its own agent's adapter
(:class:`RowAdapters`), each training thread through its own agent's adapter (:func:`adapter_in_this_thread`
under :func:`active_adapter_fused`), and the adapter's update fused into the base layer's output. These
compute what PEFT computes (tests/models/test_lora.py compares them); why each exists and what it saves is
measured in docs/reports/step-time.md.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Iterator, Sequence

import torch


class RowAdapters:
    """Runs every row of a batch through its own LoRA adapter of one shared base.

    PEFT's mixed-adapter batches (``adapter_names=``) gather each adapter's rows, run its two small matmuls
    per layer on them and scatter the results back, which makes a team's decoding step markedly slower than
    one adapter's. Here each layer's adapters are stacked instead, A matrices one above the other (r1 + r2 +
    ... rows) and scaled B matrices side by side, and the layer adds ``((x @ A.T) * mask) @ B.T``, where
    ``mask`` keeps each row's own adapter's block of the rank dimension: the same sum as each row through its
    own adapter, in two matmuls for the whole team. A team's rows, which come as equal consecutive blocks per
    adapter, take :func:`_add_low_rank_grouped` instead: per block, its own adapter only. While routing, each
    LoRA layer's forward is replaced by its base layer plus the stacked update (not PEFT's forward with the
    adapters disabled and a hook adding it: ``disable_adapter`` checks every layer's status per call).
    Measurements: docs/reports/step-time.md, "Eighth round". Adapters this does not cover (DoRA and other variants,
    non-linear layers) keep PEFT's routing. Built with no model, it routes nothing (the model runs as it is).

    A model sharded by FSDP (:mod:`teamrl.backends.fsdp`) holds each layer's adapters in full only inside the
    layer's forward pass: its stacks are built there, at every call (``layers`` then hold no weights).
    """

    def __init__(self, model: torch.nn.Module | None = None, names: Sequence[str] = (),
                 layers: Sequence[tuple[torch.nn.Module, torch.Tensor | None, torch.Tensor | None]] = ()):
        self.model, self.names, self.layers = model, list(names), list(layers)
        #: Every layer's adapters have one rank, so a layer's stacked weights split into equal blocks.
        self.uniform_rank = all(len({module.lora_A[n].weight.shape[0] for n in self.names}) == 1
                                for module, _, _ in self.layers)

    @classmethod
    def build(cls, model: torch.nn.Module, adapter_names: Sequence[str]) -> RowAdapters:
        """The adapters named in ``adapter_names``, stacked per layer of ``model`` (or left to PEFT)."""
        names = list(dict.fromkeys(adapter_names))
        modules = plain_lora_layers(model, names)
        if modules is None:
            return cls(model)  # not a plain LoRA linear layer: PEFT routes every layer
        if any(_sharded(module.lora_A[n].weight) for module in modules for n in names):
            return cls(model, names, [(module, None, None) for module in modules])
        return cls(model, names, [(module, *_stacked(module, names)) for module in modules])

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
            forwards = [functools.partial(_grouped_forward, module, *_blocks(a, b, count, index))
                        if a is not None else functools.partial(_sharded_grouped_forward, module, self.names, index)
                        for module, a, b in self.layers]
        else:
            first_layer = self.layers[0][0]
            ranks = [first_layer.lora_A[n].weight.shape[0] for n in self.names]
            rank_block = torch.repeat_interleave(torch.arange(count), torch.tensor(ranks))
            row_block = torch.tensor([self.names.index(n) for n in row_names])
            mask = (row_block[:, None] == rank_block[None, :])[:, None, :]
            forwards = [functools.partial(_masked_forward, module, a, b, mask.to(a)) if a is not None
                        else functools.partial(_sharded_masked_forward, module, self.names, mask)
                        for module, a, b in self.layers]
        for (module, _, _), forward in zip(self.layers, forwards):
            module.forward = forward
        try:
            yield {}
        finally:
            for module, _, _ in self.layers:
                del module.forward


def _stacked(module: torch.nn.Module, names: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's adapters ``names`` stacked: A matrices one above the other, scaled B matrices side by side."""
    return (torch.cat([module.lora_A[n].weight for n in names]),
            torch.cat([module.lora_B[n].weight * module.scaling[n] for n in names], dim=1))


def _blocks(stacked_a: torch.Tensor, stacked_b: torch.Tensor, count: int,
            index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, in, r) and (blocks, r, out) views of the stacked weights, block k through adapter ``index[k]``."""
    return (stacked_a.view(count, -1, stacked_a.shape[1]).transpose(1, 2)[index],
            stacked_b.view(stacked_b.shape[0], count, -1).permute(1, 2, 0)[index])


def _sharded(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a shard (a DTensor, as FSDP2 keeps parameters between forward passes)."""
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor)


def _sharded_grouped_forward(layer: torch.nn.Module, names: Sequence[str], index: torch.Tensor, x: torch.Tensor,
                             *args, **kwargs) -> torch.Tensor:
    return _grouped_forward(layer, *_blocks(*_stacked(layer, names), len(names), index), x, *args, **kwargs)


def _sharded_masked_forward(layer: torch.nn.Module, names: Sequence[str], mask: torch.Tensor, x: torch.Tensor,
                            *args, **kwargs) -> torch.Tensor:
    stacked_a, stacked_b = _stacked(layer, names)
    return _masked_forward(layer, stacked_a, stacked_b, mask.to(stacked_a), x, *args, **kwargs)


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
    passes over the output-sized tensor (and one more in the backward), which on CPU cost more than the
    adapter's matmuls themselves (docs/reports/step-time.md, "Fourth round")."""
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
    through every adapter and masks: about half the time (docs/reports/step-time.md, "Eighth round")."""
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
    each on its own threads (:mod:`teamrl.algorithms.fast_update`)."""
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
    float32 and its output back costs a tenth of an update, and bfloat16 GEMMs of a few hundred rows by
    the rank are faster (docs/reports/step-time.md, "Sixth round"). Decoding keeps float32: there bfloat16's
    call overhead makes those small GEMMs slower."""
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
