"""Gateway."""
