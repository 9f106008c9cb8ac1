"""Failure classification: is an exception raised in training a dead peer, or a bug?

A comm error (or a poisoned receive) ends the generation: the first rank to see it declares the
failure in the job store, unless the node agent does first. Anything else is the user's error and
is raised, as DeepSpeed alone would.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from ds_swift.detect.watchdog import declare_failure
from ds_swift.membership import JobStore

__all__ = ["COMM_ERROR_MARKERS", "PeerFailure", "classify_failure", "is_comm_error"]

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


class PeerFailure(RuntimeError):
    """Raised after a receive when the generation has failed (the data may be a poison message)."""


def is_comm_error(exc: BaseException) -> bool:
    """True for the errors a dead peer or a timed-out op raises (matched by message, see the markers)."""
    if isinstance(exc, PeerFailure):
        return True
    if not isinstance(exc, RuntimeError | OSError | dist.DistError):
        return False
    text = str(exc)
    return any(m in text for m in COMM_ERROR_MARKERS)


def classify_failure(exc: BaseException, store: JobStore | None, generation: int, poll_interval_s: float) -> str:
    """How ``exc`` ended ``generation`` (declaring the failure if nobody has); re-raises ``exc``
    when it is not a failure, or when there is no job store to recover with."""
    if store is None:
        raise exc  # no job store, no recovery: fail as DeepSpeed alone would
    if store.failure(generation) is not None:
        return f"{type(exc).__name__} after the failure flag"
    if is_comm_error(exc):
        # Let the node agent speak first: a dead peer is usually seen by its agent within
        # ~100 ms, and the rank that sees it first may be that peer's machine-mate, about to
        # be killed mid-declaration (which would leave a half-written failure record).
        deadline = time.monotonic() + max(0.5, 5 * poll_interval_s)
        while time.monotonic() < deadline:
            if store.failure(generation) is not None:
                return f"comm error, failure declared: {str(exc)[:120]}"
            time.sleep(0.01)
        first = declare_failure(store, generation, f"rank {dist.get_rank()}: {type(exc).__name__}: {str(exc)[:200]}")
        return f"comm error ({'declared' if first else 'already declared'}): {str(exc)[:120]}"
    raise exc
