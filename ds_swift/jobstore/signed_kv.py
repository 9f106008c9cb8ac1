"""The job's keys: one namespace per launch, signed values, signed counters, dead launches collected.

Layout (``root`` is ``swift/<token>.<tag>/``, ``tag`` an HMAC of the token, :mod:`.store_auth`)::

    <root>token                    "<token> <launch id>": the job's current launch (signed)
    <root>L.<launch id>/...        every key of that launch: membership, the agents' protocol, and
                                   torch's own rendezvous (``gen<g>/pg/...``)
    <root>L.<launch id>/launch/record   {"started", "beat", "ended"} of that launch (signed)

Why per launch: a relaunch with the same token and secret (a requeued SLURM job, a user running
the same script again) must never read a dead launch's ``gen0/joined``, ``gen0/failed`` or
``hung/machine/<m>``: the agents would kill machines at once or join stale generations. Each
launch has its own id (:func:`new_launch_id`, or one every agent derives alike, e.g. from SLURM's
job, step and restart count); its keys live under it, and the launch id is bound into every MAC,
so a value copied from another launch's namespace reads as forged. A launch on an etcd store
deletes the namespaces of other launches whose record says ended at once, and of those whose
record (or its absence, or an unsigned one) it has seen unchanged, byte for byte, for
:data:`STALE_S` on its own monotonic clock (a running launch rewrites its record every
:data:`BEAT_S`, so a live one never stays unchanged that long); it looks at its start and at every
beat after. The record's own time is never compared with this host's clock: the launch that wrote it
ran on another host, whose clock may be minutes off, and a record that merely says an old time is
no proof that its launch is over. A TCPStore cannot list its keys, and lives only as long as the
launch that serves it.

Counters are signed values ``<n>:<nonce>`` updated by compare-and-swap: an unsigned bump (``add``
by a client without the secret) reads as forged. Counters, the generation and heartbeats never go
backwards: a value lower than one this process read before (an old signed value written again)
is rejected the same way.
"""

from __future__ import annotations

import datetime
import json
import re
import secrets
import time
from typing import TYPE_CHECKING

from ds_swift.jobstore.auth import Sealer
from ds_swift.jobstore.contention import CasBudget

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch.distributed as dist

__all__ = ["BEAT_S", "LAUNCH_ENV", "STALE_S", "SignedKV", "check_launch_id", "new_launch_id"]

LAUNCH_ENV = "SWIFT_LAUNCH_ID"
RECORD_KEY = "launch/record"
#: how often a running launch rewrites its record; one seen unchanged for STALE_S is a dead launch's
BEAT_S = 60.0
STALE_S = 600.0
_HIGH_KEYS = 4096  # high-water marks kept per process (oldest dropped first): bounded memory
# _raw_get's compare_set: an expected value no key ever holds (ds-swift's values never hold a NUL),
# and what would be written if one did
_ABSENT = "\0ds-swift: absent\0"
_NEVER = "\0ds-swift: never written\0"
_LAUNCH_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def new_launch_id() -> str:
    return secrets.token_hex(8)


def check_launch_id(text: str) -> str:
    if not _LAUNCH_ID.fullmatch(text):
        raise ValueError(f"launch id {text!r}: use 1 to 64 of A-Z a-z 0-9 . _ -")
    return text


