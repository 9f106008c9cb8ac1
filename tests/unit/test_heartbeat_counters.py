"""Heartbeats are counters judged on each observer's own clock (issue 30, item 3): two hosts whose
wall clocks differ by 15 s, and a job store that stalls for longer than the heartbeat timeout,
kill no machine; one observer alone suspects, it does not kill.

Two simulated hosts, A (rank 0, machine 0, agent 0) and B (rank 1, machine 1, agent 1), share one
real job store. Each host has its own wall clock and its own monotonic clock: the test patches
``time.time`` and ``time.monotonic`` to read the clocks of the host whose code runs at the moment,
and moves the shared true time itself (no sleeps: the timeouts are 10 s of simulated time).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from ds_swift.detect.watchdog import Watchdog, hung_machine_key
from ds_swift.jobstore.membership import JobStore
from ds_swift.launch.liveness import AgentLiveness

TOKEN = "unit-heartbeat-counters"
TIMEOUT_S = 10.0
POLL_S = 0.1


class Hosts:
    """True time ``t`` and, per host, a wall-clock skew and a monotonic origin of its own."""

    def __init__(self, skew_s: dict[str, float]) -> None:
        self.t = 0.0
        self.skew_s = skew_s
        self.boot = {"a": 50.0, "b": 90_000.0}  # monotonic clocks count from each host's boot
        self.host = "a"

    def time(self) -> float:
        return 1.8e9 + self.t + self.skew_s[self.host]

    def monotonic(self) -> float:
        return self.boot[self.host] + self.t

    @contextmanager
    def on(self, host: str) -> Iterator[None]:
        before, self.host = self.host, host
        try:
            yield
        finally:
            self.host = before


@pytest.fixture
def store() -> JobStore:
    return JobStore.host(TOKEN)


def client(store: JobStore) -> JobStore:
    return JobStore.connect("127.0.0.1", store.port, TOKEN)


class Job:
    """Each host's worker watchdog (watching the other host's rank) and agent liveness."""

    def __init__(self, store: JobStore, hosts: Hosts, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(time, "time", hosts.time)
        monkeypatch.setattr(time, "monotonic", hosts.monotonic)
        self.store, self.hosts = store, hosts
        self.stores = {h: client(store) for h in ("a", "b")}
        self.dogs: dict[str, Watchdog] = {}
        self.agents: dict[str, AgentLiveness] = {}
        for host, rank in (("a", 0), ("b", 1)):
            with hosts.on(host):
                self.dogs[host] = Watchdog(
                    lambda h=host: self.stores[h],
                    rank=rank,
                    generation=0,  # type: ignore[misc]
                    poll_interval_s=POLL_S,
                    heartbeat_timeout_s=TIMEOUT_S,
                    watch_ranks=[1 - rank],
                )
                self.agents[host] = AgentLiveness(
                    self.stores[host], [rank], 2, TIMEOUT_S, clock=lambda: time.monotonic()
                )

    def poll(self, host: str) -> None:
        with self.hosts.on(host):
            self.dogs[host].poll_once(self.stores[host])
            assert self.agents[host].step() == [], f"agent of host {host} found the other host's agent dead"

    def run(self, seconds: float, first: str = "a") -> None:
        """Both hosts poll every 100 ms of true time for ``seconds``."""
        order = (first, "b" if first == "a" else "a")
        for _ in range(round(seconds / POLL_S)):
            self.hosts.t += POLL_S
            for host in order:
                self.poll(host)

    def assert_nobody_killed(self) -> None:
        assert self.store.failure(0) is None, self.store.failure(0)
        assert self.store.generation() == 0
        for machine in (0, 1):
            assert self.store.get(hung_machine_key(machine)) is None, self.store.get(hung_machine_key(machine))
        assert not any(dog.failed.is_set() for dog in self.dogs.values())


def test_a_15s_clock_skew_between_two_hosts_kills_no_machine(store: JobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host B's wall clock runs 15 s behind host A's (heartbeat timeout 10 s): 30 s of training,
    every rank and agent beating, and nobody is suspected, let alone killed."""
    job = Job(store, Hosts({"a": 0.0, "b": -15.0}), monkeypatch)
    job.run(30.0)
    job.assert_nobody_killed()
    assert not [k for k in ("suspect/0/0", "suspect/0/1") if store.get(k) is not None]  # not even suspected


def stall_inside(job: Job, host: str, seconds: float, method: str, target: Any) -> Callable[[], None]:
    """Make the next ``target.method`` call on ``host`` take ``seconds`` of true time (a stalled
    store answers late); returns a function that undoes it."""
    original = getattr(target, method)

    def slow(*args: Any, **kwargs: Any) -> Any:
        job.hosts.t += seconds
        setattr(target, method, original)
        return original(*args, **kwargs)

    setattr(target, method, slow)
    return lambda: setattr(target, method, original)


