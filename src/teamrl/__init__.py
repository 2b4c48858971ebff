"""teamrl: train teams of LLM agents to cooperate with multi-agent reinforcement learning (MAGRPO).

The data flow, one module each: task (``teamrl.envs``) -> rollout (``teamrl.rollout``) -> joint reward
(``teamrl.rewards``) -> returns and advantages (``teamrl.algorithms.advantages``) -> per-agent update
(``teamrl.algorithms.magrpo``), wired by ``teamrl.train.Trainer`` from a ``teamrl.config.TrainConfig``.

The names below are imported on first use (PEP 562): importing teamrl, or running ``teamrl --help``,
must not pay for torch and transformers (several seconds) before anything needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Each public name and the module that defines it.
_EXPORTS = {
    "Agent": "teamrl.team", "ConfigError": "teamrl.config", "Environment": "teamrl.envs.base",
    "RewardResult": "teamrl.rewards.base", "Step": "teamrl.envs.base", "Team": "teamrl.team",
    "TrainConfig": "teamrl.config", "Trainer": "teamrl.train", "config_from_dict": "teamrl.config",
    "load_config": "teamrl.config", "make_env": "teamrl.envs.base", "register_env": "teamrl.envs.base",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on demand
    from teamrl.config import ConfigError, TrainConfig, config_from_dict, load_config
    from teamrl.envs.base import Environment, Step, make_env, register_env
    from teamrl.rewards.base import RewardResult
    from teamrl.team import Agent, Team
    from teamrl.train import Trainer


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'teamrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
