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
A spare keeps a pool of warm workers (:mod:`.warm`, on unless ``--cold-spares``), already imported
and waiting: taking over a machine hands them their ranks instead of starting processes.

Multi-host, an agent can die with its machine; another agent then notices (:mod:`.liveness`) and
calls :meth:`MachineAgent.adopt_lost_machine`, which handles that machine's failure the same way
(without the restart option: there is no agent left to restart on).
"""

from __future__ import annotations

import enum
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ds_swift.detect.beats import CounterClock
from ds_swift.detect.classify import rank_error_key
from ds_swift.detect.watchdog import hung_machine_key, suspect_key
from ds_swift.jobstore.membership import JobStore, WorkerEnv, grow_key, grown_layout, read_layout, resumed_key
from ds_swift.jobstore.url import StoreCredentials
from ds_swift.testing.faults import FaultSpec, format_specs

from .args import Command, LaunchArgs
from .control import EventLog, JobControl
from .inject_group import GroupKill, PendingFailure
from .spawn import Worker, describe_exit, spawn_warm, spawn_worker, supports_warm
from .warm import WarmPool

#: seconds between GPU health polls (NVML queries are cheap, but not free on 8 GPUs)
GPU_POLL_S = 2.0
#: seconds between looks at the job store for a watchdog's verdict that a rank here is hung
HUNG_POLL_S = 0.25

__all__ = ["AgentState", "JobSpec", "MachineAgent"]


class AgentState(enum.Enum):
    SPARE = "spare"  # waiting for a machine to take over
    RUNNING = "running"  # its machine's ranks are up
    RESTARTING = "restarting"  # its machine failed; ranks restart after --restart-delay
    RETIRED = "retired"  # its machine failed and went to a spare (or the job gave up)
    DONE = "done"  # every rank of its machine exited 0


@dataclass(frozen=True)
class JobSpec:
    """What every agent knows about the job (the same on every host)."""

    command: Command
    num_machines: int
    nproc_per_node: int
    num_spares: int
    max_failures: int
    restart_delay_s: float | None
    store_addr: str
    store_port: int
    token: str
    run_dir: str
    inject: tuple[FaultSpec, ...] = ()
    op_timeout_s: float | None = None
    store_url: str = ""
    """``etcd://...`` or ``tcp://...`` when no agent hosts the store (workers get it as SWIFT_STORE_URL)."""
    warm_spares: bool = False
    """Spares keep warm workers (ds-swift-launch: on unless ``--cold-spares``)."""
    secret: str = field(default="", repr=False)
    elastic: bool = False
    """With no spare left, the job goes on without a failed machine (``--elastic``)."""
    launch: str = ""
    """The launch id (:mod:`ds_swift.jobstore.signed_kv`): workers use that launch's keys only."""
    store_credentials: StoreCredentials = field(default_factory=StoreCredentials, repr=False)

    @classmethod
    def from_args(cls, args: LaunchArgs, store_addr: str, store_port: int, token: str, store_url: str = "",
                  launch: str = "") -> JobSpec:
        return cls(
            command=args.command,
            num_machines=args.nnodes,
            nproc_per_node=args.nproc_per_node,
            num_spares=args.spares,
            max_failures=args.max_failures,
            restart_delay_s=args.restart_delay_s,
            store_addr=store_addr,
            store_port=store_port,
            token=token,
            run_dir=args.run_dir,
            inject=args.inject,
            op_timeout_s=args.op_timeout_s,
            store_url=store_url,
            warm_spares=not args.cold_spares,
            secret=args.job_secret,
            elastic=args.elastic,
            launch=launch,
            store_credentials=args.store_credentials,
        )

    @property
    def world_size(self) -> int:
        return self.num_machines * self.nproc_per_node

    def ranks(self, machine: int) -> range:
        return range(machine * self.nproc_per_node, (machine + 1) * self.nproc_per_node)


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


