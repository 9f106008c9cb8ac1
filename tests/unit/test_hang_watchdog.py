"""Hang detection (issue 15): the training thread's progress, the watchdog's verdicts, and the key
that makes a hung or stopped machine's agent kill it."""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest

from ds_swift.config import ConfigError, SwiftConfig
from ds_swift.detect.progress import Progress
from ds_swift.detect.watchdog import Watchdog, hung_machine_key, suspect_key
from ds_swift.jobstore.membership import JobStore

TOKEN = "unit-hang"


@pytest.fixture
def store() -> JobStore:
    return JobStore.host(TOKEN)


def watchdog(store: JobStore, rank: int, progress: Progress | None = None, watch: list[int] | None = None) -> Watchdog:
    client = JobStore.connect("127.0.0.1", store.port, TOKEN)
    return Watchdog(
        lambda: client,
        rank=rank,
        generation=0,
        poll_interval_s=0.01,
        heartbeat_timeout_s=5.0,
        watch_ranks=watch or [],
        progress=progress,
        hang_timeout_s=2.0,
        ranks_per_machine=2,
    )


def test_a_training_thread_without_progress_mid_iteration_is_hung(store: JobStore) -> None:
    progress = Progress()
    wd = watchdog(store, rank=3, progress=progress)
    progress.arm(True)
    progress.beat("BackwardPass", 7)
    assert wd.poll_once(wd._store_factory()) is None  # just beat
    progress.t -= 2.5  # as if the backward pass had run for 2.5 s
    seen = wd.poll_once(wd._store_factory())
    assert seen is not None and wd.failed.is_set()
    assert seen.reason.startswith("rank 3 hung: no progress for 2.5 s in BackwardPass of iteration 7")
    assert store.failure(0) == seen.reason
    assert store.get(hung_machine_key(1)) == f"0 {seen.reason}"  # rank 3 is on machine 1 (2 ranks each)


def test_time_outside_an_iteration_does_not_count(store: JobStore) -> None:
    progress = Progress()
    wd = watchdog(store, rank=0, progress=progress)
    progress.beat("OptimizerStep", 3)
    progress.arm(False)  # a checkpoint save, a recovery, the user's code between iterations
    progress.t -= 60.0
    assert progress.stuck_for() == 0.0 and wd.poll_once(wd._store_factory()) is None
    assert store.failure(0) is None and store.get(hung_machine_key(0)) is None


def test_a_stopped_peer_is_named_with_its_last_instruction(store: JobStore) -> None:
    """One observer's silence is a suspicion; the second observer's makes it the verdict."""
    store.heartbeat(2, "RecvGrad of iteration 5")
    now = [0.0]
    first, second = watchdog(store, rank=0, watch=[2]), watchdog(store, rank=1, watch=[2])
    for wd in (first, second):
        wd._beats.clock = lambda: now[0]
    assert first.poll_once(first._store_factory()) is None and second.poll_once(second._store_factory()) is None
    for t in range(1, 7):  # rank 2's counter stands still for 6 s of the observers' clocks (timeout 5 s)
        now[0] = float(t)
        seen = first.poll_once(first._store_factory())
    assert seen is None and store.failure(0) is None and store.get(hung_machine_key(1)) is None
    assert (store.get(suspect_key(0, 1)) or "").startswith("5.0 rank 2: no heartbeat for 6.0 s, last in RecvGrad")
    for t in range(1, 7):
        now[0] = float(t) + 0.5
        seen = second.poll_once(second._store_factory())
    assert seen is not None
    assert "rank 2: no heartbeat for 5.5 s" in seen.reason and "last in RecvGrad of iteration 5" in seen.reason
    assert "1 other observer(s) agree" in seen.reason
    assert (store.get(hung_machine_key(1)) or "").startswith("0 rank 2: no heartbeat")


def test_heartbeats_carry_the_progress_note(store: JobStore) -> None:
    progress = Progress()
    progress.beat("ForwardPass", 4)
    wd = watchdog(store, rank=1, progress=progress)
    wd.poll_once(wd._store_factory())
    beat = store.heartbeat_of(1)
    assert beat is not None and beat[1] == "ForwardPass of iteration 4" and store.last_heartbeat(1) == beat[0] == 1


