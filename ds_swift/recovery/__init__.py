"""Recovery after a machine failure, run by every rank of the new generation.

- :mod:`~ds_swift.recovery.consensus`: what every rank agrees on (the reports, the consensus
  iteration, who undoes, the plan), as pure functions of what every rank reports;
- :mod:`~ds_swift.recovery.base`: the recovery-strategy interface (can it restore these lost
  ranks, at what cost, how) and the registry that asks the strategies cheapest first;
- :mod:`~ds_swift.recovery.registry`: the registered strategies, one line each:
  :mod:`~ds_swift.recovery.strategies.replication` (a surviving replica sends its whole state),
  :mod:`~ds_swift.recovery.strategies.buddy` (a lost rank's ZeRO-1/bf16 optimizer partition comes from the
  copy a buddy rank on another machine holds, see :mod:`ds_swift.runtime.buddy`),
  :mod:`~ds_swift.recovery.strategies.message_logging` (the failed logging groups replay from the message
  log, :mod:`~ds_swift.recovery.replay.runner` runs it, built on
  :mod:`~ds_swift.recovery.replay.engine`, :mod:`~ds_swift.recovery.replay.log`,
  :mod:`~ds_swift.recovery.replay.collectives` and :mod:`~ds_swift.recovery.replay.parallel`), and the fallback
  :mod:`~ds_swift.recovery.strategies.global_checkpoint` (every rank reloads the last global checkpoint);
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
