"""Joint reward functions: each is a plain function of the joint action (one completion per agent)."""

from teamrl.rewards.base import RewardResult

__all__ = ["RewardResult"]
