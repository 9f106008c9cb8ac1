"""What every rank agrees on at the start of a recovery, as pure functions of what every rank published.

After a failure every rank of the new generation publishes a :class:`RankReport` (survivor or
replacement, its pipeline coordinates, its machine, the last iteration whose optimizer step it
applied). Every rank then derives the same :class:`RecoveryInputs` from the same reports, so no
further agreement round is needed:

- the consensus pre-failure iteration is the newest iteration every survivor stepped
  (``min`` of their last stepped iterations); survivors ahead of it undo (SWIFT section 4);
- which of those survivors cannot undo (no own copy of the consensus iteration, and no record or
  more than one step ahead).

Which strategy restores the lost ranks is each strategy's own question
(:meth:`~ds_swift.recovery.base.RecoveryStrategy.can_restore`); the registry
(:mod:`ds_swift.recovery.registry`) asks them and returns the :class:`RecoveryPlan`.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ds_swift.recovery.holdings import BuddyHeld, MessageLogHeld

__all__ = ["LoggingSetup", "RankReport", "RecoveryInputs", "RecoveryPlan"]


@dataclass(frozen=True)
class RankReport:
    """What one rank tells the others at the start of a recovery."""

    rank: int
    survivor: bool
    stage: int
    dp: int
    tp: int
    machine: int
    last_stepped: int = -1
    """The last iteration whose step this rank applied (-1: none, or a replacement)."""
    can_undo: bool = False
    """The rank can undo its steps back to one iteration before ``last_stepped``."""
    holdings: Mapping[str, Any] = field(default_factory=dict)
    """What this rank's protections hold for the recovery, by protection name (JSON objects; a
    strategy reads one through its view in ds_swift.recovery.holdings, e.g. ``BuddyHeld.of(report)``)."""
    checkpoints: tuple[int, ...] = ()
    """The iterations of the newest checkpoints this rank can load, newest first (a few: see
    ds_swift.recovery.coordinator ``common_checkpoint``)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RankReport:
        doc = json.loads(text)
        doc["checkpoints"] = tuple(doc.get("checkpoints", ()))
        return cls(**doc)


@dataclass(frozen=True)
class RecoveryPlan:
    """What every rank does next; identical on every rank."""

    strategy: str
    """The name of the strategy that restores the lost ranks (see ds_swift.recovery.registry)."""
    reason: str
    consensus: int
    """The agreed pre-failure iteration: every rank resumes at ``consensus + 1``."""
    survivors: tuple[int, ...]
    replacements: tuple[int, ...]
    donors: dict[int, int] = field(default_factory=dict)
    """replacement rank -> donor rank"""
    undo: tuple[int, ...] = ()
    """survivors that undo their last step(s) down to ``consensus``"""
    replay_ranks: tuple[int, ...] = ()
    """logging: the ranks that load the global checkpoint and replay (the failed logging groups)"""
    replay_from: int = 0
    """logging: the first iteration replayed (the global checkpoint's iterations done; 0: the initial state)"""

    @property
    def replay_iterations(self) -> range:
        """logging: the iterations replayed, ``replay_from .. consensus`` (empty when nobody replays)."""
        return range(self.replay_from, self.consensus + 1) if self.replay_ranks else range(0)

    @property
    def pre_failure_iteration(self) -> int:
        """The iteration in flight when the failure hit, as agreed: training is "back" when it is reached."""
        return self.consensus + 1

    def donor_of(self, rank: int) -> int | None:
        return self.donors.get(rank)

    def recipients_of(self, rank: int) -> list[int]:
        return sorted(r for r, d in self.donors.items() if d == rank)


@dataclass(frozen=True)
class LoggingSetup:
    """What logging-based recovery can use, the same on every rank.

    Args:
        replayable_stages: the pipeline stages the topology plan recovers by logging (their inbound
            cross-group sends are logged).
        machine_groups: the selective-logging groups of machines (section 5.3); a failure rolls the
            whole group of the failed machine back. Machines in no group form their own.
        checkpoint_step: the newest global checkpoint complete for every rank (iterations done;
            -1: none yet, the replay starts from the initial state).
        unavailable: why logging-based recovery from that checkpoint is known not to work (a replay
            of an earlier attempt found a missing or corrupt log record), or None.
        update_stages: the stages recovered by logging that log their updates (TranLogs' per-stage
            mix, ``logging.kinds``): a lost rank of theirs re-applies its own logged updates.
    """

    replayable_stages: frozenset[int]
    machine_groups: tuple[tuple[int, ...], ...] = ()
    checkpoint_step: int = -1
    unavailable: str | None = None
    update_stages: frozenset[int] = frozenset()

    def group_machines(self, machines: Collection[int]) -> set[int]:
        """Every machine sharing a logging group with one of ``machines``."""
        out = set(machines)
        for group in self.machine_groups:
            if out & set(group):
                out |= set(group)
        return out


