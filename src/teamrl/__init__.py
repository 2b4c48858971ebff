"""teamrl: train teams of LLM agents to cooperate with multi-agent reinforcement learning (MAGRPO)."""

__version__ = "0.1.0"
