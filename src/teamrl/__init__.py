"""teamrl: train teams of LLM agents to cooperate with multi-agent reinforcement learning (MAGRPO).

The data flow, one module each: task (``teamrl.envs``) -> rollout (``teamrl.rollout``) -> joint reward
(``teamrl.rewards``) -> returns and advantages (``teamrl.algorithms.advantages``) -> per-agent update
(``teamrl.algorithms.magrpo``), wired by ``teamrl.train.Trainer`` from a ``teamrl.config.TrainConfig``.
"""

__version__ = "0.1.0"

from teamrl.config import ConfigError, TrainConfig, config_from_dict, load_config  # noqa: E402
from teamrl.envs.base import Environment, Step, make_env, register_env  # noqa: E402
from teamrl.rewards.base import RewardResult  # noqa: E402
from teamrl.team import Agent, Team  # noqa: E402
from teamrl.train import Trainer  # noqa: E402

__all__ = [
    "Agent", "ConfigError", "Environment", "RewardResult", "Step", "Team", "TrainConfig", "Trainer",
    "config_from_dict", "load_config", "make_env", "register_env",
]
