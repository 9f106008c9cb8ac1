"""Failure detection inside a worker: a thread that waits on the job's failure flag and heartbeats.

The thread has its own store connection: the main thread may sit in a store call of its own (a
rendezvous wait) and the watchdog must not queue behind it. Under ds-swift-launch it waits on its
agent's relay of the flag instead (:mod:`.relay`: no store request), with a backstop read.

What the watchdog does *not* do on gloo is unblock the main thread. Nothing in gloo can interrupt
a pending op from another thread (shared/NOTES-deepspeed-cpu.md); a worker blocked on a peer is
woken by that peer (poison message, or its process group being destroyed) or by the op
timeout. On NCCL it does: its ``on_failure`` hook aborts this rank's communicators
(ds_swift.transport.shutdown), which releases a main thread blocked behind a kernel that waits on
a dead peer. The watchdog's job is to make the failure known: the ``failed`` event lets the main
thread stop before its next iteration, and the recv check (patches/deepspeed_rebuild.py) reads
it after every receive.

Heartbeats are counters judged on this rank's own monotonic clock (:mod:`.beats`), and one
watchdog's view of a silent peer is a suspicion, not a verdict: it writes ``suspect/<g>/<m>``
(:func:`suspect_key`) and the machine is failed only when a second observer agrees, or when the
machine's own agent, reading its ranks' counters on its clock, finds them silent too
(launch/agent.py). A store stall seen by this watchdog itself starts every silence afresh.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ds_swift.detect.beats import BeatFile, CounterClock
from ds_swift.detect.progress import Progress
from ds_swift.detect.relay import BACKSTOP_S, WakeFifo, open_wake
from ds_swift.jobstore.agreement import wake
from ds_swift.jobstore.membership import JobStore
from ds_swift.logs import say
from ds_swift.threadname import name_os_thread, yield_on_wakeup

__all__ = [
    "BEATS_PER_TIMEOUT",
    "FailureSeen",
    "Watchdog",
    "declare_failure",
    "hung_machine_key",
    "suspect_key",
]

#: Heartbeats a worker writes (and reads of its watched peers' heartbeats) per heartbeat timeout. A
#: stopped peer is then declared at most a tenth of the timeout late; writing them at every poll of
#: the failure flag instead (10 per second by default) cost job-store round trips that were most of
#: the watchdog's CPU time and of the store server's on a CPU job (gpu_overhead.py's CPU sampling,
#: tiny GPT, 4 ranks: the watchdog threads' 6.8 ms per iteration went to 2.7).
BEATS_PER_TIMEOUT = 10

#: a blocking wait that returns this much before the next beat is due still beats (a wait's own
#: timer may end it early: the turn would otherwise wait the rest again, and miss the beat)
_EARLY_S = 0.005
#: the longest one wait of a rank that beats for its agent: on its FIFO (:mod:`.relay`), or, without
#: one, on the store, whose C++ wait cannot be interrupted: ``stop(final=True)`` waits it out (a daemon
#: thread leaving it during finalization unwinds C++ frames that may not throw: SIGABRT)
WAIT_SLICE_S = 2.0

#: What a job store that cannot be reached raises (torch's DistStoreError, etcd's errors as
#: RuntimeError, MembershipError, timeouts, refused connections). Anything else out of a poll is a bug.
STORE_ERRORS = (RuntimeError, OSError)


def hung_machine_key(machine: int) -> str:
    """Job-store key a watchdog sets to ``"<generation> <reason>"`` when a rank of ``machine`` is
    hung (no progress) or stopped (no heartbeat): the machine's agent then kills it, and its
    failure is handled as any machine's (launch/agent.py)."""
    return f"hung/machine/{machine}"


def suspect_key(generation: int, machine: int) -> str:
    """Job-store key of the first suspicion that ``machine`` stopped in ``generation``:
    ``"<heartbeat timeout> <reason>"``; ``<key>/n`` counts the observers that agree (one each,
    ``<key>/by/<rank>``). Two observers, or the machine's own agent, make it a verdict."""
    return f"suspect/{generation}/{machine}"


@dataclass(frozen=True)
class FailureSeen:
    """The watchdog's observation of a generation's failure."""

    generation: int
    reason: str
    t_seen: float


