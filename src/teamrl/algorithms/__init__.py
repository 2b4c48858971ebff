"""teamrl.algorithms."""
