"""TranLogs' per-stage mix at runtime (issue 34, item 1), through ds-swift-launch with real processes
and a real SIGKILL, in the configuration users run: bf16 + ZeRO-1 (BF16_Optimizer), clipping, an LR
schedule (``configs/gpt_tiny_pp2_dp2_bf16_zero1.json``), pp 2 x dp 2 on 2 machines, one stage per
machine (rank order tp-dp-pp): stage 0 logs its inbound messages, stage 1 its updates, in one job.

The kinds are forced per stage (``logging.kinds: [messages, updates]``): on the tiny GPT every
stage's inbound messages are smaller than its updates, so the planner's own pick (``auto``) is
messages everywhere (tests/unit/test_stage_logging.py has it pick both kinds from measured sizes).
Buddy copies are off so that the update or message log, not a buddy copy, restores the lost stage.

Each kill lands at iteration 7's optimizer step (no survivor can step it: the gradient clipping
all-reduces the norm over every stage), after the global checkpoint of iteration 4: the
lost stage's ranks load it and get back to iteration 6 from their stage's log (re-applied updates
for stage 1, a replay of the logged gradients for stage 0); the survivors keep their state; the
end is bitwise equal to the failure-free run, optimizer state included: the shared one of the bf16
tests (tests/dist/conftest.py's ``bf16_baseline``: the same DeepSpeed config and iterations; neither
the rank order, the buddy copies nor the logging changes a number).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ds_swift.testing.checkpoints import checkpoint_tensors, compare_tensors
from ds_swift.testing.jobs import JobRun, JobSpec, run_job

ROOT = Path(__file__).resolve().parents[2]
FAULT_WORKER = Path(__file__).parent / "workers" / "gpt_fault_worker.py"
CONFIG = ROOT / "configs" / "gpt_tiny_pp2_dp2_bf16_zero1.json"
ITERS = 12  # as the shared failure-free run (tests/dist/conftest.py's bf16_baseline)
JOB_DEADLINE_S = 420.0
SWIFT: dict[str, Any] = {
    "machines": {"rank_order": "tp-dp-pp"},
    "buddy": {"enabled": False},
    "logging": {"kinds": ["messages", "updates"]},
    "checkpoint": {"interval": 4},
}

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]


def launch(tmp: Path, launcher_args: list[str]) -> JobRun:
    return run_job(tmp, JobSpec(FAULT_WORKER, CONFIG, ITERS, launcher_args, swift=SWIFT), JOB_DEADLINE_S)


def test_one_job_logs_messages_on_one_stage_and_updates_on_the_other_and_recovers_each_bitwise(
    tmp_path: Path, bf16_baseline: JobRun
) -> None:
    assert bf16_baseline.iterations == ITERS and bf16_baseline.config["bf16"]["enabled"]
    reference = checkpoint_tensors(bf16_baseline.final_tag)
    assert any("optim" in k for k in reference), sorted(reference)[:20]  # fp32 masters and moments compared
    for machine, strategy in ((1, "tranlogs"), (0, "logging")):
        job = launch(
            tmp_path / f"kill{machine}", ["--spares", "1", "--inject", f"machine={machine},iteration=7,phase=step"]
        )
        assert job.code == 0, job.output[-8000:]
        # the choice, once, at start-up, with the measured sizes (the replacements take it from the store)
        (line,) = [ln for ln in job.output.splitlines() if "per-stage logging (measured in iteration 0" in ln]
        assert "stage 0: messages (logging.kinds=messages: inbound messages" in line, line
        assert "stage 1: updates (logging.kinds=updates: updates" in line, line
        (tl,) = job.timelines()
        assert tl["strategy"] == strategy, tl["reason"]
        assert tl["failed_machine"] == machine and tl["consensus"] == 6 and tl["checkpoint_step"] == 4
        assert (tl["replay"]["from"], tl["replay"]["to"]) == (4, 6)
        assert "checkpoint fallback" not in job.output and "FALL BACK" not in job.output
        diff = compare_tensors(reference, checkpoint_tensors(job.final_tag))
        assert diff.bitwise_equal, f"machine {machine}: {diff.describe()}"
