"""Was the Ray backend, now ``teamrl.backends.ray``. Deprecated: its names moved (issue #47); importing one from here
warns and still works for one release.
"""

from teamrl._deprecated import moved_names

__getattr__ = moved_names(__name__, {
    "RayTeam": "teamrl.backends.ray:RayTeam",
    "AgentWorker": "teamrl.backends.ray:AgentWorker",
    "Seat": "teamrl.backends.ray:Seat",
})
