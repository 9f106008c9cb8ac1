"""The etcd job store against a real etcd: TLS and authentication keep outsiders out, and a new
launch collects what dead launches of the job left."""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from etcd_server import Etcd

from ds_swift.jobstore.etcd import EtcdStore
from ds_swift.jobstore.membership import JobStore, MembershipError
from ds_swift.jobstore.signed_kv import STALE_S
from ds_swift.jobstore.url import StoreCredentials

SECRET = "etcd-store-test-secret-" + "3" * 10
TOKEN = "etcd-tok"

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


@pytest.fixture
def secure_etcd(tmp_path: Path) -> Iterator[Etcd]:
    server = Etcd(tmp_path, tls=True)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[Etcd]:
    server = Etcd(tmp_path)
    try:
        yield server
    finally:
        server.stop()


def _client(etcd: Etcd, tls: bool, credentials: StoreCredentials) -> EtcdStore:
    return EtcdStore(
        [("127.0.0.1", etcd.port)], timeout=datetime.timedelta(seconds=2), tls=tls, credentials=credentials
    )


def test_tls_and_auth_keep_out_a_client_without_credentials(secure_etcd: Etcd) -> None:
    job = JobStore.open(
        secure_etcd.url, TOKEN, timeout_s=10, create=True, secret=SECRET, credentials=secure_etcd.credentials
    )
    job.declare_failure(0, "machine 1 died")
    key = job.prefix + "gen0/failed"
    full = secure_etcd.credentials
    outsiders = {
        "plain HTTP": _client(secure_etcd, False, StoreCredentials()),
        "TLS, no CA (server not trusted)": _client(secure_etcd, True, StoreCredentials()),
        "CA, no client certificate": _client(secure_etcd, True, StoreCredentials(ca=full.ca)),
        "client certificate, no user": _client(secure_etcd, True, dataclasses.replace(full, user="", password="")),
        "client certificate, wrong password": _client(secure_etcd, True, dataclasses.replace(full, password="guess")),
        "user and password, no client certificate": _client(
            secure_etcd, True, dataclasses.replace(full, cert="", key="")
        ),
    }
    for what, client in outsiders.items():
        attempts = {
            "read": lambda c: c.check([key]),
            "write": lambda c: c.set(key, "forged"),
            "list": lambda c: c.keys("swift/"),
            "delete": lambda c: c.delete_prefix("swift/"),
        }
        for name, attempt in attempts.items():
            with pytest.raises(RuntimeError):
                attempt(client)
                pytest.fail(f"{what}: {name} got through")
    assert job.failure(0) == "machine 1 died" and job.generation() == 1
    # The job's user may use swift/ only.
    with pytest.raises(RuntimeError, match="permission denied"):
        _client(secure_etcd, True, full).set("elsewhere", "x")
    # A worker finds the credentials in its environment (SWIFT_STORE_*), as the launcher hands them on.
    worker = JobStore.open(secure_etcd.url, TOKEN, timeout_s=10, secret=SECRET, launch=job.launch, credentials=full)
    assert worker.failure(0) == "machine 1 died"
    with pytest.raises(MembershipError, match="cannot reach the job store"):
        JobStore.open(secure_etcd.url, TOKEN, timeout_s=10, secret=SECRET, credentials=StoreCredentials(ca=full.ca))


def test_the_login_token_is_renewed(secure_etcd: Etcd) -> None:
    client = _client(secure_etcd, True, secure_etcd.credentials)
    client.set("swift/x", "1")
    first = client._token
    client._token_at -= 3600  # old: renewed before the next request
    assert client.get("swift/x") == b"1" and client._token not in (None, first)
    client._token = "forgotten.42"  # a token a restarted member no longer knows: its gateway times out
    assert client.get("swift/x") == b"1" and client._token != "forgotten.42"


