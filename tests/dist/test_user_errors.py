"""A user's ordinary error that reads like a comm error is the user's error, not a machine
failure (issue 16), through ds-swift-launch with real processes, bf16 + ZeRO-1.

Rank 0's model raises ``RuntimeError("... gloo ... timed out (NCCL ...)")`` in training: no
failure flag is set and every rank heartbeats, so rank 0 raises it as the job's own error (with a
note saying so) after the heartbeat timeout instead of starting a recovery for it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ds_swift.testing.jobs import JobSpec, run_job

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "workers" / "user_error_worker.py"
BF16 = ROOT / "configs" / "gpt_tiny_pp2_dp2_bf16_zero1.json"
SWIFT = {"watchdog": {"heartbeat_timeout_s": 2.0, "op_timeout_s": 30.0, "hang_timeout_s": None}}

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def test_a_users_runtime_error_mentioning_gloo_is_raised_as_its_own(tmp_path: Path, warm_deepspeed: None) -> None:
    env = {"USER_ERROR_RANK": "0", "USER_ERROR_FORWARD": "150"}
    job = run_job(tmp_path, JobSpec(WORKER, BF16, 6, [], swift=SWIFT, env=env, nproc_per_node=2), 240.0)
    assert job.code != 0, job.output[-4000:]
    assert "RuntimeError: user layer: gloo all-reduce of my custom metric timed out" in job.output, job.output[-6000:]
    assert "not a machine failure (no failure declared and every rank heartbeating" in job.output, job.output[-6000:]
    assert "raised as the job's own error" in job.output
    assert "comm error, failure declared: user layer" not in job.output, job.output[-6000:]
    assert not job.timelines(), job.output[-4000:]  # no recovery ran for it


def test_a_strategy_the_layout_cannot_serve_ends_the_job_at_start_naming_it(
    tmp_path: Path, warm_deepspeed: None
) -> None:
    """strategy "logging" on pp 2 x dp 2 with each replica's stages on one machine (rank order
    tp-pp-dp): no send to log. Every rank refuses it once its engine is built (the launcher cannot
    know the engine's topology), it was a warning and a job without logging before; the launcher
    ends the job with the reason, no spare takes a machine over."""
    job = run_job(
        tmp_path,
        JobSpec(ROOT / "examples" / "pretrain_gpt.py", BF16, 3, ["--spares", "1"], swift={"strategy": "logging"}),
        240.0,
    )
    assert job.code != 0, job.output[-4000:]
    said = [line for line in job.output.splitlines() if "job failed:" in line]
    assert len(said) == 1 and "raised ConfigError: swift config: strategy='logging' is impossible" in said[0], said
    assert "(the job's own error, not a machine failure)" in said[0], said
    assert "takes over machine" not in job.output and not job.timelines(), job.output[-4000:]


def test_an_error_every_rank_raises_before_the_first_step_ends_the_job_and_takes_no_spare(
    tmp_path: Path, warm_deepspeed: None
) -> None:
    """Issue 52's example: an fp16 config on a host whose DeepSpeed accelerator refuses fp16 (the CPU
    accelerator here, without the tests' SWIFT_TEST_CPU_FP16): every rank raises ValueError in
    deepspeed.initialize, outside ds-swift's calls. Each exit was taken for a machine failure: both
    spares took both machines over, failed alike, and the job ended with "no replacement: all 2
    spares are in use", the real error buried in the log."""
    fp16 = ROOT / "configs" / "gpt_tiny_pp2_dp2_fp16_zero1.json"
    job = run_job(tmp_path, JobSpec(ROOT / "examples" / "pretrain_gpt.py", fp16, 3, ["--spares", "2"]), 240.0)
    assert job.code != 0, job.output[-4000:]
    said = [line for line in job.output.splitlines() if "job failed:" in line]
    assert len(said) == 1 and "raised ValueError: Type fp16 is not supported" in said[0], job.output[-6000:]
    assert "the job's own error, not a machine failure" in said[0], said
    assert "spare" not in said[0] and "requested" not in job.output, job.output[-6000:]
    assert job.output.rstrip().splitlines()[-1] == said[0], job.output[-2000:]  # the job's last line
