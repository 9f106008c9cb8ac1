"""The agreement round: every rank writes one key, one leader reads them all once and publishes one
signed verdict, which every rank waits on.

ds-swift agrees this way wherever ranks must act on the same answer and no collective can be trusted
(a rank may be dead): the join of a generation, the recovery's report, checkpoint, restore, verify
and strategy rounds, the post-recovery guard, the buddy copies' landing. Keys, under a round's
``prefix`` (``gen<g>/<topic>`` for a generation's rounds)::

    <prefix>/<rank>      each rank's value (signed)
    <prefix>/verdict     the leader's verdict (signed; first writer wins), or FAILED<reason> when the
                         round's generation failed first (:func:`wake`)

Cost of a round of N ranks, in store requests: one write, one blocking wait and one read per rank;
the leader adds one blocking wait for the N keys (per slice) and one batched read of them (one
request on a TCPStore, one transaction per 128 keys on etcd). O(N) in all, where every rank reading
every rank's key, polling every 20 ms, was O(N^2) and more the longer the slowest rank took.

Every wait is bounded (``timeout_s``) and ends at once when the round's generation fails: this
process's watchdog, which blocks on the failure flag, writes the FAILED verdict into every round
waited on here (:func:`wake`), so the one write wakes every rank of the round; a waiter also reads
the flag itself every :data:`BACKSTOP_S` (the leader every :data:`LEADER_SLICE_S`), in case no
watchdog saw it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, overload

from ds_swift.jobstore.worker_env import MembershipError

if TYPE_CHECKING:
    from ds_swift.jobstore.membership import JobStore

__all__ = [
    "BACKSTOP_S",
    "FAILED",
    "LEADER_SLICE_S",
    "GenerationFailed",
    "RoundTimeout",
    "agree",
    "collect",
    "pack",
    "round_prefix",
    "unpack",
    "verdict_key",
    "wake",
]

#: how long a waiter blocks on the verdict before it reads the failure flag itself
BACKSTOP_S = 5.0
#: the leader waits for the ranks' keys in slices this long, reading the flag between them
LEADER_SLICE_S = 1.0
#: a verdict written by :func:`wake`: the round's generation failed (the reason follows)
FAILED = "\x00failed "
VERDICT = "verdict"
_MISSING_NAMED = 16  # ranks named in a timeout's message


def round_prefix(generation: int, topic: str) -> str:
    """The keys of generation ``generation``'s round ``topic``."""
    return f"gen{generation}/{topic}"


def verdict_key(prefix: str) -> str:
    """The key of the verdict of the round under ``prefix``."""
    return f"{prefix}/{VERDICT}"


def pack(values: Mapping[int, str]) -> str:
    """A verdict carrying every rank's value (``decide=pack``; :func:`unpack` on every rank): where
    every rank needs them all (the recovery's reports). JSON, zlib-compressed: N reports that
    differ in a few numbers compress about twentyfold, and every rank reads the verdict."""
    raw = json.dumps([[r, v] for r, v in sorted(values.items())], separators=(",", ":")).encode()
    return base64.b64encode(zlib.compress(raw, 6)).decode()


def unpack(verdict: str) -> dict[int, str]:
    """The values :func:`pack` put in a verdict, by rank."""
    return {int(r): str(v) for r, v in json.loads(zlib.decompress(base64.b64decode(verdict)))}


