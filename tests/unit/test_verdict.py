"""One verdict per failure (issue 30 item 1): a comm error with every rank alive is a stall, declared
for every rank to act on (nobody killed); a rank's own error is recorded so its peers raise it too."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from ds_swift.detect.classify import (
    STALL,
    Liveness,
    classify_failure,
    is_transport_error,
    job_error,
    rank_error_key,
)
from ds_swift.detect.job_error import JobErrorRecord
from ds_swift.jobstore.membership import JobStore

# gloo's own errors, as torch 2.13 raises them (plain RuntimeErrors).
GLOO_TIMEOUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
    "waiting 1000ms for recv operation to complete"
)
GLOO_CLOSED = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"


@pytest.fixture
def store() -> JobStore:
    return JobStore.host("unit-verdict")


@pytest.fixture
def alive(store: JobStore) -> Iterator[None]:
    """Every rank of 4 heartbeating every 20 ms."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            for r in range(4):
                store.kv.set(f"hb/{r}", repr(time.time()))
            stop.wait(0.02)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join()


def test_gloo_own_errors_are_transport_errors_and_lookalikes_are_not() -> None:
    assert is_transport_error(RuntimeError(GLOO_TIMEOUT))
    assert is_transport_error(RuntimeError(GLOO_CLOSED))
    assert is_transport_error(RuntimeError("Application timeout caused pair closure"))
    assert not is_transport_error(RuntimeError("user code: gloo config timed out while parsing"))


@pytest.mark.parametrize("text", [GLOO_TIMEOUT, GLOO_CLOSED])
def test_a_slow_op_with_every_rank_alive_is_a_declared_stall(store: JobStore, alive: None, text: str) -> None:
    live = Liveness(range(4), heartbeat_timeout_s=0.3, rank=2, hang_timeout_s=0.4)
    how = classify_failure(RuntimeError(text), store, 0, 0.01, live)
    assert how.startswith("stall (declared)"), how
    reason = store.failure(0) or ""
    assert reason.startswith(STALL) and "rank 2" in reason and "nothing lost" in reason
    # Every other rank, whatever its own error, acts on that verdict at once.
    peer = Liveness(range(4), heartbeat_timeout_s=30.0, rank=1)
    assert "after the failure flag" in classify_failure(RuntimeError(GLOO_CLOSED), store, 0, 0.01, peer)
    assert job_error(store, 0) is None


def test_a_peers_own_error_is_raised_not_recovered(store: JobStore, alive: None) -> None:
    bug = ValueError("loss function: shapes (4, 8) and (4, 9) differ")
    with pytest.raises(ValueError):
        classify_failure(bug, store, 0, 0.01, Liveness(range(4), heartbeat_timeout_s=30.0, rank=3))
    assert (job_error(store, 0) or "").startswith("rank 3 raised ValueError")
    said = JobErrorRecord.parse(store.get(rank_error_key(3)) or "")  # its agent ends the job, no spare
    assert said.what.startswith("rank 3 raised") and not said.machines_fault
    # The peer blocked on rank 3 fails on the closed connection: the job's own error, not a stall.
    closed = RuntimeError(GLOO_CLOSED)
    with pytest.raises(RuntimeError) as raised:
        classify_failure(closed, store, 0, 0.01, Liveness(range(4), heartbeat_timeout_s=30.0, rank=0))
    assert any("rank 3 raised ValueError" in n for n in raised.value.__notes__)
    assert store.failure(0) is None  # nothing declared: nobody recovers, the job ends with the error
    assert (job_error(store, 0) or "").startswith("rank 3 raised ValueError")  # the first error stays the verdict
