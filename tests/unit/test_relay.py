"""The failure flag relayed on the machine (ds_swift/detect/relay.py): the agent waits on it once for
its ranks, a rank's watchdog waits on its FIFO (no store request, nothing logged by the store's
client), wakes the moment the agent relays it, stops at once, and reads the flag itself only every
BACKSTOP_S (a relay gone)."""

from __future__ import annotations

import datetime
import os
import threading
import time
from pathlib import Path

import torch.distributed as dist

from ds_swift.detect import relay
from ds_swift.detect.beats import BeatFile
from ds_swift.detect.relay import FailureRelay, relay_failure, relayed_failure
from ds_swift.detect.watchdog import Watchdog
from ds_swift.jobstore.membership import JobStore
from ds_swift.testing.counting_store import CountingStore

TOKEN = "unit-relay"


def counting() -> CountingStore:
    server = dist.HashStore()
    server.set_timeout(datetime.timedelta(seconds=30))
    return CountingStore(server)


def started(tmp_path: Path, js: JobStore, heartbeat_timeout_s: float = 30.0) -> Watchdog:
    return Watchdog(
        lambda: js, 0, 0, 0.05, heartbeat_timeout_s, (1,), beat_file=BeatFile(str(tmp_path), 0, 30.0)
    ).start()


def wait_until(cond: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_rank_under_an_agent_waits_on_its_fifo_and_wakes_when_the_agent_relays(tmp_path: Path) -> None:
    store = counting()
    js = JobStore(store, TOKEN)
    wd = started(tmp_path, js, heartbeat_timeout_s=0.3)  # turns of 0.3 s: several while we look
    try:
        wait_until(lambda: (tmp_path / "wake.0").exists())
        time.sleep(1.0)
        tally = store.take()
        # the backstop's first read of the flag, and nothing else, in a second of several turns
        assert tally.total_requests <= 1 and "wait" not in tally.calls, dict(tally.calls)
        t0 = time.monotonic()
        relay_failure(str(tmp_path), 0, "machine 1 died")
        wait_until(wd.failed.is_set, timeout_s=5.0)
        assert time.monotonic() - t0 < 0.25  # the FIFO woke it: not the next 0.3 s turn, nor the backstop
        assert wd.seen is not None and wd.seen.reason == "machine 1 died"
    finally:
        wd.stop(final=True)


def test_a_stopped_watchdog_ends_its_wait_at_once(tmp_path: Path) -> None:
    wd = started(tmp_path, JobStore(counting(), TOKEN))
    wait_until(lambda: (tmp_path / "wake.0").exists())
    waiter = wd._thread
    t0 = time.monotonic()
    wd.stop(final=True)
    assert waiter is not None and not waiter.is_alive() and time.monotonic() - t0 < 1.0


def test_the_backstop_reads_the_flag_when_no_relay_comes(tmp_path: Path, monkeypatch: object) -> None:
    monkeypatch.setattr(relay, "BACKSTOP_S", 0.2)  # type: ignore[attr-defined]
    monkeypatch.setattr("ds_swift.detect.watchdog.BACKSTOP_S", 0.2)  # type: ignore[attr-defined]
    store = counting()
    js = JobStore(store, TOKEN)
    wd = started(tmp_path, js, heartbeat_timeout_s=0.1)
    try:
        JobStore(store, TOKEN).declare_failure(0, "declared by a worker; no agent relays it")
        wait_until(wd.failed.is_set, timeout_s=5.0)
    finally:
        wd.stop(final=True)


def test_the_agents_relay_writes_each_generations_failure_and_wakes_its_ranks(tmp_path: Path) -> None:
    store = counting()
    beats = tmp_path / "beats"
    beats.mkdir()
    wd = started(beats, JobStore(store, TOKEN))
    try:
        wait_until(lambda: (beats / "wake.0").exists())
        agent_relay = FailureRelay(lambda: JobStore(store, TOKEN), str(tmp_path / "beats"), 0, "agent 0")
        agent_relay.start()
        threading.Timer(0.1, lambda: JobStore(store, TOKEN).declare_failure(0, "machine 1 died")).start()
        wait_until(wd.failed.is_set, timeout_s=10.0)
        assert relayed_failure(str(beats), 0) == "machine 1 died"
        JobStore(store, TOKEN).declare_failure(1, "machine 0 died")
        wait_until(lambda: relayed_failure(str(beats), 1) == "machine 0 died")  # on to the next generation
        assert sorted(os.listdir(beats)) == ["0", "failed.0", "failed.1", "wake.0"]
    finally:
        wd.stop(final=True)
    agent_relay.close(JobStore(store, TOKEN), timeout_s=10.0)  # the job's end: its wait ends, the store still up
    assert not agent_relay._thread.is_alive()
    assert relayed_failure(str(beats), 2) is None  # "job over" is not a failure
