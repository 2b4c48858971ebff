"""teamrl.envs."""
