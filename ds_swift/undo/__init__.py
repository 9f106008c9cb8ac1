"""undo."""
