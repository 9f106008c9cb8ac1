"""The safety net must not end a healthy job (issue 30 item 4): a buddy copier error stops copying,
loudly, and training goes on; any strategy error falls back to the global checkpoint after an agreed
error round; checkpoint write errors are told by errno, not by text."""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import Ends

from ds_swift.checkpoint import periodic as checkpoint
from ds_swift.jobstore.agreement import RoundTimeout, round_prefix, verdict_key
from ds_swift.jobstore.membership import JobStore
from ds_swift.protect.buddy import BuddyCopier
from ds_swift.protect.buddy_holdings import StoreLanding
from ds_swift.recovery import coordinator
from ds_swift.recovery.base import RankContext, RecoveryOutcome, RecoveryStrategy, Registry
from ds_swift.recovery.consensus import RankReport, RecoveryInputs, RecoveryPlan
from ds_swift.recovery.timeline import RankTimeline

GLOO_TIMEOUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
    "waiting 30000ms for send operation to complete"
)


# ------------------------------------------------------------------ buddy copier
def test_a_copier_error_stops_copying_loudly_and_training_goes_on(capsys: pytest.CaptureFixture[str]) -> None:
    copier = BuddyCopier(1, ())
    landed = threading.Event()
    landed.set()  # the round ended: with an error on the copier's thread
    worker = SimpleNamespace(
        landed=landed, error=RuntimeError(GLOO_TIMEOUT), stopped=False, channel=object(), landing=None
    )
    copier._worker = worker  # type: ignore[assignment]
    checked: list[bool] = []
    copier.before_step(lambda: checked.append(True))  # the training thread's next step: no raise
    assert checked, "the generation's failure flag is looked at first (a dead peer is a failure)"
    assert copier.off is not None and "Timed out" in copier.off
    assert worker.stopped and worker.channel is None
    copier.after_step(object())  # copying is off: nothing is handed to a copier
    copier.before_step()
    assert "BUDDY COPIES OFF" in capsys.readouterr().err


def test_a_copier_error_after_the_generation_failed_is_that_failure() -> None:
    copier = BuddyCopier(1, ())
    landed = threading.Event()
    landed.set()
    copier._worker = SimpleNamespace(
        landed=landed,
        error=RuntimeError(GLOO_TIMEOUT),
        stopped=False,  # type: ignore[assignment]
        channel=object(),
        landing=None,
    )

    def failed() -> None:
        raise RuntimeError("generation 0 failed: machine 1 lost")

    with pytest.raises(RuntimeError, match="machine 1 lost"):
        copier.before_step(failed)


def test_a_buddy_round_lands_only_once_every_rank_wrote_its_key() -> None:
    store = JobStore.host("unit-buddy-landing")
    world, results = 3, {}
    # Each rank's copier on a connection of its own, as in a job: threads sharing one client would
    # queue behind each other's blocking waits.
    conns = [store] + [JobStore.connect("127.0.0.1", store.port, "unit-buddy-landing", timeout_s=10) for _ in (1, 2)]
    ranks = [StoreLanding(conns[r], 0, world, rank=r) for r in range(world)]
    threads = {
        r: threading.Thread(target=lambda r=r: results.setdefault(r, ranks[r](7, lambda: False))) for r in (0, 1)
    }
    for t in threads.values():
        t.start()
    # Ranks 0 (the leader) and 1 wait for rank 2: their keys are in, the verdict is not.
    assert store.wait_value("buddy/0/7/1", 30) is not None and store.wait_value("buddy/0/7/0", 30) is not None
    assert store.get("buddy/0/7/verdict") is None and results == {}
    assert ranks[2](7, lambda: False) is True
    for t in threads.values():
        t.join(30)
    assert results == {0: True, 1: True}

    # The next rounds clean up two back: the store holds a bounded number of landing keys.
    def rounds(*versions: int) -> None:
        for version in versions:
            done = [threading.Thread(target=lambda r=r, v=version: ranks[r](v, lambda: False)) for r in range(world)]
            for t in done:
                t.start()
            for t in done:
                t.join(30)

    rounds(8, 9)
    assert all(store.get(f"buddy/0/7/{r}") is None for r in range(world)) and store.get("buddy/0/7/verdict") is None
    assert store.get("buddy/0/9/verdict") is not None
    # Rounds buddy.interval (5) iterations apart: two rounds back, not two iterations back.
    rounds(14, 19)
    for gone in (8, 9):
        assert all(store.get(f"buddy/0/{gone}/{r}") is None for r in range(world)), gone
        assert store.get(f"buddy/0/{gone}/verdict") is None, gone
    assert store.get("buddy/0/14/verdict") is not None and store.get("buddy/0/19/verdict") is not None


def test_a_rank_turning_copies_off_ends_every_ranks_wait_for_its_rounds() -> None:
    store = JobStore.host("unit-buddy-off")
    waiting = StoreLanding(store, 0, 2, rank=0)  # rank 0's copier, waiting for rank 1's key in round 5
    StoreLanding(store, 0, 2, rank=1).turn_off("rank 1: RuntimeError: timed out")
    with pytest.raises(RuntimeError, match="turned off on another rank"):
        waiting(5, lambda: False)


