"""ds-swift-launch's agent decisions without processes.

These tests drive :class:`MachineAgent` with fake workers (scripted exit codes) against a job store
served in this process, so every branch of the failure handling (spare, restart, abort, max
failures, a generation already failed) is checked in milliseconds. The command line and the
workers' argv and environment are in ``test_launch_args.py``.
"""

from __future__ import annotations

import signal
from pathlib import Path

from ds_swift.launch.args import Command


class FakeWorker:
    _next_pid = 1000

    def __init__(self, wenv) -> None:  # noqa: ANN001
        FakeWorker._next_pid += 1
        self.pid = FakeWorker._next_pid
        self.wenv = wenv
        self.rank = wenv.rank
        self.generation = wenv.generation
        self.rc: int | None = None
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return self.rc

    def signal_group(self, sig: int) -> None:
        self.signals.append(sig)
        if self.rc is None:
            self.rc = -sig


class Cluster:
    """Agents of a simulated job around a store served in this process; spawns are recorded, not run."""

    def __init__(
        self,
        tmp_path: Path,
        machines: int = 2,
        nproc: int = 2,
        spares: int = 0,
        restart_delay: float | None = None,
        max_failures: int = 3,
    ) -> None:
        from ds_swift.jobstore.membership import JobStore
        from ds_swift.launch.agent import JobSpec, MachineAgent
        from ds_swift.launch.control import EventLog, JobControl

        self.store = JobStore.host("tok", port=0)
        self.control = JobControl(self.store)
        self.job = JobSpec(
            Command("t.py"),
            machines,
            nproc,
            spares,
            max_failures,
            restart_delay,
            "127.0.0.1",
            self.store.port,
            "tok",
            str(tmp_path),
        )
        self.spawned: list[FakeWorker] = []
        events = EventLog(str(tmp_path))
        self.agents = [
            MachineAgent(n, self.job, self.store, events, spawn=self._spawn) for n in range(machines + spares)
        ]
        for agent in self.agents:
            agent.start()

    def _spawn(self, command: Command, wenv, nproc: int, op_timeout: float | None) -> FakeWorker:  # noqa: ANN001
        worker = FakeWorker(wenv)
        self.spawned.append(worker)
        return worker

    def step(self) -> None:
        for agent in self.agents:
            agent.tick()
        for agent in self.agents:
            agent.poll_store()

    def worker(self, rank: int) -> FakeWorker:
        return [w for w in self.spawned if w.rank == rank][-1]


def test_a_dead_rank_fails_its_machine_and_a_spare_takes_over(tmp_path: Path) -> None:
    from ds_swift.launch.agent import AgentState

    c = Cluster(tmp_path, spares=1)
    assert [w.rank for w in c.spawned] == [0, 1, 2, 3]
    c.worker(3).rc = -signal.SIGKILL
    c.step()
    assert c.spawned[2].signals == [signal.SIGKILL]  # its sibling goes down with the machine
    assert c.agents[1].state is AgentState.RETIRED and c.agents[2].state is AgentState.RUNNING
    assert c.store.generation() == 1
    assert "machine 1: rank 3 killed by SIGKILL" in (c.store.failure(0) or "")
    new = c.spawned[4:]
    assert [(w.rank, w.wenv.machine, w.wenv.generation, w.wenv.replacement) for w in new] == [
        (2, 1, 1, True),
        (3, 1, 1, True),
    ]
    assert c.store.get("gen0/failed_machine") == "1"
    t = [float(c.store.get(f"gen0/t/{k}") or 0) for k in ("detected", "declared", "replacement_spawned")]
    assert 0 < t[0] <= t[1] <= t[2]
    assert c.worker(0).signals == []  # survivors are untouched
    assert c.control.abort_reason() is None


