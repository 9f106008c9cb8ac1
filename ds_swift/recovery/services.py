"""The failure-free half of a recovery strategy: what the job runs while nothing fails, so that the
strategy can restore the lost ranks when something does.

Each strategy declares it (:meth:`ds_swift.recovery.base.RecoveryStrategy.services`) as one
:class:`StrategyServices`; the runtime, the checkpoint set-up, the topology analyzer, the start-up
cost lines and the simulator read these fields, never the strategy's name. ``"strategy": "auto"``
runs the union of the services of the strategies ``auto`` may choose
(:meth:`ds_swift.recovery.base.Registry.services_for`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

__all__ = ["SimKind", "StageKind", "StrategyServices", "UpdateLog"]

#: What the topology analyzer may plan for a pipeline stage (ds_swift.plan.analysis).
StageKind = Literal["replication", "logging"]
#: Which ranks log their optimizer update after each step (ds_swift.protect.update_logger):
#: ``every_rank`` (TranLogs), ``per_stage`` (the stages ``logging.kinds`` says), or ``off``.
UpdateLog = Literal["off", "per_stage", "every_rank"]
#: How the what-if simulator models the strategy's recovery (ds_swift.sim.model).
SimKind = Literal["checkpoint", "snapshot", "replication", "logging", "elastic"]

_UPDATE_LOG_ORDER = ("off", "per_stage", "every_rank")


@dataclass(frozen=True)
class StrategyServices:
    """What one strategy needs running while nothing fails (all off: the global checkpoint only).

    Args:
        buddy_copies: copy each rank's optimizer partition to buddy ranks on other machines after
            every step (``buddy``; only where ``buddy.enabled`` and the state is partitioned).
        erasure_chunks: the copier sends each rank's whole state as erasure-coded chunks instead
            (``pipechurn``); takes precedence over ``buddy_copies``.
        inflight_copy: every rank keeps the iteration in flight (its sends and a gradient copy),
            so that after a decode only the lost ranks' passes run again (``pipechurn`` with
            ``pipechurn.partial_recompute``: ds_swift.recovery.state.inflight).
        digests: publish state digests every ``verify.digest_interval`` iterations (where
            ``verify.enabled``), for a restore to be checked against.
        update_log: which ranks log their optimizer update after each step.
        stage_recovery: what the topology analyzer may plan per pipeline stage (empty: every stage
            recovers by checkpoint, no pipeline message is logged).
        async_checkpoints: periodic checkpoints are asynchronous even where the state is on CPU.
        checkpoint_tuner: CheckFreq chooses the checkpoint interval from measured costs.
        running_checkpoint: SCAR's prioritized running checkpoints (``checkpoint.running_fraction``).
        elastic: with no spare left, the job goes on with fewer data-parallel replicas.
        sim_kind: how the what-if simulator models the recovery.
    """

    buddy_copies: bool = False
    erasure_chunks: bool = False
    inflight_copy: bool = False
    digests: bool = False
    update_log: UpdateLog = "off"
    stage_recovery: frozenset[StageKind] = frozenset()
    async_checkpoints: bool = False
    checkpoint_tuner: bool = False
    running_checkpoint: bool = False
    elastic: bool = False
    sim_kind: SimKind = "checkpoint"

    def merged(self, other: StrategyServices) -> StrategyServices:
        """Both strategies' services (``auto`` runs every service its candidates need)."""
        kinds = {"checkpoint": 0, "snapshot": 1, "logging": 2, "replication": 3, "elastic": 4}
        values: dict[str, object] = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "update_log":
                values[f.name] = max(a, b, key=_UPDATE_LOG_ORDER.index)
            elif f.name == "stage_recovery":
                values[f.name] = a | b
            elif f.name == "sim_kind":
                values[f.name] = max(a, b, key=kinds.__getitem__)  # the cheapest recovery auto may take
            else:
                values[f.name] = a or b
        return StrategyServices(**values)  # type: ignore[arg-type]
