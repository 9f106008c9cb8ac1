"""TranLogs when a lost rank's last update record never reached the log (bf16 + ZeRO-1, pp 2 x dp 2).

Machine 1 (ranks 2 and 3) is killed in iteration 8's first backward pass while their records of
iteration 7 are still unstored (held by tests/dist/workers/gpt_fault_worker.py: the race that a
kill soon after a step loses). The survivors stepped 7. The replacements report their newest
record, 6; every rank lands on 6 instead of falling back to the global checkpoint. Strategy
tranlogs makes no buddy copies, so the survivors hold no own copy of 6, and update-undo's inverse
update would take them back only to within 2 ulp (the digest check then failed the recovery on
hosts where a rounding differed): they load global_step6 and re-apply their own records of 6, as
the replacements do theirs, and the job trains on from 7 bitwise equal to the failure-free run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ds_swift.testing.checkpoints import checkpoint_tensors, compare_tensors
from ds_swift.testing.jobs import JobRun, JobSpec, assert_verified, run_job

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "workers" / "gpt_fault_worker.py"
BF16 = ROOT / "configs" / "gpt_tiny_pp2_dp2_bf16_zero1.json"
ITERS = 12

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


def test_a_record_lost_with_its_rank_lands_every_rank_one_iteration_earlier(
    tmp_path: Path, bf16_baseline: JobRun
) -> None:
    swift = {"strategy": "tranlogs", "checkpoint": {"interval": 3}}
    spec = JobSpec(
        WORKER,
        BF16,
        ITERS,
        ["--spares", "1", "--inject", "machine=1,iteration=8,phase=backward"],
        swift=swift,
        nnodes=2,
        nproc_per_node=2,
        loss_log=True,
        env={"SWIFT_TEST_HOLD_RECORD": "machine=1,iteration=7"},
    )
    job = run_job(tmp_path, spec, 180.0)
    assert job.code == 0, job.output[-6000:]
    assert len(re.findall(r"\[test\] rank [23]: holding the update record of iteration 7", job.output)) == 2
    (tl,) = job.timelines()
    assert tl["strategy"] == "tranlogs", tl["reason"]
    assert "checkpoint fallback" not in job.output and "FALL BACK" not in job.output, job.output[-6000:]
    assert tl["consensus"] == 6 and tl["undo_ranks"] == [] and tl["checkpoint_step"] == 6, tl
    assert "ranks [2, 3] were lost before their update records of iteration 7 were stored" in tl["reason"], tl
    assert (
        "survivors [0, 1], with no own copy of it, load global_step6 and re-apply their own records too" in tl["reason"]
    )
    replay = tl["replay"]
    assert (replay["from"], replay["to"], replay["records"], replay["ranks"]) == (6, 6, 4, [0, 1, 2, 3]), replay
    assert "undo: last stepped iteration 7" not in job.output and "APPROXIMATE RECOVERY" not in job.output
    assert_verified(tl, [0, 1, 2, 3], r"the re-applied state \(iteration 6\) bitwise equal")
    diff = compare_tensors(checkpoint_tensors(bf16_baseline.final_tag), checkpoint_tensors(job.final_tag))
    assert diff.bitwise_equal, diff.describe()
