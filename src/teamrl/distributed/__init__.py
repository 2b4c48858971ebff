"""Training past one process: the agents as Ray actors driven by the Trainer (``distributed.backend: ray``).

Needs the ``ray`` extra (``pip install "teamrl[ray]"``); see docs/distributed.md.
"""

from teamrl.distributed.ray_team import RayTeam

__all__ = ["RayTeam"]