def test_a_new_launch_collects_the_keys_dead_launches_left(etcd: Etcd) -> None:
    def launch() -> JobStore:
        return JobStore.open(etcd.url, TOKEN, timeout_s=10, create=True, secret=SECRET)

    crashed, ended, running = launch(), launch(), launch()
    for js in (crashed, ended, running):
        js.declare_failure(0, "machine 1 died")
    ended.write_record(ended=True)
    raw = _client(etcd, False, StoreCredentials())
    raw.set(f"{crashed.root_prefix}L.forged/gen0/failed", "x")  # a namespace without a signed record
    fresh = launch()
    t0 = time.monotonic()
    assert [launch_id for launch_id, _ in fresh.collected] == [ended.launch], fresh.collected  # at once
    assert {k.split("/")[2] for k in raw.keys(fresh.root_prefix + "L.")} == {
        f"L.{crashed.launch}",
        f"L.{running.launch}",
        f"L.{fresh.launch}",
        "L.forged",
    }
    # A launch whose record (or its absence) this process sees unchanged for STALE_S on its own clock
    # is dead (a crash); a live one rewrites its record every BEAT_S.
    running.write_record()
    assert fresh.collect_leftovers(now=t0 + STALE_S / 2) == []
    running.write_record()
    gone = fresh.collect_leftovers(now=t0 + STALE_S + 60)
    assert sorted(launch_id for launch_id, _ in gone) == sorted([crashed.launch, "forged"]), gone
    assert fresh.failure(0) is None and fresh.generation() == 0
    fresh.clear()  # a clean end: its keys and the token record go too; the running launch's stay
    assert {k.split("/")[2] for k in raw.keys(fresh.root_prefix)} == {f"L.{running.launch}"}


def test_gathers_rounds_and_joins_of_more_than_128_ranks(etcd: Etcd) -> None:
    """etcd refuses a transaction of more than 128 operations (--max-txn-ops): a gather, a check,
    an agreement round and a join of 300 ranks go through in batches; a wait watches (no polling)."""
    import threading

    from ds_swift.jobstore.agreement import agree, round_prefix

    n = 300
    job = JobStore.open(etcd.url, TOKEN, timeout_s=30, create=True, secret=SECRET)
    for r in range(n):
        job.publish(1, "report", r, f"rank {r}")
    assert job.gather(1, "report", range(n), timeout_s=30) == {r: f"rank {r}" for r in range(n)}
    keys = [f"gen1/report/{r}" for r in range(n)]
    assert job.kv.check(keys) and not job.kv.check([*keys, "gen1/report/absent"])
    assert job.read_present(keys)[-1] == f"rank {n - 1}"
    # A round whose leader waits for 300 keys, 299 of them written while it watches.
    leader = JobStore.open(etcd.url, TOKEN, timeout_s=30, secret=SECRET)
    said: dict[str, str] = {}

    def lead() -> None:
        said["verdict"] = agree(
            leader,
            round_prefix(2, "ckpt"),
            0,
            "5",
            range(n),
            lambda v: str(min(int(x) for x in v.values())),
            timeout_s=60,
            generation=2,
        )

    t = threading.Thread(target=lead, daemon=True)
    t.start()
    time.sleep(0.5)  # the leader is watching now
    for r in range(1, n):
        job.set(f"{round_prefix(2, 'ckpt')}/{r}", str(3 + r % 2))
    t.join(60)
    assert said == {"verdict": "3"}
    # The last rank to say its value reads the verdict at once (it is there).
    assert agree(job, round_prefix(2, "ckpt"), n - 1, "4", range(n), timeout_s=10, generation=2) == "3"
    # The launcher's done count on etcd: the marks counted in one request, no compare-and-swap.
    from ds_swift.launch.control import JobControl

    control = JobControl(job)
    for m in range(199):
        control.mark_machine_done(m)
    assert control.done_count() == 199 and not control.all_done(200)
    control.mark_machine_done(199)
    assert control.all_done(200)