def test_a_replacement_left_behind_by_its_failed_generation_starts_again_in_place(tmp_path: Path) -> None:
    """The survivors gave up on generation 1 while the replacement was still starting (found by the
    fault matrix: a slow start under load); the replacement then dies on its half-formed groups.
    Its machine is sound: its ranks start again, in generation 2, on the same agent, no spare."""
    from ds_swift.launch.agent import AgentState

    c = Cluster(tmp_path, spares=1)
    c.worker(3).rc = -signal.SIGKILL
    c.step()
    assert [(w.rank, w.generation) for w in c.spawned[4:]] == [(2, 1), (3, 1)]
    c.store.declare_failure(1, "rank 0: failed during recovery: wait timeout")
    c.worker(2).rc = 1
    c.step()
    again = c.spawned[6:]
    assert [(w.rank, w.wenv.generation, w.wenv.replacement) for w in again] == [(2, 2, True), (3, 2, True)]
    assert c.spawned[5].signals == [signal.SIGKILL]  # the half-started sibling goes
    assert c.store.failure(2) is None and c.store.generation() == 2
    assert c.agents[2].state is AgentState.RUNNING and c.control.abort_reason() is None
    # An error exit of ranks whose generation is healthy is a machine failure, as before.
    c.store.set("gen2/joined/0", "1")  # the survivors are in generation 2
    c.worker(3).rc = 1
    c.step()
    assert "machine 1: rank 3 exited with code 1" in (c.store.failure(2) or "")


