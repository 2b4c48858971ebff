"""Was the Ray backend's package; the backends are ``teamrl.backends`` now (``RayTeam``: ``teamrl.backends.ray``).
Deprecated: importing a name from here warns and still works for one release (issue #47).
"""

from teamrl._deprecated import moved_names

__getattr__ = moved_names(__name__, {"RayTeam": "teamrl.backends.ray:RayTeam"})
