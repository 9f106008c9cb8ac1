"""The control plane's store traffic grows with the job as issue 48 says: O(1) per rank per second,
O(N) per round, no polling (a counting store: ds_swift.testing.counting_store)."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from ds_swift.detect import watchdog
from ds_swift.detect.beats import BeatFile
from ds_swift.detect.watchdog import Watchdog
from ds_swift.jobstore.agreement import GenerationFailed, agree, round_prefix, wake
from ds_swift.jobstore.membership import JobStore
from ds_swift.testing.counting_store import CountingStore, family_of

TOKEN = "unit-scale"


def counting() -> CountingStore:
    server = dist.HashStore()
    server.set_timeout(datetime.timedelta(seconds=30))
    return CountingStore(server)


def on_threads(n: int, fn: Callable[[int], Any]) -> dict[int, Any]:
    """``fn(rank)`` for every rank on a thread of its own (each would be a process); their results."""
    out: dict[int, Any] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    assert len(out) == n, "a rank did not finish"
    return out


def test_family_names_drop_the_namespace_and_the_numbers() -> None:
    assert family_of("swift/tok.abc/L.x/gen12/report/7") == "gen#/report/#"
    assert family_of("swift/tok.abc/launch/alive/3") == "launch/alive/#"


@pytest.mark.parametrize("n", [8, 64])
def test_an_agreement_round_costs_a_few_requests_per_rank(n: int) -> None:
    store = counting()
    verdicts = on_threads(
        n,
        lambda r: agree(
            JobStore(store, TOKEN),
            round_prefix(3, "report"),
            r,
            f"rank {r}",
            range(n),
            lambda values: str(len(values)),
            timeout_s=30,
            generation=3,
        ),
    )
    assert set(verdicts.values()) == {str(n)}  # the same verdict on every rank
    tally = store.take()
    # per rank: its write, a wait for the verdict and one read; the leader: one wait for the N
    # keys, one batched read, the verdict's compare-and-swap. Every rank reading every rank's key
    # would be N per rank.
    assert tally.total_requests <= 4 * n + 8, dict(tally.requests)
    assert tally.calls["multi_get"] == 1


def test_a_failure_of_the_generation_ends_every_wait_at_once() -> None:
    store = counting()
    started = threading.Barrier(3)

    def waiter(rank: int) -> str:
        js = JobStore(store, TOKEN)
        if rank == 2:  # the watchdog of a rank whose peer died: it sees the flag and wakes the round
            started.wait()
            time.sleep(0.2)
            js.declare_failure(5, "machine 1 died")
            return "woke"
        started.wait()
        try:
            agree(js, round_prefix(5, "restore"), rank, "", range(4), timeout_s=30, generation=5)
        except GenerationFailed as failed:
            return failed.reason
        return "no failure"

    def wake_on_flag() -> None:
        js = JobStore(store, TOKEN)
        reason = js.wait_for_failure(5, 30)
        assert reason is not None
        wake(js, 5, reason)

    watchdog = threading.Thread(target=wake_on_flag, daemon=True)
    watchdog.start()
    t0 = time.monotonic()
    said = on_threads(3, waiter)  # rank 3 never comes: only the failure ends the round
    assert said[1] == "machine 1 died"  # a non-leader, woken through the verdict key
    assert said[0] == "machine 1 died"  # the leader, at its next slice
    assert time.monotonic() - t0 < 10  # not the round's timeout of 30 s


@pytest.mark.parametrize("n", [8, 64])
def test_the_join_is_one_key_per_rank_and_rank_0s_complete(n: int) -> None:
    store = counting()
    on_threads(n, lambda r: JobStore(store, TOKEN).join(2, r, n, timeout_s=30))
    tally = store.take()
    assert tally.total_requests <= 4 * n + 8, dict(tally.requests)
    assert JobStore(store, TOKEN).joined(2, range(n))


def test_waiting_longer_costs_no_more_requests() -> None:
    """A gather waits on the store (one request) however long the last rank takes: no polling."""

    def cost(delay_s: float) -> int:
        store = counting()
        js = JobStore(store, TOKEN)

        def late() -> None:
            time.sleep(delay_s)
            JobStore(store, TOKEN).publish(1, "timeline", 1, "x")

        t = threading.Thread(target=late, daemon=True)
        t.start()
        js.publish(1, "timeline", 0, "x")
        assert js.gather(1, "timeline", [0, 1], timeout_s=30) == {0: "x", 1: "x"}
        t.join()
        return store.take().total_requests

    assert cost(0.9) <= cost(0.0) + 1  # a slice of the leader's wait (1 s) at most


def test_a_watchdog_beats_for_its_agent_and_waits_on_the_flag(tmp_path: Any) -> None:
    """A rank that beats for its agent: its beats and hang checks touch no store; its thread's turn
    is one blocking wait on the flag for a whole heartbeat timeout (two requests if it times out),
    woken the moment the flag is set."""
    store = counting()
    js = JobStore(store, TOKEN)
    wd = Watchdog(lambda: js, 0, 0, 0.05, 0.3, (1, 2, 3), beat_file=BeatFile(str(tmp_path), 0, 0.3))
    for _ in range(3):
        wd.local_turn()  # the beater's turns: no peer reads, no heartbeat in the store
    assert store.take().total_requests == 0
    assert (tmp_path / "0").read_text().startswith("3 0.3")  # the beats went to the agent's file
    t0 = time.monotonic()
    conn, _ = wd.turn(js)  # no failure: the wait ends after the heartbeat timeout
    tally = store.take()
    assert tally.calls["wait"] == 1 and tally.total_requests == 2, dict(tally.calls)
    assert 0.25 < time.monotonic() - t0 < 5
    threading.Timer(0.05, lambda: JobStore(store, TOKEN).declare_failure(0, "machine 1 died")).start()
    wd.heartbeat_timeout_s = 30.0  # a long wait: only the flag ends it
    t0 = time.monotonic()
    conn, _ = wd.turn(conn)
    assert wd.failed.is_set() and time.monotonic() - t0 < 5


def test_a_stopped_watchdog_is_not_a_hung_rank_and_its_wait_has_ended(tmp_path: Any) -> None:
    """At the end of training the watchdog stops: its last beat has no timeout (the process's exit,
    its process groups' teardown, may take longer than the heartbeat timeout: its agent declared
    the machine hung), and its thread is out of the store's C++ wait (one still inside when the
    interpreter finalizes is ended by pthread_exit: std::terminate, SIGABRT)."""
    from ds_swift.detect.beats import read_beat

    js = JobStore(counting(), TOKEN)
    wd = Watchdog(lambda: js, 0, 0, 0.05, 30.0, (1,), beat_file=BeatFile(str(tmp_path), 0, 30.0)).start()
    deadline = time.monotonic() + 10
    while read_beat(str(tmp_path / "0")) is None and time.monotonic() < deadline:
        time.sleep(0.02)  # the beater's first beat
    waiter = wd._thread
    wd.stop(final=True)
    beat = read_beat(str(tmp_path / "0"))
    assert beat is not None and beat[1] == float("inf") and beat[2] == "stopped", beat
    assert waiter is not None and not waiter.is_alive()  # a heartbeat timeout of 30 s: the slice ended it
    assert watchdog.WAIT_SLICE_S < 30.0


def test_agents_watch_a_bounded_ring_of_neighbours() -> None:
    from ds_swift.launch.liveness import AgentLiveness

    store = JobStore(counting(), TOKEN)
    live = AgentLiveness(store, [10], 1000, timeout_s=10.0, clock=lambda: 0.0)
    assert live.watched() == [8, 9, 11, 12]
    live._dead |= {11, 12}  # found dead: the watch moves on to the next live agents
    assert live.watched() == [8, 9, 13, 14]
    assert AgentLiveness(store, [0], 3, timeout_s=10.0).watched() == [1, 2]


def test_all_done_reads_one_count_until_every_machine_is_done() -> None:
    from ds_swift.launch.control import JobControl

    raw = counting()
    control = JobControl(JobStore(raw, TOKEN))
    control.mark_machine_done(0)
    raw.take()
    assert not control.all_done(500)
    assert raw.take().total_requests == 1  # not one read per machine
    for m in range(1, 500):
        control.mark_machine_done(m)
    assert control.all_done(500)


def test_ds_swifts_gloo_groups_connect_no_full_mesh() -> None:
    """Created as Transport.create makes them (lazily), a group costs one write per rank and a
    connection only where two ranks exchange (a ring here); a full mesh was 3 N^2 requests."""
    import torch

    from ds_swift.transport.core import lazy_gloo

    n, store = 16, counting()
    groups: dict[int, Any] = {}

    def create(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(
            dist.PrefixStore("gen1/pg/host", store), rank, n, datetime.timedelta(seconds=30)
        )

    with lazy_gloo():
        on_threads(n, create)
    assert store.take().total_requests == n

    def ring(rank: int) -> None:
        out = torch.zeros(1)
        sent = groups[rank].send([torch.ones(1)], (rank + 1) % n, 0)
        groups[rank].recv([out], (rank - 1) % n, 0).wait()
        sent.wait()

    on_threads(n, ring)
    assert store.take().total_requests <= 3 * 2 * n  # each pair: a wait and a read of its peer's address


def test_a_survivor_forgets_its_undone_digests_without_reading_its_slots() -> None:
    """After a recovery every rank drops its digests of the iterations trained again: a process reads
    back only the slots it did not write itself (a replacement: its predecessor's), one each."""
    from ds_swift.recovery.state.digest import StateDigest
    from ds_swift.recovery.verify import SLOTS, DigestSlots, forget_from, publish_digest, published_digests

    raw = counting()
    store, digest = JobStore(raw, TOKEN), StateDigest(("w",), ("0" * 16,))
    slots = DigestSlots(3)
    for iteration in range(0, 101, 10):  # its ring: 70, 80, 90, 100
        publish_digest(store, 3, iteration, 10, digest, slots)
    raw.take()
    forget_from(store, 3, 101, slots)  # resumes after them all: nothing to drop, nothing read
    assert raw.take().total_requests == 0
    forget_from(store, 3, 85, slots)  # a step back: 90 and 100 dropped, written without a read
    tally = raw.take()
    assert tally.calls == {"set": 2}, dict(tally.calls)
    assert sorted(published_digests(store, 3)) == [70, 80]
    raw.take()
    forget_from(store, 3, 85, DigestSlots(3))  # a replacement's process: it reads every slot once
    assert raw.take().calls == {"compare_set": SLOTS}
    forget_from(store, 3, 85, slots)  # what it wrote stays known: still nothing read
    assert raw.take().total_requests == 0


def test_the_checkpoint_every_rank_loads_follows_from_the_reports() -> None:
    """The checkpoint round is needed only where a rank named nothing old enough but may hold more:
    from each rank's newest loadable checkpoints (up to its own bound), the same checkpoint as every
    rank naming its newest one within the job's bound, min over the ranks."""
    import random

    from ds_swift.recovery.consensus import RankReport
    from ds_swift.recovery.coordinator import REPORTED_CHECKPOINTS, checkpoint_bound, common_checkpoint

    rng = random.Random(48)
    decided = 0
    for _ in range(2000):
        consensus = rng.randrange(0, 40)
        reports, loadable = [], []
        for rank in range(rng.randrange(1, 6)):
            survivor = rank == 0 or rng.random() < 0.7
            stepped = consensus + rng.randrange(2) if survivor else -1
            tags = sorted(rng.sample(range(0, 60), rng.randrange(0, 6)), reverse=True)
            own = [t for t in tags if not survivor or t <= stepped + 1]
            loadable.append(tags)
            reports.append(
                RankReport(rank, survivor, 0, rank, 0, rank, stepped, checkpoints=tuple(own[:REPORTED_CHECKPOINTS]))
            )
        bound = checkpoint_bound(reports)
        expected = min(max((t for t in tags if bound is None or t <= bound), default=-1) for tags in loadable)
        found = common_checkpoint(reports, bound)
        if found is not None:
            decided += 1
            assert found == expected, (reports, bound)
        else:  # only where a rank's named checkpoints are all above the bound
            assert any(r.checkpoints and min(r.checkpoints) > (bound or 0) for r in reports)
    assert decided > 1500  # most recoveries need no round of their own
    text = RankReport(1, True, 0, 0, 0, 0, 5, checkpoints=(6, 4)).to_json()
    assert RankReport.from_json(text).checkpoints == (6, 4)


def test_a_survivor_learns_the_failed_machine_in_a_wait_and_a_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recorded by the machine's agent after its declaration (the generation moved with it): two
    requests (the wait, the read); no record (a worker
    declared) or nobody asking: the generation is moved here."""
    from ds_swift.detect.failed_machine import FailedMachine
    from ds_swift.launch.control import JobControl

    raw = counting()
    store = JobStore(raw, TOKEN)
    store.begin("")
    store.declare_failure(0, "machine 2 died")
    JobControl(store).record_failure_timeline(0, 2, 1.0, 2.0)
    raw.take()
    assert FailedMachine(store, 0, 5.0)() == 2
    assert raw.take().calls == {"wait": 1, "compare_set": 1}
    # the first declarer died half-way: flag written, generation not moved, nothing recorded
    store.kv.set("gen1/failed", store.sealer.seal("gen1/failed", "a worker's declaration"))
    failed = FailedMachine(store, 1, 0.2)
    assert failed() is None and store.generation() == 2
    raw.take()
    FailedMachine(store, 2, 0.2).settle()  # asked by nobody (a membership change): moved all the same
    # its read, the agents' relays woken (ds_swift.detect.relay: not left waiting on generation 2), its move
    assert raw.take().total_requests == 3 and store.generation() == 3


def test_a_connection_reads_the_launch_in_one_request_and_one_key_in_one() -> None:
    raw = counting()
    store = JobStore(raw, TOKEN, "unit-scale-secret-0123")
    store.begin("L1")
    raw.take()
    assert JobStore(raw, TOKEN, "unit-scale-secret-0123").current_launch() == (TOKEN, "L1")
    assert raw.take().total_requests == 1  # a check, then a get (its wait and its read) were three
    store.publish(1, "digest_sent", 5, "x")
    raw.take()
    assert store.gather(1, "digest_sent", [5], timeout_s=5) == {5: "x"}
    assert raw.take().calls == {"wait": 1, "compare_set": 1}  # a multi_get is a wait and a read more


def _tcp_pair() -> tuple[dist.TCPStore, Callable[[], CountingStore]]:
    """A real TCPStore server (torch's libuv one, whose waits a compare_set of the key ends) and a
    factory of counted clients of it."""
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )

    def client() -> CountingStore:
        return CountingStore(
            dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30))
        )

    return server, client


def _waiting(client: CountingStore, timeout_s: float = 10.0) -> None:
    """Until ``client`` has asked the server for its wait (counted before the request is sent)."""
    deadline = time.monotonic() + timeout_s
    while client.tally.calls["wait"] == 0:
        assert time.monotonic() < deadline, "the waiter never waited"
        time.sleep(0.005)


def test_reading_the_absent_failure_flag_wakes_no_rank_waiting_on_it() -> None:
    """Every rank's watchdog waits on the flag; a read of it while absent (a declarer's first look,
    a poison check, a round's backstop) must not end their waits: on a TCPStore a compare_set of
    an absent key does, and each woken rank's read would wake the others again."""
    server, client = _tcp_pair()
    waiter_raw = client()
    got: list[str | None] = []
    t = threading.Thread(target=lambda: got.append(JobStore(waiter_raw, TOKEN).wait_for_failure(4, 30)), daemon=True)
    t.start()
    reader = JobStore(client(), TOKEN)
    _waiting(waiter_raw)
    for _ in range(20):  # reads spread over the wait's first 0.2 s: the waiter's request is in by then
        assert reader.failure(4) is None
        time.sleep(0.01)
    reader.declare_failure(4, "machine 3 died")
    t.join(30)
    assert got == ["machine 3 died"]
    assert waiter_raw.take().calls == {"wait": 1, "compare_set": 1}, "the waiter was woken before the write"
    del server


def test_a_waiter_woken_by_a_read_of_the_absent_key_wakes_the_others_at_most_once() -> None:
    """A read that wakes a key's waiters while it is absent (a bug elsewhere) costs a check and a wait
    per wake-up after the first: no waiter reads the absent key twice, so no storm outlives it."""
    server, client = _tcp_pair()
    waiter_raw = client()
    got: list[str | None] = []
    t = threading.Thread(target=lambda: got.append(JobStore(waiter_raw, TOKEN).wait_signed("v", 30)), daemon=True)
    t.start()
    _waiting(waiter_raw)
    writer = JobStore(client(), TOKEN)
    for _ in range(5):
        time.sleep(0.05)
        writer.kv.compare_set("v", "\x00never", "x")  # a one-request read of the absent key: wakes its waiters
    writer.claim("v", "the verdict")
    t.join(30)
    assert got == ["the verdict"]
    calls = waiter_raw.take().calls
    assert calls["compare_set"] <= 2, calls  # one read of the absent key at most, then the verdict's
    del server
