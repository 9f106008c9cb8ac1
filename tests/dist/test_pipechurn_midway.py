"""PipeChurn's partial recomputation after failures in the MIDDLE of an iteration, through the real
launcher, in the configuration users run (bf16 + ZeRO-1, pp 2 x dp 2, one rank per machine, rank
order tp-pp-dp: rank 0 and 1 are stages 0 and 1 of replica 0, ranks 2 and 3 those of replica 1).

One job, two SIGKILLs:

- iteration 5, machine 0 at its first backward pass: rank 1 (its stage 1) had finished the forward
  and backward passes of micro-batches 0 and 1 (it received activation 1 before rank 0 reached the
  backward). Rank 1 keeps those two and redoes 2 and 3; the lost rank redoes its 4, fed gradients 0
  and 1 from rank 1's copy; replica 1 had run every pass and keeps them: 6 passes of 16.
- iteration 9, machine 1 at its first forward pass: rank 0 had run forwards 0 and 1 and no backward
  (it waits for gradient 0): their graphs died with the engine, so rank 0 redoes all 4; the lost
  rank its 4; replica 1 keeps its: 8 passes of 16, 2 of them forwards dropped by the failure.

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
    swift = {"strategy": "pipechurn", "pipechurn": {"data_chunks": 2, "parity_chunks": 1},
             "machines": {"gpus_per_node": 1}, "checkpoint": {"interval": 100}}  # fmt: skip
    kills = "machine=0,iteration=5,phase=backward;machine=1,iteration=9,phase=forward"
    spec = JobSpec(ROOT / "examples" / "pretrain_gpt.py", BF16, ITERS, ["--spares", "2", "--inject", kills],
                   swift=swift, nnodes=4, nproc_per_node=1, loss_log=True)  # fmt: skip
    job = run_job(tmp_path, spec, 180.0)
    assert job.code == 0, job.output[-6000:]
    assert "checkpoint fallback" not in job.output and "FULL RETRAIN" not in job.output, job.output[-6000:]
    backward, forward = job.timelines()
    for tl, it in ((backward, 5), (forward, 9)):
        assert tl["strategy"] == "pipechurn" and tl["consensus"] == it - 1, tl
        assert f"of iteration {it}, only the lost ranks' passes are recomputed" in tl["reason"], tl["reason"]
        assert tl["replay"]["partial"] and tl["replay"]["full_retrain_passes"] == 16, tl["replay"]
    # Killed at its backward: the lost rank 0 redoes 4, rank 1 the 2 it had not finished.
    assert backward["replay"]["passes_by_rank"] == {"0": 4, "1": 2, "2": 0, "3": 0}, backward["replay"]
    assert backward["replay"]["micro_batch_passes"] == 6 and backward["replay"]["forwards_dropped"] == 0
    assert "survivors [1] had not finished" in backward["reason"], backward["reason"]
    assert re.search(r"rank 1: recomputed my 2 micro-batch passes of iteration 5 .*\(kept 2; [0-9.]+ MB of kept "
                     r"sends to the lost ranks\)", job.output), job.output[-3000:]  # fmt: skip
    assert re.search(r"rank 0: recomputed my 4 micro-batch passes of iteration 5 .* fed by ranks \[1\]", job.output)
    # Killed at its forward: rank 0 ran two forwards and no backward; everything is redone in replica 0.
    assert forward["replay"]["passes_by_rank"] == {"0": 4, "1": 4, "2": 0, "3": 0}, forward["replay"]
    assert forward["replay"]["micro_batch_passes"] == 8 and forward["replay"]["forwards_dropped"] == 2
    kept = re.findall(r"rank (\d+): kept my passes of iteration (\d+)", job.output)
    assert sorted(kept) == [("2", "5"), ("2", "9"), ("3", "5"), ("3", "9")], kept
    # Each iteration trained once (5 and 9 finished by their steps after the recoveries).
    iterations = [p.iteration for p in read_loss_log(job.loss_log)]
    assert iterations == sorted(set(iterations)) and iterations[-1] == ITERS - 1, iterations
    diff = compare_tensors(checkpoint_tensors(bf16_baseline.final_tag), checkpoint_tensors(job.final_tag))
    assert diff.bitwise_equal, diff.describe()
