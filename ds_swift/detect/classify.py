"""Failure classification: is an exception raised in training a dead peer, a stall, or a bug?

Every rank of a generation acts on one agreed verdict, kept in the job store:

1. **failure**: the failure flag of the generation is set with evidence (a node agent saw a worker
   die, a watchdog saw a heartbeat stop), or the error is :class:`PeerFailure` (a receive after the
   flag was set). The generation is recovered; the dead machine's ranks are replaced;
2. **the job's own error**: a rank raised an error that is not a comm error: it records it
   (:func:`job_error_key`) before raising, and a peer whose op then fails on the closed connection
   raises it too, naming that rank, instead of declaring anything (the one error that may be its
   machine's fault instead, a device error on one machine after the generation's first step, is
   told apart in :mod:`ds_swift.detect.job_error`);
3. **stall**: a comm error proper (torch.distributed's error types, gloo's own transport errors:
   :func:`is_transport_error`) with no death in evidence: every rank's heartbeat counter moving for the
   heartbeat timeout, judged on this rank's own clock (:mod:`.beats`: no other host's clock enters it) (a timed-out op also the hang timeout: a hung peer's own watchdog names it first). A
   slow op is not a dead machine: the rank declares the generation failed with a ``stall:`` reason
   (:data:`STALL`), nobody is killed, and every rank re-forms the next generation in-process with
   the state it holds (a recovery with no rank lost: nothing is lost, nothing is rolled back). On
   NCCL that holds because no step is applied from collectives an abort may have cut (torch's own
   watchdog aborts a timed-out one): ds_swift.patches.step_guard refuses it, so what a rank holds is
   the state after its last whole step.

An error whose *text* merely looks like a comm error (``RuntimeError("... timed out")`` from user
code) is none of these by its text alone: it waits for evidence of a death like any comm error,
and without one is raised as the job's own error, so such a bug surfaces as that bug, not as up to
five recoveries.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ds_swift.detect.beats import CounterClock
from ds_swift.detect.job_error import job_error, job_error_key, rank_error_key, record_job_error
from ds_swift.detect.watchdog import declare_failure
from ds_swift.jobstore.membership import JobStore

__all__ = [
    "COMM_ERROR_MARKERS",
    "STALL",
    "CommunicatorFailure",
    "TIMEOUT_MARKERS",
    "Liveness",
    "PeerFailure",
    "classify_failure",
    "hang_patience",
    "is_comm_error",
    "is_transport_error",
    "job_error",
    "job_error_key",
    "rank_error_key",
    "record_job_error",
    "record_uncaught",
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


#: gloo's own transport errors. gloo raises plain RuntimeErrors; its own name the source line they
#: come from ("[.../gloo/transport/tcp/pair.cc:534] Connection closed by peer ...", "[...
#: unbound_buffer.cc:78] Timed out waiting 1000ms for recv operation to complete"), or, for an op on a
#: pair an earlier timeout closed, "Application timeout caused pair closure" (measured, torch 2.13).
_GLOO_OWN = re.compile(r"gloo/transport/[\w/]+\.cc:\d+\]|Application timeout caused pair closure")

#: How a stall's failure reason starts (``gen<g>/failed``): a comm error with every rank alive.
STALL = "stall: "
#: between two looks at the job's own error and the ranks' heartbeats, a comm error waits at most
#: this long (and a tenth of the heartbeat timeout) on the failure flag, woken at once when it is set
CLASSIFY_SLICE_S = 1.0


class PeerFailure(RuntimeError):
    """Raised after a receive when the generation has failed (the data may be a poison message), or
    before a step whose collectives ds-swift's abort of the failed generation may have cut."""


class CommunicatorFailure(dist.DistBackendError):
    """Raised before a step whose collectives torch's own NCCL watchdog saw fail or time out (it
    aborts them itself): a comm error like any, declared on evidence (a dead rank, or a stall)."""


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


