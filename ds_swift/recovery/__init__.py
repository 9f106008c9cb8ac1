"""Recovery after a machine failure, run by every rank of the new generation.

- :mod:`~ds_swift.recovery.consensus`: the plan (consensus iteration, undo, donors, strategy) as a
  pure function of what every rank reports;
- :mod:`~ds_swift.recovery.coordinator`: one rank's side of the protocol, and what a survivor
  keeps across the rebuild;
- :mod:`~ds_swift.recovery.replication`: moving a rank's whole training state to a replacement;
- :mod:`~ds_swift.recovery.logging_recovery`: logging-based recovery in the runtime (check round,
  checkpoint load, replay, waiting on the store, the loud fallback), built on
  :mod:`~ds_swift.recovery.replay` (re-executing lost iterations from the message log),
  :mod:`~ds_swift.recovery.replay_log` (log prefetch, progress), :mod:`~ds_swift.recovery.collectives`
  (the optimizer step's recorded collectives) and :mod:`~ds_swift.recovery.parallel` (survivors
  sharing the replay).

The checkpoint fallback lives in :mod:`ds_swift.checkpoint`; the engine wrapper that detects
failures and rebuilds DeepSpeed in-process in :mod:`ds_swift.engine`.
"""

from ds_swift.recovery.consensus import LoggingSetup, RankReport, RecoveryPlan, plan_recovery

__all__ = ["LoggingSetup", "RankReport", "RecoveryPlan", "plan_recovery"]
