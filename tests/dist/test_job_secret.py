"""The job secret through the real launcher: a forged failure flag is rejected and the job trains on.

A client that reaches the job store but lacks the secret writes ``gen0/failed``: once where the
job's keys would be without a secret, and once inside the real namespace (as an etcd client that
listed it could). Every rank must read and reject it, no recovery may start, and the job ends at
its last iteration in generation 0. Meanwhile no process of the job has the secret on its command
line.
"""

from __future__ import annotations

import datetime
import subprocess
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from ds_swift.jobstore.auth import write_secret_file
from ds_swift.jobstore.membership import JobStore, MembershipError
from ds_swift.testing.jobs import JobRun, JobSpec, run_job
from ds_swift.testing.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "gpt_tiny_pp2_dp2_bf16_zero1.json"
SECRET = "job-secret-for-the-forgery-test-" + "7" * 8
TOKEN = "forgery-test"
ITERS = 12

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


class Intruder:
    """Polled by run_job: forges the failure flag as soon as the store is up; looks for the secret in argv."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.forged = False
        self.argv_leaks: list[str] = []
        self.looked_at = 0.0

    def __call__(self, job: JobRun) -> None:
        # Every process of the job lives for most of it: a look a second sees each one many times,
        # at a fifth of the CPU that a `ps` at every poll (0.2 s) took from the job's ranks.
        if time.monotonic() - self.looked_at >= 1.0:
            self.looked_at = time.monotonic()
            ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=False).stdout
            self.argv_leaks += [line for line in ps.splitlines() if SECRET in line]
        if self.forged:
            return
        try:  # the job's own client (the test knows the secret) only to learn where the keys are
            js = JobStore.connect("127.0.0.1", self.port, TOKEN, timeout_s=2, secret=SECRET)
        except MembershipError:
            return  # the launcher has not opened the store yet
        raw = dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=datetime.timedelta(seconds=10))
        dist.PrefixStore(f"swift/{TOKEN}", raw).set("gen0/failed", "INTRUDER-REASON")
        dist.PrefixStore(js.prefix.rstrip("/"), raw).set("gen0/failed", "INTRUDER-REASON")
        self.forged = True


def test_a_failure_flag_forged_without_the_secret_is_rejected_and_training_goes_on(tmp_path: Path) -> None:
    secret_file = tmp_path / "job.secret"
    write_secret_file(str(secret_file), SECRET)
    port = free_port()
    launcher_args = [
        "--spares",
        "1",
        "--master_port",
        str(port),
        "--job-token",
        TOKEN,
        "--job-secret-file",
        str(secret_file),
    ]
    intruder = Intruder(port)
    spec = JobSpec(ROOT / "examples" / "pretrain_gpt.py", CONFIG, ITERS, launcher_args)
    job = run_job(tmp_path / "job", spec, timeout_s=200.0, on_poll=intruder)
    assert intruder.forged, "the store never came up while the job ran"
    assert job.code == 0, job.output[-6000:]
    assert "rejected a write to job-store key 'gen0/failed'" in job.output, job.output[-6000:]
    assert job.timelines() == [], "a forged flag started a recovery"
    assert "INTRUDER-REASON" not in job.output  # never taken for a reason
    assert job.final_tag.is_dir(), job.output[-3000:]
    assert intruder.argv_leaks == []
