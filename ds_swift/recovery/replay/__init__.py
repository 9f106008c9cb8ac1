"""The replay from the message log that the logging strategies share: its plan, the
re-execution, the log reader's side, the served receives, parallel recovery and the runner."""
