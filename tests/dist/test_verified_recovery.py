"""Verified recovery (issue 16, item 3) under ds-swift-launch: real processes, real SIGKILL.

Before training resumes, every restored rank's state is checked against a reference digest: the
donor's (replication, buddy copies of ZeRO-1 partitions) or the one the lost rank published while
it was alive (logging-based replay). Each job loses machine 1:

- logging (``configs/gpt_tiny_pp4.json``, pp 4 on 2 machines, a digest every iteration): the
  replay of iterations 8..11 is checked to its end against the digests ranks 2 and 3 published
  before they died, and says so;
- the same with a digest every 5 iterations (the replay is checked at iteration 10), and one
  element of one logged activation (iteration 10, micro-batch 1, stage 1 -> 2) changed and its
  checksums written again, so that the log reader accepts it: the digest check catches the wrong
  state, every rank falls back to the global checkpoint loudly, naming the tensor, and the job
  still ends bitwise equal to the failure-free run;
- replication (pp 2 x dp 2, fp32) and buddy copies (bf16 + ZeRO-1): each replacement's state is
  checked against its donor's digest of what it sent (asserted in the acceptance runs of
  tests/dist/test_recovery_gpt.py and tests/dist/test_recovery_bf16.py, which verify by default).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_swift.testing.checkpoints import checkpoint_tensors, compare_tensors
from ds_swift.testing.jobs import JobRun, JobSpec, assert_verified, run_job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"
FAULT_WORKER = Path(__file__).parent / "workers" / "gpt_fault_worker.py"
PP4 = ROOT / "configs" / "gpt_tiny_pp4.json"
ITERS = 20  # as the shared failure-free run (tests/dist/conftest.py's pp4_baseline)
KILL_MACHINE_1 = "machine=1,iteration=12,phase=backward"
#: A whole job: 4 workers start (~15 s on 2 busy cores), train, lose a machine, wait for the
#: replacement's start (~7 s), recover, finish. A hang shows up as this deadline.
JOB_DEADLINE_S = 240.0

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]


def launch(
    tmp: Path, config: Path, inject: str | None, env: dict[str, str] | None = None, swift: dict[str, Any] | None = None
) -> JobRun:
    args = ["--spares", "1", "--inject", inject] if inject else []
    spec = JobSpec(FAULT_WORKER, config, ITERS, args, ["--dropout", "0.1"], swift=swift or {}, env=env or {})
    return run_job(tmp, spec, JOB_DEADLINE_S)


def one_timeline(job: JobRun) -> dict[str, Any]:
    assert job.code == 0, job.output[-8000:]
    (tl,) = job.timelines()
    return tl


def assert_bitwise_equal(reference: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    diff = compare_tensors(reference, got)
    assert diff.bitwise_equal, f"differs from the failure-free run: {diff.describe()}"


@pytest.fixture(scope="module")
def reference(pp4_baseline: JobRun) -> dict[str, torch.Tensor]:
    """The failure-free pp 4 run of tests/dist/conftest.py, shared with the other logging tests (the same
    DeepSpeed config, model and iterations; its swift section changes no number)."""
    assert pp4_baseline.iterations == ITERS and pp4_baseline.config["pipeline"] == {"stages": 4}
    return checkpoint_tensors(pp4_baseline.final_tag)


def test_a_replay_is_verified_against_the_digests_the_lost_ranks_published(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    job = launch(tmp_path, PP4, KILL_MACHINE_1)  # the default: a digest every iteration
    tl = one_timeline(job)
    assert tl["strategy"] == "logging" and (tl["replay"]["from"], tl["replay"]["to"]) == (8, 11), tl["reason"]
    assert_verified(
        tl,
        [2, 3],
        r"state replayed to iteration 11 bitwise equal to the digest rank [23] published "
        r"\(\d+ tensors\)$",
    )
    # The replayed ranks (and any survivor that went back a step by its own copy).
    found = re.search(r"restored state verified on ranks \[([0-9, ]*)\]", job.output)
    assert found and {2, 3} <= {int(r) for r in found.group(1).split(",")}, job.output[-4000:]
    assert "checkpoint fallback" not in job.output
    assert_bitwise_equal(reference, checkpoint_tensors(job.final_tag))


def test_a_perturbed_replay_is_caught_and_falls_back_naming_the_tensor(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    perturb = {"SWIFT_TEST_PERTURB_LOG": "rank=2,iteration=10,micro_batch=1,src=1"}
    job = launch(tmp_path, PP4, KILL_MACHINE_1, env=perturb, swift={"verify": {"digest_interval": 5}})
    tl = one_timeline(job)
    assert "[test] perturbed the record of iteration 10 micro-batch 1" in job.output, job.output[-6000:]
    # the log reader accepted it (no LogUnavailable): the replay ran to its end on the wrong message
    assert "LOGGING-BASED RECOVERY FAILED" not in job.output
    assert tl["strategy"] == "checkpoint" and tl["checkpoint_step"] == 8 and tl["consensus"] == 11
    assert tl["reason"].startswith(
        "restored state failed verification: rank 2: the state replayed to iteration 10 "
        "differs from the digest rank 2 published then: tensor "
    ), tl["reason"]
    named = re.search(r"tensor (\S+) differs \(reference digest [0-9a-f]{16}, restored [0-9a-f]{16}\)", tl["reason"])
    assert named and named.group(1).startswith(("module/", "optimizer/")), tl["reason"]
    assert tl["verification"] == {"2": "mismatch", "3": "mismatch"}  # rank 3 ran on rank 2's wrong output
    # Agreed on every rank, said once (by rank 0); each rank's fallback line names the reason again.
    loud = re.findall(
        r"rank (\d): restored state failed verification: .*ALL RANKS FALL BACK TO THE GLOBAL CHECKPOINT", job.output
    )
    assert loud == ["0"], job.output[-6000:]
    for rank in (1, 2, 3):  # the others name the reason once: in their own fallback line
        said = re.findall(rf"rank {rank}: .*restored state failed verification: rank 2", job.output)
        assert len(said) == 1, said
    for rank in range(4):
        assert f"rank {rank}: checkpoint fallback (restored state failed verification" in job.output
    assert_bitwise_equal(reference, checkpoint_tensors(job.final_tag))  # trained 8..11 again, from global_step8
