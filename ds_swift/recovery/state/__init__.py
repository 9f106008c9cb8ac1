"""State mechanics the strategies share: state transfer, buddy assignment, digests,
erasure-coded chunks, the update log."""
