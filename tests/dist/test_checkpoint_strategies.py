"""Checkpoint-reload strategies through the real launcher, in the configuration users run
(bf16 + ZeRO-1, pp 2 x dp 2): ``global_checkpoint`` (asynchronous saves) and ``checkfreq``
(asynchronous saves at the interval CheckFreq's rule chooses). A machine is SIGKILLed; every rank
reloads the last *complete* checkpoint, and the job ends bitwise equal to a failure-free run.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from ds_swift.checkpoint import COMPLETE_MARKER, complete_checkpoints
from ds_swift.testing.checkpoints import checkpoint_tensors, compare_tensors
from ds_swift.testing.jobs import JobRun, JobSpec, run_job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"
BF16 = ROOT / "configs" / "gpt_tiny_pp2_dp2_bf16_zero1.json"
ITERS = 12

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


def launch(tmp: Path, launcher_args: list[str], swift: dict[str, Any] | None = None) -> JobRun:
    return run_job(tmp, JobSpec(EXAMPLE, BF16, ITERS, launcher_args, swift=swift or {}), 180.0)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory, warm_deepspeed: None) -> JobRun:
    run = launch(tmp_path_factory.mktemp("baseline"), [])
    assert run.code == 0 and not run.timelines(), run.output[-6000:]
    return run


def one_checkpoint_recovery(job: JobRun) -> dict[str, Any]:
    assert job.code == 0, job.output[-6000:]
    (tl,) = job.timelines()
    assert tl["strategy"] == "checkpoint", tl["reason"]
    assert "could not be written" not in job.output and "does not count" not in job.output
    return tl


def assert_bitwise(baseline: JobRun, job: JobRun) -> None:
    diff = compare_tensors(checkpoint_tensors(baseline.final_tag), checkpoint_tensors(job.final_tag))
    assert diff.bitwise_equal, diff.describe()


def test_global_checkpoint_saves_asynchronously_and_reloads_the_last_complete_one(
    tmp_path: Path, baseline: JobRun
) -> None:
    swift = {"strategy": "global_checkpoint", "checkpoint": {"interval": 3}}
    job = launch(tmp_path, ["--spares", "1", "--inject", "machine=1,iteration=8,phase=backward"], swift)
    tl = one_checkpoint_recovery(job)
    # The newest checkpoint complete by the kill: after 6 iterations, or 3 if 6 was still being written.
    assert tl["checkpoint_step"] in (3, 6), tl
    assert f"loading global_step{tl['checkpoint_step']}" in job.output
    # Every checkpoint the job wrote completed: every rank's persisted marker, then rank 0's.
    assert [done for done, _ in complete_checkpoints(job.ckpt_dir)] == [3, 6, 9, 12]
    tag = job.ckpt_dir / "global_step12"
    assert len(list(tag.glob("swift_persisted.*.rank*"))) == 4 and (tag / COMPLETE_MARKER).exists()
    assert (job.ckpt_dir / "latest").read_text() == "global_step12"
    assert_bitwise(baseline, job)


def test_checkfreq_chooses_its_interval_and_recovers_bitwise(tmp_path: Path, baseline: JobRun) -> None:
    swift = {"strategy": "checkfreq", "checkfreq": {"profile_at": 3, "max_overhead": 0.5}}
    job = launch(tmp_path, ["--spares", "1", "--inject", "machine=1,iteration=9,phase=backward"], swift)
    chosen = re.search(r"checkfreq: snapshot .* a checkpoint every (\d+) iterations", job.output)
    assert chosen, job.output[-4000:]
    k = int(chosen.group(1))
    tl = one_checkpoint_recovery(job)
    assert tl["checkpoint_step"] is not None and tl["checkpoint_step"] >= 3, tl
    # The profiling checkpoint, then every k iterations, on every rank (the replacements included).
    expected = [3] + [i for i in range(4, ITERS + 1) if i % k == 0]
    assert [done for done, _ in complete_checkpoints(job.ckpt_dir)] == expected
    assert_bitwise(baseline, job)
