"""Mixed precision for models trained whole: float32 master weights, 16-bit compute.

AdamW updates a parameter in place in the parameter's dtype. In bfloat16 (8 bits of mantissa) a step smaller
than half the spacing between representable values around the weight is rounded away: at lr 5e-6, three steps
changed 7.5% of a 2048 x 2048 matrix's entries and none of the norm weights (~1.0, spacing 2^-7), where float32
changed all of them (issue #48). Every paper preset fine-tunes fully in bfloat16, so it would train almost nothing.

The standard remedy is the one ``accelerate`` (``Accelerator(mixed_precision="bf16")``) and the Hugging Face
Trainer (``bf16=True``) apply, and FSDP2's ``MixedPrecisionPolicy`` (``param_dtype=bfloat16``) reproduces for a
sharded model: the trained weights (and so their gradients and AdamW's moments) stay float32, and the forward
pass runs under ``torch.autocast`` in 16 bits, which casts each weight for its matmul (once per autocast region;
the casts are differentiable, so the float32 weights get the gradients). Memory per trained parameter: 4 bytes of
weight + 4 of gradient + 8 of AdamW state, the same 16 as 16-bit weights with a float32 master copy kept in the
optimiser (DeepSpeed's and Megatron's way), and no second set of weights to keep in sync. (torchtune trains
bfloat16 weights directly and accepts the lost updates; at the presets' learning rates they are most of them.)

LoRA needs nothing of this: the base is frozen, and PEFT keeps adapters in float32 on a 16-bit base
(``get_peft_model``/``add_adapter``'s ``autocast_adapter_dtype``, on by default), which teamrl's fused LoRA
layers run in the base's dtype (:mod:`teamrl.models.lora`).
"""

from __future__ import annotations

import types

import torch
from torch import nn

_COMPUTE_DTYPE = "teamrl_compute_dtype"


def train_in_mixed_precision(model: nn.Module, compute_dtype: torch.dtype) -> nn.Module:
    """``model`` (in place) with float32 weights whose forward passes compute in ``compute_dtype`` (bfloat16 or
    float16) under ``torch.autocast``: its own forward and its decoder's (``get_decoder()``, which critics and
    reward models call directly). A float32 ``compute_dtype`` changes nothing."""
    if compute_dtype == torch.float32:
        return model
    model.to(torch.float32)
    entries = [model]
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if isinstance(decoder, nn.Module) and decoder is not model:
        entries.append(decoder)
    for entry in entries:
        set_compute_dtype(entry, compute_dtype)
        # A bound method (not a closure over the module): deepcopy rebinds it to the copy (a KL reference).
        entry.forward = types.MethodType(_autocast_forward, entry)
    return model


def _autocast_forward(self: nn.Module, *args, **kwargs):
    device_type = next(self.parameters()).device.type
    with torch.autocast(device_type=device_type, dtype=getattr(self, _COMPUTE_DTYPE)):
        return type(self).forward(self, *args, **kwargs)


def set_compute_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Record that ``model`` computes in ``dtype`` whatever its weights' dtype (autocast here, or FSDP's mixed
    precision policy)."""
    setattr(model, _COMPUTE_DTYPE, dtype)


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype ``model``'s forward computes in: its mixed-precision dtype, else its weights' (the first one's)."""
    return getattr(model, _COMPUTE_DTYPE, None) or next(model.parameters()).dtype
