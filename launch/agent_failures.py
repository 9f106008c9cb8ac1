"""How an agent reacts when its machine's ranks stop (a mixin of :class:`.agent.MachineAgent`,
which owns the state named below).

A health problem (a failing GPU, a hung rank: :mod:`.health`) or a non-zero exit fails the whole
machine: the other local ranks are SIGKILLed, as a crash would, and :mod:`.fate` decides among
spare, shrink, restart and abort. Not a machine failure: a rank that raised the job's own error,
or that exited after another rank's (the job ends; how a device error on one machine is told from
the job's own: ds_swift.detect.job_error), and replacement ranks left behind by a generation that
failed before they joined (they start again here). A machine killed with an injected group is
declared once the group is down.
"""

from __future__ import annotations

import enum
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ds_swift.detect.job_error import JobErrorRecord, job_error, rank_error_key

from .spawn import Worker, describe_exit

if TYPE_CHECKING:
    from ds_swift.jobstore.membership import JobStore

    from .control import EventLog, JobControl
    from .fate import MachineFate
    from .health import MachineHealth
    from .inject_group import GroupKill, PendingFailure
    from .job import JobSpec

__all__ = ["AgentState", "FailureHandling"]


class AgentState(enum.Enum):
    SPARE = "spare"  # waiting for a machine to take over
    RUNNING = "running"  # its machine's ranks are up
    RESTARTING = "restarting"  # its machine failed; ranks restart after --restart-delay
    RETIRED = "retired"  # its machine failed and went to a spare (or the job gave up)
    DONE = "done"  # every rank of its machine exited 0


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