class Watchdog:
    """Waits on ``gen<g>/failed`` (a blocking store wait, woken the moment it is set); writes this
    rank's heartbeat, and checks its watched peers', every :attr:`beat_every_s` (a tenth of the
    heartbeat timeout, at least a poll interval), between two waits.

    Args:
        store_factory: opens a new connection to the job store (one per thread).
        rank: this worker's rank.
        generation: the generation it trains in (moved on by :meth:`set_generation`).
        poll_interval_s: the pause after a poll that failed (the store may be down), and the least
            time between beats.
        heartbeat_timeout_s: a watched peer whose heartbeat is older declares the generation failed.
        watch_ranks: the peers whose heartbeats this worker checks (its pipeline and replica neighbours).
        progress: the training thread's progress (None: not watched).
        hang_timeout_s: armed time without progress after which this rank declares itself hung.
        ranks_per_machine: to name the machine of a stale or hung rank (rank // ranks_per_machine).
        machines: the job's machines in rank order (after an elastic shrink, not all of them; None: 0, 1, ...).
        on_failure: called on the watchdog's thread once per failed generation, right after
            ``failed`` is set (ds-swift aborts its NCCL communicators there).
        beat_file: where this rank beats for its machine's agent (ds-swift-launch: every worker);
            its peers then beat for theirs too, and are not watched here (their agents judge them
            on their own clocks). None: this rank beats in the job store and watches ``watch_ranks``.
    """

    def __init__(
        self,
        store_factory: Callable[[], JobStore],
        rank: int,
        generation: int,
        poll_interval_s: float,
        heartbeat_timeout_s: float,
        watch_ranks: Sequence[int] = (),
        progress: Progress | None = None,
        hang_timeout_s: float | None = None,
        ranks_per_machine: int = 1,
        machines: Sequence[int] | None = None,
        on_failure: Callable[[FailureSeen], object] | None = None,
        beat_file: BeatFile | None = None,
    ) -> None:
        self.on_failure = on_failure
        self.beat_file = beat_file
        self.machines = tuple(machines) if machines is not None else None
        self._store_factory = store_factory
        self.progress = progress
        self.hang_timeout_s = hang_timeout_s
        self.ranks_per_machine = max(1, ranks_per_machine)
        self.rank = rank
        self.poll_interval_s = poll_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.beat_every_s = max(poll_interval_s, heartbeat_timeout_s / BEATS_PER_TIMEOUT)
        """Seconds between this rank's heartbeats (and between checks of its peers')."""
        self._next_beat = -math.inf  # the observer clock's time of the next heartbeat: the first poll beats
        self._lock = threading.Lock()
        self._generation = generation
        self._beats: CounterClock[int] = CounterClock(
            heartbeat_timeout_s, max_gap_s=max(heartbeat_timeout_s / 2, 3 * poll_interval_s)
        )
        self._suspected: set[tuple[int, int]] = set()
        self._watch = list(watch_ranks)
        self._seen: FailureSeen | None = None
        self.failed = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beater: threading.Thread | None = None
        self._hang_store: JobStore | None = None  # the beater's connection, opened to declare a hang
        # The thread's failing polls in a row, since when (observer clock), and what was said of them.
        self._failing = 0
        self._failing_since = 0.0
        self._blind_said = False
        self._bugs_said: set[str] = set()
        #: (monotonic time, seconds, what): the generation in force fails if ``what`` is not done by then
        self._deadline: tuple[float, float, str] | None = None
        self._wake: WakeFifo | None = None  # beating for its agent: the agent relays the flag (detect/relay.py)
        self._next_backstop = -math.inf  # the observer clock's time of the next read of the flag itself

    # ------------------------------------------------------------------ control
    def start(self) -> Watchdog:
        if self._thread is None:
            if self.beat_file is not None and self._wake is None:
                self._wake = open_wake(os.path.dirname(self.beat_file.path), self.rank)
            self._thread = threading.Thread(target=self._run, name=f"ds-swift-watchdog-{self.rank}", daemon=True)
            self._thread.start()
            if self.beat_file is not None:  # the beats and the hang check, beside the thread's long waits
                self._beater = threading.Thread(target=self._beat_run, name=f"ds-swift-beat-{self.rank}", daemon=True)
                self._beater.start()
        return self

    def stop(self, timeout_s: float = 5.0, final: bool = False) -> None:
        """Stop both threads. The waiting one (a daemon thread: it declares nothing of a generation
        gone) is woken where it waits on its FIFO (:mod:`.relay`); one in a store wait is waited for
        until its wait ends (at most :data:`WAIT_SLICE_S`, or a beat) only when ``final`` (the process
        is about to exit); otherwise a tenth of a second (an elastic change starts a new watchdog at once)."""
        self._stop.set()
        if self._wake is not None:
            self._wake.poke()
        longest = (WAIT_SLICE_S if self.beat_file is not None else self.beat_every_s) + 0.5
        waiting = longest if final else min(timeout_s, 0.1)
        for thread in (self._beater, self._thread):
            if thread is not None:
                thread.join(timeout_s if thread is self._beater else waiting)
        if self.beat_file is not None and self._beater is not None:
            with contextlib.suppress(OSError):  # the agent's directory gone: the job is ending anyway
                self.beat_file.finish()
        if self._wake is not None and (final or self._thread is None or not self._thread.is_alive()):
            self._wake.close()  # (an elastic change's new watchdog opens the rank's FIFO again)
            self._wake = None
        self._thread = self._beater = None

    def set_generation(self, generation: int, watch_ranks: Sequence[int] = ()) -> None:
        """Watch ``generation`` from now on (after a rebuild); clears the failed event."""
        with self._lock:
            self._generation = generation
            self._beats.reset()  # the peers rebuilt: every silence starts at the next read
            self._watch = list(watch_ranks)
            self._seen = None
            self.failed.clear()

    def set_deadline(self, seconds: float | None, what: str = "") -> None:
        """Declare the generation in force failed if ``what`` is not done within ``seconds`` (None:
        done, no deadline). The rebuild's: a generation that cannot create its communicators (a peer
        lost or stuck while they are created) fails, its communicators are aborted (``on_failure``)
        and the rank moves on to the next generation, or ends after ds-swift's attempts (a clear
        exit, never a silent wait)."""
        with self._lock:
            self._deadline = None if seconds is None else (time.monotonic() + seconds, seconds, what)

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def seen(self) -> FailureSeen | None:
        with self._lock:
            return self._seen

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        name_os_thread()  # top -H, py-spy and the overhead benchmark tell it apart
        # Its ten polls a second must not preempt the training thread; under SCHED_BATCH it still
        # runs within milliseconds of waking (the running thread's time slice), against a heartbeat
        # timeout of seconds.
        yield_on_wakeup()
        store: JobStore | None = None
        while not self._stop.is_set():
            store, pause_s = self.turn(store)
            self._stop.wait(pause_s)

    def turn(self, store: JobStore | None) -> tuple[JobStore | None, float]:
        """One turn of the thread: a guarded poll that then blocks on the failure flag until the next
        beat (one request, woken the moment the flag is set); returns the connection for the next
        turn and how long to pause before it (only after a failed poll: the store may be down).
        benchmarks/scale.py drives the same turns on a fake clock."""
        failing = self._failing
        store = self.guarded_poll(store, wait=True)
        return store, self.poll_interval_s if self._failing > failing or self._seen is not None else 0.0

    def guarded_poll(self, store: JobStore | None, wait: bool = False) -> JobStore | None:
        """One turn of the thread's loop, which nothing may end (the watchdog must never end a healthy
        job): a poll on ``store`` (None: opened first, the store may be down at start-up too); returns
        the connection for the next turn. Polls failing for longer than the heartbeat timeout are
        said once, as is their end, and an error no store raises (a bug) the first time."""
        try:
            if store is None:
                store = self._store_factory()
            self.poll_once(store, wait=wait)
        except Exception as exc:  # noqa: BLE001 - the store may be unreachable for a while; keep polling
            self._poll_failed(exc)
            return store
        if self._blind_said:
            say(
                f"watchdog polls succeed again after {self._failing} failed: failure and hang detection on this "
                "rank are back",
                self.rank,
                name=__name__,
            )
        self._failing, self._blind_said = 0, False
        return store

    def _poll_failed(self, exc: Exception) -> None:
        now = self._beats.clock()
        if self._failing == 0:
            self._failing_since = now
        self._failing += 1
        what = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, STORE_ERRORS) and type(exc).__name__ not in self._bugs_said:
            self._bugs_said.add(type(exc).__name__)
            say(
                f"watchdog poll raised {what}, which no job store raises (a bug?); polling goes on",
                self.rank,
                level=logging.WARNING,
                name=__name__,
            )
        failing_s = now - self._failing_since
        if not self._blind_said and failing_s > self.heartbeat_timeout_s:
            self._blind_said = True
            say(
                f"watchdog polls have failed for {failing_s:.0f} s ({self._failing} in a row, last {what}): failure "
                "and hang detection on this rank are blind while it lasts (a declared failure is not read, a hang "
                "here or a stopped peer is not declared, and with the store down no heartbeat is written: its peers "
                "may suspect this machine); training goes on",
                self.rank,
                level=logging.WARNING,
                name=__name__,
            )

    def poll_once(self, store: JobStore, wait: bool = False) -> FailureSeen | None:
        """One poll (public so tests can drive it without a thread). ``wait``: the failure flag is
        waited on until the next beat is due, instead of read (the thread's turns)."""
        beats = self._beats
        now = beats.begin_round()
        try:
            seen = self._poll(store, now, wait)
        except Exception:
            beats.store_error()  # what this rank reads next says nothing of its peers' past
            raise
        beats.end_round()
        return seen

    def _poll(self, store: JobStore, now: float, wait: bool = False) -> FailureSeen | None:
        # The thread of a rank that beats for its agent only waits on the flag; its beater beats.
        local = wait and self.beat_file is not None
        # on the clock the peers' silences are judged by; a store wait may end a little early
        beat = not local and now >= self._next_beat - _EARLY_S
        if beat:
            self._next_beat = now + self.beat_every_s
            self._beat(store)
        with self._lock:
            g, watch = self._generation, list(self._watch)
            if self._seen is not None:
                return self._seen
        reason = None if wait else store.failure(g)
        if reason is None and not local:
            reason = self._hung(store, g)
        if reason is None:  # a rebuild deadline, in either mode
            reason = self._past_deadline(store, g)
        if reason is None and beat and self.beat_file is None:  # peers' counters, as often as this rank beats
            reason = self._stale_peer(store, now, watch, g)
        if reason is None and wait:
            # A blocking wait, not a poll (a TCPStore wait, an etcd watch, the agent's relay): it returns
            # the moment the flag is written, or at once if it was, so no failure falls between turns.
            limit = min(self.heartbeat_timeout_s, WAIT_SLICE_S) if local else self._next_beat - self._beats.clock()
            with self._lock:
                if self._deadline is not None:  # a rebuild deadline is checked when it passes, not a wait later
                    limit = min(limit, self._deadline[0] - time.monotonic())
            reason = self._relayed(store, g, max(0.0, limit)) if local else store.wait_for_failure(g, max(0.0, limit))
        if reason is None:
            return None
        return self._handle(store, g, reason)

    def _relayed(self, store: JobStore, g: int, limit: float) -> str | None:
        """Beating for its agent: the failure the agent relayed (a wait on the rank's FIFO, no store
        request), and every :data:`BACKSTOP_S` the flag read in the store itself (a relay gone)."""
        if self._wake is None:  # no FIFO here (said when it was tried): the store wait, as without an agent
            return store.wait_for_failure(g, limit)
        reason = self._wake.wait(g, limit)
        now = self._beats.clock()
        if reason is None and now >= self._next_backstop:
            self._next_backstop = now + BACKSTOP_S
            reason = store.failure(g)
        return reason

    def _beat(self, store: JobStore | None) -> None:
        note = self.progress.note() if self.progress is not None else ""
        if self.beat_file is not None:
            self.beat_file.beat(note)
        else:
            assert store is not None
            store.heartbeat(self.rank, note)

    def local_turn(self) -> None:
        """The beater's turn (a rank that beats for its agent): the beat, in a file on the machine,
        and the look for a hang of the training thread; the job store only to declare one."""
        assert self.beat_file is not None
        self._beat(None)
        with self._lock:
            g = self._generation
            if self._seen is not None:
                return
        reason = self._hang_reason()
        if reason is not None:
            if self._hang_store is None:
                self._hang_store = self._store_factory()  # its own: the thread's may be mid-wait
            self._handle(self._hang_store, g, self._fail_machine(self._hang_store, g, self.rank, reason))

    def _beat_run(self) -> None:
        name_os_thread()
        yield_on_wakeup()
        while not self._stop.is_set():
            try:
                self.local_turn()
            except Exception as exc:  # noqa: BLE001 - a hang declared while the store is down: said, retried
                self._poll_failed(exc)
            self._stop.wait(self.beat_every_s)

    def _handle(self, store: JobStore, g: int, reason: str) -> FailureSeen | None:
        """Generation ``g`` failed for ``reason``: say so once (the event, the hook, the rounds)."""
        if self._stop.is_set():
            return None  # stopped (the thread was still in its wait): nothing of this rank is watched now
        seen = FailureSeen(g, reason, time.time())
        with self._lock:
            if self._generation != g:
                return None  # the main thread moved on while we polled
            if self._seen is not None:
                return self._seen  # the other thread of this watchdog saw it first
            self._seen = seen
        self.failed.set()
        if self.on_failure is not None:
            try:
                self.on_failure(seen)
            except Exception as exc:  # noqa: BLE001 - the failure is known either way; say why the hook failed
                say(
                    f"after the failure of generation {g}: {type(exc).__name__}: {exc}; this rank's communicators "
                    "were not aborted: a training thread blocked on a dead peer may wait up to watchdog.op_timeout_s",
                    self.rank,
                    level=logging.WARNING,
                    name=__name__,
                )
        # The rounds of g this process waits in (a join, a recovery round) end now, on every rank.
        wake(store, g, seen.reason)
        return seen

    def _stale_peer(self, store: JobStore, now: float, watch: list[int], g: int) -> str | None:
        """A watched peer whose beat counter has not moved for the timeout on this rank's clock is
        suspected; a verdict once another observer agrees (or its agent finds it silent too)."""
        for peer in watch:
            beat = store.heartbeat_of(peer)
            if beat is None:
                continue  # not started yet: nothing to judge
            silent = self._beats.stale(peer, beat[0], now)
            if silent is None:
                continue
            where = f", last in {beat[1]}" if beat[1] else ""
            reason = f"rank {peer}: no heartbeat for {silent:.1f} s{where} (seen by rank {self.rank})"
            verdict = self._suspect(store, g, peer, reason)
            if verdict is not None:
                return verdict
        return None

    def _machine_of(self, rank: int) -> int:
        index = rank // self.ranks_per_machine
        return self.machines[index] if self.machines is not None else index

    def _suspect(self, store: JobStore, g: int, peer: int, reason: str) -> str | None:
        """Record this rank's suspicion of ``peer``'s machine; the verdict once two observers agree."""
        machine = self._machine_of(peer)
        key = suspect_key(g, machine)
        if (g, machine) not in self._suspected:
            self._suspected.add((g, machine))
            if store.add(f"{key}/by/{self.rank}", 1) == 1:
                if store.add(f"{key}/n", 1) == 1:
                    store.set(key, f"{self.heartbeat_timeout_s!r} {reason}")
                say(
                    f"suspects machine {machine}: {reason}; a verdict needs a second observer or the machine's own "
                    "agent",
                    self.rank,
                    name=__name__,
                )
        observers = store.add(f"{key}/n", 0)
        if observers < 2:
            return None
        return self._fail_machine(store, g, peer, f"{reason}, and {observers - 1} other observer(s) agree")

    def _hung(self, store: JobStore, g: int) -> str | None:
        """This rank's training thread made no progress for ``hang_timeout_s`` mid-iteration."""
        reason = self._hang_reason()
        return None if reason is None else self._fail_machine(store, g, self.rank, reason)

    def _hang_reason(self) -> str | None:
        progress, limit = self.progress, self.hang_timeout_s
        if progress is None or limit is None:
            return None
        stuck = progress.stuck_for()
        if stuck <= limit:
            return None
        return (
            f"rank {self.rank} hung: no progress for {stuck:.1f} s in {progress.note()} "
            f"(watchdog.hang_timeout_s={limit:g})"
        )

    def _past_deadline(self, store: JobStore, g: int) -> str | None:
        with self._lock:
            d = self._deadline
            if d is None or time.monotonic() < d[0]:
                return None
            self._deadline = None
        reason = f"rank {self.rank}: {d[2]} not done within {d[1]:g} s (the rebuild deadline)"
        declare_failure(store, g, reason)
        return store.failure(g) or reason

    def _fail_machine(self, store: JobStore, g: int, rank: int, reason: str) -> str:
        """Declare ``g`` failed for ``reason`` and have ``rank``'s agent kill its machine."""
        store.set(hung_machine_key(self._machine_of(rank)), f"{g} {reason}")
        declare_failure(store, g, reason)
        return store.failure(g) or reason


def declare_failure(store: JobStore, generation: int, reason: str) -> bool:
    """Declare ``generation`` failed (see :meth:`JobStore.declare_failure`, which also repairs a
    declaration whose first writer died half-way)."""
    return store.declare_failure(generation, reason)
