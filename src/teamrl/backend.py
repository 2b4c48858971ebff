"""Was the agents' backends (``teamrl.backends``) and the update's optimiser (``teamrl.algorithms.update``).
Deprecated: its names moved (issue #47); importing one from here warns and still works for one release.
"""

from teamrl._deprecated import moved_names

__getattr__ = moved_names(__name__, {
    "AgentBackend": "teamrl.algorithms.base:AgentBackend",
    "LocalBackend": "teamrl.backends.local:LocalBackend",
    "make_backend": "teamrl.backends:make_backend",
    "train_agents": "teamrl.backends.local:train_agents",
    "policy_logprobs": "teamrl.backends.local:policy_logprobs",
    "make_optimizer": "teamrl.algorithms.update:make_optimizer",
    "make_scheduler": "teamrl.algorithms.update:make_scheduler",
})