@dataclass(frozen=True)
class RecoveryInputs:
    """Everything a strategy's decision reads, the same on every rank (build it with :meth:`agree`).

    Args:
        reports: one report per rank of the new generation, by rank.
        consensus: the agreed pre-failure iteration (the newest one every survivor stepped; -1: none).
        survivors: the ranks that kept their state across the failure.
        replacements: the ranks that lost it (their machine failed): the lost ranks to restore.
        undo: the survivors ahead of the consensus, which undo their last step.
        cannot_undo: those of ``undo`` that cannot (no own copy of the consensus iteration, and no
            undo record or more than one step ahead).
        checkpoint_step: the newest global checkpoint complete for every rank (-1: none yet).
        logging: what logging-based recovery may use (None: no message log).
        forced: the config's ``strategy``: "auto", or the name of the one strategy allowed (the
            global checkpoint stays the fallback).
        zero_stage: the ZeRO stage; above 0 each rank holds the only copy of its optimizer partition.
        optimizer_wrapper: the name of an optimizer wrapper whose state survivors cannot keep across
            the rebuild (ZeRO 2/3, CPU offload: see ds_swift.patches.deepspeed_optim_state), or None.
        partitioned: each data-parallel rank holds only its own slice of the optimizer state
            (ZeRO-1, BF16_Optimizer): a replica cannot donate a lost rank's slice.
    """

    reports: tuple[RankReport, ...]
    consensus: int
    survivors: tuple[int, ...]
    replacements: tuple[int, ...]
    undo: tuple[int, ...] = ()
    cannot_undo: tuple[int, ...] = ()
    checkpoint_step: int = -1
    logging: LoggingSetup | None = None
    forced: str = "auto"
    zero_stage: int = 0
    optimizer_wrapper: str | None = None
    partitioned: bool = False

    @classmethod
    def agree(
        cls,
        reports: Iterable[RankReport],
        *,
        checkpoint_step: int = -1,
        logging: LoggingSetup | None = None,
        forced: str = "auto",
        zero_stage: int = 0,
        optimizer_wrapper: str | None = None,
        partitioned: bool = False,
        consensus: int | None = None,
    ) -> RecoveryInputs:
        """The consensus iteration and who undoes, from every rank's report (any order).

        ``consensus``: an iteration below the newest every survivor stepped (a strategy whose
        source lags, see :meth:`rebased`); by default that newest one.
        """
        ordered = tuple(sorted(reports, key=lambda r: r.rank))
        survivors = tuple(r.rank for r in ordered if r.survivor)
        replacements = tuple(r.rank for r in ordered if not r.survivor)
        ahead = [r for r in ordered if r.survivor]
        if consensus is None:
            consensus = min((r.last_stepped for r in ahead), default=-1)
        undo = tuple(r.rank for r in ahead if r.last_stepped > consensus)
        cannot = tuple(
            r.rank
            for r in ahead
            if r.last_stepped > consensus
            and consensus not in BuddyHeld.of(r).own
            and (not r.can_undo or r.last_stepped - consensus > 1)
        )
        return cls(
            ordered,
            consensus,
            survivors,
            replacements,
            undo,
            cannot,
            checkpoint_step,
            logging,
            forced,
            zero_stage,
            optimizer_wrapper,
            partitioned,
        )

    def rebased(self, consensus: int) -> RecoveryInputs:
        """The same inputs agreeing on an earlier ``consensus`` (more survivors undo, maybe some cannot)."""
        return RecoveryInputs.agree(
            self.reports,
            checkpoint_step=self.checkpoint_step,
            logging=self.logging,
            forced=self.forced,
            zero_stage=self.zero_stage,
            optimizer_wrapper=self.optimizer_wrapper,
            partitioned=self.partitioned,
            consensus=consensus,
        )

    @property
    def by_rank(self) -> dict[int, RankReport]:
        return {r.rank: r for r in self.reports}

    def undoes_exactly(self, rank: int, to: int | None = None) -> bool:
        """Survivor ``rank`` gets back to iteration ``to`` (default: the consensus; a plan's, where a
        strategy rebased it) bitwise: it holds its own copy of that iteration (otherwise it undoes
        one step by update-undo's inverse update, within 2 ulp)."""
        return (self.consensus if to is None else to) in BuddyHeld.of(self.by_rank[rank]).own

    def undo_words(self) -> str:
        """How the survivors of ``undo`` get back to the consensus, for a plan's reason ("" where
        none undoes): bitwise from their own copies, or by update-undo's inverse update."""
        exact = [r for r in self.undo if self.undoes_exactly(r)]
        inexact = [r for r in self.undo if r not in exact]
        words = f"; survivors {exact} undo to iteration {self.consensus} from their own copies of it" if exact else ""
        return words + (
            f"; survivors {inexact} undo to iteration {self.consensus} by the inverse update" if inexact else ""
        )

    def lost_log_senders(self, group: Collection[int]) -> list[tuple[int, str]]:
        """``(rank, why)`` of the pipeline neighbours outside ``group`` whose message log stopped
        covering their sends: the messages a replay of ``group`` needs from them are missing."""
        members = {r.rank for r in self.reports if r.rank in group}
        coords = {(r.stage, r.dp, r.tp) for r in self.reports if r.rank in members}
        lost = {r.rank: MessageLogHeld.of(r).lost for r in self.reports}
        return [
            (r.rank, why)
            for r in self.reports
            if (why := lost[r.rank]) is not None
            and r.rank not in members
            and ((r.stage - 1, r.dp, r.tp) in coords or (r.stage + 1, r.dp, r.tp) in coords)
        ]

    @property
    def failed_machines(self) -> set[int]:
        """The machines of the lost ranks."""
        return {r.machine for r in self.reports if not r.survivor}

    def keep_blocker(self) -> str | None:
        """Why the survivors cannot keep their own state to the consensus iteration (None: they can).

        Every strategy that keeps the survivors' state needs this; the global checkpoint does not.
        """
        if not self.survivors:
            return "no rank survived with its state"
        if self.cannot_undo:
            return (
                f"ranks {list(self.cannot_undo)} stepped past the consensus iteration {self.consensus} and cannot undo"
            )
        return None

    def reload_blocker(self) -> str | None:
        """Why the survivors cannot keep their state while the lost ranks reload theirs from the
        global checkpoint (TranLogs, SCAR's partial recovery); None: they can, or nobody is lost."""
        why = self.keep_blocker()
        if why is not None or not self.replacements:
            return why
        return self.wrapper_blocker()

    def wrapper_blocker(self) -> str | None:
        """Why survivors cannot keep their optimizer wrapper's state across the rebuild (None: they can)."""
        if self.optimizer_wrapper is not None:
            return f"{self.optimizer_wrapper}: survivors cannot keep its state across the rebuild"
        return None

    def unpartitioned_blocker(self) -> str | None:
        """Why the state a replica holds is not a whole rank's state (None: it is).

        Under ZeRO stage > 0 (and BF16_Optimizer) a lost rank's optimizer partition exists only on
        that rank, and on its buddies (ds_swift.recovery.strategies.buddy).
        """
        why = self.wrapper_blocker()
        if why is not None:
            return why
        if self.partitioned or self.zero_stage > 0:
            what = f"ZeRO stage {self.zero_stage}" if self.zero_stage > 0 else "BF16_Optimizer"
            return (
                f"{what} keeps each rank's optimizer partition only on that rank (and its buddy copies): "
                f"a replica does not hold the partitions of ranks {list(self.replacements)}"
            )
        return None

    def plan(
        self,
        strategy: str,
        reason: str = "",
        *,
        donors: dict[int, int] | None = None,
        replay_ranks: tuple[int, ...] = (),
        replay_from: int = 0,
    ) -> RecoveryPlan:
        """A plan of ``strategy`` carrying this consensus, plus the strategy's own fields."""
        return RecoveryPlan(
            strategy,
            reason,
            self.consensus,
            self.survivors,
            self.replacements,
            donors=dict(donors or {}),
            undo=self.undo,
            replay_ranks=replay_ranks,
            replay_from=replay_from,
        )
