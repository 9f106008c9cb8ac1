"""Logging-based recovery of the GPT example under ds-swift-launch: real processes, real SIGKILL.

``configs/gpt_tiny_pp4.json``: pp 4 on 2 simulated machines of 2 ranks (stages 0,1 on machine 0,
stages 2,3 on machine 1), a global checkpoint every 8 iterations, strategy "logging": the sends
between stage 1 and stage 2 are logged. A lost machine's stages have no replica: their
replacements load the last global checkpoint and replay the iterations since from the message
log, while the survivors keep their state and never load a checkpoint. Every job trains 20
iterations with dropout 0.1 (so the RNG keying is tested too) and must end bitwise equal to one
failure-free run of the same model and DeepSpeed config (tests/dist/conftest.py's ``pp4_baseline``,
shared with test_logging_budget.py, whose swift section changes no number). Three jobs:

- sequential: machine 1 killed in iteration 12's backward pass (the issue's acceptance run);
- parallel (exact): the same kill, then a rank of machine 1 killed as the checkpoint of iteration 16
  starts (it is replayed up to and saved again), then machine 0 killed at iteration 18's optimizer
  step, and the replacement of rank 0 killed while replaying (a cascading failure: the recovery
  restarts);
- pp 4 on 4 machines: two simultaneous failures, adjacent (machines 1+2) then apart (1+3), both at
  an optimizer step, then a kill in a forward pass with a corrupt log record: every rank falls back
  to the global checkpoint, loudly.

Jobs run ``tests/dist/workers/gpt_fault_worker.py`` (the example plus test hooks), which prints a
line whenever DeepSpeed loads a checkpoint on a rank, and can corrupt a log record or kill a
replacement in the middle of its replay. The last tests check the plan itself (no process).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_swift.testing.checkpoints import checkpoint_tensors, compare_tensors
from ds_swift.testing.jobs import JobRun, JobSpec, run_job

ROOT = Path(__file__).resolve().parents[2]
FAULT_WORKER = Path(__file__).parent / "workers" / "gpt_fault_worker.py"
PP4 = ROOT / "configs" / "gpt_tiny_pp4.json"
ITERS = 20
MODEL_ARGS = ["--dropout", "0.1"]
#: A whole job: 4 workers start (~15 s on 2 busy cores), train, lose machines, wait for each
#: replacement's start (~7 s), replay, finish. A hang shows up as this deadline.
JOB_DEADLINE_S = 240.0

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]


def launch(
    tmp: Path,
    launcher_args: list[str],
    swift: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    nnodes: int = 2,
    nproc: int = 2,
) -> JobRun:
    """One job of the GPT example (through the fault worker) on its own checkpoint and log dirs."""
    spec = JobSpec(
        FAULT_WORKER,
        PP4,
        ITERS,
        launcher_args,
        MODEL_ARGS,
        swift=swift or {},
        env=env or {},
        nnodes=nnodes,
        nproc_per_node=nproc,
    )
    return run_job(tmp, spec, JOB_DEADLINE_S)


def loads(job: JobRun, who: str = "original") -> dict[int, list[str]]:
    """rank -> the checkpoint tags DeepSpeed loaded on its ``who`` ("original"/"replacement") workers."""
    out: dict[int, list[str]] = {}
    for rank, tag in re.findall(rf"\[test\] rank (\d+) \({who}\): load_checkpoint (global_step\d+)", job.output):
        out.setdefault(int(rank), []).append(tag)
    return out


def final_tensors(job: JobRun) -> dict[str, torch.Tensor]:
    return checkpoint_tensors(job.final_tag)


def assert_bitwise_equal(reference: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    diff = compare_tensors(reference, got)
    assert any(t.is_floating_point() and t.numel() for t in reference.values())
    assert diff.bitwise_equal, f"differs from the failure-free run: {diff.describe()}"


def assert_recovered(job: JobRun, recoveries: int) -> list[dict[str, Any]]:
    assert job.code == 0, job.output[-8000:]
    timelines = job.timelines()
    assert len(timelines) == recoveries, job.output[-6000:]
    for tl in timelines:
        assert tl["total_s"] >= tl["recovery_s"] >= 0
        for r in tl["ranks"]:
            if r["role"] == "survivor" and tl["t_kill"] is not None:
                # Nobody waited on a dead peer: every survivor knew well before its op timeout.
                assert r["t_detect"] - tl["t_kill"] < job.op_timeout_s, r
    return timelines


def assert_logging(
    tl: dict[str, Any],
    machine: int,
    consensus: int,
    group: list[int],
    helpers: list[int] | None = None,
    start: int | None = None,
) -> None:
    """``tl`` is a logging-based recovery of ``machine``: ``group`` loaded the checkpoint of ``start``
    (default: the last one due) and replayed (with ``helpers`` sharing the micro-batches, parallel
    recovery), everyone else kept its state."""
    assert tl["strategy"] == "logging", tl["reason"]
    assert tl["failed_machine"] == machine and tl["consensus"] == consensus
    replay = tl["replay"]
    start = 8 * ((consensus + 1) // 8) if start is None else start
    assert sorted(replay["ranks"]) == sorted(group + (helpers or []))
    assert (replay["from"], replay["to"], replay["source"]) == (start, consensus, f"global_step{start}")
    assert tl["checkpoint_step"] == start and replay["log_bytes_read"] > 0
    assert replay["parallel"] == ("exact" if helpers else None)
    assert {"checkpoint_load", "replay"} <= set(tl["phases"])
    per_rank = replay["per_rank"]
    for r in tl["ranks"]:
        if r["rank"] in group + (helpers or []):
            assert per_rank[str(r["rank"])]["iterations"] == consensus + 1 - start
            assert r["extra"]["replay"] == per_rank[str(r["rank"])] and r["t_replayed"] is not None
        if r["rank"] in group:
            assert r["t_loaded"] is not None and r["extra"]["checkpoint_loaded"] == start
        else:
            assert r["t_loaded"] is None and "checkpoint_loaded" not in r["extra"], r  # kept its state
    if helpers:
        shares = {tuple(per_rank[str(r)]["share"]) for r in group + helpers}
        assert shares == {(0, 2), (1, 3)}  # two sub-pipelines, round robin over 4 micro-batches


# --------------------------------------------------------------------------- jobs (one run each)
@pytest.fixture(scope="module")
def reference(pp4_baseline: JobRun) -> dict[str, torch.Tensor]:
    """The failure-free run, shared by every test (and test_logging_budget.py's)."""
    assert pp4_baseline.iterations == ITERS and pp4_baseline.config["pipeline"] == {"stages": 4}
    assert not pp4_baseline.timelines() and not loads(pp4_baseline) and not loads(pp4_baseline, "replacement")
    return final_tensors(pp4_baseline)


@pytest.fixture(scope="module")
def sequential(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    """The issue's acceptance run: machine 1 dies in iteration 12's backward pass."""
    return launch(
        tmp_path_factory.mktemp("sequential"), ["--spares", "1", "--inject", "machine=1,iteration=12,phase=backward"]
    )


@pytest.fixture(scope="module")
def parallel(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    """Parallel recovery (exact): machine 1 dies in iteration 12's backward pass; its replacement
    rank 3 dies when the periodic checkpoint after 16 iterations starts; machine 0 dies at
    iteration 18's optimizer step, and the replacement of rank 0 dies while replaying iteration 17."""
    return launch(
        tmp_path_factory.mktemp("parallel"),
        [
            "--spares",
            "4",
            "--max-failures",
            "4",
            "--inject",
            "machine=1,iteration=12,phase=backward;machine=0,iteration=18,phase=step",
        ],
        swift={"parallel_recovery": True, "parallel_recovery_mode": "exact", "parallel_recovery_force": True},
        env={"SWIFT_TEST_KILL_IN_REPLAY": "rank=0,iteration=17", "SWIFT_TEST_KILL_IN_SAVE": "rank=3,iteration=16"},
    )


@pytest.fixture(scope="module")
def four_machines(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    """pp 4 on 4 machines of one rank (every stage boundary logged; same ranks and stages as the
    reference). Machines 1 and 2 die at once at iteration 10's step (adjacent: replayed together,
    the sends between them live); machines 1 and 3 at iteration 14's step (apart: each replays
    alone, every neighbour from the log); machine 2 in iteration 18's forward pass, with a corrupt
    record in the log its replacement needs."""
    return launch(
        tmp_path_factory.mktemp("four_machines"),
        [
            "--spares",
            "5",
            "--max-failures",
            "5",
            "--inject",
            "machine=1+2,iteration=10,phase=step;machine=1+3,iteration=14,phase=step;"
            "machine=2,iteration=18,phase=forward",
        ],
        swift={"machines": {"gpus_per_node": 1}},
        nnodes=4,
        nproc=1,
        env={"SWIFT_TEST_CORRUPT_LOG": "rank=2,iteration=17,micro_batch=1,src=1"},
    )


# --------------------------------------------------------------------------- tests
@pytest.mark.slow  # CI runs the bf16 + ZeRO-1 variant (tests/dist/test_recovery_logging_bf16.py)
def test_kill_at_backward_replays_machine_1_bitwise(sequential: JobRun, reference: dict[str, torch.Tensor]) -> None:
    (tl,) = assert_recovered(sequential, 1)
    assert_logging(tl, machine=1, consensus=11, group=[2, 3])
    assert loads(sequential) == {}, loads(sequential)  # machine 0's workers never load a checkpoint
    assert loads(sequential, "replacement") == {2: ["global_step8"], 3: ["global_step8"]}
    assert "checkpoint fallback" not in sequential.output
    # progress while replaying: iterations done / to do, bytes of log
    assert re.search(r"rank 2: replay 4/4 iterations, [\d.]+ MB of log", sequential.output), sequential.output[-4000:]
    assert_bitwise_equal(reference, final_tensors(sequential))


def test_parallel_exact_replay_is_bitwise_equal(parallel: JobRun, reference: dict[str, torch.Tensor]) -> None:
    first, *_ = assert_recovered(parallel, 3)
    # survivors 0, 1 host copies of the lost stages 2, 3 and replay half of the micro-batches
    assert_logging(first, machine=1, consensus=11, group=[2, 3], helpers=[0, 1])
    assert "checkpoint fallback" not in parallel.output
    assert_bitwise_equal(reference, final_tensors(parallel))


def test_a_failure_in_the_periodic_checkpoint_replays_and_saves_it_again(parallel: JobRun) -> None:
    _, in_save, _ = assert_recovered(parallel, 3)
    assert "[test] rank 3: SIGKILL in the checkpoint of iteration 16" in parallel.output
    # global_step16 was cut short: the replay runs from global_step8 up to the iteration before it
    assert_logging(in_save, machine=1, consensus=15, group=[2, 3], helpers=[0, 1], start=8)
    # every rank saved it again after the recovery (the next recovery loads it)
    assert (parallel.ckpt_dir / "global_step16" / "swift_complete").exists()


def test_kill_at_step_of_machine_0_replays_from_the_gradient_log(parallel: JobRun) -> None:
    *_, last = assert_recovered(parallel, 3)
    # stages 0, 1 read the gradients stage 2 logged; ranks 2, 3 (replacements of machine 1) help
    assert_logging(last, machine=0, consensus=17, group=[0, 1], helpers=[2, 3])
    assert loads(parallel) == {}  # no original worker ever loaded a checkpoint
    replacement = loads(parallel, "replacement")
    assert replacement[2] == replacement[3] == ["global_step8"] * 2  # as survivors of the last failure: none


def test_a_failure_during_the_replay_restarts_the_recovery(parallel: JobRun) -> None:
    *_, last = assert_recovered(parallel, 3)
    assert "[test] rank 0: SIGKILL while replaying iteration 17" in parallel.output
    # generation 2 failed (machine 0); its recovery (generation 3) failed in the replay; generation 4 recovered
    assert last["failed_generation"] == 3 and "generation 3 failed during recovery" in parallel.output
    replacement = loads(parallel, "replacement")
    assert replacement[0] == replacement[1] == ["global_step16", "global_step16"]  # both attempts loaded it


def test_two_simultaneous_failures_adjacent_then_apart(
    four_machines: JobRun, reference: dict[str, torch.Tensor]
) -> None:
    adjacent, apart, _ = assert_recovered(four_machines, 3)
    for tl, machines, consensus in ((adjacent, [1, 2], 9), (apart, [1, 3], 13)):
        assert tl["strategy"] == "logging", tl["reason"]
        assert tl["consensus"] == consensus and tl["replay"]["machines"] == machines
        assert tl["replay"]["ranks"] == machines and (tl["replay"]["from"], tl["replay"]["to"]) == (8, consensus)
    per_rank = adjacent["replay"]["per_rank"]
    mbs = 2 * 4  # iterations 8, 9 x 4 micro-batches
    assert per_rank["1"]["messages_from_log"] == per_rank["2"]["messages_from_log"] == mbs  # 1 <-> 2 live
    per_rank = apart["replay"]["per_rank"]
    mbs = 6 * 4  # iterations 8..13
    assert per_rank["1"]["messages_from_log"] == 2 * mbs and per_rank["3"]["messages_from_log"] == mbs
    assert_bitwise_equal(reference, final_tensors(four_machines))


def test_corrupt_record_falls_back_to_the_global_checkpoint_loudly(four_machines: JobRun) -> None:
    """The third failure (machine 2, iteration 18's forward pass): the activation the replacement
    needs for iteration 17, micro-batch 1 is corrupt. Its replay fails on the checksum and says which
    file and record; every rank (survivors too) then reloads global_step16 and trains 16..17 again."""
    *_, tl = assert_recovered(four_machines, 3)
    assert tl["strategy"] == "checkpoint" and tl["checkpoint_step"] == 16 and tl["consensus"] == 17
    assert "logging-based recovery from global_step16 failed before" in tl["reason"]
    loud = re.search(r"rank 2: LOGGING-BASED RECOVERY FAILED: LogUnavailable: .*", four_machines.output)
    assert loud, four_machines.output[-6000:]
    assert re.search(
        r"act_s001-s002_dp0000_tp000_it0000000016-0000000020\.swlog: record #\d+ .*iteration 17, "
        r"micro-batch 1.*checksum",
        loud.group(0),
    ), loud.group(0)
    assert "ALL RANKS FALL BACK TO THE GLOBAL CHECKPOINT (global_step16)" in loud.group(0)
    for rank in range(4):
        assert f"rank {rank}: checkpoint fallback" in four_machines.output
    # rank 0, a survivor of all three failures, loaded a checkpoint only in this fallback
    assert loads(four_machines) == {0: ["global_step16"]}
    assert loads(four_machines, "replacement") == {
        1: ["global_step8", "global_step8", "global_step16"],
        2: ["global_step8", "global_step16", "global_step16"],
        3: ["global_step8", "global_step16"],
    }


# --------------------------------------------------------------------------- the plan (pure, no process)
def _reports(lost: set[int], stages: int = 4, per_machine: int = 2, last: int = 11) -> list[Any]:
    """pp ``stages``, one replica, ``per_machine`` consecutive stages per machine; machines ``lost`` failed."""
    from ds_swift.recovery.consensus import RankReport

    return [
        RankReport(
            rank=r,
            survivor=r // per_machine not in lost,
            stage=r,
            dp=0,
            tp=0,
            machine=r // per_machine,
            last_stepped=-1 if r // per_machine in lost else last,
            can_undo=True,
        )
        for r in range(stages)
    ]


def test_plan_replays_the_lost_machines_logging_group_from_the_checkpoint() -> None:
    from ds_swift.recovery.consensus import LoggingSetup
    from ds_swift.recovery.registry import plan_recovery
    from ds_swift.recovery.replay.runner import parallel_layout

    setup = LoggingSetup(frozenset(range(4)), ((0,), (1,)), checkpoint_step=8)
    plan = plan_recovery(_reports({1}), logging=setup)
    assert plan.strategy == "logging", plan.reason
    assert plan.replay_ranks == (2, 3) and list(plan.replay_iterations) == [8, 9, 10, 11]
    assert "no surviving data-parallel replica of stage(s) [2, 3]" in plan.reason
    layout = parallel_layout(plan, _reports({1}), micro_batches=4)
    assert not isinstance(layout, str)
    assert (layout.stages, layout.replacements, layout.helpers) == ((2, 3), (2, 3), (0, 1))
    assert parallel_layout(plan, _reports({1}), micro_batches=1) == (
        "parallel recovery needs at least two micro-batches per iteration"
    )
    # no checkpoint yet: replay from the initial state
    plan0 = plan_recovery(_reports({1}, last=3), logging=LoggingSetup(frozenset(range(4)), checkpoint_step=-1))
    assert plan0.strategy == "logging" and list(plan0.replay_iterations) == [0, 1, 2, 3]


def test_plan_rolls_the_whole_group_back_and_keeps_the_others() -> None:
    from ds_swift.recovery.consensus import LoggingSetup
    from ds_swift.recovery.registry import plan_recovery

    # pp 6 on 3 machines; machines 1 and 2 share a logging group: losing 2 rolls 1 back too
    setup = LoggingSetup(frozenset(range(6)), ((0,), (1, 2)), checkpoint_step=8)
    plan = plan_recovery(_reports({2}, stages=6), logging=setup)
    assert plan.strategy == "logging" and plan.replay_ranks == (2, 3, 4, 5)
    assert plan.survivors == (0, 1, 2, 3) and "rolling back survivors [2, 3]" in plan.reason


def test_plan_falls_back_to_the_checkpoint_and_says_why() -> None:
    from ds_swift.recovery.consensus import LoggingSetup
    from ds_swift.recovery.registry import plan_recovery

    reports = _reports({1})
    failed = LoggingSetup(frozenset(range(4)), checkpoint_step=8, unavailable="rank 2: corrupt record #5")
    cases = {
        "not set up": None,
        "failed before (rank 2: corrupt record #5)": failed,
        "stage(s) [3] of the failed logging group are not recovered by logging": LoggingSetup(frozenset({0, 1, 2})),
        "no rank outside the failed logging group": LoggingSetup(frozenset(range(4)), ((0, 1),)),
    }
    for why, setup in cases.items():
        plan = plan_recovery(reports, logging=setup)
        assert plan.strategy == "checkpoint" and why in plan.reason, (why, plan.reason)
    assert (
        plan_recovery(reports, forced="checkpoint", logging=LoggingSetup(frozenset(range(4)))).strategy == "checkpoint"
    )


def test_plan_refuses_an_undo_next_to_a_replay_of_partitioned_state() -> None:
    """A survivor outside the replayed group that undoes restores its fp32 masters only; under a
    partitioned state (ZeRO-1, BF16_Optimizer with dp > 1) its low-precision parameters are all-gathered
    from data-parallel peers that are replaying meanwhile: refused, saying why (the checkpoint then)."""
    import dataclasses

    from ds_swift.recovery.consensus import LoggingSetup
    from ds_swift.recovery.registry import plan_recovery

    setup = LoggingSetup(frozenset(range(4)), ((0,), (1,)), checkpoint_step=8)
    reports = [dataclasses.replace(r, last_stepped=12) if r.rank == 1 else r for r in _reports({1})]
    plan = plan_recovery(reports, logging=setup)
    assert plan.strategy == "logging" and plan.undo == (1,), plan.reason  # unpartitioned: a local refresh
    plan = plan_recovery(reports, logging=setup, zero_stage=1, partitioned=True)
    assert plan.strategy == "checkpoint" and "survivors [1] would undo a step" in plan.reason, plan.reason
