"""One module per recovery strategy; the registered list is ds_swift.recovery.registry."""
