"""Which process of a multi-process job this is, for the code every rank runs alike (``distributed.backend: fsdp``):
rank 0 writes the run's files, and decisions that start collectives are taken by all ranks together. In a process
on its own every helper here is a no-op (rank 0 of 1)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_main_process() -> bool:
    """Whether this process writes the run's files: rank 0 of a job (``RANK`` before the group is joined), or a
    process on its own."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def barrier() -> None:
    """Wait for every rank."""
    if _distributed():
        dist.barrier()


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (a collective): what each rank saw (a signal, say) made one decision."""
    if not _distributed():
        return flag
    value = torch.tensor([1.0 if flag else 0.0])
    if dist.get_backend() == "nccl":
        value = value.cuda()
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
