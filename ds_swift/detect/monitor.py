"""What the runtime asks of detection for the generation in force: did it fail, and how?"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from ds_swift import transport
from ds_swift.detect.beats import BeatFile
from ds_swift.detect.classify import CommunicatorFailure, Liveness, PeerFailure, classify_failure
from ds_swift.detect.progress import Progress
from ds_swift.detect.watchdog import Watchdog
from ds_swift.jobstore.membership import JobStore, WorkerEnv
from ds_swift.logs import say_here

__all__ = ["FailureMonitor"]


class FailureMonitor:
    """The failure flag, the watchdog and the after-receive check of one worker, across generations.

    Args:
        store: the job store (None without ds-swift-launch: nothing is watched and every error
            is raised as DeepSpeed alone would).
        generation: the generation this worker trains in.
        poll_interval_s: the watchdog's poll interval (a comm error also waits a few of them
            for the node agent's declaration).
    """

    def __init__(self, store: JobStore | None, generation: int, poll_interval_s: float, watch: bool = True) -> None:
        self.store = store
        #: False only where a benchmark switched failure detection off (ds_swift.protect.costs):
        #: no watchdog thread, and no failure-flag reads after receives and before iterations
        self.watch = watch
        self._generation = generation
        self._poll_interval_s = poll_interval_s
        self._watchdog: Watchdog | None = None
        self._armed = True  # the recv check applies to the generation in force, not during a recovery
        self._liveness: Liveness | None = None
        #: the training thread's progress (beaten by the runtime's instruction hooks)
        self.progress = Progress()

    def start_watchdog(
        self,
        env: WorkerEnv,
        heartbeat_timeout_s: float,
        peers: Sequence[int],
        hang_timeout_s: float | None = None,
        machines: Sequence[int] | None = None,
    ) -> None:
        """Start polling the failure flag (and heartbeating, and watching for a hang) on a store
        connection of its own. ``machines``: the job's machines in rank order (None: all of them)."""
        if not self.watch:
            return
        beat_file = BeatFile(env.beat_dir, env.rank, heartbeat_timeout_s) if env.beat_dir else None
        # Ranks beating for their agents have no counter in the store: a comm error's evidence of a
        # death is then the agents' declaration, which a dead agent's neighbours make after
        # --agent-timeout and a beat (launch/liveness.py).
        self._liveness = Liveness(
            range(env.world_size) if beat_file is None else (),
            heartbeat_timeout_s,
            env.rank,
            hang_timeout_s,
            agents_timeout_s=1.2 * env.agent_timeout_s if beat_file is not None else 0.0,
        )
        self._watchdog = Watchdog(
            lambda: JobStore.from_env(env),
            env.rank,
            self._generation,
            self._poll_interval_s,
            heartbeat_timeout_s,
            peers,
            progress=self.progress,
            hang_timeout_s=hang_timeout_s,
            ranks_per_machine=env.world_size // max(1, len(machines) if machines is not None else env.num_machines),
            machines=machines,
            on_failure=lambda seen: transport.on_generation_failed(seen.generation, seen.reason),
            beat_file=beat_file,
        ).start()

    @property
    def generation(self) -> int:
        return self._generation

    def set_generation(self, generation: int, peers: Sequence[int] = ()) -> None:
        """Watch ``generation`` from now on, and the heartbeats of ``peers``."""
        self._generation = generation
        if self._watchdog is not None:
            self._watchdog.set_generation(generation, peers)

    def arm_deadline(self, seconds: float | None, what: str = "") -> None:
        """The generation in force fails if ``what`` is not done within ``seconds`` (None: disarm);
        see :meth:`ds_swift.detect.watchdog.Watchdog.set_deadline`. Without a watchdog, nothing."""
        if self._watchdog is not None:
            self._watchdog.set_deadline(seconds, what)

    def set_armed(self, on: bool) -> None:
        self._armed = on

    def stop(self, final: bool = False) -> None:
        """Stop watching; ``final``: the process exits next (its watchdog's wait is waited out)."""
        if self._watchdog is not None:
            self._watchdog.stop(final=final)

    # ------------------------------------------------------------------ checks
    def check_after_receive(self, received: torch.Tensor | None = None) -> None:
        """After a pipeline receive into ``received`` (or before a step, None): raise if the
        generation failed (the buffer may be poison).

        A receive reads no job store unless the buffer carries the poison mark
        (ds_swift.transport.shutdown.POISON_MARK): every poison is sent after the failure flag is
        set, and a device buffer is never poisoned (NCCL is aborted, and the watchdog sets its event
        before it aborts). A store read per receive cost a round trip to the store host per
        micro-batch: on a GPU step of ~100 ms with 8 micro-batches, 1-3 % of the step."""
        if not self._armed or not self.watch:
            return
        wd, store = self._watchdog, self.store
        if wd is not None and wd.failed.is_set():
            raise PeerFailure(f"generation {self._generation} failed (watchdog)")
        if store is None or (received is not None and not transport.carries_poison(received)):
            return
        reason = store.failure(self._generation)
        if reason is None and received is not None:
            # The poison mark with no flag yet: a poisoner sets the flag before it sends, so wait a
            # few polls for the store to show it; a buffer that merely looks like the mark is not
            # trusted either way (training on a poisoned buffer would be a silent wrong state).
            reason = store.wait_for_failure(self._generation, 5 * self._poll_interval_s)
            reason = reason or "a poison message from a pipeline neighbour (no failure flag seen)"
        if reason is not None:
            raise PeerFailure(f"generation {self._generation} failed: {reason}")

    def check_step(self, iteration: int) -> None:
        """Right before the optimizer applies the step of ``iteration`` (ds_swift.patches.step_guard):
        wait for the device, then raise if an abort may have cut the collectives the step follows, so
        that the step is never applied (the consensus then counts ``iteration`` as not stepped here).

        Sound because whoever aborts marks first: ds-swift's watchdog marks the generation before
        its abort, torch's NCCL watchdog records its error before its own (ds_swift.transport.
        communicators). A mark seen now came before the abort or it came after the wait, which the
        collectives had passed: either way the answer is right. Not armed-dependent: a replay's
        steps are checked too."""
        transport.synchronize_device()
        taint = transport.step_taint()
        if taint is None:
            return
        what = f"generation {self._generation}: the step of iteration {iteration} is not applied: {taint.why}"
        say_here(what, level=logging.WARNING, name=__name__)
        if taint.declared:
            raise PeerFailure(what)
        raise CommunicatorFailure(what)

    def failure_seen(self) -> str | None:
        """Why the generation in force failed, if it did (None without a job store).

        With a watchdog thread running this is its event alone, no store read: the thread reads the
        flag every ``poll_interval_s``, and a failure it has not seen yet is met inside the
        iteration (a receive from the lost peer fails, or brings the poison mark, or the op timeout
        ends it; :meth:`classify`), exactly as a failure in the middle of an iteration is. A store
        read here cost the training thread a round trip to the store host per iteration: on the
        tiny CPU GPT (4 ranks on 2 cores) 4-5 ms of wall time per iteration and rank, waiting for
        the store's thread to be scheduled (benchmarks/gpu_overhead.py, issue 29)."""
        if self.store is None or not self.watch:
            return None
        wd = self._watchdog
        if wd is not None:
            return "failure flag (watchdog)" if wd.failed.is_set() else None
        if self.store.failure(self._generation) is not None:
            return "failure flag"
        return None

    def failure_reason(self, generation: int) -> str | None:
        """Why ``generation`` failed: what the watchdog read from the flag when it saw it (no request),
        else the flag itself (None: not failed, or no job store)."""
        seen = self._watchdog.seen if self._watchdog is not None else None
        if seen is not None and seen.generation == generation:
            return seen.reason
        return self.store.failure(generation) if self.store is not None else None

    def classify(self, exc: BaseException, generation: int | None = None, early: bool = False) -> str:
        """How ``exc`` ended ``generation`` (default: the one in force); re-raises it when it is not
        a failure (see :func:`~ds_swift.detect.classify.classify_failure`). ``early``: raised before
        this rank's first step in the generation."""
        g = self._generation if generation is None else generation
        return classify_failure(exc, self.store, g, self._poll_interval_s, self._liveness, early=early)

    def begin_recovery(self) -> float:
        """A survivor starts recovering: the recv check is off (the job's generation is moved on, if
        no agent did, before the join: ds_swift.detect.failed_machine.FailedMachine). Returns when the
        failure was first seen here."""
        assert self.store is not None
        seen = self._watchdog.seen if self._watchdog is not None else None
        t_detect = min(time.time(), seen.t_seen) if seen is not None else time.time()
        self._armed = False
        return t_detect
