"""The job's checkpoints: periodic global checkpoints in DeepSpeed's format (``periodic``;
``background`` writes them off the training thread), CheckFreq's interval (``checkfreq``),
SCAR's running checkpoint (``running``) and crash-safe files (``durable``)."""
