"""PipeChurn's partial recomputation after failures in the MIDDLE of an iteration, through the real
launcher, in the configuration users run (bf16 + ZeRO-1, pp 2 x dp 2, one rank per machine, rank
order tp-pp-dp: rank 0 and 1 are stages 0 and 1 of replica 0, ranks 2 and 3 those of replica 1).

One job, two SIGKILLs:

- iteration 5, machine 0 at its first backward pass: rank 1 (its stage 1) had finished the forward
  and backward passes of micro-batches 0 and 1 (it received activation 1 before rank 0 reached the
  backward). Rank 1 keeps those two and redoes 2 and 3; the lost rank redoes its 4, fed gradients 0
  and 1 from rank 1's copy: 6 passes of replica 0's 8.
- iteration 9, machine 1 at its first forward pass: rank 0 had run forwards 0 and 1 and no backward
  (it waits for gradient 0): their graphs died with the engine, so rank 0 redoes all 4; the lost
  rank its 4.

Replica 1 does not wait on replica 0 before the gradient reduction: the failure's abort stops it
wherever it is (measured: at iteration 5 once with rank 2 three passes in and rank 3 done, rank 3
then serving rank 2 its kept gradient 3). Its counts are checked against what its ranks can have
kept (stage 1 finishes each backward pass before stage 0), not fixed numbers.

The job ends bitwise equal to the failure-free run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ds_swift.bench.demo_report import read_loss_log
from ds_swift.testing.checkpoints import checkpoint_tensors, compare_tensors
from ds_swift.testing.jobs import JobRun, JobSpec, run_job

ROOT = Path(__file__).resolve().parents[2]
BF16 = ROOT / "configs" / "gpt_tiny_pp2_dp2_bf16_zero1.json"
ITERS = 12

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


def test_pipechurn_recomputes_only_the_passes_a_mid_iteration_failure_lost_bitwise(
    tmp_path: Path, bf16_baseline: JobRun
) -> None:
    swift = {
        "strategy": "pipechurn",
        "pipechurn": {"data_chunks": 2, "parity_chunks": 1},
        "machines": {"gpus_per_node": 1},
        "checkpoint": {"interval": 100},
    }
    # settled=1: each kill waits for the erasure-coded copies of the iteration before to land (they
    # travel in the background during the iteration; one step behind, the survivors would undo it
    # and the plan would be the full retrain, by design).
    kills = "machine=0,iteration=5,phase=backward,settled=1;machine=1,iteration=9,phase=forward,settled=1"
    spec = JobSpec(
        ROOT / "examples" / "pretrain_gpt.py",
        BF16,
        ITERS,
        ["--spares", "2", "--inject", kills],
        swift=swift,
        nnodes=4,
        nproc_per_node=1,
        loss_log=True,
    )
    job = run_job(tmp_path, spec, 180.0)
    assert job.code == 0, job.output[-6000:]
    assert "checkpoint fallback" not in job.output and "FULL RETRAIN" not in job.output, job.output[-6000:]
    backward, forward = job.timelines()
    for tl, it in ((backward, 5), (forward, 9)):
        assert tl["strategy"] == "pipechurn" and tl["consensus"] == it - 1, tl
        assert f"of iteration {it}, only the lost ranks' passes are recomputed" in tl["reason"], tl["reason"]
        assert tl["replay"]["partial"] and tl["replay"]["full_retrain_passes"] == 16, tl["replay"]
    for tl in (backward, forward):  # replica 1: whatever the abort left it, never a pass kept twice
        by = tl["replay"]["passes_by_rank"]
        assert 0 <= by["3"] <= by["2"] <= 4 and tl["replay"]["micro_batch_passes"] == sum(by.values()), tl["replay"]
    # Killed at its backward: the lost rank 0 redoes 4, rank 1 the 2 it had not finished.
    by = backward["replay"]["passes_by_rank"]
    assert (by["0"], by["1"]) == (4, 2) and backward["replay"]["micro_batch_passes"] < 16, backward["replay"]
    assert "survivors [1" in backward["reason"], backward["reason"]
    assert re.search(
        r"rank 1: recomputed my 2 micro-batch passes of iteration 5 .*\(kept 2; [0-9.]+ MB of kept "
        r"sends to the lost ranks\)",
        job.output,
    ), job.output[-3000:]
    assert re.search(r"rank 0: recomputed my 4 micro-batch passes of iteration 5 .* fed by ranks \[1\]", job.output)
    # Killed at its forward: rank 0 ran two forwards and no backward; replica 0 redoes everything.
    by = forward["replay"]["passes_by_rank"]
    assert (by["0"], by["1"]) == (4, 4) and forward["replay"]["forwards_dropped"] >= 2, forward["replay"]
    # Each iteration trained once (5 and 9 finished by their steps after the recoveries).
    iterations = [p.iteration for p in read_loss_log(job.loss_log)]
    assert iterations == sorted(set(iterations)) and iterations[-1] == ITERS - 1, iterations
    diff = compare_tensors(checkpoint_tensors(bf16_baseline.final_tag), checkpoint_tensors(job.final_tag))
    assert diff.bitwise_equal, diff.describe()
