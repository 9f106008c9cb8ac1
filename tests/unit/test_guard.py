"""The post-recovery guard's decisions (issue 30 item 7), without processes: an in-process job store and a
fake engine (the guard reads ``global_steps`` and ``skipped_steps`` only)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ds_swift.config import ConfigError, SwiftConfig
from ds_swift.jobstore.membership import JobStore
from ds_swift.runtime.guard import (
    FIRST_TRIP_KEY,
    ROLLBACK_KEY,
    GuardTripped,
    LossGuard,
    forced_strategy,
    judge,
    reference_of,
)


class FakeStore(JobStore):
    """A real job store in this process (torch's HashStore, no secret) that keeps its declarations
    instead of moving the generation."""

    def __init__(self) -> None:
        super().__init__(dist.HashStore(), "tok")
        self.failures: dict[int, str] = {}

    def declare_failure(self, generation: int, reason: str) -> bool:
        first = generation not in self.failures
        self.failures.setdefault(generation, reason)
        return first


@dataclass(frozen=True)
class Plan:
    strategy: str
    reason: str = ""


@dataclass
class Outcome:
    plan: Plan


@dataclass
class Engine:
    global_steps: int = 0
    skipped_steps: int = 0


def train(guard: LossGuard, engine: Engine, loss: float, generation: int = 0, skipped: bool = False) -> str | None:
    engine.global_steps += 1
    engine.skipped_steps += int(skipped)
    return guard.after_iteration(engine, loss, generation)


def test_judge_trips_on_non_finite_and_divergence_only() -> None:
    assert judge(float("nan"), 3.0, 3.0, 2.0, skipped=False) == "the loss is nan"
    assert judge(float("inf"), None, None, 2.0, skipped=False) == "the loss is inf"  # no history: still
    assert judge(6.5, 3.0, 3.0, 2.0, skipped=False) is not None  # above 2 x 3
    assert judge(5.9, 3.0, 3.0, 2.0, skipped=False) is None  # a spike, within the trend's bound
    assert judge(100.0, None, None, 2.0, skipped=False) is None  # no reference: only non-finite trips
    assert judge(float("nan"), 3.0, 3.0, 2.0, skipped=True) is None  # an fp16 overflow skip: the scaler's
    assert judge(None, 3.0, 3.0, 2.0, skipped=False) is None
    # Negative losses (not an LM's, but a loss): the bound is the max plus (factor - 1) x the magnitude.
    assert judge(-0.5, -1.0, 2.0, 2.0, skipped=False) is None and judge(1.5, -1.0, 2.0, 2.0, skipped=False)
    assert reference_of([3.0, float("nan"), 2.5]) == 3.0 and reference_of([]) is None


def survivor_and_replacement(store: FakeStore) -> tuple[LossGuard, Engine, LossGuard, Engine]:
    """Rank 0 trained iterations 0..5 (failure in 6); rank 1 is the replacement (no history)."""
    a, b = LossGuard(4, 2.0, 0, store), LossGuard(4, 2.0, 1, store)
    ea, eb = Engine(), Engine()
    for loss in (3.0, 2.8, 2.6, 2.5, 2.4, 2.3):
        assert train(a, ea, loss) is None  # no recovery yet: nothing judged
    eb.global_steps = 6
    recover(store, 1, 6, "buddy", (a, ea), (b, eb))
    return a, ea, b, eb


def recover(
    store: FakeStore, generation: int, resume: int, strategy: str, *ranks: tuple[LossGuard, Engine]
) -> list[Outcome]:
    """Every rank's after_recovery, one after the other: the round's leader (rank 0) waits for every
    rank's value, so the last rank's (a replacement's: empty) is published ahead."""
    store.publish(generation, "guard_ref", ranks[-1][0].rank, "")
    outcomes = []
    for guard, engine in ranks:
        engine.global_steps = resume
        outcomes.append(Outcome(Plan(strategy, 'the config forces strategy "checkpoint"')))
        guard.after_recovery(engine, outcomes[-1], generation, len(ranks), 1.0)
    return outcomes


def test_every_rank_agrees_on_the_reference_and_trips_once() -> None:
    store = FakeStore()
    a, ea, b, eb = survivor_and_replacement(store)
    assert a.window is not None and b.window is not None
    assert (a.window.reference, b.window.reference) == (3.0, 3.0)  # the replacement's from the survivor's
    for guard, engine in ((a, ea), (b, eb)):
        assert train(guard, engine, 2.2, generation=1) is None
        assert train(guard, engine, 4.0, generation=1, skipped=True) is None  # an overflow skip
    whys = [train(guard, engine, math.nan, generation=1) for guard, engine in ((a, ea), (b, eb))]
    assert all(w is not None and "iteration 8" in w and "the loss is nan" in w for w in whys), whys
    assert store.failures[1] == whys[0] and store.get(ROLLBACK_KEY) == "1" and store.get(FIRST_TRIP_KEY) == "1"
    assert forced_strategy(store, "auto") == "checkpoint"
    # The step back to the checkpoint of 4 iterations (generation 2): served, the window opens again.
    outcomes = recover(store, 2, 4, "checkpoint", (a, ea), (b, eb))
    assert forced_strategy(store, "auto") == "auto"
    assert all(o.plan.reason == f"{whys[0]} (the guard's step back)" for o in outcomes)  # in the timeline
    assert a.window is not None and a.window.reference == 3.0
    # A second trip, in a later generation: the job ends, with the launcher's abort key set once.
    with pytest.raises(GuardTripped, match="already stepped back to the global checkpoint once"):
        train(a, ea, 7.0, generation=2)
    assert "diverges" in (store.get("launch/abort") or "")
    assert store.failures.keys() == {1}  # no second step back


def test_outside_the_window_and_off_nothing_is_judged() -> None:
    store = FakeStore()
    a, ea, _, _ = survivor_and_replacement(store)
    for loss in (2.2, 2.1, 2.0, 1.9):  # the window: iterations 6..9
        assert train(a, ea, loss, generation=1) is None
    assert train(a, ea, math.nan, generation=1) is None  # iteration 10: after the window
    off = LossGuard(0, 2.0, 0, store)
    e = Engine()
    off.after_recovery(e, Outcome(Plan("buddy")), 1, 1, 1.0)
    assert train(off, e, math.nan) is None and off.window is None


def test_the_config_fields_are_checked() -> None:
    verify = SwiftConfig.from_dict({}).verify
    assert (verify.guard_iterations, verify.guard_loss_factor) == (20, 2.0)
    with pytest.raises(ConfigError, match="verify.guard_iterations"):
        SwiftConfig.from_dict({"verify": {"guard_iterations": -1}})
    with pytest.raises(ConfigError, match="verify.guard_loss_factor"):
        SwiftConfig.from_dict({"verify": {"guard_loss_factor": 1.0}})


def test_an_elastic_resize_renumbers_the_rank_the_guard_publishes_under() -> None:
    """A shrink from dp 2 to 1 makes old rank 2 the new rank 0: its peers gather ranks 0..world-1, so
    it must publish under its new number (under the old one, every rank waited out the join timeout)."""
    store = FakeStore()
    guard = LossGuard(4, 2.0, 2, store)  # built as rank 2 of the first generation
    engine = Engine()
    for loss in (3.0, 2.5, 2.75):  # as the engine returns them: tensors, read only at the recovery
        train(guard, engine, torch.tensor(loss))  # type: ignore[arg-type]
    guard.after_recovery(engine, Outcome(Plan("lossy_forward")), 1, 1, 1.0, rank=0)  # world 1 after the shrink
    assert store.get("gen1/guard_ref/0") == "3.0,2.5,2.75" and guard.rank == 0
    assert guard.window is not None and guard.window.reference is not None


def test_the_reference_is_agreed_in_the_recoverys_restore_round(ends: Any) -> None:
    """Lent to the recovery, the guard's values ride its restore round (ds_swift.recovery.coordinator):
    the same reference on every rank as its own round gave, and no round of its own (three store
    requests per rank). A recovery that falls back leaves it undecided: the guard's own round then."""
    import threading

    from ds_swift.recovery.base import RankContext, Rider
    from ds_swift.recovery.coordinator import _agree_on_restores
    from ds_swift.recovery.handover import Handover
    from ds_swift.recovery.timeline import RankTimeline

    store = FakeStore()
    a, b = LossGuard(4, 2.0, 0, store), LossGuard(4, 2.0, 1, store)
    ea, eb = Engine(), Engine()
    for loss in (3.0, 2.8, 2.6, 2.5, 2.4, 2.3):
        train(a, ea, loss)
    riders = {0: a.rider(1), 1: b.rider(1)}
    reasons: dict[int, Any] = {}

    def restore_round(rank: int) -> None:
        rider = riders[rank]
        assert rider is not None
        ctx = RankContext(
            store, 1, rank, None, None, None, RankTimeline(rank, "survivor", 0), 5.0, lent=Handover(rider)
        )
        reasons[rank] = _agree_on_restores(ctx, 2, None, None, 6)

    threads = [threading.Thread(target=restore_round, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    assert ends(lambda: [t.join(10) for t in threads], 15, "the restore round") is None
    assert reasons == {0: None, 1: None}
    assert all(isinstance(r, Rider) and r.said is not None for r in riders.values())
    for guard, engine in ((a, ea), (b, eb)):
        engine.global_steps = 6
        guard.after_recovery(engine, Outcome(Plan("buddy")), 1, 2, 0.5)
        assert guard.window is not None and guard.window.reference == 3.0  # the replacement's from the survivor's
    assert not store.kv.check(["gen1/guard_ref/0"]) and not store.kv.check(["gen1/guard_ref/1"])
    off = LossGuard(0, 2.0, 0, store)
    assert off.rider(1) is None  # off: nothing rides the round
