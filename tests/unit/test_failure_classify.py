"""Failures are recognised by the failure flag, peer liveness and the exception's type (issue 16):
an error whose text merely looks like a comm error, with every rank alive, is the job's own."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from ds_swift.detect.beats import CounterClock
from ds_swift.detect.classify import Liveness, PeerFailure, classify_failure, hang_patience, stale_ranks
from ds_swift.jobstore.membership import JobStore

TOKEN = "unit-classify"


@pytest.fixture
def store() -> JobStore:
    return JobStore.host(TOKEN)


def beat(store: JobStore, ranks: range) -> None:
    for r in ranks:
        store.heartbeat(r)


def beating(store: JobStore, ranks: range) -> Iterator[None]:
    """``ranks`` alive: their watchdogs heartbeat every 20 ms."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            beat(store, ranks)
            stop.wait(0.02)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join()


@pytest.fixture
def heartbeats(store: JobStore) -> Iterator[None]:
    """Every rank of 4 alive."""
    yield from beating(store, range(4))


@pytest.fixture
def heartbeats3(store: JobStore) -> Iterator[None]:
    """Ranks 0..2 of 4 alive."""
    yield from beating(store, range(3))


def test_a_bug_with_gloo_in_its_text_and_every_rank_alive_is_raised(store: JobStore, heartbeats: None) -> None:
    live = Liveness(range(4), heartbeat_timeout_s=0.5, rank=1)
    bug = RuntimeError("user code: gloo config timed out while parsing")
    with pytest.raises(RuntimeError, match="gloo config timed out") as raised:
        classify_failure(bug, store, 0, 0.01, live)
    assert any("not a machine failure" in n for n in raised.value.__notes__)
    assert store.failure(0) is None  # nothing declared: no recovery starts


def test_only_a_timed_out_op_waits_for_a_hung_peers_verdict() -> None:
    live = Liveness(range(2), heartbeat_timeout_s=5.0, rank=0, hang_timeout_s=120.0)
    assert hang_patience(RuntimeError("[gloo] Timed out waiting 30000ms for recv"), live) == 120.0
    assert hang_patience(dist.DistBackendError("op timed out"), live) == 120.0
    # A hung peer closes no connection, and raises nothing on our side: no hang wait for these.
    assert hang_patience(RuntimeError("gloo: Connection closed by peer"), live) == 0.0
    assert hang_patience(RuntimeError("user code: bad gloo option"), live) == 0.0
    off = Liveness(range(2), heartbeat_timeout_s=5.0, rank=0, hang_timeout_s=None)
    assert hang_patience(RuntimeError("Timed out"), off) == 0.0


def test_a_comm_looking_bug_surfaces_after_the_heartbeat_timeout_not_the_hang_timeout(
    store: JobStore, heartbeats: None
) -> None:
    live = Liveness(range(4), heartbeat_timeout_s=0.3, rank=1, hang_timeout_s=3600.0)
    with pytest.raises(RuntimeError, match="bad gloo option") as raised:
        classify_failure(RuntimeError("user code: bad gloo option"), store, 0, 0.01, live)
    # The note says how long it waited: the heartbeat timeout and 3 polls, not the hour.
    assert any("for 0.3 s" in n for n in raised.value.__notes__), raised.value.__notes__


def test_an_ordinary_error_is_raised_at_once(store: JobStore) -> None:
    live = Liveness(range(2), heartbeat_timeout_s=30.0, rank=0)
    start = time.monotonic()
    with pytest.raises(ValueError):
        classify_failure(ValueError("Connection closed"), store, 0, 0.01, live)
    assert time.monotonic() - start < 10.0  # did not sit out the heartbeat timeout (generous bound)
    assert store.failure(0) is None


def test_a_stale_rank_is_one_whose_counter_stops_on_the_observers_clock(store: JobStore) -> None:
    live = Liveness(range(4), heartbeat_timeout_s=1.0, rank=0)
    now = [0.0]
    beats: CounterClock[int] = CounterClock(1.0, clock=lambda: now[0])
    beat(store, range(4))
    assert stale_ranks(store, live, beats) == []
    for t in (0.5, 1.0, 1.5):  # ranks 0..2 beat on; rank 3 stopped after its first beat
        now[0] = t
        beat(store, range(3))
        found = stale_ranks(store, live, beats)
    assert found == [(3, 1.5)]


def test_a_comm_error_with_a_stale_rank_declares_the_failure(store: JobStore, heartbeats3: None) -> None:
    beat(store, range(3, 4))  # rank 3 beat once, then stopped; ranks 0..2 beat on
    live = Liveness(range(4), heartbeat_timeout_s=0.3, rank=0)
    how = classify_failure(RuntimeError("Connection closed by peer"), store, 0, 0.01, live)
    assert "rank 3 (no heartbeat" in how
    assert "rank 0: RuntimeError and rank 3" in (store.failure(0) or "")


def test_a_comm_error_waits_for_the_agents_declaration(store: JobStore) -> None:
    beat(store, range(2))
    live = Liveness(range(2), heartbeat_timeout_s=30.0, rank=0)
    agent = threading.Timer(0.2, lambda: store.declare_failure(0, "machine 1: rank 1 exited (-9)"))
    agent.start()
    try:
        how = classify_failure(dist.DistBackendError("recv failed"), store, 0, 0.01, live)
    finally:
        agent.cancel()
    assert how.startswith("comm error, failure declared")


def test_after_the_flag_anything_is_the_failure(store: JobStore) -> None:
    store.declare_failure(0, "machine 0 lost")
    assert "after the failure flag" in classify_failure(KeyError("x"), store, 0, 0.01, None)


def test_a_poisoned_receive_is_a_failure_without_waiting(store: JobStore) -> None:
    how = classify_failure(PeerFailure("generation 0 failed (watchdog)"), store, 0, 0.01, None)
    assert how.startswith("PeerFailure")


def test_without_a_job_store_everything_is_raised() -> None:
    with pytest.raises(RuntimeError):
        classify_failure(RuntimeError("Connection closed by peer"), None, 0, 0.01, None)


def test_a_poisoned_receive_waits_for_the_failure_flag_through_the_job_store(store: JobStore) -> None:
    """The monitor reads ``gen<g>/failed`` only through JobStore (its key in one place)."""
    import torch

    from ds_swift.detect.monitor import FailureMonitor
    from ds_swift.transport.shutdown import POISON_MARK

    assert JobStore.failed_key(3) == "gen3/failed"
    monitor = FailureMonitor(store, 0, poll_interval_s=0.01)
    poisoned = torch.tensor([POISON_MARK, 0], dtype=torch.int32)
    # A poison mark without a flag: the monitor waits a few polls, then still refuses the buffer.
    with pytest.raises(PeerFailure, match="a poison message from a pipeline neighbour"):
        monitor.check_after_receive(poisoned)
    assert store.wait_for_failure(0, 0.0) is None
    store.declare_failure(0, "machine 1: rank 3 killed by SIGKILL")
    assert store.wait_for_failure(0, 1.0) == "machine 1: rank 3 killed by SIGKILL"
    with pytest.raises(PeerFailure, match="rank 3 killed by SIGKILL"):
        monitor.check_after_receive(poisoned)
    monitor.check_after_receive(torch.zeros(2, dtype=torch.int32))  # no mark: no store read, no error
