"""The recovery-strategy interface, and the registry that picks a strategy by capability and cost.

A strategy answers three questions about one recovery, from inputs every rank shares
(:class:`~ds_swift.recovery.consensus.RecoveryInputs`): can it restore these lost ranks
(:meth:`RecoveryStrategy.can_restore`, a pure function: unit-testable without processes), about
how much the restore costs (:meth:`RecoveryStrategy.expected_cost`), and what every rank does
(:meth:`RecoveryStrategy.plan`). Then every rank runs :meth:`RecoveryStrategy.restore` with its
own :class:`RankContext`.

The :class:`Registry` asks its strategies cheapest first and takes the first that can; the global
checkpoint is its fallback, last and always able. The registered strategies are listed in
:mod:`ds_swift.recovery.registry`: a new strategy is one module and one line there.
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ds_swift.logs import say
from ds_swift.recovery.consensus import RecoveryInputs, RecoveryPlan
from ds_swift.recovery.handover import Handover
from ds_swift.recovery.services import StrategyServices

if TYPE_CHECKING:
    from ds_swift.checkpoint.periodic import CheckpointManager
    from ds_swift.config import SimulateConfig, SwiftConfig
    from ds_swift.jobstore.membership import JobStore, WorkerEnv
    from ds_swift.recovery.kept import KeptState
    from ds_swift.recovery.simulated_failure import SimulatedFailure
    from ds_swift.recovery.state.digest import Verdict
    from ds_swift.recovery.timeline import RankTimeline

__all__ = [
    "BenchVariant",
    "MembershipChange",
    "MembershipRefused",
    "MembershipView",
    "RankContext",
    "RecoveryOutcome",
    "RecoveryStrategy",
    "Registry",
    "RestoreFailed",
    "Rider",
    "announce_deviation",
    "checkpoint_source",
    "loud",
    "redo_words",
]


def loud(rank: int, msg: str) -> None:
    """A line every operator must see (a fallback, a lost iteration): a warning on ds-swift's channel."""
    say(msg, rank, level=logging.WARNING, name=__name__)


def checkpoint_source(checkpoint_step: int) -> str:
    """What a reload starts from: ``global_step<n>``, or the initial state (-1: none complete yet)."""
    return f"global_step{checkpoint_step}" if checkpoint_step >= 0 else "the initial state"


def redo_words(summary: Mapping[str, Any] | None, how: str) -> str:
    """The summary line's words for a restore that redid iterations on the lost ranks from a log
    (``summary``: its :attr:`RecoveryOutcome.summary`; ``how``: what they did, "replayed")."""
    if not summary:
        return ""
    r = summary
    par = f", parallel {r['parallel']}" if r.get("parallel") else ""
    return (
        f"ranks {r['ranks']} {how} iterations {r['from']}..{r['to']} from {r['source']} in "
        f"{r['replay_s']:.2f} s, {r['log_bytes_read'] / 1e6:.1f} MB of log{par}"
    )


@dataclass
class RecoveryOutcome:
    """What one rank's recovery did (the runtime logs it and writes the timeline from it)."""

    plan: RecoveryPlan
    resume_iteration: int
    checkpoint_step: int | None = None
    bytes_moved: int = 0
    notes: list[str] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    """What the restore did, the same on every rank, for the timeline (its ``replay`` entry: the
    iterations a message-log replay or re-applied update log covered, the passes PipeChurn ran)."""
    latest_checkpoint: int = -1
    """The newest global checkpoint complete for every rank (iterations done; -1: none)."""
    deviation: str | None = None
    """Approximate strategies: how far the restored state is from the failure-free run's."""
    verdict: Verdict | None = None
    """This rank's check of the state it restored against its reference digest (None: it restored
    nothing that has one; see ds_swift.recovery.verify)."""
    back_iteration: int | None = None
    """Training is back once ``global_steps`` reaches it (None: the plan's pre-failure iteration;
    a strategy that counts more, as PipeChurn the in-flight iteration done again, sets it)."""
    handed: Handover = field(default_factory=Handover)
    """What the strategy hands the runtime to act on when training resumes, by type
    (ds_swift.recovery.handover: lossy forward's GradScale, PipeChurn's FinishIteration)."""


