"""Recovery in the configuration users run (issue 12): bf16/fp16 + ZeRO-1, DeepSpeed's wrappers,
clipping and an LR schedule, under ds-swift-launch with real processes and a real SIGKILL.

Each test kills a machine and checks that the job ends with exit code 0, that the timeline names
the strategy (buddy copies of the lost ZeRO-1 partitions), that no survivor loaded a checkpoint,
and that the final DeepSpeed checkpoint (parameters and optimizer state, fp32 master partitions
included) is bitwise equal to a failure-free run's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_swift.testing.checkpoints import checkpoint_tensors, compare_tensors
from ds_swift.testing.jobs import JobRun, JobSpec, assert_verified, run_job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"
#: the example with fp16 allowed on DeepSpeed's CPU accelerator (GPU jobs need no such thing)
FP16_WORKER = Path(__file__).parent / "workers" / "fp16_cpu_worker.py"
BF16 = ROOT / "configs" / "gpt_tiny_pp2_dp2_bf16_zero1.json"
ITERS = 12
JOB_DEADLINE_S = 180.0
#: fp16 with a loss scale that overflows now and then: grows every 2 clean steps, from 2^14
FP16 = {
    "enabled": True,
    "loss_scale": 0,
    "initial_scale_power": 14,
    "loss_scale_window": 2,
    "hysteresis": 1,
    "min_loss_scale": 1,
}

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


def fp16_config(tmp: Path) -> Path:
    cfg = json.loads(BF16.read_text())
    del cfg["bf16"]
    cfg["fp16"] = FP16
    path = tmp / "gpt_tiny_pp2_dp2_fp16_zero1.json"
    path.write_text(json.dumps(cfg))
    return path


def launch(
    tmp: Path,
    config: Path,
    launcher_args: list[str],
    swift: dict[str, Any] | None = None,
    nnodes: int = 2,
    script: Path = EXAMPLE,
    script_args: tuple[str, ...] = (),
) -> JobRun:
    spec = JobSpec(
        script, config, ITERS, launcher_args, script_args, swift=swift or {}, nnodes=nnodes, nproc_per_node=4 // nnodes
    )
    return run_job(tmp, spec, JOB_DEADLINE_S)


def assert_bitwise_equal(reference: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    diff = compare_tensors(reference, got)
    assert diff.bitwise_equal, diff.describe()


def optimizer_files(tag: Path) -> list[str]:
    return sorted(p.name for p in tag.glob("*optim_states.pt"))


def one_recovery(job: JobRun) -> dict[str, Any]:
    assert job.code == 0, job.output[-6000:]
    (tl,) = job.timelines()
    return tl


@pytest.fixture(scope="module")
def baseline(bf16_baseline: JobRun) -> JobRun:
    """The failure-free run of this job: tests/dist/conftest.py's, shared with the other bf16 tests."""
    assert bf16_baseline.iterations == ITERS
    # The optimizer state (fp32 master partitions of BF16_Optimizer) is part of the comparison.
    assert optimizer_files(bf16_baseline.final_tag), list(bf16_baseline.final_tag.iterdir())
    return bf16_baseline