# ------------------------------------------------------------------ strategy error
class _Broken(RecoveryStrategy):
    name = "broken"

    def can_restore(self, inputs: RecoveryInputs) -> str | None:
        return None

    def expected_cost(self, inputs: RecoveryInputs) -> float:
        return 0.0

    def restore(self, plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> RecoveryOutcome:
        raise KeyError("owner 3's manifest")  # a strategy's bug: not RestoreFailed


class _Checkpoint(RecoveryStrategy):
    name = "checkpoint"

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def can_restore(self, inputs: RecoveryInputs) -> str | None:
        return None

    def expected_cost(self, inputs: RecoveryInputs) -> float:
        return 1.0

    def restore(self, plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> RecoveryOutcome:
        self.reasons.append(plan.reason)
        return RecoveryOutcome(plan, 0)


def test_a_strategy_error_falls_back_to_the_global_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    fallback = _Checkpoint()
    monkeypatch.setattr(coordinator, "STRATEGIES", Registry([_Broken()], fallback=fallback))
    store = JobStore.host("unit-safety-net")
    report = RankReport(rank=0, survivor=True, stage=0, dp=0, tp=0, machine=0, last_stepped=4)
    ctx = RankContext(store, 1, 0, None, None, None, RankTimeline(rank=0, role="survivor", failed_generation=0), 10.0)
    outcome = coordinator.run_recovery(
        ctx, world_size=1, report=report, strategy="auto", zero_stage=1, optimizer_wrapper=None
    )
    assert outcome.plan.strategy == "checkpoint"
    assert fallback.reasons and "strategy 'broken' raised KeyError" in fallback.reasons[0]
    assert (
        store.get("gen1/restore/0") is not None and store.get("gen1/fallback/verdict") is not None
    )  # the rounds took place


# ------------------------------------------------------------------ checkpoint write errors
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS])
def test_write_errors_are_told_by_errno(code: int) -> None:
    assert checkpoint._write_error(OSError(code, "whatever the text"))
    wrapped = RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64")
    wrapped.__cause__ = OSError(code, "")
    assert checkpoint._write_error(wrapped)


def test_a_write_error_text_without_errno_is_not_a_write_error(tmp_path: Path) -> None:
    # The storage takes a probe write: the text alone ("No space left on device") says nothing.
    assert not checkpoint._write_error(RuntimeError("No space left on device"), tmp_path)
    assert not checkpoint._write_error(OSError(errno.ECONNRESET, "No space left on device"))


def test_torchs_zip_writer_error_is_a_write_error_where_the_storage_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = open

    def full(path: Any, *args: Any, **kw: Any) -> Any:
        if str(path).startswith(str(tmp_path)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *args, **kw)

    monkeypatch.setattr("builtins.open", full)
    assert checkpoint._write_error(RuntimeError("basic_ios::clear: iostream error"), tmp_path)


class _BrokenCheckpoint(_Checkpoint):
    def restore(self, plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> RecoveryOutcome:
        raise RuntimeError("no global checkpoint loads on every rank")


def test_an_error_in_the_fallback_itself_ends_the_job_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reload under every strategy raised out of the recovery, on that rank alone: its peers
    resumed and waited for it in their first collective until a timeout called it a stall."""
    from ds_swift.detect.classify import job_error, rank_error_key

    monkeypatch.setattr(coordinator, "STRATEGIES", Registry([_Broken()], fallback=_BrokenCheckpoint()))
    store = JobStore.host("unit-safety-net-fallback")
    report = RankReport(rank=0, survivor=True, stage=0, dp=0, tp=0, machine=0, last_stepped=4)
    ctx = RankContext(store, 1, 0, None, None, None, RankTimeline(rank=0, role="survivor", failed_generation=0), 10.0)
    with pytest.raises(coordinator.FallbackFailed, match="fallback to the global checkpoint failed too") as got:
        coordinator.run_recovery(
            ctx, world_size=1, report=report, strategy="auto", zero_stage=1, optimizer_wrapper=None
        )
    assert "no global checkpoint loads on every rank" in str(got.value)
    assert store.get(verdict_key(round_prefix(1, "fallback"))) is not None  # agreed with every rank first
    said = store.get(rank_error_key(0))  # the job's own error: its launcher ends the job with it
    assert said is not None and "FallbackFailed" in said and job_error(store, 1) is not None


# ------------------------------------------------------------------ buddy rounds that never land
def test_a_round_whose_keys_never_come_ends_its_wait(ends: Ends) -> None:
    """A rank whose copier died without a word (its 'off' key unwritten) held every other rank's
    landing wait for good: now the wait raises after its timeout, and that copier stops."""
    store = JobStore.host("unit-buddy-late")
    leader = StoreLanding(store, 0, 2, rank=0, timeout_s=1.0)
    err = ends(lambda: leader(3, lambda: False), 30.0, "the landing wait never ends")
    assert isinstance(err, RoundTimeout) and len(err.pending) == 1, err  # rank 1's key, named


def test_a_step_waits_for_a_round_at_most_its_deadline_then_copies_go_off_loudly(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The training thread's wait for the previous round had no deadline: a round that never landed
    held the step until the hang detector replaced this healthy machine as hung."""

    class _Landing(StoreLanding):
        def __init__(self) -> None:
            self.timeout_s = 0.5

        def turn_off(self, reason: str) -> None:
            raise ConnectionError("job store unreachable")

    copier = BuddyCopier(1, (), land_timeout_s=0.5)
    never = threading.Event()
    worker = SimpleNamespace(landed=never, error=None, stopped=False, channel=object(), landing=_Landing())
    copier._worker = worker  # type: ignore[assignment]
    done = threading.Event()
    t = threading.Thread(target=lambda: (copier.before_step(lambda: None), done.set()), daemon=True)
    t.start()
    assert done.wait(30.0), "the step still waits for a round that never lands"
    assert copier.off is not None and "did not land within 0.5 s" in copier.off
    assert worker.stopped and worker.channel is None
    err = capsys.readouterr().err
    assert "BUDDY COPIES OFF" in err and "could not be told (ConnectionError: job store unreachable)" in err, err
