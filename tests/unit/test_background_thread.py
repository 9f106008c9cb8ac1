"""ds_swift.background_thread: the one background-worker loop behind ds-swift's threads."""

from __future__ import annotations

import os
import threading

import pytest

from ds_swift.background_thread import BackgroundThread, OnError


def test_items_are_handled_in_order_on_a_named_thread() -> None:
    seen: list[tuple[int, str]] = []
    w: BackgroundThread[int] = BackgroundThread(
        "ds-swift-test", lambda i: seen.append((i, threading.current_thread().name))
    )
    for i in range(5):
        assert w.submit(i, nbytes=10)
    assert w.wait_idle(10.0)
    assert seen == [(i, "ds-swift-test") for i in range(5)]
    assert (w.stats.items, w.stats.bytes, w.stats.errors) == (5, 50, 0)
    assert w.stop(10.0) and not w.alive
    assert not w.submit(9)  # refused after stop, never left pending
    assert w.wait_idle(0.0)


def test_record_goes_on_and_check_raises_on_the_calling_thread() -> None:
    def handle(i: int) -> None:
        if i == 1:
            raise OSError(28, "No space left on device")

    w: BackgroundThread[int] = BackgroundThread("ds-swift-test", handle, on_error=OnError.RECORD)
    for i in range(3):
        w.submit(i)
    assert w.wait_idle(10.0)
    assert w.off is None and (w.stats.items, w.stats.errors) == (2, 1)
    with pytest.raises(OSError, match="No space"):
        w.check()
    w.check()  # each error is raised once
    w.stop(10.0)


def test_stop_drops_later_items_and_keeps_the_error() -> None:
    hooked: list[BaseException] = []
    handled: list[int] = []

    def handle(i: int) -> None:
        if i == 0:
            raise RuntimeError("gloo timeout")
        handled.append(i)

    gate = threading.Event()
    w: BackgroundThread[int] = BackgroundThread(
        "ds-swift-test", lambda i: (gate.wait(10.0), handle(i)), on_error=OnError.STOP, on_error_hook=hooked.append
    )
    w.submit(0)
    w.submit(1)  # queued behind the item that fails
    gate.set()
    assert w.wait_idle(10.0)  # the queued item is dropped, not left pending
    assert not w.submit(2) and handled == []
    assert isinstance(w.error, RuntimeError) and w.off == "RuntimeError: gloo timeout"
    assert [str(e) for e in hooked] == ["gloo timeout"]
    assert w.stop(10.0) and not w.alive  # the thread ended at the error


def test_off_calls_the_hook_once_per_error_and_training_goes_on() -> None:
    said: list[str] = []
    w: BackgroundThread[int] = BackgroundThread(
        "ds-swift-test", lambda i: 1 / 0, on_error=OnError.OFF, on_error_hook=lambda e: said.append(f"OFF: {e}")
    )
    w.submit(0)
    assert w.wait_idle(10.0)
    assert said == ["OFF: division by zero"] and not w.submit(1)
    w.stop(10.0)


def test_a_byte_bound_makes_the_producer_wait_for_room() -> None:
    gate = threading.Event()
    w: BackgroundThread[int] = BackgroundThread("ds-swift-test", lambda i: gate.wait(10.0), max_bytes=100)
    assert w.submit(0, nbytes=80)  # an item alone always goes
    done = threading.Event()

    def produce() -> None:
        w.submit(1, nbytes=80)
        done.set()

    t = threading.Thread(target=produce)
    t.start()
    assert not done.wait(0.2)  # 160 bytes would be queued: it waits for the first to be handled
    gate.set()
    assert done.wait(10.0) and w.wait_idle(10.0)
    t.join(10.0)
    assert w.stats.stall_s > 0 and w.stats.max_queued_bytes == 80
    w.stop(10.0)


def test_setup_and_teardown_run_on_the_thread() -> None:
    where: list[str] = []
    w: BackgroundThread[int] = BackgroundThread(
        "ds-swift-test",
        lambda i: None,
        setup=lambda: where.append("setup"),
        teardown=lambda: where.append(threading.current_thread().name),
    )
    w.submit(0)
    assert w.stop(10.0)
    assert where == ["setup", "ds-swift-test"]


