"""Launches of one job in one store, replays and counter bumps (ds_swift.jobstore.signed_kv).

A store that outlives a launch (etcd; here a TCPStore the test serves, as ``--store tcp://`` does)
must not hand a relaunch with the same token and secret the dead launch's keys; a signed value
written again later (a replay), or a counter bumped without the secret, must be rejected.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from ds_swift.detect.watchdog import hung_machine_key
from ds_swift.jobstore.membership import JobStore, MembershipError, WorkerEnv
from launch.control import JobControl

SECRET = "launches-test-secret-" + "5" * 12
TOKEN = "requeued-job"


@pytest.fixture
def served() -> Iterator[dist.TCPStore]:
    """A store no launch hosts (it outlives them), as etcd or ``--store tcp://`` are."""
    yield dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)


def _url(store: dist.TCPStore) -> str:
    return f"tcp://127.0.0.1:{store.port}"


def _outsider(store: dist.TCPStore, prefix: str) -> dist.PrefixStore:
    raw = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    return dist.PrefixStore(prefix.rstrip("/"), raw)  # PrefixStore adds the "/"


def test_a_relaunch_never_reads_the_dead_launchs_keys(served: dist.TCPStore) -> None:
    dead = JobStore.open(_url(served), TOKEN, timeout_s=10, create=True, secret=SECRET)
    dead.add("gen0/joined", 2)
    dead.set(hung_machine_key(1), "0 no progress for 60 s")
    dead.declare_failure(0, "machine 1 died")  # then the whole launch died: nothing cleared
    assert dead.generation() == 1

    relaunch = JobStore.open(_url(served), TOKEN, timeout_s=10, create=True, secret=SECRET)
    assert relaunch.generation() == 0 and relaunch.failure(0) is None
    assert relaunch.add("gen0/joined", 0) == 0 and relaunch.get(hung_machine_key(1)) is None
    # The dead launch's values copied into the new launch's keys (same key, same secret) read as forged.
    inside = _outsider(served, relaunch.prefix)
    inside.set("gen0/failed", dead.kv.get("gen0/failed"))
    inside.set(hung_machine_key(1), dead.kv.get(hung_machine_key(1)))
    assert relaunch.failure(0) is None and relaunch.get(hung_machine_key(1)) is None


def test_a_worker_of_the_dead_launch_is_refused(served: dist.TCPStore) -> None:
    dead = JobStore.open(_url(served), TOKEN, timeout_s=10, create=True, secret=SECRET)
    JobStore.open(_url(served), TOKEN, timeout_s=10, create=True, secret=SECRET)  # the relaunch
    env = WorkerEnv(
        rank=0,
        local_rank=0,
        world_size=1,
        machine=0,
        num_machines=1,
        generation=0,
        replacement=False,
        store_addr="127.0.0.1",
        store_port=served.port,
        token=TOKEN,
        run_dir=".",
        inject="",
        store_url=_url(served),
        secret=SECRET,
        launch=dead.launch,
    )
    with pytest.raises(MembershipError, match="earlier launch of the job"):
        JobStore.from_env(env, timeout_s=10)


def test_a_replayed_generation_or_heartbeat_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    job = JobStore.host(TOKEN, secret=SECRET)
    inside = _outsider(job.raw, job.prefix)  # type: ignore[arg-type]
    job.declare_failure(0, "machine 1 died")
    old_generation = job.kv.get("generation")  # generation 1, signed by the job itself
    job.declare_failure(1, "machine 0 died")
    assert job.generation() == 2
    inside.set("generation", old_generation)
    assert job.generation() == 2
    job.declare_failure(2, "machine 1 died again")  # the replay does not block the next move
    assert job.generation() == 3
    job.heartbeat(0, "step 1")
    beat = job.heartbeat_of(0)
    old_beat = job.kv.get("hb/0")
    job.heartbeat(0, "step 2")
    assert beat is not None and job.heartbeat_of(0) is not None
    inside.set("hb/0", old_beat)
    later = job.heartbeat_of(0)
    assert later is not None and later[0] > beat[0]
    assert "an old signed value replayed" in capsys.readouterr().err


