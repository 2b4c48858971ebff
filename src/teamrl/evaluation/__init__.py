"""teamrl.evaluation."""
