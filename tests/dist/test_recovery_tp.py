"""Tensor parallelism under recovery (issue 12, item 6): tp 2 x pp 2 x dp 2 in bf16 + ZeRO-1
(megatron-core's tensor-parallel layers, DeepSpeed's BF16_Optimizer), through ds-swift-launch with
real processes and a real SIGKILL.

Two machines of 4 ranks (rank order tp-pp-dp: each machine holds one whole data-parallel replica)
and a spare; machine 1 dies in iteration 5's backward pass. Its ZeRO-1 partitions come back from
their buddy copies on machine 0 (tensor-parallel rank t of stage s from the same tp rank and stage
of the other replica); no survivor loads a checkpoint; the end is bitwise equal to the
failure-free run, fp32 masters included.

Rank 3 (stage 1, tp rank 1, a survivor) ignores the failure flag after its receives
(``SWIFT_TEST_DEAF_RECV``), as a rank does whose receive returned just before the flag was set: its
tensor-parallel peer rank 2 leaves at the flag while rank 3 goes on into the forward pass's
tensor-parallel all-reduce. Rank 3 must then fail at once, when rank 2's teardown frees the group
(``patches/deepspeed_rebuild.release_autograd_groups``), not at its op timeout: in the full suite
this happened by chance, and cost the whole op timeout in 4 of 6 runs before that fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ds_swift.testing.checkpoints import checkpoint_tensors, compare_tensors
from ds_swift.testing.jobs import JobRun, JobSpec, run_job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"
FAULT_WORKER = Path(__file__).parent / "workers" / "gpt_fault_worker.py"
BF16 = ROOT / "configs" / "gpt_tiny_pp2_dp2_bf16_zero1.json"
ITERS = 7
JOB_DEADLINE_S = 420.0
SWIFT = {
    "machines": {"gpus_per_node": 4, "rank_order": "tp-pp-dp"},
    "watchdog": {"op_timeout_s": 30.0},
    "checkpoint": {"interval": 4},
}
#: a small model (8 ranks share 2 cores), split over 2 tensor-parallel ranks
SCRIPT = ("--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2")

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]


def launch(tmp: Path, launcher_args: list[str], script: Path = EXAMPLE, env: dict[str, str] | None = None) -> JobRun:
    spec = JobSpec(script, BF16, ITERS, launcher_args, SCRIPT, swift=SWIFT, nnodes=2, nproc_per_node=4, env=env or {})
    return run_job(tmp, spec, JOB_DEADLINE_S)


def test_tp2_pp2_dp2_bf16_kill_at_backward_recovers_bitwise(tmp_path: Path, warm_deepspeed: None) -> None:
    reference = launch(tmp_path / "reference", [])
    assert reference.code == 0, reference.output[-6000:]
    assert "plan: tp=2 pp=2 dp=2" in reference.output
    want = checkpoint_tensors(reference.final_tag)
    job = launch(
        tmp_path / "killed",
        ["--spares", "1", "--inject", "machine=1,iteration=5,phase=backward"],
        FAULT_WORKER,
        {"SWIFT_TEST_DEAF_RECV": "rank=3"},
    )
    assert job.code == 0, job.output[-8000:]
    (tl,) = job.timelines()
    # Every survivor, rank 3 included, was out of the failed generation well before its op timeout.
    torn = {r["rank"]: r["t_torn_down"] - tl["t_kill"] for r in tl["ranks"] if r["role"] == "survivor"}
    assert sorted(torn) == [0, 1, 2, 3] and max(torn.values()) < SWIFT["watchdog"]["op_timeout_s"], torn
    assert tl["strategy"] == "buddy", tl["reason"]
    assert tl["failed_machine"] == 1 and tl["consensus"] == 4
    # rank = tp + 2 pp + 4 dp: each lost rank's partition from the same (tp, pp) of replica 0
    assert tl["donors"] == {"4": 0, "5": 1, "6": 2, "7": 3}, tl["donors"]
    assert "checkpoint fallback" not in job.output and tl["checkpoint_step"] is None
    diff = compare_tensors(want, checkpoint_tensors(job.final_tag))
    assert any(t.is_floating_point() for t in want.values()) and diff.bitwise_equal, diff.describe()
