"""The registered recovery strategies: a new strategy is one module and one line in this list.

The order here does not matter (the registry asks the cheapest first, see
:meth:`~ds_swift.recovery.base.Registry.choose`); the global checkpoint is the fallback.
"""

from __future__ import annotations

from collections.abc import Iterable

from ds_swift.recovery.base import Registry
from ds_swift.recovery.consensus import LoggingSetup, RankReport, RecoveryInputs, RecoveryPlan
from ds_swift.recovery.strategies.buddy import BuddyStrategy
from ds_swift.recovery.strategies.global_checkpoint import GlobalCheckpointStrategy
from ds_swift.recovery.strategies.lossy import LossyForwardStrategy
from ds_swift.recovery.strategies.message_logging import LoggingStrategy
from ds_swift.recovery.strategies.pipechurn import PipeChurnStrategy
from ds_swift.recovery.strategies.replication import ReplicationStrategy
from ds_swift.recovery.strategies.rollback import ImmediateRollbackStrategy
from ds_swift.recovery.strategies.scar import ScarStrategy
from ds_swift.recovery.strategies.tranlogs import TranLogsStrategy

__all__ = ["STRATEGIES", "plan_recovery"]

STRATEGIES = Registry(
    [
        ReplicationStrategy(),
        BuddyStrategy(),
        LoggingStrategy(),
        TranLogsStrategy(),
        PipeChurnStrategy(),
        ScarStrategy(),
        ImmediateRollbackStrategy(),
        LossyForwardStrategy(),
    ],
    fallback=GlobalCheckpointStrategy(),
)


def plan_recovery(
    reports: Iterable[RankReport],
    zero_stage: int = 0,
    forced: str = "auto",
    optimizer: str | None = None,
    logging: LoggingSetup | None = None,
    checkpoint_step: int | None = None,
    registry: Registry = STRATEGIES,
    partitioned: bool = False,
) -> RecoveryPlan:
    """The plan every rank computes from every rank's report: the consensus, then the cheapest
    registered strategy able to restore the lost ranks (pure: no process group).

    Args:
        reports: one report per rank of the new generation.
        zero_stage: the ZeRO stage; above 0 each rank holds the only copy of its optimizer partition.
        forced: the config's ``strategy`` (auto, or a registered strategy's name).
        optimizer: the name of an optimizer wrapper whose state survivors cannot keep across the
            rebuild, or None.
        logging: what logging-based recovery may use (None: no message log).
        checkpoint_step: the newest complete global checkpoint (default: ``logging``'s, else -1).
        registry: the strategies to choose from.
        partitioned: each data-parallel rank holds only its slice of the optimizer state.
    """
    if checkpoint_step is None:
        checkpoint_step = logging.checkpoint_step if logging is not None else -1
    inputs = RecoveryInputs.agree(
        reports, checkpoint_step=checkpoint_step, logging=logging, forced=forced, zero_stage=zero_stage,
        optimizer_wrapper=optimizer, partitioned=partitioned,
    )  # fmt: skip
    return registry.choose(inputs)[0]
