"""A ``torch.distributed.Store`` that counts what its clients ask of the server, per key family.

Wraps any store (an in-process ``HashStore`` for the scale harness and the unit tests, a TCPStore
client, an etcd client) and counts, for every call, the requests the job store's *server* answers
and the bytes that cross the wire, grouped by key family (``hb/#``, ``gen#/report/#``,
``launch/alive/#``: digit runs become ``#``, the job's namespace and launch prefix are dropped):
``benchmarks/scale.py`` turns them into per-rank rates and per-recovery totals, and the unit
tests bound them (a gather of N keys costs at most c x N requests).

Requests are counted as a TCPStore server sees them: ``get`` and ``multi_get`` are two each (the
client waits for the keys, then reads them: torch's TCPStore::doGet), every other call one; a
``wait`` is one request however long it blocks, two when it times out (the client then cancels it:
``cancel_wait``).

``virtual_waits``: a ``wait`` on keys that are absent does not block but fails at once as a timed-out
wait does (``DistStoreError``), and the time it would have blocked is added to :attr:`slept_s`: the
scale harness's fake clock then advances the waiting actor by it (one thread plays every rank).
"""

from __future__ import annotations

import collections
import datetime
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

__all__ = ["CountingStore", "Tally", "family_of"]

#: server requests per call under TCPStore's protocol (anything not listed: one)
_REQUESTS = {"get": 2, "multi_get": 2}
_DIGITS = re.compile(r"\d+")


def family_of(key: str) -> str:
    """``swift/<ns>/L.<launch>/gen12/report/7`` -> ``gen#/report/#`` (at most three parts)."""
    parts = [p for p in key.split("/") if p]
    if parts and parts[0] == "swift":
        parts = parts[2:]
    if parts and parts[0].startswith("L."):
        parts = parts[1:]
    return "/".join(_DIGITS.sub("#", p) for p in parts[:3]) or "(root)"


@dataclass
class Tally:
    """Requests and bytes per family (and per call kind, for the tables)."""

    requests: collections.Counter[str] = field(default_factory=collections.Counter)
    bytes: collections.Counter[str] = field(default_factory=collections.Counter)
    calls: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def matching(self, prefix: str) -> int:
        """Requests of the families that start with ``prefix``."""
        return sum(n for fam, n in self.requests.items() if fam.startswith(prefix))

    def merged(self, other: Tally) -> Tally:
        return Tally(self.requests + other.requests, self.bytes + other.bytes, self.calls + other.calls)


def _size(value: str | bytes | Iterable[int]) -> int:
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, bytes | bytearray):
        return len(value)
    return len(bytes(value))


class CountingStore(dist.Store):
    """Counts the server requests and bytes of every call on ``inner`` (see the module docstring).

    Keep a Python reference to it while torch's ``PrefixStore`` uses it: pybind forgets a Python
    store's methods once the Python object is gone."""

    #: a Store written in Python: torch's PrefixStore cannot route delete_key to it (ds_swift.jobstore.signed_kv)
    python_store = True

    def __init__(self, inner: dist.Store, virtual_waits: bool = False) -> None:
        super().__init__()
        # Any: torch's stubs say str where the store takes bytes as well (and a multi_set they omit)
        self.inner: Any = inner
        self.virtual_waits = virtual_waits
        self.tally = Tally()
        self.slept_s = 0.0
        """Virtual waits only: the seconds the waits that timed out would have blocked."""
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ counting
    def _count(self, op: str, keys: Sequence[str], nbytes: int) -> None:
        n = _REQUESTS.get(op, 1)
        fam = family_of(keys[0]) if keys else "(none)"
        with self._lock:
            self.tally.requests[fam] += n
            self.tally.bytes[fam] += nbytes + sum(len(k) for k in keys)
            self.tally.calls[op] += 1

    def take(self) -> Tally:
        """What was counted since the last take (and start counting afresh)."""
        with self._lock:
            out, self.tally = self.tally, Tally()
        return out

    # ------------------------------------------------------------------ torch.distributed.Store
    def set(self, key: str, value: str | bytes) -> None:
        self._count("set", [key], _size(value))
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        value = bytes(self.inner.get(key))
        self._count("get", [key], len(value))
        return value

    def add(self, key: str, amount: int) -> int:
        self._count("add", [key], 8)
        return int(self.inner.add(key, amount))

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        out = bytes(self.inner.compare_set(key, expected_value, desired_value))
        self._count("compare_set", [key], _size(expected_value) + _size(desired_value) + len(out))
        return out

    def check(self, keys: list[str]) -> bool:
        self._count("check", keys, 0)
        return bool(self.inner.check(keys))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._count("wait", keys, 0)
        if self.virtual_waits and not self.inner.check(keys):
            with self._lock:
                self.slept_s += timeout.total_seconds() if timeout is not None else 0.0
            self._count("cancel_wait", keys, 0)
            raise dist.DistStoreError("Wait timeout (virtual)")
        try:
            if timeout is None:
                self.inner.wait(keys)
            else:
                self.inner.wait(keys, timeout)
        except RuntimeError:
            self._count("cancel_wait", keys, 0)  # a TCPStore client cancels a wait that timed out
            raise

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = [bytes(v) for v in self.inner.multi_get(keys)]
        self._count("multi_get", keys, sum(len(v) for v in values))
        return values

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._count("multi_set", keys, sum(_size(v) for v in values))
        self.inner.multi_set(keys, values)

    def delete_key(self, key: str) -> bool:
        self._count("delete_key", [key], 0)
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        self._count("num_keys", [], 0)
        return int(self.inner.num_keys())
