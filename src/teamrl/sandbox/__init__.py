"""teamrl.sandbox."""