def test_the_os_sees_the_short_name() -> None:
    import os
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("thread names in /proc are Linux's")
    comm: list[str] = []

    def handle(i: int) -> None:
        path = f"/proc/self/task/{threading.get_native_id()}/comm"
        comm.append(open(path).read().strip() if os.path.exists(path) else "sw-buddy")

    w: BackgroundThread[int] = BackgroundThread("ds-swift-buddy", handle)
    w.submit(0)
    assert w.stop(10.0) and comm == ["sw-buddy"]


def test_a_setup_that_fails_ends_the_worker_and_is_said() -> None:
    said: list[str] = []

    def setup() -> None:
        raise PermissionError("no tmp dir")

    w: BackgroundThread[int] = BackgroundThread(
        "ds-swift-test", lambda i: None, setup=setup, on_error_hook=lambda e: said.append(str(e))
    )
    w.submit(0)  # may be queued before the thread fails: then dropped
    assert w.stop(10.0) and w.wait_idle(10.0)
    assert said == ["no tmp dir"] and w.off == "PermissionError: no tmp dir" and w.stats.items == 0
    with pytest.raises(PermissionError):
        w.check()


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_the_worker_thread_does_not_preempt_on_wakeup_and_the_submitter_keeps_its_policy() -> None:
    """The worker runs under SCHED_BATCH (a hand-over must not stop the training thread while the
    worker runs on its core), with its nice value unchanged; the thread that submits is untouched."""
    before = os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[tuple[int, int]] = []
    w: BackgroundThread[int] = BackgroundThread(
        "ds-swift-test",
        lambda i: seen.append((os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))),
    )
    assert w.submit(0)
    assert w.wait_idle(10.0)
    w.stop(10.0)
    assert seen == [(os.SCHED_BATCH, before[1])]
    assert (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())) == before


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_the_overhead_benchmarks_wakeup_switch_leaves_the_worker_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """``SWIFT_BENCH_WITHOUT=wakeup`` (gpu_overhead.py's ``-wakeup`` row) measures what SCHED_BATCH buys."""
    monkeypatch.setenv("SWIFT_BENCH_WITHOUT", "logging,wakeup")
    seen: list[int] = []
    w: BackgroundThread[int] = BackgroundThread("ds-swift-test", lambda i: seen.append(os.sched_getscheduler(0)))
    assert w.submit(0) and w.wait_idle(10.0)
    w.stop(10.0)
    assert seen == [os.SCHED_OTHER]


def test_a_handler_that_finishes_nothing_turns_the_worker_off_instead_of_holding_the_producer() -> None:
    hung = threading.Event()
    w: BackgroundThread[int] = BackgroundThread(
        "ds-swift-test", lambda i: hung.wait(60.0), max_items=1, stuck_after_s=0.3
    )
    try:
        assert w.submit(0) and w.submit(1)  # the first is in the handler, the second queued
        assert not w.submit(2)  # waited 0.3 s without one item finished: gives up
        assert w.off is not None and "no item finished" in w.off and "stuck" in w.off
        assert not w.submit(3)  # and refuses at once from then on
    finally:
        hung.set()
        w.stop(10.0)
    assert w.stats.items == 1  # the item in the handler when it gave up ends; the queued one is dropped


def test_a_slow_handler_that_still_finishes_items_never_trips_the_bound() -> None:
    go = threading.Semaphore(0)
    w: BackgroundThread[int] = BackgroundThread(
        "ds-swift-test", lambda i: go.acquire(timeout=60.0), max_items=1, stuck_after_s=3.0
    )
    stop = threading.Event()

    def release() -> None:  # one item every 0.2 s: 20 items take ~4 s, longer than the bound
        while not stop.wait(0.2):
            go.release()

    t = threading.Thread(target=release, daemon=True)
    t.start()
    try:
        assert all(w.submit(i) for i in range(20))
        assert w.wait_idle(30.0) and w.off is None and w.stats.items == 20
        assert w.stats.stall_s > 3.0  # the producer did wait, in all, longer than the bound
    finally:
        stop.set()
        for _ in range(20):
            go.release()
        w.stop(10.0)
