"""msglog."""
