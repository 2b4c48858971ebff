"""teamrl.rollout."""