class SignedKV:
    """Signed reads and writes, signed counters and the launch namespace of one job.

    ``launch`` "" (unit tests, tools): the keys live at the root, as a single launch would."""

    def __init__(self, store: dist.Store, token: str, secret: str | None = None, launch: str = "") -> None:
        self.raw = store
        self.token = token
        self.sealer = Sealer(secret, launch)
        self.root_sealer = Sealer(secret)  # the token record belongs to no launch
        # PrefixStore puts a "/" between its prefix and a key: prefix and root_prefix end with it.
        self.root_prefix = f"swift/{self.sealer.namespace(token)}/"
        import torch.distributed as dist  # here, not at import: the launcher's parser reads LAUNCH_ENV

        self.root = dist.PrefixStore(self.root_prefix[:-1], store)
        self._high: dict[str, float] = {}
        self._started = time.time()
        self._seen: dict[str, tuple[bytes | None, float]] = {}
        """Other launches' records as this process last saw them: (raw value, monotonic time first seen)."""
        self.launch = ""
        self.prefix = self.root_prefix
        self.kv = self.root
        self._bind(launch)

    def _bind(self, launch: str) -> None:
        self.launch = launch
        self.sealer.launch = launch
        self.prefix = self.root_prefix + (f"L.{launch}/" if launch else "")
        import torch.distributed as dist

        self.kv = dist.PrefixStore(self.prefix[:-1], self.raw)

    # ------------------------------------------------------------------ signed values
    def _put(self, key: str, value: str) -> None:
        self.kv.set(key, self.sealer.seal(key, value))

    def _raw_get(self, key: str) -> bytes | None:
        """The raw value at ``key`` now, or None: one request. A TCPStore has no "get if present"
        (``check`` then ``get`` is three requests: get waits for the key first); a ``compare_set``
        from a value no key ever holds answers the value, or that value when the key is absent."""
        return self._get_in(self.kv, self.prefix, key)

    def _get_in(self, store: dist.Store, prefix: str, key: str) -> bytes | None:
        """:meth:`_raw_get` of ``key`` in ``store``, whose keys are under ``prefix``."""
        try_get = getattr(self.raw, "try_get", None)  # etcd: one range request
        if try_get is not None:
            value: bytes | None = try_get(prefix + key)
            return value
        got = bytes(store.compare_set(key, _ABSENT, _NEVER))
        return None if got == _ABSENT.encode() else got

    def wait_keys(self, keys: list[str], timeout_s: float) -> bool:
        """Block until every key in ``keys`` exists (True) or ``timeout_s`` passed (False): one
        request however long it blocks (a TCPStore waits on the server; etcd watches)."""
        if not keys:
            return True
        if timeout_s < 1e-3:  # torch reads a zero timeout as none at all: wait forever
            return bool(self.kv.check(keys))
        try:
            self.kv.wait(keys, datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, LookupError):  # DistStoreError on a TCPStore, LookupError from etcd
            return False
        return True

    def _read(self, key: str) -> str | None:
        raw = self._raw_get(key)
        return None if raw is None else self.sealer.open(key, raw)

    def _peek(self, key: str) -> str | None:
        """:meth:`_read` of a key that ranks may be waiting on while it is absent (the failure flag):
        a TCPStore's ``compare_set`` of an absent key wakes its waiters (see :meth:`wait_signed`),
        a ``check`` wakes nobody. One request while the key is absent (its usual state), two once
        it is there; etcd's read wakes nobody: one."""
        if getattr(self.raw, "try_get", None) is None and not self.kv.check([key]):
            return None
        return self._read(key)

    def wait_signed(self, key: str, timeout_s: float) -> str | None:
        """The signed value at ``key`` once it is there, or None after ``timeout_s``: a blocking
        wait and one read (two requests) when a write ends the wait.

        torch 2.13's TCPStore (its libuv server) wakes a key's waiters on any ``compare_set`` of it,
        also of an absent key, and the one-request read here is one (:meth:`_raw_get`). Nothing
        reads a waited-on key while it may be absent that way: a verdict is written by a claim that
        tries its compare-and-swap first, the failure flag is read with a ``check`` first
        (:meth:`_peek`). A wake-up that finds the key absent all the same (one that read it so: a
        bug) reads it again only after a ``check``, which wakes nobody: each waiter wakes the others
        at most once, never a storm that lasts until the key is written (measured before these
        rules: 4 of 5 agreement rounds paid a 50 ms pause, each woken waiter's read waking the
        rest). A value not signed with the job secret is waited past, 50 ms at a time, until the
        rank's own overwrites it."""
        deadline = time.monotonic() + timeout_s
        guarded = False
        while self.wait_keys([key], deadline - time.monotonic()):  # False: the whole time passed
            if guarded and not self.kv.check([key]):
                continue  # woken by a read of the absent key, not by a write
            raw = self._raw_get(key)
            if raw is None:
                guarded = True
                continue
            value = self.sealer.open(key, raw)
            if value is not None:
                return value
            time.sleep(max(0.0, min(0.05, deadline - time.monotonic())))  # forged: the real one overwrites it
            if time.monotonic() >= deadline:
                break
        return None

    def read_present(self, keys: list[str]) -> list[str | None]:
        """The signed values at ``keys``, which must all exist (after a wait for them): one request
        on a TCPStore, one transaction per 128 keys on etcd; None where a value is not signed with
        the job secret."""
        if len(keys) == 1:  # one request (a compare_set), where a multi_get is a wait and a read
            raw = self._raw_get(keys[0])
            return [None if raw is None else self.sealer.open(keys[0], raw)]
        many = getattr(self.raw, "get_many", None)  # etcd: torch's PrefixStore bridge has no multi_get for it
        if many is not None:
            raws: list[bytes | None] = list(many([self.prefix + k for k in keys]))
        else:
            raws = [bytes(v) for v in self.kv.multi_get(keys)]
        return [None if raw is None else self.sealer.open(k, raw) for k, raw in zip(keys, raws, strict=True)]

    def claim(self, key: str, value: str) -> str | None:
        """Set ``key`` to ``value`` unless it holds a signed value already; returns the signed value
        it holds afterwards (``value`` if this call set it). A value not signed with the job secret
        is overwritten. Compare-and-swap, so of two callers one wins and both return its value."""
        desired = self.sealer.seal(key, value).encode()
        raw: bytes | None = None  # first as if absent: one request, and no read of the absent key
        for _ in range(8):  # (which would wake its waiters: see wait_signed)
            got = bytes(self.kv.compare_set(key, raw or b"", desired))  # type: ignore[arg-type]
            if got == desired:
                return value
            text = self.sealer.open(key, got)
            if text is not None:
                return text
            raw = got  # not signed with the job secret: replaced from exactly that value
        return self._read(key)

    def _not_lower(self, key: str, value: float, size: int) -> float:
        """``value``, or the highest value of ``key`` read before if ``value`` is lower (a replay)."""
        high = self._high.get(key)
        if high is not None and value < high:
            self.sealer.reject(
                key, size, why=f"that goes back ({value:g} after {high:g}: an old signed value replayed)"
            )
            return high
        if high is None and len(self._high) >= _HIGH_KEYS:
            del self._high[next(iter(self._high))]
        self._high[key] = value
        return value

    def delete(self, key: str) -> bool:
        """Delete ``key``. A Python store's own method: torch's Python-store bridge has no deleteKey."""
        if getattr(self.raw, "python_store", False):  # a Store written in Python (etcd, a counting wrapper)
            return bool(self.raw.delete_key(self.prefix + key))
        return bool(self.kv.delete_key(key))

    # ------------------------------------------------------------------ signed counters
    def _count(self, key: str, raw: bytes | None) -> int:
        value = None if raw is None else self.sealer.open(key, raw)
        if raw is None or value is None:  # absent, deleted or forged: what this process last read (0 if nothing)
            return int(self._high.get(key, 0))
        return int(self._not_lower(key, int(value.partition(":")[0]), len(raw)))

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the signed counter at ``key`` (absent: 0); returns the new value.

        Compare-and-swap on the whole signed value: the nonce makes each write unique, so the value
        compare_set returns is ours only if our write won. A forged value is overwritten. Raises
        StoreContention once the retry budget is spent (ds_swift.jobstore.contention)."""
        budget = CasBudget(key)
        while True:
            raw = self._raw_get(key)
            current = self._count(key, raw)
            if amount == 0:
                return current
            new = current + int(amount)
            desired = self.sealer.seal(key, f"{new}:{secrets.token_hex(6)}").encode()
            if self._swap(key, raw, desired):
                self._high[key] = new
                return new
            budget.lost()

    def advance(self, key: str, value: int, before: Callable[[], None] | None = None) -> None:
        """Set the signed decimal at ``key`` to ``value`` unless it holds as much already (never
        backwards). ``before``: called once, just before the first write, only where the key moves."""
        desired = self.sealer.seal(key, str(value)).encode()
        budget = CasBudget(key)
        while True:
            raw = self._raw_get(key)
            text = None if raw is None else self.sealer.open(key, raw)
            if text is not None and int(text) >= value:
                return
            if before is not None:
                before()
                before = None
            if self._swap(key, raw, desired):
                return
            budget.lost()

    def _swap(self, key: str, raw: bytes | None, desired: bytes) -> bool:
        """compare_set from exactly ``raw`` (absent: None); True if ``desired`` is what the key holds now.
        Bytes, not str: a forged value need not be UTF-8, and must match byte for byte to be replaced."""
        expected = raw or b""
        return bytes(self.kv.compare_set(key, expected, desired)) == desired  # type: ignore[arg-type]

    # ------------------------------------------------------------------ launches
    def current_launch(self) -> tuple[str, str] | None:
        """(token, launch id) the store's token record names, or None if absent or not signed by us
        (one request: every worker's connection reads it)."""
        raw = self._get_in(self.root, self.root_prefix, "token")
        text = None if raw is None else self.root_sealer.open("token", raw)
        if text is None:
            return None
        token, _, launch = text.partition(" ")
        return token, launch

    def begin(self, launch: str) -> None:
        """Make ``launch`` the job's current launch (idempotent: every agent of it may call it)."""
        self._bind(launch)
        self.write_record()
        self.kv.compare_set("generation", "", self.sealer.seal("generation", "0"))
        # Last: a client that finds the token record finds the launch's keys in place.
        self.root.set("token", self.root_sealer.seal("token", f"{self.token} {launch}".rstrip()))

    def write_record(self, ended: bool = False) -> None:
        record = {"started": self._started, "beat": time.time(), "ended": ended}
        self._put(RECORD_KEY, json.dumps(record))

    def collect_leftovers(self, now: float | None = None) -> list[tuple[str, str]]:
        """Delete other launches' namespaces that are over (see the module docstring); returns
        (launch id, why) for each. Call it again (every beat): a launch that stopped rewriting its
        record is over only once this process has seen the record unchanged for STALE_S. ``now``:
        this process's monotonic clock. A no-op on a store that cannot list its keys (TCPStore)."""
        keys = getattr(self.raw, "keys", None)
        delete_prefix = getattr(self.raw, "delete_prefix", None)
        if keys is None or delete_prefix is None:
            return []
        now = time.monotonic() if now is None else now
        start = self.root_prefix + "L."
        launches = {k[len(start) :].partition("/")[0] for k in keys(start)}
        self._seen = {k: v for k, v in self._seen.items() if k in launches}
        out: list[tuple[str, str]] = []
        for launch in sorted(launches - {self.launch}):
            why = self._launch_over(launch, now)
            if why is not None:
                delete_prefix(f"{self.root_prefix}L.{launch}/")
                self._seen.pop(launch, None)
                out.append((launch, why))
        return out

    def _launch_over(self, launch: str, now: float) -> str | None:
        key = f"{self.root_prefix}L.{launch}/{RECORD_KEY}"
        raw = bytes(self.raw.get(key)) if self.raw.check([key]) else None
        text = None if raw is None else self.sealer.for_launch(launch).open(RECORD_KEY, raw)
        if text is not None and json.loads(text).get("ended"):
            return "ended"
        seen = self._seen.get(launch)
        if seen is None or seen[0] != raw:
            self._seen[launch] = (raw, now)  # new, or rewritten since: alive as far as anyone can tell
            return None
        idle = now - seen[1]
        if idle < STALE_S:
            return None
        what = "its record" if text is not None else "no launch record signed with the job secret"
        return f"{what} unchanged for {idle:.0f} s (a running launch rewrites its record every {BEAT_S:g} s)"

    def clear(self) -> None:
        """The launch ended: delete its keys from a store that outlives it (etcd), and the token
        record if it still names this launch. A no-op for a TCPStore (it ends with the launch)."""
        delete_prefix = getattr(self.raw, "delete_prefix", None)
        if delete_prefix is None:
            return
        delete_prefix(self.prefix)
        if self.launch and self.current_launch() == (self.token, self.launch):
            self.raw.delete_key(self.root_prefix + "token")  # the Python method: torch cannot route it
