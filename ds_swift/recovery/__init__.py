"""Recovery after a machine failure, run by every rank of the new generation.

- :mod:`~ds_swift.recovery.consensus`: what every rank agrees on (the reports, the consensus
  iteration, who undoes, the plan), as pure functions of what every rank reports;
- :mod:`~ds_swift.recovery.base`: the recovery-strategy interface (can it restore these lost
  ranks, at what cost, how) and the registry that asks the strategies cheapest first;
- :mod:`~ds_swift.recovery.registry`: the registered strategies, one line each (one module each in
  :mod:`ds_swift.recovery.strategies`, the global checkpoint the fallback); each owns both halves:
  what the job runs while nothing fails (:mod:`~ds_swift.recovery.services`: buddy copies, erasure
  chunks, digests, the update log, message logging, asynchronous or tuned checkpoints, elastic
  resizes) and the restore, built on the mechanics they share (:mod:`~ds_swift.recovery.replay`,
  :mod:`~ds_swift.recovery.state`);
- :mod:`~ds_swift.recovery.coordinator`: one rank's side of the protocol (reports, choice,
  restore, verify, barrier); :mod:`~ds_swift.recovery.verify`: each restored rank's state checked
  against a reference digest (:mod:`~ds_swift.recovery.state.digest`), a mismatch a failed restore;
  :mod:`~ds_swift.recovery.kept`: what a survivor keeps across the rebuild;
  :mod:`~ds_swift.recovery.host`: what the runtime lends a recovery.

The engine wrapper that detects failures and rebuilds DeepSpeed in-process is in
:mod:`ds_swift.runtime`.
"""

from ds_swift.recovery.base import RecoveryStrategy, Registry
from ds_swift.recovery.consensus import LoggingSetup, RankReport, RecoveryInputs, RecoveryPlan

__all__ = ["LoggingSetup", "RankReport", "RecoveryInputs", "RecoveryPlan", "RecoveryStrategy", "Registry"]
