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


def relay_of(store: CountingStore, beats: Path) -> FailureRelay:
    return FailureRelay(lambda: JobStore(store, TOKEN), str(beats), 0, "agent 0").start()


def test_a_declaration_whose_first_writer_died_after_the_flag_is_relayed_by_a_later_declarer(tmp_path: Path) -> None:
    """The first declarer of generation 0 set the flag and died before the rest of its writes; a later
    declarer finishes them. The relay, waiting on generation 0, wakes and relays it, and then the next
    generation's failure: not a relay waiting on generation 0 for ever while the job goes on."""
    store = counting()
    agent_relay = relay_of(store, tmp_path)
    try:
        dying = JobStore(store, TOKEN)
        assert dying.add("gen0/failed_n", 1) == 1
        dying.set(JobStore.failed_key(0), "machine 1 died")  # ... and killed here
        assert not JobStore(store, TOKEN).declare_failure(0, "rank 0: a stall")  # the flag set: not first
        wait_until(lambda: relayed_failure(str(tmp_path), 0) == "machine 1 died")
        JobStore(store, TOKEN).declare_failure(1, "machine 0 died")
        wait_until(lambda: relayed_failure(str(tmp_path), 1) == "machine 0 died")
    finally:
        agent_relay.close(JobStore(store, TOKEN), timeout_s=10.0)
    assert not agent_relay._thread.is_alive()


def test_the_relay_follows_the_jobs_generation_past_one_left_without_a_failure_flag(tmp_path: Path) -> None:
    """The job leaves generation 0 without its flag (the generation moved by a rank past a failure of
    which it saw only a verdict): the relay follows the job's generation, not the last it relayed plus
    one, and relays generation 1's failure."""
    store = counting()
    agent_relay = relay_of(store, tmp_path)
    try:
        JobStore(store, TOKEN).advance_generation(0)
        wait_until(lambda: agent_relay.generation == 1)
        JobStore(store, TOKEN).declare_failure(1, "machine 0 died")
        wait_until(lambda: relayed_failure(str(tmp_path), 1) == "machine 0 died")
        assert relayed_failure(str(tmp_path), 0) is None
    finally:
        agent_relay.close(JobStore(store, TOKEN), timeout_s=10.0)


def test_a_relay_started_after_generations_failed_catches_up_at_its_first_wake(tmp_path: Path) -> None:
    """The machine's first ranks start (and its relay with them) in generation 0 while the job is
    already past generations 0 and 1: one wake relays both and waits on generation 2."""
    store = counting()
    JobStore(store, TOKEN).declare_failure(0, "machine 1 died")
    JobStore(store, TOKEN).declare_failure(1, "machine 2 died")
    agent_relay = relay_of(store, tmp_path)
    try:
        wait_until(lambda: agent_relay.generation == 2)
        assert relayed_failure(str(tmp_path), 0) == "machine 1 died"
        assert relayed_failure(str(tmp_path), 1) == "machine 2 died"
    finally:
        agent_relay.close(JobStore(store, TOKEN), timeout_s=10.0)


def test_a_non_final_stop_closes_the_ranks_fifo(tmp_path: Path) -> None:
    """An elastic change stops the rank's watchdog (not final) and starts another: the old one's FIFO
    ends are closed, not left open for every change."""
    wd = started(tmp_path, JobStore(counting(), TOKEN))
    wait_until(lambda: (tmp_path / "wake.0").exists())
    fifo = wd._wake
    assert fifo is not None
    wd.stop()
    assert wd._wake is None
    for fd in (fifo._r, fifo._w):  # closed (or its number reused by another file)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        assert target != str(tmp_path / "wake.0"), "the FIFO is still open"
