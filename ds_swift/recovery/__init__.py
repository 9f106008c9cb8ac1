"""Recovery after a machine failure, run by every rank of the new generation.

- :mod:`~ds_swift.recovery.consensus`: the plan (consensus iteration, undo, donors, strategy) as a
  pure function of what every rank reports;
- :mod:`~ds_swift.recovery.coordinator`: one rank's side of the protocol, and what a survivor
  keeps across the rebuild;
- :mod:`~ds_swift.recovery.replication`: moving a rank's whole training state to a replacement;
- :mod:`~ds_swift.recovery.replay` / :mod:`~ds_swift.recovery.parallel`: logging-based replay of
  lost iterations from the message log (not wired into the coordinator yet: a stage without a
  replica falls back to the global checkpoint).

The checkpoint fallback lives in :mod:`ds_swift.checkpoint`; the engine wrapper that detects
failures and rebuilds DeepSpeed in-process in :mod:`ds_swift.engine`.
"""

from ds_swift.recovery.consensus import RankReport, RecoveryPlan, plan_recovery

__all__ = ["RankReport", "RecoveryPlan", "plan_recovery"]