@pytest.mark.parametrize("where", ["between_polls", "inside_a_call"])
def test_a_store_stall_longer_than_the_heartbeat_timeout_kills_no_machine(
    store: JobStore, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The store answers nobody for 15 s (timeout 10 s); when it is back, host A reads first, before
    host B's next beat lands: A's silence clocks start afresh after its own stall (no verdict)."""
    job = Job(store, Hosts({"a": 0.0, "b": 0.0}), monkeypatch)
    job.run(5.0)
    if where == "between_polls":
        job.hosts.t += 15.0  # nobody's call gets through: no beat, no read
        job.poll("a")
    else:
        undo = stall_inside(job, "a", 15.0, "heartbeat", job.stores["a"])  # A's own beat write hangs 15 s
        job.poll("a")
        undo()
        job.poll("a")  # and its next round, still before B's next beat
        undo = stall_inside(job, "a", 15.0, "add", job.stores["a"])  # the agent's beat hangs 15 s
        with job.hosts.on("a"):
            job.agents["a"]._next_beat = 0.0
            assert job.agents["a"].step() == []
            job.agents["a"]._next_beat = 0.0
            assert job.agents["a"].step() == []
        undo()
    job.run(20.0)
    job.assert_nobody_killed()


def test_one_observer_suspects_and_the_second_kills(store: JobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 stops beating: host A's watchdog only suspects machine 1 (its view alone is no
    verdict); a second observer's agreement makes it one."""
    from ds_swift.detect.watchdog import BEATS_PER_TIMEOUT, suspect_key

    job = Job(store, Hosts({"a": 0.0, "b": 0.0}), monkeypatch)
    job.run(2.0)
    for _ in range(round(12.0 / POLL_S)):  # B's rank is stopped: only A polls
        job.hosts.t += POLL_S
        with job.hosts.on("a"):
            job.dogs["a"].poll_once(job.stores["a"])
    # within the timeout and a beat (peers are read as often as a rank beats)
    assert re.match(rf"{TIMEOUT_S!r} rank 1: no heartbeat for 1[01]\.\d s", store.get(suspect_key(0, 1)) or "")
    assert store.failure(0) is None and store.get(hung_machine_key(1)) is None
    store.add(f"{suspect_key(0, 1)}/n", 1)  # a second observer (another rank's watchdog) agrees
    job.hosts.t += TIMEOUT_S / BEATS_PER_TIMEOUT  # A's next round of peer checks
    with job.hosts.on("a"):
        seen = job.dogs["a"].poll_once(job.stores["a"])
    assert seen is not None and "1 other observer(s) agree" in seen.reason
    assert (store.get(hung_machine_key(1)) or "").startswith("0 rank 1: no heartbeat")


def test_a_stopped_rank_is_failed_by_its_own_agent_on_its_own_clock(
    store: JobStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A rank beats for its machine's agent (a file on the machine: no job store). The agent reads it
    on its own clock: while the rank beats, nothing is killed; once it stops for its timeout, the
    agent kills it and fails the machine."""
    import signal

    from ds_swift.detect.beats import BeatFile
    from ds_swift.launch.agent import JobSpec, MachineAgent
    from ds_swift.launch.args import Command
    from ds_swift.launch.control import EventLog

    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])

    class Worker:
        pid, rank, generation, code = 1001, 1, 0, None

        def poll(self) -> int | None:
            return self.code

        def signal_group(self, sig: int) -> None:
            if sig == signal.SIGKILL:
                self.code = -signal.SIGKILL

    worker, told = Worker(), []
    job = JobSpec(Command("t.py"), 2, 1, 1, 3, None, "127.0.0.1", store.port, TOKEN, str(tmp_path))
    agent = MachineAgent(1, job, store, EventLog(str(tmp_path)), spawn=lambda *a: told.append(a[1]) or worker)
    agent.start()
    beats = BeatFile(told[0].beat_dir, 1, TIMEOUT_S)  # what the rank's watchdog writes (SWIFT_BEAT_DIR)
    for _ in range(60):  # 15 s: rank 1 beats on
        now[0] += 0.25
        beats.beat("forward")
        agent.tick()
    assert worker.code is None and store.failure(0) is None
    for _ in range(60):  # 15 s: rank 1 stopped
        now[0] += 0.25
        agent.tick()
    assert worker.code == -signal.SIGKILL
    # seen within a look (a second) of the timeout: 10 s and under one more
    assert re.search(r"machine 1: hung \(rank 1: no heartbeat for 1[01]\.\d s", store.failure(0) or ""), store.failure(
        0
    )
    assert "last in forward, on its agent's clock" in (store.failure(0) or "")
    agent.close()
