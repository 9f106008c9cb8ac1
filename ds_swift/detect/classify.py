"""Failure classification: is an exception raised in training a dead peer, or a bug?

An error is a failure of the generation when the job says so, not when its text looks like one:

1. the failure flag of the generation is set (a node agent saw a worker die, a watchdog saw a
   heartbeat stop), or the error is :class:`PeerFailure` (a receive after the flag was set);
2. else an error that *may* come from a dead peer (a ``torch.distributed`` error type, or a
   ``RuntimeError``/``OSError`` whose text is one gloo/NCCL use for a closed connection or a
   timed-out op) waits for evidence: the flag, or a rank of the job whose heartbeat counter does
   not move for the heartbeat timeout on this rank's own clock (:mod:`.beats`: no other host's
   clock enters it), which it declares. A timed-out op may also come from a hung peer (alive,
   heartbeating, not progressing), whose own watchdog sets the flag after the hang timeout: only
   such an error waits that long; a closed connection or any other comm-looking error waits the
   heartbeat timeout. With no evidence within that time, every rank is alive: the error is raised
   as the job's own, with a note saying so;
3. anything else is the job's own error and is raised at once, as DeepSpeed alone would.

So a bug that raises ``RuntimeError("... timed out")`` surfaces as that bug, not as up to five
recoveries.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from ds_swift.detect.beats import CounterClock
from ds_swift.detect.watchdog import declare_failure
from ds_swift.membership import JobStore

__all__ = [
    "COMM_ERROR_MARKERS",
    "TIMEOUT_MARKERS",
    "Liveness",
    "PeerFailure",
    "classify_failure",
    "hang_patience",
    "is_comm_error",
    "stale_ranks",
]

#: Substrings of the errors gloo/NCCL raise when a peer died or an op timed out.
COMM_ERROR_MARKERS = (
    "Connection closed",
    "Connection reset",
    "Connection refused",
    "Broken pipe",
    "Timed out",
    "timed out",
    "Socket Timeout",
    "pair.cc",
    "NCCL",
    "gloo",
)


#: Substrings of the errors a timed-out op raises (the ones a hung, not dead, peer can cause).
TIMEOUT_MARKERS = ("Timed out", "timed out", "Timeout", "timeout")


class PeerFailure(RuntimeError):
    """Raised after a receive when the generation has failed (the data may be a poison message)."""


def is_comm_error(exc: BaseException) -> bool:
    """True for the errors a dead peer or a timed-out op may raise: torch.distributed's error types,
    and RuntimeError/OSError with one of the markers in their text (gloo raises plain RuntimeErrors).
    Only a candidate: :func:`classify_failure` wants evidence of a dead rank as well."""
    if isinstance(exc, PeerFailure | dist.DistError):
        return True
    if not isinstance(exc, RuntimeError | OSError):
        return False
    text = str(exc)
    return any(m in text for m in COMM_ERROR_MARKERS)


@dataclass(frozen=True)
class Liveness:
    """Which ranks' heartbeats show them alive (written by every worker's watchdog)."""

    ranks: Sequence[int]
    heartbeat_timeout_s: float
    rank: int
    """This worker's rank (named in what it declares)."""
    hang_timeout_s: float | None = None
    """A hung peer (alive, heartbeating, no progress) is declared by its own watchdog after this
    long: a comm error caused by it waits that long for the verdict too."""


def hang_patience(exc: BaseException, liveness: Liveness) -> float:
    """How long ``exc`` waits for a hung peer's verdict: the hang timeout for a timed-out op (the
    one error a hung peer causes), nothing for any other error (a hung peer closes no connection)."""
    if liveness.hang_timeout_s is None or not any(m in str(exc) for m in TIMEOUT_MARKERS):
        return 0.0
    return liveness.hang_timeout_s


def stale_ranks(store: JobStore, liveness: Liveness, beats: CounterClock[int]) -> list[tuple[int, float]]:
    """One round of reads: ``(rank, seconds its beat counter has not moved on this rank's clock)``
    of every rank silent past the timeout (a rank without a beat yet is starting, not dead)."""
    now = beats.begin_round()
    try:
        out = []
        for rank in liveness.ranks:
            count = store.last_heartbeat(rank)
            silent = beats.stale(rank, count, now) if count is not None else None
            if silent is not None:
                out.append((rank, silent))
    except Exception:
        beats.store_error()
        raise
    beats.end_round()
    return out


def classify_failure(
    exc: BaseException, store: JobStore | None, generation: int, poll_interval_s: float, liveness: Liveness | None = None
) -> str:
    """How ``exc`` ended ``generation`` (declaring the failure on evidence of a dead rank);
    re-raises ``exc`` when it is not a failure, or when there is no job store to recover with.

    ``liveness``: the ranks whose heartbeats count as evidence; without it (a worker whose
    watchdog has not started) a possible comm error only waits for the flag."""
    if store is None:
        raise exc  # no job store, no recovery: fail as DeepSpeed alone would
    if store.failure(generation) is not None:
        return f"{type(exc).__name__} after the failure flag"
    if isinstance(exc, PeerFailure):
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    if not is_comm_error(exc):
        raise exc
    # Let the node agent speak first: a dead peer is usually seen by its agent within ~100 ms;
    # else a dead rank's heartbeat goes stale within the heartbeat timeout. Only a timed-out op can
    # be a hung peer's doing: that one waits for the hung rank's own verdict (the hang timeout).
    patience = (
        max(liveness.heartbeat_timeout_s, hang_patience(exc, liveness)) + 3 * poll_interval_s
        if liveness is not None
        else 5 * poll_interval_s
    )
    deadline = time.monotonic() + max(0.5, patience)
    beats: CounterClock[int] | None = CounterClock(liveness.heartbeat_timeout_s) if liveness is not None else None
    while True:
        if store.failure(generation) is not None:
            return f"comm error, failure declared: {str(exc)[:120]}"
        dead = stale_ranks(store, liveness, beats) if liveness is not None and beats is not None else []
        if dead and liveness is not None:
            said = ", ".join(f"rank {r} (no heartbeat for {age:.1f} s)" for r, age in dead)
            first = declare_failure(store, generation, f"rank {liveness.rank}: {type(exc).__name__} and {said}")
            return f"comm error ({'declared' if first else 'already declared'}), {said}: {str(exc)[:120]}"
        if time.monotonic() >= deadline:
            break
        time.sleep(max(0.01, poll_interval_s / 2))
    exc.add_note(
        f"ds-swift: not a machine failure (no failure declared and every rank heartbeating for "
        f"{patience:.1f} s): raised as the job's own error"
    )
    raise exc
