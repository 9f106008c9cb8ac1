"""``buddy.interval: "auto"``, the default, in the configuration users run (bf16 + ZeRO-1, pp 2 x dp 2
on two machines, ds-swift-launch, a real SIGKILL).

Copies after every step for the first rounds of the generation, then rank 0 chooses the interval
from the step time it measured (ds_swift.protect.buddy_interval) and every rank follows it from the
next iteration on. Which interval depends on this machine's speed; the test reads it from rank 0's
line and checks the recovery against it: every rank goes back to the newest round held, the
iterations since are trained again, and the job ends bitwise equal to a failure-free run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ds_swift.protect.buddy_interval import DECIDE_AFTER, LADDER
from ds_swift.testing.checkpoints import checkpoint_tensors, compare_tensors
from ds_swift.testing.jobs import JobRun, JobSpec, run_job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"
BF16 = ROOT / "configs" / "gpt_tiny_pp2_dp2_bf16_zero1.json"
#: past the choice (the round of iteration DECIDE_AFTER - 2, the generation's DECIDE_AFTER-th) and
#: room for the 10 iterations the tiny GPT's ~0.1 s steps choose
ITERS = 30
KILL = 27

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


def launch(tmp: Path, launcher_args: list[str]) -> JobRun:
    spec = JobSpec(EXAMPLE, BF16, ITERS, launcher_args, nnodes=2, nproc_per_node=2)
    return run_job(tmp, spec, 240.0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, warm_deepspeed: None) -> JobRun:
    run = launch(tmp_path_factory.mktemp("auto_reference"), [])
    assert run.code == 0 and not run.timelines(), run.output[-6000:]
    return run


def test_auto_chooses_the_interval_from_the_step_time_and_a_failure_goes_back_to_the_newest_round_bitwise(
    tmp_path: Path, reference: JobRun
) -> None:
    job = launch(tmp_path, ["--spares", "1", "--inject", f"machine=1,iteration={KILL},phase=backward"])
    assert job.code == 0, job.output[-6000:]
    chosen = re.findall(r"rank (\d+): buddy copies: every (\d+) iteration\(s\) from iteration (\d+) on", job.output)
    assert len(chosen) == 1 and chosen[0][0] == "0", chosen  # rank 0 chooses, once, and says so
    k, first = int(chosen[0][1]), int(chosen[0][2])
    assert k in LADDER and first == DECIDE_AFTER - 1, chosen  # rounds of iterations -1 (start-up) .. 18
    (tl,) = job.timelines()
    print(f"auto interval {k}: consensus {tl['consensus']}, {tl['reason']}")
    stepped = KILL - 1  # both survivors stepped it; machine 1 died in the next iteration's backward pass
    newest = stepped - stepped % k
    # The newest round is held everywhere, unless it is the step just before the kill and had not
    # landed: then the one before it.
    allowed = {newest} | ({newest - k} if newest == stepped else set())
    assert tl["strategy"] == "buddy" and tl["consensus"] in allowed, (k, tl["consensus"], tl["reason"])
    if tl["consensus"] < stepped - 1:
        assert f"iterations {tl['consensus'] + 1}..{stepped} are trained again" in tl["reason"], tl["reason"]
    if tl["consensus"] < stepped:  # each survivor back to the round from its own copy: bitwise
        assert sorted(tl["undo_ranks"]) == [0, 1], tl
        assert "from their own copies" in tl["reason"], tl["reason"]
    assert "checkpoint fallback" not in job.output and tl["checkpoint_step"] is None
    diff = compare_tensors(checkpoint_tensors(reference.final_tag), checkpoint_tensors(job.final_tag))
    assert diff.bitwise_equal, diff.describe()
