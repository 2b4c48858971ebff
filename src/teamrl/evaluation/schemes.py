"""Was the coding task's cooperation schemes, now ``teamrl.envs.code_schemes`` (the task names its schemes:
``Environment.cooperation_schemes``). Deprecated: importing a name from here warns and still works for one release
(issue #47)."""

from teamrl._deprecated import moved_names

__getattr__ = moved_names(__name__, {name: f"teamrl.envs.code_schemes:{name}" for name in (
    "SCHEMES", "SchemeResult", "classify_scheme", "scheme_distribution")})
