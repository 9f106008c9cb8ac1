"""An agent that connects to the job store before the host agent wrote the job's keys (srun starts
every agent at once) waits for them instead of failing the job; a store of another job is still
refused, naming the token."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from ds_swift.jobstore.membership import JobStore, MembershipError


@pytest.fixture
def bare_store() -> dist.TCPStore:
    """A store that listens but holds no job's keys yet (the host between its listen and its writes)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)


def test_an_agent_waits_for_the_token_the_host_writes_late(bare_store: dist.TCPStore) -> None:
    written = threading.Event()

    def host_writes() -> None:
        JobStore(bare_store, "job-a").kv.set("token", "job-a")
        written.set()

    timer = threading.Timer(0.3, host_writes)
    timer.start()
    try:
        store = JobStore.connect("127.0.0.1", bare_store.port, "job-a", wait_s=30.0)
    finally:
        timer.cancel()
    assert written.is_set() and store.kv.check(["token"])


def test_without_waiting_or_for_another_job_the_store_is_refused(bare_store: dist.TCPStore) -> None:
    with pytest.raises(MembershipError, match="does not serve job token job-b"):
        JobStore.connect("127.0.0.1", bare_store.port, "job-b")
    JobStore(bare_store, "job-a").kv.set("token", "job-a")
    with pytest.raises(MembershipError, match="does not serve job token job-b"):
        JobStore.connect("127.0.0.1", bare_store.port, "job-b", wait_s=0.2)