def announce_deviation(
    ctx: RankContext, inputs: RecoveryInputs, strategy: str, outcome: RecoveryOutcome, deviation: str
) -> None:
    """An approximate strategy's deviation: in the outcome (and so the timeline) on every rank, and
    said loudly once, by the lowest rank."""
    say_deviation(ctx.rank, ctx.rank == min(r.rank for r in inputs.reports), strategy, outcome, deviation)


def say_deviation(rank: int, lowest: bool, strategy: str, outcome: RecoveryOutcome, deviation: str) -> None:
    """:func:`announce_deviation` where the reports are not at hand (an elastic resize, whose ranks
    are renumbered): ``lowest`` is whether this rank is the one that says it."""
    outcome.deviation = deviation
    if lowest:
        loud(rank, f"APPROXIMATE RECOVERY (strategy {strategy}): {deviation}")


@dataclass
class Rider:
    """What the runtime agrees in the recovery's restore round instead of in a round of its own (three
    store requests per rank saved): each rank's ``value(resume_iteration)``, the round leader's
    ``decide`` over every rank's (the same function on every rank), and, once the round ended without
    a fallback, the decision (``said``, the same on every rank). Lent to the recovery
    (``RankContext.lent``) for ``generation``; ds-swift's post-recovery guard agrees its reference
    losses this way (ds_swift.runtime.guard)."""

    generation: int
    value: Callable[[int], str]
    decide: Callable[[Mapping[int, str]], str]
    said: str | None = None


@dataclass
class RankContext:
    """What this rank brings to a restore (its engine, the job store, what it kept).

    Args:
        store: the job's key-value store.
        generation: the generation being recovered into (already joined).
        rank: this rank.
        engine: this rank's rebuilt DeepSpeed engine.
        kept: a survivor's state kept across the rebuild (None: a replacement).
        ckpt: the global checkpoint manager (None: checkpoints are off).
        timeline: this rank's recovery timeline (strategies stamp their phases).
        gather_timeout_s: the longest a store gather waits for every rank.
        verify: check restored state against its reference digest (``verify.enabled``).
        lent: what the runtime kept for the strategies while nothing failed, by type
            (ds_swift.recovery.handover; a strategy reads its own: ``ctx.lent.get(InflightKeeper)``).
    """

    store: JobStore
    generation: int
    rank: int
    engine: Any
    kept: KeptState | None
    ckpt: CheckpointManager | None
    timeline: RankTimeline
    gather_timeout_s: float
    verify: bool = False
    lent: Handover = field(default_factory=Handover)

    def log(self, msg: str) -> None:
        """One line on ds-swift's channel (ds_swift.logs), tagged with this rank."""
        say(msg, self.rank, name=__name__)

    def keep_state(self, plan: RecoveryPlan) -> None:
        """A survivor that keeps its state (not one of ``plan.replay_ranks``): undo to the consensus
        where the plan says so, then load what it kept into the rebuilt engine."""
        if self.kept is None or self.rank in plan.replay_ranks:
            return
        self.kept.restore(self.engine, plan.consensus, self.rank in plan.undo, self.timeline)