def test_bf16_zero1_kill_at_backward_recovers_from_buddy_copies(tmp_path: Path, baseline: JobRun) -> None:
    """pp 2 x dp 2, the replicas on the other machine; machine 1 dies in iteration 7's backward."""
    job = launch(tmp_path, BF16, ["--spares", "1", "--inject", "machine=1,iteration=7,phase=backward"])
    tl = one_recovery(job)
    assert tl["strategy"] == "buddy", tl["reason"]
    # The kill may come before the copies of iteration 6 landed: then the survivors undo 6, bitwise
    # from their own copies (tests/dist/test_checkpoint_strategies.py forces that case).
    assert tl["failed_machine"] == 1 and (tl["consensus"], tl["undo_ranks"]) in ((6, []), (5, [0, 1])), tl["reason"]
    assert tl["donors"] == {"2": 0, "3": 1}  # each lost partition came from its buddy on machine 0
    assert "checkpoint fallback" not in job.output and tl["checkpoint_step"] is None
    # Issue 50: the survivors kept their engine (its process groups swapped in place); only the
    # replacements built one.
    assert sorted(r["rank"] for r in tl["ranks"] if "engine_kept_s" in r["extra"]) == [0, 1], tl["ranks"]
    # The start-up costs: said by one rank per stage (ranks 0 and 1, data-parallel rank 0), not by all.
    said = sorted(line.split(":")[0] for line in job.output.splitlines() if "protection costs" in line)
    assert said == ["[ds-swift] rank 0", "[ds-swift] rank 1"], said
    # Verified recovery (issue 16): each partition checked against its holder's digest of the copy.
    assert_verified(tl, [2, 3], r"my optimizer partition bitwise equal to donor rank [01]'s")
    assert_bitwise_equal(checkpoint_tensors(baseline.final_tag), checkpoint_tensors(job.final_tag))


def test_a_stage_whose_replicas_share_its_machine_is_restored_from_buddy_copies_with_nothing_logged(
    tmp_path: Path, baseline: JobRun
) -> None:
    """Rank order tp-dp-pp: each stage's two data-parallel ranks on one machine, so no stage has a
    replica on another machine. The buddy copies of the ZeRO-1 partitions (each on the other
    machine) restore a lost stage exactly, so the topology analyzer logs no message for it (before,
    every message across the machines was also logged, for nothing). Machine 1 (all of stage 1) dies
    in iteration 7's backward pass; the job ends bitwise equal to the failure-free run."""
    inject = ["--spares", "1", "--inject", "machine=1,iteration=7,phase=backward"]
    job = launch(tmp_path, BF16, inject, {"machines": {"rank_order": "tp-dp-pp"}})
    tl = one_recovery(job)
    assert "recovery plan per pipeline stage: {0: 'replication', 1: 'replication'}" in job.output, job.output[-4000:]
    assert "have no data-parallel replica on another machine; the buddy copies" in job.output
    assert "logging plan" not in job.output and not list(job.dir.rglob("*.swlog"))  # nothing logged
    assert tl["strategy"] == "buddy" and tl["failed_machine"] == 1, tl["reason"]
    assert sorted(tl["donors"]) == ["2", "3"] and set(tl["donors"].values()) <= {0, 1}, tl["donors"]
    assert "checkpoint fallback" not in job.output and tl["checkpoint_step"] is None
    assert_bitwise_equal(checkpoint_tensors(baseline.final_tag), checkpoint_tensors(job.final_tag))


def test_buddy_copies_at_an_interval_take_every_rank_back_to_the_newest_copy_bitwise(
    tmp_path: Path, baseline: JobRun
) -> None:
    """``buddy.interval`` 4: copies after the steps of iterations 0, 4 and 8 only. Machine 1 is killed
    in iteration 11's backward pass (both survivors stepped 10): the lost ranks' newest copies are of
    8, so every rank goes back to 8 (the survivors bitwise from their own copies of 8, two steps
    back) and trains 9 and 10 again. The job ends bitwise equal to the failure-free run."""
    inject = ["--spares", "1", "--inject", "machine=1,iteration=11,phase=backward"]
    job = launch(tmp_path, BF16, inject, {"buddy": {"interval": 4}, "verify": {"digest_interval": 4}})
    tl = one_recovery(job)
    assert tl["strategy"] == "buddy" and tl["consensus"] == 8 and tl["undo_ranks"] == [0, 1], tl["reason"]
    assert "iterations 9..10 are trained again" in tl["reason"], tl["reason"]
    assert "survivors [0, 1] undo to iteration 8 from their own copies of it" in tl["reason"], tl["reason"]
    assert tl["deviation"] is None and "APPROXIMATE RECOVERY" not in job.output
    assert job.output.count("undo: last stepped iteration 10 -> consensus 8 (own copy)") == 2, job.output[-4000:]
    assert "after the steps of every 4th iteration" in job.output
    # Each survivor checked its state undone from its own copy against its digest of iteration 8.
    assert_verified(tl, [0, 1, 2, 3], r"(my own copy \(iteration 8\)|my optimizer partition) bitwise equal")
    assert_bitwise_equal(checkpoint_tensors(baseline.final_tag), checkpoint_tensors(job.final_tag))


