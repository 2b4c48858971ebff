"""teamrl.baselines."""