class FailureHandling:
    """The agent's checks of its ranks, and what follows a machine failure."""

    # Set by MachineAgent.__init__ (annotations only).
    node: int
    job: JobSpec
    store: JobStore
    control: JobControl
    events: EventLog
    machine: int | None
    state: AgentState
    workers: list[Worker]
    _dying: list[Worker]
    _restart_at: float
    _grow_back: bool
    _failed_generation: int
    _groups: GroupKill
    _health: MachineHealth
    _fates: MachineFate
    _pending: PendingFailure | None
    _spawn_generation: int
    _spawned_replacements: bool
    _publish_machine: Callable[[], None]
    _ranks_text: Callable[[], str]
    _spawn_replacement: Callable[[], None]

    if TYPE_CHECKING:

        @property
        def name(self) -> str: ...

    def _check_workers(self) -> None:
        if not self.workers:
            return
        problem = self._health.problem(self.name, self.machine, self._spawn_generation, self.workers)
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
            self.events(
                f"machine {self.machine}: {self._ranks_text()} exited 0",
                event="machine_done",
                node=self.node,
                machine=self.machine,
            )

    def _own_error(self, worker: Worker, returncode: int) -> bool:
        """The rank exited on the job's own error (it said so in the store before exiting: a bug, a
        config the job cannot run, not a dead machine; ds_swift.detect.job_error): the job ends with
        it, as it would without ds-swift; replacing the machine would only run into the same error
        again, spending the spares. Also True for a rank that exited on a connection another rank's
        own error closed. False for a crash, and for a device error after the first step on this
        machine alone: the machine's fault."""
        if returncode <= 0:
            return False
        said = self.store.get(rank_error_key(worker.rank))
        if said is None:
            # No error of its own: a peer's own error may have closed its connections (recorded
            # before that peer exited, so before this rank could fail on it).
            generation = self.store.generation()
            first = job_error(self.store, generation)
            if first is None:
                return False
            self.events(
                f"machine {self.machine}: rank {worker.rank} {describe_exit(returncode)} after {first} ended "
                f"generation {generation}: not a machine failure",
                event="job_error_followed",
                node=self.node,
                machine=self.machine,
            )
            self.state = AgentState.RETIRED
            self._publish_machine()
            return True
        record = JobErrorRecord.parse(said)
        elsewhere = self._same_error_elsewhere(record) if record.sig else []
        if record.machines_fault and not elsewhere:
            self.store.delete(rank_error_key(worker.rank))  # acted on: a later exit of this rank is its own
            self.events(
                f"machine {self.machine}: {record.what}: a device error after the generation's first step, on this "
                "machine alone: taken for the machine's fault (the same error on another machine would end the job)",
                event="device_error",
                node=self.node,
                machine=self.machine,
            )
            return False
        why = "the job's own error, not a machine failure"
        if elsewhere:
            why = f"the same error on the machines of agents {[self.node, *elsewhere]}: the job's own, not a machine failure"
        self.control.abort(f"machine {self.machine}: {record.what} ({why})")
        self.state = AgentState.RETIRED
        self._publish_machine()
        return True

    def _same_error_elsewhere(self, record: JobErrorRecord) -> list[int]:
        """The other agents whose machines' ranks raised an error of ``record``'s signature (in any
        generation): each agent says its own, then looks at every other's (two agents doing so at
        once: the later one sees both). One read per agent: this runs once per failure."""
        key = f"job_error/sig/{record.sig}/agent"
        self.store.set(f"{key}{self.node}", "1")
        agents = range(self.job.num_machines + self.job.num_spares)
        return [n for n in agents if n != self.node and self.store.get(f"{key}{n}") is not None]

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
        reason = (
            f"machine {self.machine}: replacement rank {worker.rank} {describe_exit(returncode)} after its "
            f"generation {worker.generation} failed without it"
        )
        if self._fates.one_too_many(reason):
            self.state = AgentState.RETIRED
            return True
        self.events(
            f"{reason}: its ranks start again in generation {current}",
            event="replacement_restarted",
            node=self.node,
            machine=self.machine,
            generation=current,
            rank=worker.rank,
        )
        self._spawn_replacement()
        return True

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
        self._pending = self._groups.pending(
            index, generation, worker.rank, returncode, t_detected, what if what == group else f"{what} ({group})"
        )
        self._groups.down(self._pending)
        self.events(
            f"machine {self.machine}: down with {self._groups.describe(index)}; its failure is declared "
            "once the whole group is down",
            event="group_down",
            node=self.node,
            machine=self.machine,
            index=index,
            generation=generation,
        )

    def _fail_machine(
        self, rank: int, returncode: int, t_detected: float, why: str | None = None, generation: int | None = None
    ) -> None:
        machine = self.machine
        assert machine is not None
        what = why if why is not None else f"rank {rank} {describe_exit(returncode)}"
        reason = f"machine {machine}: {what} at {_clock(t_detected)}"
        outcome, self._failed_generation = self._fates.handle(
            machine, reason, t_detected, own=True, rank=rank, returncode=returncode, generation=generation
        )
        if outcome == "restart" or (outcome == "shrink" and self.job.restart_delay_s is not None):
            self._grow_back = outcome == "shrink"
            self.state = AgentState.RESTARTING
            self._restart_at = time.monotonic() + (self.job.restart_delay_s or 0.0)
            self.events(
                f"machine {machine}: {self.name} restarts {self._ranks_text()} in {self.job.restart_delay_s:g} s",
                event="restart_scheduled",
                node=self.node,
                machine=machine,
            )
        else:
            self.state = AgentState.RETIRED
        self._publish_machine()

    def adopt_lost_machine(self, node: int, silent_s: float) -> None:
        """Agent ``node`` died (its liveness counter stopped): fail the machine it ran, as it would have."""
        t_detected = time.time()
        value = self.store.get(f"launch/machine_of/{node}")
        self.store.add("launch/lost_agents", 1)
        if not value:
            self.events(
                f"agent {node} is gone (silent for {silent_s:.1f} s); it ran no machine",
                event="agent_lost",
                node=self.node,
                lost_node=node,
            )
            return
        machine = int(value)
        reason = f"machine {machine}: its agent {node} is gone (silent for {silent_s:.1f} s) at {_clock(t_detected)}"
        self.events(
            f"{self.name} handles the failure of machine {machine} for dead agent {node}",
            event="agent_lost",
            node=self.node,
            lost_node=node,
            machine=machine,
        )
        self._fates.handle(machine, reason, t_detected, own=False, lost_node=node)

    def _give_up(self, reason: str) -> None:
        self.state = AgentState.RETIRED
        self.control.abort(reason)
