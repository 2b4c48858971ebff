"""Environments: the Dec-POMDP interface and the built-in tasks."""

from teamrl.envs import build as _build  # noqa: F401  (registers 'build')
from teamrl.envs import coding as _coding  # noqa: F401  (registers 'humaneval', 'coophumaneval', 'mbpp')
from teamrl.envs import schedule as _schedule  # noqa: F401  (registers 'schedule')
from teamrl.envs import writing as _writing  # noqa: F401  (registers 'tldr' and 'arxiv')
from teamrl.envs.base import ENVIRONMENTS, Environment, Step, make_env, register_env
from teamrl.envs.checks import EnvironmentOutputError
from teamrl.envs.dataset import DatasetTask
from teamrl.envs.digit_sum import DigitSumGame
from teamrl.envs.program import ProgramTask

__all__ = ["ENVIRONMENTS", "DatasetTask", "DigitSumGame", "Environment", "EnvironmentOutputError", "Step", "make_env",
           "ProgramTask", "register_env"]