def test_no_replacement_aborts_with_the_reason(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    c.worker(1).rc = 1
    c.step()
    reason = c.control.abort_reason() or ""
    assert "machine 0: rank 1 exited with code 1" in reason and "no spare machines (--spares 0)" in reason


def test_restart_on_the_same_agent_after_the_delay(tmp_path: Path) -> None:
    from ds_swift.launch.agent import AgentState

    c = Cluster(tmp_path, restart_delay=0.0)
    c.worker(0).rc = -signal.SIGSEGV
    c.step()
    assert c.agents[0].state in (AgentState.RESTARTING, AgentState.RUNNING)
    c.step()
    assert c.agents[0].state is AgentState.RUNNING
    assert [(w.rank, w.wenv.generation, w.wenv.replacement) for w in c.spawned[4:]] == [(0, 1, True), (1, 1, True)]


def test_spares_first_then_restart_then_max_failures(tmp_path: Path) -> None:
    c = Cluster(tmp_path, machines=2, nproc=1, spares=1, restart_delay=0.0, max_failures=2)
    c.worker(1).rc = -9  # failure 1: the spare (agent 2) takes machine 1
    c.step()
    assert c.agents[2].machine == 1 and c.spawned[-1].wenv.generation == 1
    c.store.set("gen1/joined/0", "1")  # generation 1 formed
    c.worker(1).rc = -9  # failure 2: no spare left, agent 2 restarts it
    c.step()
    c.step()
    assert c.store.generation() == 2 and c.spawned[-1].wenv.generation == 2 and c.control.abort_reason() is None
    c.store.set("gen2/joined/0", "1")
    c.worker(0).rc = -9  # failure 3 > --max-failures 2
    c.step()
    assert "failure 3, more than --max-failures 2" in (c.control.abort_reason() or "")


def test_a_generation_nobody_joined_yet_is_not_failed_again(tmp_path: Path) -> None:
    c = Cluster(tmp_path, spares=2)
    c.store.declare_failure(0, "a survivor saw the broken connection first")
    c.worker(2).rc = -9
    c.step()
    # Nobody joined generation 1: machine 1's ranks are not in it, so it stays open for the replacement.
    assert c.store.generation() == 1 and c.store.failure(1) is None
    assert c.store.get("gen0/failed_machine") == "1"
    # Once ranks joined generation 1, a death there fails it.
    c.store.set("gen1/joined/0", "1")
    c.worker(0).rc = -9
    c.step()
    assert c.store.generation() == 2 and "machine 0" in (c.store.failure(1) or "")


def test_all_ranks_exiting_zero_marks_the_machine_done(tmp_path: Path) -> None:
    from ds_swift.launch.agent import AgentState

    c = Cluster(tmp_path, spares=1)
    c.worker(0).rc = 0
    c.step()
    assert c.agents[0].state is AgentState.RUNNING  # rank 1 still runs
    c.worker(1).rc = 0
    for r in (2, 3):
        c.worker(r).rc = 0
    c.step()
    assert c.control.all_done(2) and c.agents[0].state is AgentState.DONE
    assert c.agents[2].state is AgentState.SPARE


def test_a_request_is_claimed_by_one_spare_only(tmp_path: Path) -> None:
    c = Cluster(tmp_path, machines=1, nproc=1, spares=3)
    c.worker(0).rc = -9
    c.step()
    owners = [a.node for a in c.agents if a.machine == 0 and a.workers]
    assert len(owners) == 1 and owners[0] in (1, 2, 3)
    assert len(c.spawned) == 2


# ---------------------------------------------------------------------- the job's own error or the machine's
def _record(c: Cluster, rank: int, exc: BaseException, early: bool) -> None:
    from ds_swift.detect.job_error import record_job_error

    record_job_error(c.store, c.store.generation(), rank, exc, early=early)


def test_the_same_error_on_every_machine_before_the_first_step_ends_the_job_and_takes_no_spare(
    tmp_path: Path,
) -> None:
    """The example's fp16 config on an accelerator that refuses fp16: every rank raises in
    deepspeed.initialize. Each exit was a machine failure: both spares went, then "no replacement"."""
    c = Cluster(tmp_path, spares=2)
    for rank in range(4):
        _record(c, rank, ValueError("Type fp16 is not supported on your device."), early=True)
        c.worker(rank).rc = 1
    c.step()
    reason = c.control.abort_reason() or ""
    assert "raised ValueError: Type fp16 is not supported on your device." in reason, reason
    assert "the job's own error, not a machine failure" in reason, reason
    assert c.control.take_spare() == 1  # no spare was taken before
    assert c.store.failure(0) is None and len(c.spawned) == 4


def test_a_rank_that_exits_after_a_peers_own_error_is_not_a_machine_failure(tmp_path: Path) -> None:
    c = Cluster(tmp_path, spares=1)
    _record(c, 0, KeyError("tokens"), early=False)  # machine 0's rank 0: the job's own error
    c.worker(3).rc = 1  # machine 1's rank 3 failed on the connection rank 0 closed, and exited first
    c.step()
    assert c.store.failure(0) is None and len(c.spawned) == 4, c.store.failure(0)


def test_a_device_error_on_one_machine_after_the_first_step_is_that_machines_fault(tmp_path: Path) -> None:
    from ds_swift.launch.agent import AgentState

    c = Cluster(tmp_path, spares=2)
    ecc = RuntimeError("CUDA error: uncorrectable ECC error encountered")
    _record(c, 3, ecc, early=False)
    c.worker(3).rc = 1
    c.step()
    assert c.control.abort_reason() is None and c.store.generation() == 1
    assert c.agents[2].state is AgentState.RUNNING  # a spare took machine 1 over
    # Its replacement meets the same error: two machines broke alike, so it is the job's.
    _record(c, 3, RuntimeError("CUDA error: uncorrectable ECC error encountered"), early=False)
    c.worker(3).rc = 1
    c.step()
    reason = c.control.abort_reason() or ""
    assert "the same error on the machines of agents [2, 1]" in reason, reason


def test_a_device_error_before_the_first_step_or_a_device_side_assert_is_the_jobs(tmp_path: Path) -> None:
    c = Cluster(tmp_path, spares=1)
    _record(c, 1, RuntimeError("CUDA error: device-side assert triggered"), early=False)
    c.worker(1).rc = 1
    c.step()
    assert "device-side assert" in (c.control.abort_reason() or "")
    c2 = Cluster(tmp_path / "2", spares=1)
    _record(c2, 1, RuntimeError("CUDA error: an illegal memory access was encountered"), early=True)
    c2.worker(1).rc = 1
    c2.step()
    assert "illegal memory access" in (c2.control.abort_reason() or "")