# The same kill as the test above, the script feeding train_batch(data_iter=...): in CI the engine's
# rewind of a ResumableIterator is tests/unit/test_data_iter.py's, the recovery the test above.
@pytest.mark.slow
def test_a_resumable_data_iterator_is_rewound_and_recovers_bitwise(tmp_path: Path, baseline: JobRun) -> None:
    """The script feeds train_batch(data_iter=...) from a ds_swift.data.keyed.ResumableIterator, as a
    Megatron script feeds its sampler's iterator: the retried iteration reads its own samples."""
    inject = ["--spares", "1", "--inject", "machine=1,iteration=7,phase=backward"]
    job = launch(tmp_path, BF16, inject, script_args=("--data-iter",))
    tl = one_recovery(job)
    assert tl["strategy"] == "buddy", tl["reason"]
    assert_bitwise_equal(checkpoint_tensors(baseline.final_tag), checkpoint_tensors(job.final_tag))


def test_fp16_zero1_with_a_skipped_step_recovers_bitwise(tmp_path: Path, warm_deepspeed: None) -> None:
    """fp16 + ZeRO-1 with dynamic loss scaling; a loss-scale overflow skips a step between the last
    checkpoint (after iteration 4) and the kill (iteration 7)."""
    config = fp16_config(tmp_path)
    reference = launch(tmp_path / "reference", config, [], swift={"checkpoint": {"interval": 1}}, script=FP16_WORKER)
    assert reference.code == 0, reference.output[-6000:]
    skipped = [
        int(torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)["skipped_steps"])
        for tag in (reference.ckpt_dir / "global_step5", reference.ckpt_dir / "global_step7")
    ]
    print(f"skipped steps after 5 and 7 iterations: {skipped}")
    assert skipped[1] > skipped[0], f"no overflow between iterations 5 and 7: skipped_steps {skipped}"
    inject = ["--spares", "1", "--inject", "machine=1,iteration=7,phase=backward"]
    job = launch(tmp_path / "killed", config, inject, script=FP16_WORKER)
    tl = one_recovery(job)
    assert tl["strategy"] == "buddy", tl["reason"]
    assert "checkpoint fallback" not in job.output and tl["checkpoint_step"] is None
    assert_bitwise_equal(checkpoint_tensors(reference.final_tag), checkpoint_tensors(job.final_tag))


def test_losing_a_rank_and_its_only_buddy_falls_back_to_the_checkpoint(tmp_path: Path, warm_deepspeed: None) -> None:
    """4 machines of one rank: rank 0's only buddy is rank 2 (its data-parallel peer). Both machines
    die at the start of iteration 7: the partition is gone, and the job says so and reloads."""
    # Two cold replacements start at once on a busy host: the survivors' group creation (megatron's
    # model-parallel groups, op timeout) must outwait them.
    swift = {"machines": {"gpus_per_node": 1, "rank_order": "tp-pp-dp"}, "watchdog": {"op_timeout_s": 60.0}}
    inject = "machine=0,iteration=7,phase=forward;machine=2,iteration=7,phase=forward"
    job = launch(tmp_path, BF16, ["--spares", "2", "--inject", inject], swift=swift, nnodes=4)
    assert job.code == 0, job.output[-6000:]
    timelines = job.timelines()
    assert timelines, job.output[-4000:]
    tl = timelines[0]
    assert tl["strategy"] == "checkpoint", tl["reason"]
    assert "no buddy copy of the optimizer partition of rank(s) [0, 2] survived" in tl["reason"]
    assert "checkpoint fallback" in job.output