def test_an_unsigned_counter_bump_is_rejected() -> None:
    job = JobStore.host(TOKEN, secret=SECRET)
    inside = _outsider(job.raw, job.prefix)  # type: ignore[arg-type]
    assert job.add("launch/spares_taken", 1) == 1
    try:  # TCPStore's add parses the value's leading digits (the MAC's), or drops the client if none
        inside.add("launch/spares_taken", 5)
    except RuntimeError:
        inside = _outsider(job.raw, job.prefix)  # type: ignore[arg-type]
    assert job.add("launch/spares_taken", 0) == 1
    inside.set("launch/spares_taken", "6")
    assert job.add("launch/spares_taken", 0) == 1
    inside.add("gen0/joined", 4)  # a counter the job has not created yet
    assert job.add("gen0/joined", 0) == 0
    assert job.add("gen0/joined", 1) == 1 and job.add("launch/spares_taken", 1) == 2  # forged values overwritten
    assert job.sealer.rejected["launch/spares_taken"] >= 1 and job.sealer.rejected["gen0/joined"] >= 1


def test_signed_counters_count_every_add_of_concurrent_clients() -> None:
    job = JobStore.host(TOKEN, secret=SECRET)
    clients = [JobStore.connect("127.0.0.1", job.port, TOKEN, timeout_s=10, secret=SECRET) for _ in range(3)]
    results: list[int] = []

    def bump(client: JobStore) -> None:
        results.extend(client.add("c", 1) for _ in range(20))

    threads = [threading.Thread(target=bump, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert job.add("c", 0) == 60 and sorted(results) == list(range(1, 61))  # each value handed out once


def test_done_keys_created_without_the_secret_do_not_end_the_job() -> None:
    job = JobStore.host(TOKEN, secret=SECRET)
    inside = job.kv  # the job's own keys, written without signing (as a client that found them could)
    control = JobControl(job)
    for machine in (0, 1):
        inside.set(f"launch/done/{machine}", "1")
    assert not control.all_done(2)
    control.mark_machine_done(0)
    control.mark_machine_done(1)
    assert control.all_done(2)


def test_a_buddy_round_done_key_created_without_the_secret_does_not_end_the_wait() -> None:
    from ds_swift.protect.buddy_holdings import StoreLanding

    job = JobStore.host(TOKEN, secret=SECRET)
    job.kv.set("buddy/0/3/done", "1")  # an outsider's key: what a plain etcd lets anyone write
    polled, results = threading.Event(), []
    polls: list[int] = []

    def stopped() -> bool:  # the first rank still waits after many looks at the forged key
        polls.append(1)
        if len(polls) >= 5:
            polled.set()
        return len(polls) > 1000

    first = threading.Thread(target=lambda: results.append(StoreLanding(job, 0, 2, rank=1)(3, stopped)))
    first.start()
    try:
        assert polled.wait(60) and not results  # its key written, not ended by the forged done key
        other = JobStore.connect("127.0.0.1", job.port, TOKEN, timeout_s=10, secret=SECRET)
        assert StoreLanding(other, 0, 2, rank=0)(3, lambda: False) is True  # the leader completes the round
    finally:
        first.join(60)
    assert results == [True]  # ended by the last rank's signed key


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_the_store_servers_thread_does_not_preempt_a_training_rank_on_wakeup() -> None:
    before = set(os.listdir("/proc/self/task"))
    job = JobStore.host(TOKEN, secret=SECRET)
    started = set(os.listdir("/proc/self/task")) - before
    job.set("probe", "1")
    assert started and {os.sched_getscheduler(int(t)) for t in started} == {os.SCHED_BATCH}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the launcher's own thread, whose children are the ranks