def test_the_hang_timeout_must_exceed_the_op_timeout() -> None:
    with pytest.raises(ConfigError, match="watchdog.hang_timeout_s"):
        SwiftConfig.from_dict({"enabled": True, "watchdog": {"op_timeout_s": 30.0, "hang_timeout_s": 20.0}})
    assert (
        SwiftConfig.from_dict({"enabled": True, "watchdog": {"hang_timeout_s": None}}).watchdog.hang_timeout_s is None
    )


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_the_watchdog_thread_does_not_preempt_the_training_thread_on_wakeup(store: JobStore) -> None:
    wd = watchdog(store, rank=0)
    seen: list[int] = []
    wd.on_failure = lambda _: seen.append(os.sched_getscheduler(0))  # runs on the watchdog's thread
    wd.start()
    try:
        store.declare_failure(0, "probe")
        assert wd.failed.wait(30)
    finally:
        wd.stop()
    assert seen == [os.SCHED_BATCH] and os.sched_getscheduler(0) == os.SCHED_OTHER


class DownStore:
    """A job store that cannot be reached (torch's store raises a RuntimeError then)."""

    def heartbeat(self, rank: int, note: str) -> None:
        raise RuntimeError("Connection refused")

    def failure(self, generation: int) -> str | None:
        raise RuntimeError("Connection refused")


def _said(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "ds_swift.detect.watchdog"]


def test_polls_failing_past_the_heartbeat_timeout_are_said_once_and_so_is_their_end(
    store: JobStore, caplog: pytest.LogCaptureFixture
) -> None:
    now = [0.0]
    wd = watchdog(store, rank=1)  # heartbeat timeout 5 s
    wd._beats.clock = lambda: now[0]
    down: Any = DownStore()
    for t in range(6):  # failing for 0..5 s: not yet past the timeout
        now[0] = float(t)
        assert wd.guarded_poll(down) is down
    assert _said(caplog) == []  # a store away for a moment is not worth a line
    for t in (5.5, 6.0, 9.0):
        now[0] = t
        wd.guarded_poll(down)
    ((level, msg),) = _said(caplog)
    assert level == logging.WARNING
    assert msg.startswith("watchdog polls have failed for 6 s (7 in a row, last RuntimeError: Connection refused)")
    assert "failure and hang detection on this rank are blind while it lasts" in msg
    up = wd._store_factory()
    assert wd.guarded_poll(up) is up and wd.guarded_poll(up) is up
    assert _said(caplog)[1:] == [
        (logging.INFO, "watchdog polls succeed again after 9 failed: failure and hang detection on this rank are back")
    ]
    for t in (10.0, 16.0):  # a second outage is said again
        now[0] = t
        wd.guarded_poll(down)
    assert [level for level, _ in _said(caplog)] == [logging.WARNING, logging.INFO, logging.WARNING]


def test_an_error_no_store_raises_is_said_the_first_time(store: JobStore, caplog: pytest.LogCaptureFixture) -> None:
    wd = watchdog(store, rank=1)
    wd._beats.clock = lambda: 0.0  # never failing for long: only the bug is said

    class Buggy(DownStore):
        def heartbeat(self, rank: int, note: str) -> None:
            raise TypeError("heartbeat() got an unexpected keyword argument")

    buggy: Any = Buggy()
    for _ in range(3):
        wd.guarded_poll(buggy)
    assert _said(caplog) == [
        (
            logging.WARNING,
            "watchdog poll raised TypeError: heartbeat() got an unexpected keyword argument, which no job store "
            "raises (a bug?); polling goes on",
        )
    ]


def test_a_store_down_at_start_up_does_not_end_the_watchdog(store: JobStore) -> None:
    client = JobStore.connect("127.0.0.1", store.port, TOKEN)
    opened: list[int] = []

    def factory() -> JobStore:
        opened.append(1)
        if len(opened) == 1:
            raise RuntimeError("Connection refused")  # the thread's first connection fails
        return client

    wd = Watchdog(factory, rank=0, generation=0, poll_interval_s=0.01, heartbeat_timeout_s=5.0)
    assert wd.guarded_poll(None) is None  # said nothing, raised nothing: opened again next time
    assert wd.guarded_poll(None) is client
    opened.clear()
    wd.start()
    try:
        store.declare_failure(0, "probe")
        assert wd.failed.wait(30)  # the thread outlived its failed connection and saw the failure
    finally:
        wd.stop()
