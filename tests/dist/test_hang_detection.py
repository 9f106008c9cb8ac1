"""Hang detection (issue 15), through ds-swift-launch with real processes: a hung worker is a failed
machine. bf16 + ZeRO-1, pp 2 x dp 2 on 2 machines plus a spare (configs/gpt_tiny_pp2_dp2_bf16_zero1.json).

- stopped: rank 2 is SIGSTOPped mid-run (alive, not dead: no exit for its agent to see). Its
  heartbeat stops; a watching peer names it and its last instruction, its agent kills machine 1,
  the spare takes over, and the job ends bitwise equal to the failure-free run (or, where the stop
  caught a buddy copy one step behind and the survivors undid a step, resumes within 2 ulp of it);
- stalled: rank 2's training thread blocks before its gradient all-reduce (its watchdog thread
  keeps heartbeating). Its peers' ops time out and wait; after ``watchdog.hang_timeout_s`` without
  progress its own watchdog declares it hung, and the machine is replaced the same way.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from ds_swift.testing.checkpoints import Baseline, checkpoint_tensors, compare_tensors, undo_ulp
from ds_swift.testing.jobs import JobRun, JobSpec, run_job

ROOT = Path(__file__).resolve().parents[2]
FAULT_WORKER = Path(__file__).parent / "workers" / "gpt_fault_worker.py"
BF16 = ROOT / "configs" / "gpt_tiny_pp2_dp2_bf16_zero1.json"
ITERS = 12  # as the shared failure-free run (tests/dist/conftest.py's bf16_baseline)
JOB_DEADLINE_S = 240.0
#: short timeouts, so that the test waits seconds, not minutes; not so short that a loaded 2-core
#: machine's slow rebuild after the recovery times out (an op timeout of 4 s did, once). The stalled
#: rank is declared hung by its own watchdog after the hang timeout, its peers' ops time out first.
WATCHDOG = {"heartbeat_timeout_s": 5.0, "op_timeout_s": 10.0, "hang_timeout_s": 14.0}

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


def launch(tmp: Path, env: dict[str, str] | None = None, on_poll=None) -> JobRun:  # type: ignore[no-untyped-def]
    spec = JobSpec(
        FAULT_WORKER, BF16, ITERS, ["--spares", "1"], swift={"watchdog": WATCHDOG}, env=env or {}, loss_log=True
    )
    return run_job(tmp, spec, JOB_DEADLINE_S, on_poll=on_poll)


def assert_recovered(reference: Baseline, job: JobRun, tl: dict[str, Any], dump: Path) -> None:
    """Bitwise equal to the failure-free run; where survivors undid a step (a buddy copy was one step
    behind when the machine stopped), the resumed state within 2 ulp (the update-undo guarantee)."""
    if tl["undo_ranks"]:
        ulp = undo_ulp(reference, dump / "recovered_gen1", tl["consensus"])
        print(f"ranks {tl['undo_ranks']} undid a step: resumed state within {ulp} ulp of the failure-free run")
        assert ulp <= 2
        return
    diff = compare_tensors(reference.final, checkpoint_tensors(job.final_tag))
    assert diff.bitwise_equal, diff.describe()


@pytest.fixture(scope="module")
def reference(bf16_baseline: JobRun) -> Baseline:
    """The shared failure-free run (tests/dist/conftest.py: the example itself, which the fault worker
    runs unchanged without faults; a checkpoint after every iteration, for the undo check)."""
    assert bf16_baseline.iterations == ITERS
    return Baseline(checkpoint_tensors(bf16_baseline.final_tag), bf16_baseline.ckpt_dir)


class StopRank:
    """on_poll: once the job has trained ``after`` iterations, SIGSTOP ``rank`` (its pid from the
    launcher's "started" line); remembers the pid to SIGKILL it whatever happens."""

    def __init__(self, rank: int, machine: int, after: int) -> None:
        self.rank, self.machine, self.after = rank, machine, after
        self.pid: int | None = None

    def __call__(self, job: JobRun) -> None:
        if self.pid is not None or not job.loss_log.exists():
            return
        trained = len(job.loss_log.read_text().splitlines())
        log = job.proc_logs / "launcher.log"
        started = re.search(
            rf"machine {self.machine}: ranks (\d+)\.\.\d+ started by agent \d+ \(pids ([\d ]+)\)",
            log.read_text(errors="replace") if log.exists() else "",
        )
        if trained < self.after or started is None:
            return
        self.pid = int(started.group(2).split()[self.rank - int(started.group(1))])
        os.kill(self.pid, signal.SIGSTOP)

    def kill(self) -> None:
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_stopped_worker_is_a_failed_machine(tmp_path: Path, reference: Baseline) -> None:
    stop = StopRank(rank=2, machine=1, after=4)
    dump = tmp_path / "recovered"
    try:
        job = launch(tmp_path, on_poll=stop, env={"SWIFT_TEST_DUMP_DIR": str(dump)})
    finally:
        stop.kill()
    assert stop.pid is not None, "the job ended before rank 2 was stopped"
    assert job.code == 0, job.output[-8000:]
    # The note is rank 2's last heartbeat (every 0.5 s here): where its training thread was then. Four
    # iterations can take less than a beat, so that may still be its start-up (iteration -1).
    hung = re.search(
        r"machine 1: hung \(rank 2: no heartbeat for [\d.]+ s, last in ([\w-]+) of iteration (-?\d+)", job.output
    )
    assert hung, job.output[-6000:]
    (tl,) = job.timelines()
    assert tl["failed_machine"] == 1 and tl["strategy"] == "buddy", tl["reason"]
    assert_recovered(reference, job, tl, dump)


def test_a_stalled_training_thread_is_declared_hung_by_its_own_watchdog(tmp_path: Path, reference: Baseline) -> None:
    dump = tmp_path / "recovered"
    job = launch(tmp_path, env={"SWIFT_TEST_STALL": "rank=2,iteration=5", "SWIFT_TEST_DUMP_DIR": str(dump)})
    assert job.code == 0, job.output[-8000:]
    hung = re.search(
        r"machine 1: hung \(rank 2 hung: no progress for [\d.]+ s in (\w+) of iteration 5 "
        r"\(watchdog.hang_timeout_s=14\)",
        job.output,
    )
    assert hung, job.output[-6000:]
    (tl,) = job.timelines()
    assert tl["failed_machine"] == 1, tl
    assert "not a machine failure" not in job.output  # the peers' timed-out ops waited for the verdict
    assert_recovered(reference, job, tl, dump)