class _Waits:
    """The verdict keys this process waits on, by generation (what :func:`wake` writes)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: dict[int, set[str]] = {}

    @contextlib.contextmanager
    def waiting(self, generation: int | None, key: str) -> Iterator[None]:
        if generation is None:
            yield
            return
        with self.lock:
            self.keys.setdefault(generation, set()).add(key)
        try:
            yield
        finally:
            with self.lock:
                keys = self.keys.get(generation, set())
                keys.discard(key)
                if not keys:
                    self.keys.pop(generation, None)


_WAITS = _Waits()


def wake(store: JobStore, generation: int, reason: str) -> int:
    """Generation ``generation`` failed: end every round of it this process waits on, on every rank
    (its verdict becomes FAILED<reason> unless the leader wrote one first). Returns how many."""
    with _WAITS.lock:
        keys = sorted(_WAITS.keys.get(generation, ()))
    for key in keys:
        store.claim(key, FAILED + reason)
    return len(keys)


class RoundTimeout(TimeoutError):
    """Keys not written (with a value signed by the job secret) in time; ``pending`` names them."""

    def __init__(self, what: str, timeout_s: float, pending: Sequence[str]) -> None:
        shown = ", ".join(pending[:_MISSING_NAMED]) + (
            f" (and {len(pending) - _MISSING_NAMED} more)" if len(pending) > _MISSING_NAMED else ""
        )
        super().__init__(f"{what}: {shown} not written within {timeout_s:g} s")
        self.pending = list(pending)


class GenerationFailed(RuntimeError):
    """The generation being joined or run has failed; join the next one."""

    def __init__(self, generation: int, reason: str) -> None:
        super().__init__(f"generation {generation} failed: {reason}")
        self.generation = generation
        self.reason = reason


def _failed(store: JobStore, generation: int | None) -> None:
    if generation is not None:
        reason = store.failure(generation)
        if reason is not None:
            raise GenerationFailed(generation, reason)


def collect(
    store: JobStore,
    keys: Sequence[str],
    timeout_s: float,
    *,
    generation: int | None = None,
    stopped: Callable[[], bool] | None = None,
    slice_s: float = LEADER_SLICE_S,
    what: str = "",
) -> list[str] | None:
    """The signed values at ``keys`` once every one is there: a blocking wait per slice (reading the
    flag of ``generation`` between slices: GenerationFailed), then one batched read. None once
    ``stopped()``; RoundTimeout after ``timeout_s``. A key whose value is not signed with the job
    secret (an outsider's) is waited on until its rank's own overwrites it."""
    deadline = time.monotonic() + timeout_s
    values: dict[str, str] = {}
    pending = list(keys)
    while True:
        left = deadline - time.monotonic()
        if store.wait_keys(pending, min(slice_s, max(0.0, left))):
            for key, value in zip(pending, store.read_present(pending), strict=True):
                if value is not None:
                    values[key] = value
            pending = [k for k in pending if k not in values]
            if not pending:
                return [values[k] for k in keys]
            time.sleep(min(0.05, max(0.0, left)))  # forged values: their ranks' own come
        if stopped is not None and stopped():
            return None
        _failed(store, generation)
        if time.monotonic() >= deadline:
            # Named: only the keys still missing (the wait above says only "not all"; a request per key,
            # once, on this error path: a read of many keys would wait for the absent ones).
            missing = [k for k in pending if store.get(k) is None]
            raise RoundTimeout(what or "store keys", timeout_s, missing or pending)


@overload
def agree(
    store: JobStore,
    prefix: str,
    rank: int,
    value: str,
    ranks: Sequence[int],
    decide: Callable[[Mapping[int, str]], str] | None = ...,
    *,
    timeout_s: float,
    generation: int | None = ...,
    stopped: None = ...,
    leader: int | None = ...,
) -> str: ...


@overload
def agree(
    store: JobStore,
    prefix: str,
    rank: int,
    value: str,
    ranks: Sequence[int],
    decide: Callable[[Mapping[int, str]], str] | None = ...,
    *,
    timeout_s: float,
    generation: int | None = ...,
    stopped: Callable[[], bool],
    leader: int | None = ...,
) -> str | None: ...


def agree(
    store: JobStore,
    prefix: str,
    rank: int,
    value: str,
    ranks: Sequence[int],
    decide: Callable[[Mapping[int, str]], str] | None = None,
    *,
    timeout_s: float,
    generation: int | None = None,
    stopped: Callable[[], bool] | None = None,
    leader: int | None = None,
) -> str | None:
    """One round (see the module docstring): this rank's ``value``; the verdict, the same on every rank.

    Args:
        store: this rank's job-store connection.
        prefix: the round's keys (:func:`round_prefix` for a generation's rounds).
        rank: this rank (it must be in ``ranks``).
        value: what this rank says.
        ranks: the ranks of the round.
        decide: the leader's verdict from every rank's value (rank -> value); None: "".
        timeout_s: the longest the round may take (TimeoutError).
        generation: whose failure ends the round (GenerationFailed); None: nothing does.
        stopped: ends the round early, returning None (a copier thread told to stop).
        leader: the rank that decides; None: the lowest of ``ranks``.
    """
    ordered = sorted(ranks)
    chief = ordered[0] if leader is None else leader
    verdict = verdict_key(prefix)
    store.set(f"{prefix}/{rank}", value)
    deadline = time.monotonic() + timeout_s
    with _WAITS.waiting(generation, verdict):
        if rank == chief:
            keys = [f"{prefix}/{r}" for r in ordered]
            got = collect(store, keys, timeout_s, generation=generation, stopped=stopped, what=f"round {prefix}")
            if got is None:
                return None
            said = decide(dict(zip(ordered, got, strict=True))) if decide is not None else ""
            return _opened(store.claim(verdict, said), generation, prefix)
        return _await(store, verdict, deadline, generation, stopped, f"round {prefix} (leader rank {chief})")


def _await(
    store: JobStore,
    key: str,
    deadline: float,
    generation: int | None,
    stopped: Callable[[], bool] | None,
    what: str,
) -> str | None:
    while True:
        left = deadline - time.monotonic()
        slice_s = BACKSTOP_S if stopped is None else min(BACKSTOP_S, LEADER_SLICE_S)
        held = store.wait_signed(key, min(slice_s, max(0.0, left)))  # a forged verdict: waited past
        if held is not None:
            return _opened(held, generation, what)
        if stopped is not None and stopped():
            return None
        _failed(store, generation)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: no verdict within the round's timeout")


def _opened(verdict: str | None, generation: int | None, what: str) -> str:
    if verdict is None:
        raise MembershipError(f"{what}: the verdict cannot be read (not signed with the job secret)")
    if verdict.startswith(FAILED):
        raise GenerationFailed(-1 if generation is None else generation, verdict[len(FAILED) :])
    return verdict
