"""Training past one process: the agents as Ray actors driven by the Trainer (``distributed.backend: ray``; needs the
``ray`` extra, ``pip install "teamrl[ray]"``), or every model sharded across a torchrun job's processes
(``distributed.backend: fsdp``, :mod:`teamrl.distributed.fsdp`); see docs/distributed.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RayTeam"]


def __getattr__(name: str) -> Any:
    # Imported on first use: ray is an optional extra, and the FSDP backend, a module of this package, needs none.
    if name == "RayTeam":
        from teamrl.distributed.ray_team import RayTeam

        return RayTeam
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