class RestoreFailed(Exception):
    """A restore that every rank agrees failed: every rank falls back to the global checkpoint.

    Raise it only with the same reason on every rank (after an agreement round); a failure one
    rank sees alone fails the generation instead.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class BenchVariant:
    """A row of ``ds-swift bench`` that runs its strategy another way (:meth:`RecoveryStrategy.bench_variants`).

    Args:
        swift: the swift section's overrides beside ``strategy`` (the declaring strategy's name).
        spare: the failure job has a spare machine; False: none, the launcher's ``--elastic`` (a shrink).
    """

    swift: Mapping[str, Any] = field(default_factory=dict)
    spare: bool = True


class RecoveryStrategy(ABC):
    """One way to restore the ranks a failure lost.

    Subclasses set ``name`` (the config's ``"strategy"`` value that forces it) and ``exact``
    (exact strategies end bitwise equal to the failure-free run; approximate ones report their
    deviation in :attr:`RecoveryOutcome.deviation`).
    """

    name: ClassVar[str]
    exact: ClassVar[bool] = True
    auto: ClassVar[bool] = True
    """Whether ``"strategy": "auto"`` may choose it (False: it needs set-up only its own name turns on)."""
    SERVICES: ClassVar[StrategyServices] = StrategyServices()
    """What :meth:`services` returns unless a strategy overrides it."""
    BENCH_VARIANTS: ClassVar[Mapping[str, BenchVariant]] = {}
    """What :meth:`bench_variants` returns unless a strategy overrides it."""

    def services(self, cfg: SwiftConfig) -> StrategyServices:
        """What the job runs while nothing fails so that this strategy can restore (its set-up half).

        Args:
            cfg: the swift config (a strategy may read its own sub-section).
        """
        return self.SERVICES

    def bench_variants(self, pp: int) -> Mapping[str, BenchVariant]:
        """Rows of ``ds-swift bench`` beside this strategy's own, by name (ds_swift.bench.variants).

        Args:
            pp: the bench job's pipeline stages (a variant may depend on them).
        """
        return self.BENCH_VARIANTS

    def summary_words(self, summary: Mapping[str, Any] | None, checkpoint_step: int | None) -> str:
        """What this strategy's restore did, in the recovery's summary line after its name
        (ds_swift.recovery.timeline; "": nothing more to say).

        Args:
            summary: the restore's :attr:`RecoveryOutcome.summary` (the same on every rank).
            checkpoint_step: the global checkpoint the restore loaded (None: none).
        """
        return ""

    def offered(self, inputs: RecoveryInputs) -> bool:
        """Whether to ask this strategy although the config does not name it: under ``auto`` where
        :attr:`auto` allows (a strategy may also serve another one's set-up, as TranLogs serves the
        stages that log their updates under ``logging``)."""
        return self.auto and inputs.forced == "auto"

    @abstractmethod
    def can_restore(self, inputs: RecoveryInputs) -> str | None:
        """Why this strategy cannot restore the lost ranks (None: it can). Pure: no process group,
        no store, no file; the same answer on every rank.

        Args:
            inputs: the consensus, every rank's report and what the job has set up.
        """

    @abstractmethod
    def expected_cost(self, inputs: RecoveryInputs) -> float:
        """About how many iterations of training time the restore takes (orders the strategies).

        Args:
            inputs: as for :meth:`can_restore`.
        """

    def plan(self, inputs: RecoveryInputs) -> RecoveryPlan:
        """What every rank does next (called only where :meth:`can_restore` said it can).

        Args:
            inputs: as for :meth:`can_restore`.
        """
        return inputs.plan(self.name)

    def simulated_failure(self, cfg: SimulateConfig) -> SimulatedFailure | None:
        """This strategy's failure-simulation mode (``simulate_failure``; ds_swift.recovery.simulated_failure),
        or None where it has none."""
        return None

    def membership_change(self, view: MembershipView) -> MembershipChange | None:
        """Before a survivor joins the next generation (and when a new rank joins, ``view.joining``):
        a change of the job's machines this strategy makes instead of a replacement, which the
        runtime applies and the protocol restores through (ds_swift.recovery.base); None: the
        job keeps its shape (a failed machine is replaced).

        Args:
            view: what the strategy may read (the store, this worker, its kept state, the failed machine).
        """
        return None

    @abstractmethod
    def restore(self, plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> RecoveryOutcome:
        """Run this rank's side of the restore; every rank of the generation calls it.

        Args:
            plan: the plan :meth:`plan` returned (identical on every rank).
            inputs: as for :meth:`can_restore`.
            ctx: this rank's engine, store and kept state.

        Raises:
            RestoreFailed: the restore is impossible after all (the same on every rank): the
                coordinator runs the global checkpoint's restore instead.
        """


def _join(parts: Iterable[str], tail: str) -> str:
    head = "; ".join(dict.fromkeys(p for p in parts if p))  # two strategies refusing for one reason say it once
    return f"{head}: {tail}" if head and tail else head or tail


class Registry:
    """The strategies a recovery may use; :meth:`choose` asks them cheapest first.

    Args:
        strategies: the strategies, each with a distinct name.
        fallback: the global checkpoint: last, always able, what a failed restore falls back to.
    """

    def __init__(self, strategies: Iterable[RecoveryStrategy], fallback: RecoveryStrategy) -> None:
        self.fallback = fallback
        self._strategies: list[RecoveryStrategy] = []
        for strategy in strategies:
            self.register(strategy)

    def register(self, strategy: RecoveryStrategy) -> None:
        """Add ``strategy`` (its place in the order comes from its expected cost)."""
        if strategy.name in self.names():
            raise ValueError(f"a recovery strategy named {strategy.name!r} is registered already")
        self._strategies.append(strategy)

    def copy(self) -> Registry:
        return Registry(self._strategies, self.fallback)

    def names(self) -> list[str]:
        return [s.name for s in self._strategies] + [self.fallback.name]

    def get(self, name: str) -> RecoveryStrategy:
        """The strategy registered as ``name`` (KeyError naming the registered ones where none is)."""
        for strategy in [*self._strategies, self.fallback]:
            if strategy.name == name:
                return strategy
        raise KeyError(f"no recovery strategy named {name!r}: one of {', '.join(self.names())}")

    def simulated_names(self) -> list[str]:
        """The strategies with a failure-simulation mode (``simulate_failure.strategy``)."""
        own = RecoveryStrategy.simulated_failure
        return [s.name for s in [*self._strategies, self.fallback] if type(s).simulated_failure is not own]

    def services_for(self, cfg: SwiftConfig) -> StrategyServices:
        """What the job runs while nothing fails under ``cfg.strategy``: the named strategy's
        services, or under ``auto`` the union of those of every strategy ``auto`` may choose."""
        if cfg.strategy != "auto":
            return self.get(cfg.strategy).services(cfg)
        out = self.fallback.services(cfg)
        for strategy in self._strategies:
            if strategy.auto:
                out = out.merged(strategy.services(cfg))
        return out

    def membership_change(self, forced: str, view: MembershipView) -> MembershipChange | None:
        """The membership change the configured strategy makes (``forced``: the config's strategy;
        under ``auto``, the first any strategy ``auto`` may choose makes), or None."""
        asked = [s for s in self._strategies if s.auto] if forced == "auto" else [self.get(forced)]
        return next((c for s in asked if (c := s.membership_change(view)) is not None), None)

    def candidates(self, inputs: RecoveryInputs) -> list[RecoveryStrategy]:
        """The strategies to ask, cheapest first (ties: in registration order), the fallback excluded."""
        if inputs.forced == self.fallback.name:
            return []
        chosen = [s for s in self._strategies if s.name == inputs.forced]
        if inputs.forced != "auto" and not chosen:
            raise ValueError(f"unknown recovery strategy {inputs.forced!r}: one of auto, {', '.join(self.names())}")
        also = [s for s in self._strategies if s not in chosen and s.offered(inputs)]
        return chosen + sorted(also, key=lambda s: s.expected_cost(inputs))

    def choose(self, inputs: RecoveryInputs) -> tuple[RecoveryPlan, RecoveryStrategy]:
        """The plan of the cheapest strategy that can restore the lost ranks, else the fallback's.

        The plan's reason says why the cheaper ones could not (and that the config forced the
        strategy, where it did).
        """
        refusals = [] if inputs.forced == "auto" else [f'the config forces strategy "{inputs.forced}"']
        for strategy in self.candidates(inputs):
            why = strategy.can_restore(inputs)
            if why is None:
                plan = strategy.plan(inputs)
                return dataclasses.replace(plan, reason=_join(refusals, plan.reason)), strategy
            refusals.append(why)
        plan = self.fallback.plan(inputs)
        return dataclasses.replace(plan, reason=_join(refusals, plan.reason)), self.fallback

    def fall_back(self, inputs: RecoveryInputs, reason: str) -> tuple[RecoveryPlan, RecoveryStrategy]:
        """The fallback's plan after a chosen strategy's restore failed with ``reason``."""
        return dataclasses.replace(self.fallback.plan(inputs), reason=reason), self.fallback


# ---------------------------------------------------------------- membership changes
# A change of the job's machines, made by a strategy instead of replacing a failed one.
#
# Between a survivor's teardown and its join of the next generation, the runtime asks the configured
# strategy (:meth:`~ds_swift.recovery.base.RecoveryStrategy.membership_change`) whether the next
# generation has another shape: an elastic shrink with no spare left, or a grow when a machine
# returns (ds_swift.recovery.strategies.elastic). The new ranks of a returning machine are asked too
# (``joining``). A :class:`MembershipChange` says what the runtime applies before it joins (this rank's
# new rank, the world's size, the DeepSpeed config, the machines in rank order), and the recovery
# protocol restores through it (:func:`ds_swift.recovery.coordinator.run_recovery`).


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