def is_transport_error(exc: BaseException) -> bool:
    """True for a comm library's own error, not a lookalike text: :class:`PeerFailure`,
    torch.distributed's error types, and gloo's own errors (:data:`_GLOO_OWN`)."""
    if isinstance(exc, PeerFailure | dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and _GLOO_OWN.search(str(exc)) is not None


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
    agents_timeout_s: float = 0.0
    """Ranks that beat for their machine's agent (no counter in the store): how long a dead
    agent's machine takes to be declared by its neighbours; a comm error waits that long too."""


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
    exc: BaseException,
    store: JobStore | None,
    generation: int,
    poll_interval_s: float,
    liveness: Liveness | None = None,
    early: bool = False,
) -> str:
    """How ``exc`` ended ``generation`` (declaring the failure on evidence of a dead rank);
    re-raises ``exc`` when it is not a failure, or when there is no job store to recover with.

    ``liveness``: the ranks whose heartbeats count as evidence; without it (a worker whose
    watchdog has not started) a possible comm error only waits for the flag. ``early``: raised before
    this rank's first step in ``generation`` (ds_swift.detect.job_error says what that changes)."""
    if store is None:
        raise exc  # no job store, no recovery: fail as DeepSpeed alone would
    if store.failure(generation) is not None:
        return f"{type(exc).__name__} after the failure flag"
    if isinstance(exc, PeerFailure):
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    rank = liveness.rank if liveness is not None else None
    if not is_comm_error(exc):
        record_job_error(store, generation, rank, exc, early=early)
        raise exc
    # Let the node agent speak first: a dead peer is usually seen by its agent within ~100 ms;
    # else a dead rank's heartbeat goes stale within the heartbeat timeout. Only a timed-out op can
    # be a hung peer's doing: that one waits for the hung rank's own verdict (the hang timeout).
    patience = (
        max(liveness.heartbeat_timeout_s, liveness.agents_timeout_s, hang_patience(exc, liveness)) + 3 * poll_interval_s
        if liveness is not None
        else 5 * poll_interval_s
    )
    deadline = time.monotonic() + max(0.5, patience)
    beats: CounterClock[int] | None = CounterClock(liveness.heartbeat_timeout_s) if liveness is not None else None
    while True:
        if store.failure(generation) is not None:
            return f"comm error, failure declared: {str(exc)[:120]}"
        own = job_error(store, generation)
        if own is not None:  # a peer's own error closed the connection: the job ends with it
            exc.add_note(f"ds-swift: {own}: the job's own error, which ended generation {generation}")
            record_job_error(store, generation, rank, exc, early=early)
            raise exc
        dead = stale_ranks(store, liveness, beats) if liveness is not None and beats is not None else []
        if dead and liveness is not None:
            said = ", ".join(f"rank {r} (no heartbeat for {age:.1f} s)" for r, age in dead)
            first = declare_failure(store, generation, f"rank {liveness.rank}: {type(exc).__name__} and {said}")
            return f"comm error ({'declared' if first else 'already declared'}), {said}: {str(exc)[:120]}"
        left = deadline - time.monotonic()
        if left <= 0:
            break
        # Block on the flag (woken the moment it is set) rather than read it every few milliseconds:
        # every rank of a stalled job sits here for the whole patience.
        look = liveness.heartbeat_timeout_s / 10 if liveness is not None else poll_interval_s
        store.wait_for_failure(generation, min(CLASSIFY_SLICE_S, look, left))
    if is_transport_error(exc) and liveness is not None:
        # A slow op, not a dead machine: every rank is alive. Declared as a stall so that every rank
        # of the generation acts on the same verdict, re-forming the next one with its state.
        said = (
            f"{STALL}rank {liveness.rank}: {type(exc).__name__} ({str(exc)[:160]}) with no rank dead "
            f"(every rank heartbeating for {patience:.1f} s): the next generation is formed by the same "
            "ranks with the state they hold, nothing lost (no rank applied a step after an abort may have cut "
            "its collectives: the step guard refuses it)"
        )
        first = declare_failure(store, generation, said)
        return f"stall ({'declared' if first else 'already declared'}): {str(exc)[:120]}"
    exc.add_note(
        f"ds-swift: not a machine failure (no failure declared and every rank heartbeating for "
        f"{patience:.1f} s): raised as the job's own error"
    )
    record_job_error(store, generation, rank, exc, early=early)
    raise exc


def record_uncaught(store: JobStore, rank: int, state: Any) -> None:
    """Record an exception that ends this worker outside ds-swift's calls (``deepspeed.initialize``
    refusing the config, the script's own code between iterations) before the interpreter prints it:
    its node agent then ends the job with it instead of taking the exit for a crash and spending a
    spare on it. ``state``: the worker's context (its ``generation`` and ``stepped`` as they are then).
    Communication errors and ds-swift's own failure signals are not recorded (a failure, not an error)."""
    from ds_swift.jobstore.membership import GenerationFailed, MembershipError

    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if isinstance(exc, Exception) and not isinstance(exc, GenerationFailed | MembershipError):
            if not is_comm_error(exc):
                record_job_error(store, int(state.generation), rank, exc, early=not state.stepped)
        previous(exc_type, exc, tb)

    sys.excepthook = hook
