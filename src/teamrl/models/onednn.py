"""Float32 and bfloat16 linear layers on CPU through oneDNN's linear kernel.

torch runs a float32 ``nn.Linear`` on CPU as an MKL GEMM; oneDNN (which torch ships and uses for its
bfloat16 matmuls and for ``torch.compile``'s frozen CPU linears, ``torch.ops.mkldnn._linear_pointwise``)
is much faster at the shapes an LLM trains and samples with on a few cores, on CPUs with AVX-512. On an
AVX2-only one, oneDNN still decodes faster from prepacked weights, but the update ran faster on MKL, so
there passes with gradients stay on MKL (:func:`onednn_trains`). The measurements behind both: see
docs/reports/step-time.md#onednn-linear-layers.

Both are float32 arithmetic (sums in another order, ~1e-6 relative). For small weights (a LoRA rank,
the 576 -> 192 key/value projections) MKL's lower call overhead wins, so only layers with at least
``min_weights`` weights are switched.

bfloat16 ``nn.Linear`` already runs on oneDNN, but through ``torch.matmul``, which turns an input that
is not one contiguous block of rows (the last position of each sequence, or the completion positions
that ``logits_to_keep`` slices) into a batched matmul against a copy of the weight per sequence, many
times slower for the output layer (see docs/reports/step-time.md#onednn-linear-layers). The linear kernel takes
such inputs as they are, and the same packed weights speed up bfloat16 decoding as they do float32 decoding.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn

#: Smallest weight (in_features * out_features) switched: 576 x 576 wins with oneDNN, 576 x 192 loses
#: (docs/reports/step-time.md#onednn-linear-layers).
DEFAULT_MIN_WEIGHTS = 2**18


@functools.cache
def onednn_available() -> bool:
    """Whether this torch build has oneDNN's linear kernel (x86 and most ARM wheels do)."""
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDnnLinearFunction(torch.autograd.Function):
    """``F.linear`` with oneDNN in the forward pass and for the input gradient (the GEMMs that dominate
    an update on a frozen LoRA base); the weight gradient, needed only when fine-tuning the layer, stays
    with MKL, which measured as fast as oneDNN for that shape (docs/reports/step-time.md#onednn-linear-layers)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x if weight.requires_grad else None, weight if x.requires_grad else None)
        ctx.has_bias = bias is not None
        return _linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _linear(grad, weight.t(), None)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_weight = flat_grad.t() @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat_grad.sum(0)
        return grad_x, grad_weight, grad_bias


@functools.cache
def onednn_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes :class:`OneDnnLinear` runs on oneDNN's linear kernel: float32, and bfloat16 where this CPU
    has bfloat16 instructions (AVX512-BF16, AMX; oneDNN has no bfloat16 linear on AVX2-only CPUs, where
    such layers run as ``nn.Linear``)."""
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


@functools.cache
def onednn_trains() -> bool:
    """Whether passes with gradients (the update) run on oneDNN too, or as ``nn.Linear`` (MKL): oneDNN on
    CPUs with AVX-512, where it measured faster; MKL elsewhere: on an AVX2-only CPU the update measured
    faster on MKL, while decoding still ran faster on oneDNN's packed weights. Part of oneDNN's cost there
    is building a kernel for each new number of rows, and an update's micro-batches have as many row
    counts as completion lengths. Why: see docs/reports/step-time.md#onednn-linear-layers."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


class OneDnnLinear(nn.Linear):
    """An ``nn.Linear`` whose float32 and bfloat16 CPU forward and backward run on oneDNN's linear kernel
    (see the module docstring; bfloat16 where the CPU supports it, :func:`onednn_dtypes`; passes with
    gradients only where :func:`onednn_trains`). Anything else
    (another device or dtype, mixed dtypes, autocast) runs as a plain ``nn.Linear``; parameters, state dict
    and ``isinstance`` checks (PEFT's, for LoRA) are those of ``nn.Linear``."""

    packed_weight: torch.Tensor | None = None
    """The weight in oneDNN's blocked layout, while :func:`packed_weights` holds it (gradient-free passes only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type != "cpu" or x.dtype not in onednn_dtypes() or self.weight.dtype != x.dtype
                or torch.is_autocast_enabled("cpu")):
            return super().forward(x)
        if self.packed_weight is not None and not torch.is_grad_enabled():
            return _linear(x, self.packed_weight, self.bias)
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad
                                        or (self.bias is not None and self.bias.requires_grad)):
            if not onednn_trains():
                return super().forward(x)
            return _OneDnnLinearFunction.apply(x, self.weight, self.bias)
        return _linear(x, self.weight, self.bias)


def use_onednn_linears(model: nn.Module, min_weights: int = DEFAULT_MIN_WEIGHTS) -> int:
    """Switch ``model``'s plain ``nn.Linear`` layers with at least ``min_weights`` weights to
    :class:`OneDnnLinear`, in place (same parameters); returns how many. Nothing changes where this
    torch build has no oneDNN."""
    if not onednn_available():
        return 0
    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.in_features * module.out_features >= min_weights:
            module.__class__ = OneDnnLinear
            switched += 1
    return switched


@contextlib.contextmanager
def packed_weights(model: nn.Module, rows: int) -> Iterator[None]:
    """While open, ``model``'s :class:`OneDnnLinear` layers run gradient-free passes on a copy of their
    weight reordered into oneDNN's blocked layout for ``rows``-row inputs: shorter decoding steps for a
    one-off reordering and a second copy of those weights until the block ends (measured in
    docs/reports/step-time.md#onednn-linear-layers). The weights must not change inside the block (generation
    does not change them)."""
    layers = [m for m in model.modules() if isinstance(m, OneDnnLinear) and m.weight.dtype in onednn_dtypes()
              and m.weight.device.type == "cpu"]
    try:
        for layer in layers:
            layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), rows)
        yield
    finally:
        for layer in layers:
            layer.packed_weight = None
