"""teamrl.models."""
