"""A change of the job's machines, made by a strategy instead of replacing a failed one.

Between a survivor's teardown and its join of the next generation, the runtime asks the configured
strategy (:meth:`~ds_swift.recovery.base.RecoveryStrategy.membership_change`) whether the next
generation has another shape: an elastic shrink with no spare left, or a grow when a machine
returns (ds_swift.recovery.strategies.elastic). The new ranks of a returning machine are asked too
(``joining``). A :class:`MembershipChange` says what the runtime applies before it joins (this rank's
new rank, the world's size, the DeepSpeed config, the machines in rank order), and the recovery
protocol restores through it (:func:`ds_swift.recovery.coordinator.run_recovery`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ds_swift.config import SwiftConfig
    from ds_swift.jobstore.membership import JobStore, WorkerEnv
    from ds_swift.recovery.base import RankContext, RecoveryOutcome
    from ds_swift.recovery.kept import KeptState

__all__ = ["MembershipChange", "MembershipRefused", "MembershipView"]


class MembershipRefused(RuntimeError):
    """The job cannot change its shape as the strategy would (the reason says why and what to do)."""


@dataclass(frozen=True)
class MembershipView:
    """What a strategy may read to decide a membership change.

    Args:
        store: the job store.
        generation: the generation that ended (a survivor's) or the one being joined, less one (a new rank's).
        env: this worker's environment (rank, machine, the job's machines).
        cfg: the swift config.
        ds_config: the DeepSpeed config the engine was built from.
        kept: a survivor's kept state (None: a new rank joining).
        machines: the job's machines in rank order before this change (None: never changed, all of them).
        failed_machine: waits (briefly) for the machine the launcher declared failed (None: none declared).
        join_timeout_s: how long a rank waits for the others.
        log: one line on ds-swift's channel.
    """

    store: JobStore
    generation: int
    env: WorkerEnv
    cfg: SwiftConfig
    ds_config: Mapping[str, Any]
    kept: KeptState | None
    machines: list[int] | None
    failed_machine: Callable[[], int | None]
    join_timeout_s: float
    log: Callable[[str], None]

    @property
    def joining(self) -> bool:
        """A new rank (of a machine that came back), not a survivor."""
        return self.kept is None


class MembershipChange(ABC):
    """The next generation's shape, and how every rank's recovery into it goes."""

    #: the strategy that made it (the recovery's timeline names it)
    strategy: str
    #: this rank's rank in the next generation
    rank: int
    #: the next generation's world size
    world: int
    #: the DeepSpeed config the next generation's engine is built from
    ds_config: Mapping[str, Any]
    #: the job's machines in rank order in the next generation
    machines: list[int]

    @abstractmethod
    def describe(self) -> str:
        """One line for the log: what changes."""

    @abstractmethod
    def restore(self, ctx: RankContext, zero_stage: int) -> RecoveryOutcome:
        """Every rank of the next generation (joined, its engine built at the new shape): the restore."""
