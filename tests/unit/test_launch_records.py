"""Which of a job's earlier launches are over (ds_swift.jobstore.signed_kv.collect_leftovers).

A store that lists its keys (etcd; here a dict behind torch's Store interface) keeps every launch's
namespace; a new launch deletes those that are over. A launch is over when its record says so, or
when this process has seen its record unchanged for STALE_S on its own clock: never because the
time the record states is old by this host's clock (the launch that wrote it runs on another host).
"""

from __future__ import annotations

import datetime
import json
import time

import torch.distributed as dist

from ds_swift.jobstore.signed_kv import RECORD_KEY, STALE_S, SignedKV

SECRET = "launch-records-test-secret-" + "1" * 8


class ListingStore(dist.Store):
    """An in-memory store that can list and delete by prefix, as EtcdStore can."""

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        want = expected.encode() if isinstance(expected, str) else bytes(expected)
        new = desired.encode() if isinstance(desired, str) else bytes(desired)
        if self.data.get(key, b"") == want:
            self.data[key] = new
        return self.data.get(key, want)

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        assert self.check(keys)

    def keys(self, prefix: str) -> list[str]:
        return [k for k in self.data if k.startswith(prefix)]

    def delete_prefix(self, prefix: str) -> int:
        gone = self.keys(prefix)
        for k in gone:
            del self.data[k]
        return len(gone)


def _launch(store: ListingStore, launch: str) -> SignedKV:
    kv = SignedKV(store, "tok", SECRET)
    kv.begin(launch)
    return kv


def _backdate(kv: SignedKV, seconds: float) -> None:
    """The launch's record as a host whose clock is ``seconds`` behind writes it."""
    kv._put(
        RECORD_KEY,
        json.dumps(
            {"started": 0.0, "beat": json.loads(kv._read(RECORD_KEY) or "{}")["beat"] - seconds, "ended": False}
        ),
    )


def _launches(store: ListingStore, kv: SignedKV) -> set[str]:
    start = kv.root_prefix + "L."
    return {k[len(start) :].partition("/")[0] for k in store.keys(start)}


def test_a_running_launch_on_a_host_whose_clock_is_behind_is_not_collected() -> None:
    store = ListingStore()
    running = _launch(store, "running")
    _backdate(running, 3600)  # its host's clock is an hour behind: the record looks an hour old here
    fresh = _launch(store, "fresh")
    assert fresh.collect_leftovers() == []  # this host's clocks, as at a launch's start
    t0 = time.monotonic()
    for beat in range(1, 20):  # it keeps beating (every BEAT_S), with its own clock
        _backdate(running, 3600 - beat)
        assert fresh.collect_leftovers(now=t0 + beat * 60.0) == []
    assert _launches(store, fresh) == {"running", "fresh"}


def test_a_launch_whose_record_stopped_changing_is_collected_after_stale_s_of_this_hosts_clock() -> None:
    store = ListingStore()
    crashed, ended = _launch(store, "crashed"), _launch(store, "ended")
    ended.write_record(ended=True)
    store.set(crashed.root_prefix + "L.norecord/gen0/failed", "x")  # a namespace without a (signed) record
    fresh = _launch(store, "fresh")
    assert fresh.collect_leftovers(now=50.0) == [("ended", "ended")]  # said ended: at once
    assert fresh.collect_leftovers(now=50.0 + STALE_S / 2) == []
    gone = fresh.collect_leftovers(now=51.0 + STALE_S)
    assert [launch for launch, _ in gone] == ["crashed", "norecord"], gone
    assert "unchanged for" in gone[0][1] and "no launch record signed" in gone[1][1], gone
    assert _launches(store, fresh) == {"fresh"}
