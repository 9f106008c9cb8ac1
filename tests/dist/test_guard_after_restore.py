"""The post-recovery guard through the launcher (issue 30 item 7), in the configuration users run
(bf16 + ZeRO-1, pp 2 x dp 2): a machine is SIGKILLed and recovered from buddy copies; two iterations
later the loss turns NaN (injected into the reported loss by tests/dist/workers/gpt_fault_worker.py).
Every rank steps back to the global checkpoint, once, loudly; the job trains on from there and ends
bitwise equal to the failure-free run."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds_swift.testing.checkpoints import checkpoint_tensors, compare_tensors
from ds_swift.testing.jobs import JobRun, JobSpec, run_job

ROOT = Path(__file__).resolve().parents[2]
FAULT_WORKER = Path(__file__).parent / "workers" / "gpt_fault_worker.py"
BF16 = ROOT / "configs" / "gpt_tiny_pp2_dp2_bf16_zero1.json"
ITERS = 12

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


def test_a_nan_after_a_restore_steps_every_rank_back_to_the_checkpoint_once(
    tmp_path: Path, bf16_baseline: JobRun
) -> None:
    # Checkpoints every 5 iterations (the config): global_step5 is complete before the kill in 6.
    spec = JobSpec(
        FAULT_WORKER,
        BF16,
        ITERS,
        ["--spares", "1", "--inject", "machine=1,iteration=6,phase=backward"],
        nnodes=2,
        nproc_per_node=2,
        loss_log=True,
        env={"SWIFT_TEST_NAN_LOSS": "rank=1,iteration=8"},
    )
    job = run_job(tmp_path, spec, 180.0)
    assert job.code == 0, job.output[-6000:]
    assert job.output.count("[test] rank 1: NaN loss at iteration 8") == 1, job.output[-6000:]
    first, back = job.timelines()  # the machine's recovery, then the guard's step back
    assert first["strategy"] != "checkpoint", first["reason"]
    assert back["strategy"] == "checkpoint" and back["checkpoint_step"] == 5, back
    assert back["reason"].startswith("post-recovery guard: iteration 8") and "the guard's step back" in back["reason"]
    tripped = [line for line in job.output.splitlines() if "POST-RECOVERY GUARD TRIPPED" in line]
    assert len(tripped) == 4 and all("iteration 8" in t and "the loss is nan" in t for t in tripped), tripped
    assert "EVERY RANK STEPS BACK TO THE GLOBAL CHECKPOINT" in tripped[0]
    assert "TRIPPED AGAIN" not in job.output
    diff = compare_tensors(checkpoint_tensors(bf16_baseline.final_tag), checkpoint_tensors(job.final_tag))
    assert diff.bitwise_equal, diff.describe()
