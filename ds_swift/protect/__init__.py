"""Protection: what runs in every worker while nothing fails, so that a failure can be
recovered from (buddy copies, state digests, message and update logging, running checkpoints), one
object per protection with one lifecycle, built from the configured strategy's services."""