class MachineAgent:
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
        # A GPU with uncorrectable ECC errors or a critical Xid computes wrong numbers or hangs:
        # as good as a dead machine. Without NVML (CPU machines) the monitor reports healthy.
        self._gpu = gpu_monitor
        self._gpu_next = 0.0
        self._hung_next = 0.0
        self._suspicion: tuple[int, CounterClock[int], str] | None = None  # (generation, own clock, by whom)
        self._groups = GroupKill(store, job.inject)  # --inject machine=1+2: machines killed at one instant
        self._pending: PendingFailure | None = None  # killed with a group, declared once the group is down
        self._spawn_generation = 0  # the generation the machine's workers were started in
        self._spawned_replacements = False
        self._pool: WarmPool | None = None
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
            self.events(f"{self.name}: {len(pids)} warm worker(s) started (pids {' '.join(map(str, pids))})",
                        event="warm_started", node=self.node, pids=pids)
        if self.state is AgentState.RUNNING:
            self._spawn(generation=0, replacement=False)
            self.events(
                f"machine {self.machine}: {self._ranks_text()} started by {self.name} "
                f"(pids {' '.join(str(w.pid) for w in self.workers)})",
                event="spawned", node=self.node, machine=self.machine, generation=0, pids=[w.pid for w in self.workers],
            )

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
                    event="takeover", node=self.node, machine=machine, failed_generation=failed_generation,
                )
                self._spawn_replacement()
                return

    def signal_all(self, sig: int) -> None:
        for w in [*self.workers, *self._dying]:
            w.signal_group(sig)
        if self._pool is not None:
            self._pool.signal_all(sig)

    def alive(self) -> list[Any]:
        """Workers (warm ones included) not reaped yet (reaps the ones that ended)."""
        warm = self._pool.alive() if self._pool is not None else []
        return [*(w for w in [*self.workers, *self._dying] if w.poll() is None), *warm]

    # ------------------------------------------------------------------ internals
    def _ranks_text(self) -> str:
        assert self.machine is not None
        r = self.job.ranks(self.machine)
        return f"ranks {r.start}..{r.stop - 1}" if len(r) > 1 else f"rank {r.start}"

    def _worker_envs(self, generation: int, replacement: bool) -> list[WorkerEnv]:
        assert self.machine is not None
        inject = format_specs(self.job.inject)
        ranks, world = self.job.ranks(self.machine), self.job.world_size
        if self._layout is not None:  # an elastic grow: the machine's place in the job's layout
            n = self.job.nproc_per_node
            position = self._layout.index(self.machine)
            ranks, world = range(position * n, (position + 1) * n), len(self._layout) * n
        return [
            WorkerEnv(
                rank=rank,
                local_rank=local_rank,
                world_size=world,
                machine=self.machine,
                num_machines=self.job.num_machines,
                generation=generation,
                replacement=replacement,
                store_addr=self.job.store_addr,
                store_port=self.job.store_port,
                token=self.job.token,
                run_dir=self.job.run_dir,
                inject=inject,
                store_url=self.job.store_url,
                secret=self.job.secret,
                launch=self.job.launch,
                store_credentials=self.job.store_credentials,
            )
            for local_rank, rank in enumerate(ranks)
        ]

    def _spawn(self, generation: int, replacement: bool) -> bool:
        """Start the machine's ranks: handed to the warm pool's workers where it has them; True if so."""
        wenvs = self._worker_envs(generation, replacement)
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
                self._give_up(f"machine {self.machine}: cannot start rank {wenv.rank} ({self.job.command.script}): {exc}")
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
        self.events(f"machine {self.machine}: back after {self.job.restart_delay_s:g} s; its ranks start for "
                    f"generation {g + 1} on machines {self._layout}", event="grow_started", node=self.node,
                    machine=self.machine, generation=g + 1, machines=self._layout)  # fmt: skip

    def _grow_when_joined(self) -> None:
        """The returning machine's ranks all wait in generation g+1: publish the grown layout, name the
        machine in ``launch/grow/<g>`` and end generation g (not a failure: nothing is lost), so that
        the survivors rebuild with it (ds_swift.recovery.strategies.elastic). Training paused only from here."""
        g = self._grow_pending
        assert g is not None and self.machine is not None
        if self.store.failure(g) is not None:
            self.control.abort(f"machine {self.machine}: generation {g} failed while the machine was coming back "
                               "(elastic grow); a failure during a grow is not recovered")  # fmt: skip
            return
        if self.store.add(f"gen{g + 1}/joined", 0) < self.job.nproc_per_node:
            return
        self._grow_pending = None
        self._layout = self.control.return_machine(self.machine, self.job.num_machines)
        self.store.set(grow_key(g), str(self.machine))
        self.store.declare_failure(g, f"machine {self.machine} is back (elastic grow): a rebuild with it")
        self.store.advance_generation(g)
        self.control.record_replacement_spawned(g, time.time())
        self.events(f"machine {self.machine}: its ranks wait in generation {g + 1}; generation {g} ends for a "
                    f"rebuild on machines {self._layout}", event="grow", node=self.node, machine=self.machine,
                    generation=g + 1, machines=self._layout)  # fmt: skip

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
            event="replacement_spawned", node=self.node, machine=self.machine, generation=generation,
            failed_generation=self._failed_generation, t=t, pids=[w.pid for w in self.workers], warm=warm,
        )

    def _gpu_problem(self) -> str | None:
        if time.monotonic() < self._gpu_next:
            return None
        self._gpu_next = time.monotonic() + GPU_POLL_S
        if self._gpu is None:
            from .gpu_health import GpuMonitor

            # Local slots, mapped through this agent's CUDA_VISIBLE_DEVICES (the monitor's default
            # environ), which its workers inherit; ECC errors count from here, not from boot.
            self._gpu = GpuMonitor(indices=list(range(self.job.nproc_per_node)))
        health = self._gpu.poll()
        return None if health.healthy else f"failing GPU ({'; '.join(health.problems)})"

    def _hung_problem(self) -> str | None:
        """A watchdog found a rank of this machine hung, or two observers found it stopped
        (ds_swift.detect.watchdog), or one did and this agent finds its ranks' heartbeats silent
        too: a process that is alive but makes no progress is as good as dead, and is killed as such."""
        if self.machine is None or time.monotonic() < self._hung_next:
            return None
        self._hung_next = time.monotonic() + HUNG_POLL_S
        fired = self._groups.fired_for(self.machine, self._spawn_generation) if self._groups.groups else None
        if fired is not None:
            return self._groups.describe(fired[0])
        value = self.store.get(hung_machine_key(self.machine))
        if value:
            generation, _, reason = value.partition(" ")
            if int(generation) >= self._spawn_generation:
                return f"hung ({reason})"
        return self._suspected_problem()

    def _suspected_problem(self) -> str | None:
        """One observer suspects this machine (no verdict alone: its clock, its store view, its
        link may be what is wrong): this agent reads its own ranks' beat counters on its own clock
        and fails the machine only if one of them is silent for the observer's timeout here too."""
        assert self.machine is not None
        g = self.store.generation()
        raw = self.store.get(suspect_key(g, self.machine))
        if not raw or g < self._spawn_generation:
            self._suspicion = None
            return None
        if self._suspicion is None or self._suspicion[0] != g:
            timeout_s, _, why = raw.partition(" ")
            self._suspicion = (g, CounterClock(float(timeout_s)), why)
            self.events(f"machine {self.machine}: suspected in generation {g} ({why}); {self.name} checks its "
                        "ranks' heartbeats on its own clock", event="suspected", node=self.node,
                        machine=self.machine, generation=g)  # fmt: skip
        _, beats, why = self._suspicion
        now = beats.begin_round()
        for w in self.workers:
            beat = self.store.heartbeat_of(w.rank)
            silent = beats.stale(w.rank, beat[0], now) if beat is not None else None
            if beat is not None and silent is not None:
                where = f", last in {beat[1]}" if beat[1] else ""
                return f"hung (rank {w.rank}: no heartbeat for {silent:.1f} s{where}, on its agent's clock; suspected: {why})"
        beats.end_round()
        return None

    def _check_workers(self) -> None:
        if not self.workers:
            return
        problem = self._gpu_problem() or self._hung_problem()
        if problem is not None:
            t_detected = time.time()
            for w in self.workers:
                w.signal_group(signal.SIGKILL)
            self._dying.extend(self.workers)
            victims, self.workers = self.workers, []
            # A rank that raised the job's own error stops heartbeating as it exits: a peer's
            # watchdog may call that a hang first. It is still the job's error, not the machine's.
            if not any(self._own_error(w, 1) for w in victims):
                self._machine_failed(victims[0], -signal.SIGKILL, t_detected, why=problem)
            return
        codes = [(w, w.poll()) for w in self.workers]
        failed = [(w, rc) for w, rc in codes if rc is not None and rc != 0]
        if failed:
            t_detected = time.time()
            # The machine is gone, as a crash would take it: its other ranks must not linger as
            # half a pipeline stage that survivors could still talk to.
            for w in self.workers:
                w.signal_group(signal.SIGKILL)
            self._dying.extend(self.workers)
            self.workers = []
            if not self._own_error(*failed[0]) and not self._left_behind(*failed[0]):
                self._machine_failed(*failed[0], t_detected)
        elif all(rc == 0 for _, rc in codes):
            assert self.machine is not None
            self.state = AgentState.DONE
            self._publish_machine()
            self.control.mark_machine_done(self.machine)
            self.events(f"machine {self.machine}: {self._ranks_text()} exited 0", event="machine_done",
                        node=self.node, machine=self.machine)

    def _own_error(self, worker: Worker, returncode: int) -> bool:
        """The rank exited on the job's own error (it said so in the store before raising: a bug, not
        a dead machine; ds_swift.detect.classify): the job ends with it, as it would without
        ds-swift; replacing the machine would only run into the same error again."""
        if returncode <= 0:
            return False
        said = self.store.get(rank_error_key(worker.rank))
        if said is None:
            return False
        self.control.abort(f"machine {self.machine}: {said} (the job's own error, not a machine failure)")
        self.state = AgentState.RETIRED
        self._publish_machine()
        return True

    def _left_behind(self, worker: Worker, returncode: int) -> bool:
        """Replacement ranks whose generation failed before they joined it (the survivors gave up
        waiting for a slow start) and which then exited on an error: the machine is sound, so its
        ranks start again, here, for the job's current generation, without a spare. Counted as a
        failure (``--max-failures`` ends a loop)."""
        if not self._spawned_replacements or returncode <= 0:
            return False
        current = self.store.generation()
        if worker.generation >= current or self.store.failure(worker.generation) is None:
            return False
        reason = (f"machine {self.machine}: replacement rank {worker.rank} {describe_exit(returncode)} after its "
                  f"generation {worker.generation} failed without it")  # fmt: skip
        if self._one_failure_too_many(reason):
            self.state = AgentState.RETIRED
            return True
        self.events(f"{reason}: its ranks start again in generation {current}", event="replacement_restarted",
                    node=self.node, machine=self.machine, generation=current, rank=worker.rank)  # fmt: skip
        self._spawn_replacement()
        return True

    def _one_failure_too_many(self, reason: str) -> bool:
        """Count a failure; past ``--max-failures`` the job is aborted with ``reason`` (True)."""
        count = self.control.record_failure()
        if count <= self.job.max_failures:
            return False
        self.control.abort(f"{reason}; that is failure {count}, more than --max-failures {self.job.max_failures}")
        return True

    def _declare(self, reason: str, generation: int | None = None) -> tuple[int, bool]:
        """Declare the generation in force (or ``generation``: the one a group of machines was killed
        in) failed; returns (the generation this failure ends, first declarer)."""
        if generation is not None:
            return generation, self.store.declare_failure(generation, reason)
        g = self.store.generation()
        if g >= 1 and self.store.add(f"gen{g}/joined", 0) == 0 and self.store.failure(g - 1) is not None:
            # Nobody joined g yet, so this machine's dead ranks are not in it: g-1's failure covers
            # them (a survivor saw the broken connection first, or another machine died at the same
            # moment, or a replacement died before joining). g can still form, with this machine's
            # replacement; failing it too would only cost every rank one more round.
            return g - 1, False
        return g, self.store.declare_failure(g, reason)

    def _machine_failed(self, worker: Worker, returncode: int, t_detected: float, why: str | None = None) -> None:
        assert self.machine is not None
        fired = self._groups.fired_for(self.machine, self._spawn_generation) if self._groups.groups else None
        if fired is None:
            self._fail_machine(worker.rank, returncode, t_detected, why)
            return
        # Killed with a group (--inject machine=1+2): declared once every machine of it is down.
        index, generation = fired
        what = why if why is not None else f"rank {worker.rank} {describe_exit(returncode)}"
        group = self._groups.describe(index)
        self._pending = self._groups.pending(index, generation, worker.rank, returncode, t_detected,
                                             what if what == group else f"{what} ({group})")
        self._groups.down(self._pending)
        self.events(f"machine {self.machine}: down with {self._groups.describe(index)}; its failure is declared "
                    "once the whole group is down", event="group_down", node=self.node, machine=self.machine,
                    index=index, generation=generation)  # fmt: skip

    def _fail_machine(self, rank: int, returncode: int, t_detected: float, why: str | None = None,
                      generation: int | None = None) -> None:
        machine = self.machine
        assert machine is not None
        what = why if why is not None else f"rank {rank} {describe_exit(returncode)}"
        reason = f"machine {machine}: {what} at {_clock(t_detected)}"
        outcome = self._handle_failure(machine, reason, t_detected, own=True, rank=rank, returncode=returncode,
                                       generation=generation)
        if outcome == "restart" or (outcome == "shrink" and self.job.restart_delay_s is not None):
            self._grow_back = outcome == "shrink"
            self.state = AgentState.RESTARTING
            self._restart_at = time.monotonic() + (self.job.restart_delay_s or 0.0)
            self.events(f"machine {machine}: {self.name} restarts {self._ranks_text()} in "
                        f"{self.job.restart_delay_s:g} s", event="restart_scheduled", node=self.node, machine=machine)
        else:
            self.state = AgentState.RETIRED
        self._publish_machine()

    def adopt_lost_machine(self, node: int, silent_s: float) -> None:
        """Agent ``node`` died (its liveness counter stopped): fail the machine it ran, as it would have."""
        t_detected = time.time()
        value = self.store.get(f"launch/machine_of/{node}")
        self.store.add("launch/lost_agents", 1)
        if not value:
            self.events(f"agent {node} is gone (silent for {silent_s:.1f} s); it ran no machine",
                        event="agent_lost", node=self.node, lost_node=node)
            return
        machine = int(value)
        reason = f"machine {machine}: its agent {node} is gone (silent for {silent_s:.1f} s) at {_clock(t_detected)}"
        self.events(f"{self.name} handles the failure of machine {machine} for dead agent {node}",
                    event="agent_lost", node=self.node, lost_node=node, machine=machine)
        self._handle_failure(machine, reason, t_detected, own=False, lost_node=node)

    def _handle_failure(self, machine: int, reason: str, t_detected: float, own: bool, generation: int | None = None,
                        **fields: object) -> str:
        """Declare ``machine``'s failure, then request a spare; returns "spare", "restart" or "abort"."""
        failed_generation, declared = self._declare(reason, generation)
        t_declared = time.time()
        self.control.record_failure_timeline(failed_generation, machine, t_detected, t_declared)
        t_fire = self._injected_kill_time(machine, t_detected)
        latency = ""
        if t_fire is not None:
            fields = {**fields, "kill_to_detected_ms": (t_detected - t_fire) * 1e3,
                      "kill_to_flag_ms": (t_declared - t_fire) * 1e3}
            latency = (f" (injected kill -> seen {fields['kill_to_detected_ms']:.1f} ms, "
                       f"-> gen{failed_generation}/failed {fields['kill_to_flag_ms']:.1f} ms)")
        self.events(
            f"{reason}: generation {failed_generation} failed{'' if declared else ' (already declared)'}{latency}",
            event="failure", node=self.node, machine=machine, generation=failed_generation, declared=declared,
            t_detected=t_detected, t_declared=t_declared, **fields,
        )
        if own:
            self._failed_generation = failed_generation

        fate = self._fate(machine, failed_generation, reason, own)
        self.control.set_fate(failed_generation, machine, fate)
        return fate

    def _fate(self, machine: int, failed_generation: int, reason: str, own: bool) -> str:
        """What becomes of the failed ``machine``: "spare", "restart", "shrink" or "abort"."""
        if self._one_failure_too_many(reason):
            return "abort"
        if self.job.num_spares > 0:
            slot = self.control.take_spare()
            if slot <= self.job.num_spares:
                self.control.request_replacement(slot, machine, failed_generation)
                self.events(f"machine {machine}: spare {slot} of {self.job.num_spares} requested", event="spare_requested",
                            node=self.node, machine=machine, slot=slot)
                return "spare"
        if self.job.elastic:
            left = self.control.remove_machine(machine, self.job.num_machines)
            if left:
                back = (f"; it comes back after {self.job.restart_delay_s:g} s" if own and self.job.restart_delay_s
                        is not None else "")  # fmt: skip
                self.events(f"machine {machine}: no spare left; the job goes on without it on machines {left} "
                            f"(--elastic){back}", event="shrink", node=self.node, machine=machine, machines=left)
                return "shrink"
        if own and self.job.restart_delay_s is not None:
            return "restart"
        why = f"all {self.job.num_spares} spares are in use" if self.job.num_spares else "no spare machines (--spares 0)"
        if not own:
            why += " (a dead agent's machine cannot restart in place)"
        elif self.job.restart_delay_s is None:
            why += " and no --restart-delay"
        self.control.abort(f"{reason}; no replacement: {why}")
        return "abort"

    def _injected_kill_time(self, machine: int, t_detected: float) -> float | None:
        """When an injected fault killed a rank of ``machine`` just before (for the latency line)."""
        times = []
        for i, spec in enumerate(self.job.inject):
            if machine in spec.machines:
                value = self.store.get(f"inject/{i}/t_fire")
                if value is not None and 0 <= t_detected - float(value) < 60:
                    times.append(float(value))
        return max(times) if times else None

    def _give_up(self, reason: str) -> None:
        self.state = AgentState.RETIRED
        self.control.abort(reason)
