"""teamrl.feedback."""
