"""The node agent: one per machine (and per spare), like a node's daemon.

An agent starts its machine's ranks (rank = machine * nproc_per_node + local_rank), checks them
every tick, and treats the death of any of them (a signal, or a non-zero exit) as the failure of
the whole machine: it SIGKILLs the other local ranks, as a crash would, and declares the
generation failed in the job store. The agent itself survives. Then, in this order:

- a spare agent takes over the machine id (same ranks), if a spare is left;
- otherwise, with ``--restart-delay``, this agent restarts the ranks after the delay;
- otherwise, or after ``--max-failures``, the job is aborted and every agent kills its workers.

Replacement workers start in the store's current generation with ``SWIFT_REPLACEMENT=1``. A
replacement that dies is one more machine failure, handled the same way (a cascading failure).
A spare keeps a pool of warm workers (:mod:`.warm_pool`, on unless ``--cold-spares``), already imported
and waiting: taking over a machine hands them their ranks instead of starting processes.

How the agent reacts when its ranks stop is :mod:`.agent_failures`; what it checks besides their exits
(failing GPUs, hung ranks) is :mod:`.health`; how it
declares a failure and decides among spare, shrink, restart and abort is :mod:`.fate`; what each
worker is told is :meth:`.job.JobSpec.worker_envs`.

Multi-host, an agent can die with its machine; another agent then notices (:mod:`.liveness`) and
calls :meth:`MachineAgent.adopt_lost_machine`, which handles that machine's failure the same way
(without the restart option: there is no agent left to restart on).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from ds_swift.detect.relay import FailureRelay
from ds_swift.jobstore.layout import grow_key, grown_layout, read_layout, resumed_key
from ds_swift.jobstore.membership import JobStore

from .agent_failures import AgentState, FailureHandling
from .control import EventLog, JobControl
from .fate import MachineFate
from .health import MachineHealth
from .inject_group import GroupKill, PendingFailure
from .job import JobSpec
from .spawn import Worker, spawn_warm, spawn_worker, supports_warm
from .warm_pool import WarmPool

# JobSpec lives in .job (what every agent knows about the job); it stays importable from here.
__all__ = ["AgentState", "JobSpec", "MachineAgent"]


class MachineAgent(FailureHandling):
    """One machine's (or spare's) agent. ``tick()`` runs every poll interval; it never blocks."""

    def __init__(
        self,
        node: int,
        job: JobSpec,
        store: JobStore,
        events: EventLog,
        spawn: Callable[..., Worker] = spawn_worker,
        gpu_monitor: Any | None = None,
        warm_start: Callable[..., Any] = spawn_warm,
    ) -> None:
        self.node = node
        self.job = job
        self.store = store
        self.control = JobControl(store)
        self.events = events
        self._spawn_fn = spawn
        self.machine: int | None = node if node < job.num_machines else None
        self.state = AgentState.RUNNING if self.machine is not None else AgentState.SPARE
        self.workers: list[Worker] = []
        self._dying: list[Worker] = []  # SIGKILLed by us, not reaped yet
        self._restart_at = 0.0
        self._grow_back = False  # RESTARTING after an elastic shrink: the machine comes back as a grow
        self._grow_pending: int | None = None  # the generation a grow ends once the machine's ranks joined the next
        self._layout: list[int] | None = None  # the job's machines in rank order, once a grow changed them
        self._failed_generation = 0  # the generation whose timeline the next replacement completes
        self._scan_from = 1  # next replacement request a spare looks at
        self._groups = GroupKill(store, job.inject)  # --inject machine=1+2: machines killed at one instant
        # A failing GPU or a hung rank is as good as a dead machine (launch/health.py).
        self._health = MachineHealth(node, job.nproc_per_node, store, events, self._groups, gpu_monitor)
        self._fates = MachineFate(node, job, store, self.control, events)
        self._pending: PendingFailure | None = None  # killed with a group, declared once the group is down
        self._spawn_generation = 0  # the generation the machine's workers were started in
        self._spawned_replacements = False
        self._pool: WarmPool | None = None
        self._relay: FailureRelay | None = None  # started with the machine's first ranks (ds_swift.detect.relay)
        if self.state is AgentState.SPARE and job.warm_spares and supports_warm(job.command):
            self._pool = WarmPool(job.nproc_per_node, lambda lr: warm_start(job.command, lr, job.nproc_per_node))

    @property
    def name(self) -> str:
        return f"agent {self.node}" + (" (spare)" if self.node >= self.job.num_machines else "")

    # ------------------------------------------------------------------ lifecycle
    def _publish_machine(self) -> None:
        """What a watcher must know if this agent dies: the machine it runs ("" when none)."""
        running = self.state in (AgentState.RUNNING, AgentState.RESTARTING) and self.machine is not None
        self.store.set(f"launch/machine_of/{self.node}", str(self.machine) if running else "")

    def start(self) -> None:
        self._publish_machine()
        if self._pool is not None:
            pids = self._pool.fill()
            self.events(
                f"{self.name}: {len(pids)} warm worker(s) started (pids {' '.join(map(str, pids))})",
                event="warm_started",
                node=self.node,
                pids=pids,
            )
        if self.state is AgentState.RUNNING:
            self._spawn(generation=0, replacement=False)
            self.events(
                f"machine {self.machine}: {self._ranks_text()} started by {self.name} "
                f"(pids {' '.join(str(w.pid) for w in self.workers)})",
                event="spawned",
                node=self.node,
                machine=self.machine,
                generation=0,
                pids=[w.pid for w in self.workers],
            )

    @property
    def busy(self) -> bool:
        """Work that wants the launcher's short ticks: a restart's delay running out, the machines of
        an injected group kill going down, killed workers to reap (else a tick a second will do)."""
        return self.state is AgentState.RESTARTING or self._pending is not None or bool(self._dying)

    def tick(self) -> None:
        """Look at the local ranks (waitpid, no store traffic unless something happened)."""
        self._dying = [w for w in self._dying if w.poll() is None]
        if self.state is AgentState.RUNNING and self._pending is not None:
            if self._groups.all_down(self._pending):
                p, self._pending = self._pending, None
                self._fail_machine(p.rank, p.returncode, p.t_detected, p.why, generation=p.generation)
        elif self.state is AgentState.RUNNING:
            self._check_workers()
            if self._grow_pending is not None and self.state is AgentState.RUNNING:
                self._grow_when_joined()
        elif self.state is AgentState.RESTARTING and time.monotonic() >= self._restart_at:
            if self._grow_back:
                self._grow()
            else:
                self.state = AgentState.RUNNING
                self._spawn_replacement()
        elif self.state is AgentState.SPARE and self._pool is not None:
            lines = self._pool.check()
            if lines:
                pids = [wp.pid for wp in self._pool.procs.values()]
                self.events(f"{self.name}: " + "; ".join(lines), event="warm_replaced", node=self.node, pids=pids)

    def requested_spare(self) -> bool:
        """This agent requested a spare since the last call (see :meth:`MachineFate.take_request`)."""
        return self._fates.take_request()

    def poll_store(self) -> None:
        """A spare looks for a replacement request it can claim."""
        if self.state is not AgentState.SPARE:
            return
        issued = min(self.control.spares_taken(), self.job.num_spares)
        while self._scan_from <= issued:
            request = self.control.request(self._scan_from)
            if request is None:
                return  # the counter moved a moment before the request was written: look again next tick
            slot = self._scan_from
            self._scan_from += 1
            if self.control.claim(slot):
                machine, failed_generation = request
                self.machine = machine
                self._failed_generation = failed_generation
                self.state = AgentState.RUNNING
                self._publish_machine()
                self.events(
                    f"{self.name} takes over machine {machine} ({self._ranks_text()})",
                    event="takeover",
                    node=self.node,
                    machine=machine,
                    failed_generation=failed_generation,
                )
                self._spawn_replacement()
                return

    def close(self) -> None:
        """The job ended: the failure flag's relay ends (every agent's), the ranks' beat files go."""
        if self._relay is not None:
            self._relay.close(self.store)
        self._health.close()

    def signal_all(self, sig: int) -> None:
        for w in [*self.workers, *self._dying]:
            w.signal_group(sig)
        if self._pool is not None:
            self._pool.signal_all(sig)

    def stop_warm(self) -> None:
        """The job ended: this spare's idle warm workers have nothing left to take over. SIGKILLed
        here and reaped by :meth:`alive`: they wait on their pipe until the launcher exits, so the
        launcher's reap of a finished job otherwise waited its whole timeout (10 s) for them."""
        if self._pool is None or not self._pool.procs:
            return
        pids = [wp.pid for wp in self._pool.procs.values()]
        self._pool.close()
        self.events(
            f"{self.name}: {len(pids)} idle warm worker(s) stopped at the job's end (pids {' '.join(map(str, pids))})",
            event="warm_stopped",
            node=self.node,
            pids=pids,
        )

    def alive(self) -> list[Any]:
        """Workers (warm ones included) not reaped yet (reaps the ones that ended)."""
        warm = self._pool.alive() if self._pool is not None else []
        return [*(w for w in [*self.workers, *self._dying] if w.poll() is None), *warm]

    # ------------------------------------------------------------------ internals
    def _ranks_text(self) -> str:
        assert self.machine is not None
        r = self.job.ranks(self.machine)
        return f"ranks {r.start}..{r.stop - 1}" if len(r) > 1 else f"rank {r.start}"

    def _spawn(self, generation: int, replacement: bool) -> bool:
        """Start the machine's ranks: handed to the warm pool's workers where it has them; True if so."""
        assert self.machine is not None
        wenvs = self.job.worker_envs(self.machine, generation, replacement, self._layout)
        beats = self._health.fresh_beats([w.rank for w in wenvs])  # a new worker is judged from its first beat
        wenvs = [dataclasses.replace(w, beat_dir=beats) for w in wenvs]
        if self._relay is None and wenvs:  # the failure flag, waited on once for the machine's ranks
            first = wenvs[0]
            self._relay = FailureRelay(lambda: JobStore.from_env(first), beats, generation, self.name).start()
        self._spawn_generation = generation
        self._spawned_replacements = replacement
        if self._pool is not None:
            # Empties the pool either way (one takeover per spare); it keeps what it killed, to be reaped.
            warm = self._pool.take(wenvs, (self.job.nproc_per_node, self.job.op_timeout_s))
            if warm is not None:
                self.workers.extend(warm)
                return True
        for wenv in wenvs:
            try:
                worker = self._spawn_fn(self.job.command, wenv, self.job.nproc_per_node, self.job.op_timeout_s)
            except OSError as exc:
                self._give_up(
                    f"machine {self.machine}: cannot start rank {wenv.rank} ({self.job.command.script}): {exc}"
                )
                return False
            self.workers.append(worker)
        return False

    def _grow(self) -> None:
        """The machine is back after an elastic shrink. Once the job trains again (the shrink's
        recovery is over) its ranks start, for the next generation, at their place in the grown layout
        (last); :meth:`_grow_when_joined` ends the generation in force when they wait there."""
        assert self.machine is not None
        g = self.store.generation()
        if self.store.failure(g) is not None or self.store.get(resumed_key(g)) is None:
            return  # a recovery is in progress: come back next tick
        self._layout = grown_layout(read_layout(self.store, self.job.num_machines), self.machine)
        self.state = AgentState.RUNNING
        self._grow_back = False
        self._grow_pending = g
        self._failed_generation = g
        self._spawn(generation=g + 1, replacement=True)
        self.events(
            f"machine {self.machine}: back after {self.job.restart_delay_s:g} s; its ranks start for "
            f"generation {g + 1} on machines {self._layout}",
            event="grow_started",
            node=self.node,
            machine=self.machine,
            generation=g + 1,
            machines=self._layout,
        )

    def _grow_when_joined(self) -> None:
        """The returning machine's ranks all wait in generation g+1: publish the grown layout, name the
        machine in ``launch/grow/<g>`` and end generation g (not a failure: nothing is lost), so that
        the survivors rebuild with it (ds_swift.recovery.strategies.elastic). Training paused only from here."""
        g = self._grow_pending
        assert g is not None and self.machine is not None
        if self.store.failure(g) is not None:
            self.control.abort(
                f"machine {self.machine}: generation {g} failed while the machine was coming back "
                "(elastic grow); a failure during a grow is not recovered"
            )
            return
        if not self.store.joined(g + 1, [w.rank for w in self.workers]):
            return
        self._grow_pending = None
        self._layout = self.control.return_machine(self.machine, self.job.num_machines)
        self.store.set(grow_key(g), str(self.machine))
        self.store.declare_failure(g, f"machine {self.machine} is back (elastic grow): a rebuild with it")
        self.store.advance_generation(g)
        self.control.record_replacement_spawned(g, time.time())
        self.events(
            f"machine {self.machine}: its ranks wait in generation {g + 1}; generation {g} ends for a "
            f"rebuild on machines {self._layout}",
            event="grow",
            node=self.node,
            machine=self.machine,
            generation=g + 1,
            machines=self._layout,
        )

    def _spawn_replacement(self) -> None:
        generation = self.store.generation()
        warm = self._spawn(generation=generation, replacement=True)
        if self.state is not AgentState.RUNNING:
            return  # the spawn failed and the job is being aborted
        t = time.time()
        self.control.record_replacement_spawned(self._failed_generation, t)
        self.events(
            f"machine {self.machine}: replacement {self._ranks_text()} {'handed to warm workers' if warm else 'started'} "
            f"by {self.name} in generation {generation} (pids {' '.join(str(w.pid) for w in self.workers)})",
            event="replacement_spawned",
            node=self.node,
            machine=self.machine,
            generation=generation,
            failed_generation=self._failed_generation,
            t=t,
            pids=[w.pid for w in self.workers],
            warm=warm,
        )
