"""The storage budget at runtime, through ds-swift-launch: real processes, real SIGKILL.

``configs/gpt_tiny_pp4_budget.json`` is the README's example ``swift`` section (strategy auto, a
storage budget, parallel recovery) on pp 4 over 2 simulated machines of 2 ranks, fp32, with a
global checkpoint every 8 iterations. Nothing in a DeepSpeed config sizes the pipeline messages,
so the engine logs its first iteration at every machine boundary, measures what it logged, plans
the machine groups under the budget, prints the plan once and keeps logging by it. Jobs:

- reference: failure-free (tests/dist/conftest.py's ``pp4_baseline``, shared with
  test_recovery_logging.py); logging stays on and the plan is printed once;
- killed: machine 1 killed in iteration 12's backward pass (after the first checkpoint); the
  recovery replays from the message log (parallel, exact) and ends bitwise equal to the reference;
- grouped: the same job on 4 machines of one rank with a budget that holds one boundary out of
  three: machines {0, 1} and {2, 3} become the groups from iteration 1 on (the ranks whose sends are
  no longer logged drop their logger); machine 3 killed in iteration 12's backward pass: the whole
  group {2, 3} replays, rank 2 (a survivor) rolls back with it, and the end is bitwise equal too;
- unmeetable: a budget below one boundary's logs stops the job after its first iteration with one
  line naming ``logging.storage_budget_gb`` and the smallest budget that works;
- full disk: the log's disk (a 1 MB tmpfs) fills up mid-run; training goes on, logging stops loudly,
  and a later failure whose replay would need the lost messages falls back to the checkpoint.
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
BUDGET = ROOT / "configs" / "gpt_tiny_pp4_budget.json"
ITERS = 20  # as the shared failure-free run (tests/dist/conftest.py's pp4_baseline)
MODEL_ARGS = ["--dropout", "0.1"]
JOB_DEADLINE_S = 240.0
PLAN_LINE = re.compile(
    r"rank 0: logging plan for logging.storage_budget_gb=(\S+) \(measured in iteration 0, iteration time [\d.e-]+ s\): "
    r"(\d+) group\(s\) of machines (\[.*?\]) \(exact\); (\d+) bytes logged per iteration"
)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]


def launch(
    tmp: Path,
    launcher_args: list[str],
    swift: dict[str, Any] | None = None,
    iterations: int = ITERS,
    nnodes: int = 2,
    nproc: int = 2,
) -> JobRun:
    # Forced: on a CI host with fewer cores than replaying ranks the recovery plan would rightly
    # replay sequentially (parallel recovery cannot help there), and these jobs check the parallel path.
    swift = {"parallel_recovery_force": True, **(swift or {})}
    spec = JobSpec(
        FAULT_WORKER, BUDGET, iterations, launcher_args, MODEL_ARGS, swift=swift, nnodes=nnodes, nproc_per_node=nproc
    )
    return run_job(tmp, spec, JOB_DEADLINE_S)


def loads(job: JobRun, who: str = "original") -> dict[int, list[str]]:
    """rank -> the checkpoint tags DeepSpeed loaded on its ``who`` ("original"/"replacement") workers."""
    out: dict[int, list[str]] = {}
    for rank, tag in re.findall(rf"\[test\] rank (\d+) \({who}\): load_checkpoint (global_step\d+)", job.output):
        out.setdefault(int(rank), []).append(tag)
    return out


def plan_lines(job: JobRun) -> list[re.Match[str]]:
    return list(PLAN_LINE.finditer(job.output))


def assert_bitwise_equal(reference: dict[str, torch.Tensor], job: JobRun) -> None:
    diff = compare_tensors(reference, checkpoint_tensors(job.final_tag))
    assert any(t.is_floating_point() and t.numel() for t in reference.values())
    assert diff.bitwise_equal, f"differs from the failure-free run: {diff.describe()}"


def assert_replayed(job: JobRun, machine: int, group: list[int], helpers: list[int]) -> dict[str, Any]:
    """One recovery, by logging: ``group`` loaded global_step8 and replayed 8..11 with ``helpers``."""
    assert job.code == 0, job.output[-8000:]
    (tl,) = job.timelines()
    assert tl["strategy"] == "logging", tl["reason"]
    assert tl["failed_machine"] == machine and tl["consensus"] == 11 and tl["checkpoint_step"] == 8
    replay = tl["replay"]
    assert sorted(replay["ranks"]) == sorted(group + helpers) and replay["log_bytes_read"] > 0
    assert (replay["from"], replay["to"], replay["source"]) == (8, 11, "global_step8")
    assert replay["parallel"] == "exact"
    assert "checkpoint fallback" not in job.output
    return tl


# --------------------------------------------------------------------------- jobs (one run each)
@pytest.fixture(scope="module")
def reference(pp4_baseline: JobRun) -> JobRun:
    """The failure-free run of this job (its config, iterations, model and forced parallel recovery)."""
    assert pp4_baseline.iterations == ITERS and pp4_baseline.config["swift"]["logging"]["storage_budget_gb"] == 500
    assert not pp4_baseline.timelines() and not loads(pp4_baseline)
    return pp4_baseline


@pytest.fixture(scope="module")
def reference_tensors(reference: JobRun) -> dict[str, torch.Tensor]:
    return checkpoint_tensors(reference.final_tag)


@pytest.fixture(scope="module")
def boundary_bytes(reference: JobRun) -> int:
    """What one machine boundary (activations and gradients) logs per iteration, as measured."""
    (line,) = plan_lines(reference)
    return int(line.group(4))


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    return launch(
        tmp_path_factory.mktemp("killed"), ["--spares", "1", "--inject", "machine=1,iteration=12,phase=backward"]
    )


@pytest.fixture(scope="module")
def grouped(tmp_path_factory: pytest.TempPathFactory, boundary_bytes: int) -> JobRun:
    budget = 1.5 * 8 * boundary_bytes / 1e9  # one boundary for 8 iterations, not two
    return launch(
        tmp_path_factory.mktemp("grouped"),
        ["--spares", "1", "--inject", "machine=3,iteration=12,phase=backward"],
        swift={"machines": {"gpus_per_node": 1}, "logging": {"storage_budget_gb": budget}},
        nnodes=4,
        nproc=1,
    )


# --------------------------------------------------------------------------- tests
def test_the_readme_config_keeps_logging_on_and_prints_the_plan_once(reference: JobRun) -> None:
    (line,) = plan_lines(reference)  # once, by rank 0
    assert line.group(1) == "500" and (line.group(2), line.group(3)) == ("2", "[[0], [1]]")
    assert int(line.group(4)) > 0
    assert re.search(
        r"rank 0: recovery per pipeline stage: \{0: 'logging', 1: 'logging', 2: 'logging', 3: 'logging'\}",
        reference.output,
    )
    verdict = re.search(r"rank 0: worth logging: yes: .*iteration time [\d.e-]+ s", reference.output)
    assert verdict, reference.output[-4000:]
    assert "message logging not installed" not in reference.output
    assert "topology analysis unavailable" not in reference.output
    # logged after the plan was made too: the chunk of iterations 15..19 of the machine boundary (the
    # older ones went with the global checkpoint of iteration 16)
    logs = reference.dir / "swift-logs"
    assert (logs / "act_s001-s002_dp0000_tp000_it0000000015-0000000020.swlog").exists(), sorted(logs.iterdir())
    assert (logs / "grad_s002-s001_dp0000_tp000_it0000000015-0000000020.swlog").exists()


def test_a_killed_machine_recovers_by_logging_bitwise(
    killed: JobRun, reference_tensors: dict[str, torch.Tensor]
) -> None:
    tl = assert_replayed(killed, machine=1, group=[2, 3], helpers=[0, 1])
    assert "load global_step8 and replay iterations 8..11 from the message log" in tl["reason"]
    assert loads(killed) == {}  # the survivors kept their state
    assert loads(killed, "replacement") == {2: ["global_step8"], 3: ["global_step8"]}
    assert len(plan_lines(killed)) == 1  # the replacements took the plan from the job store, silently
    assert_bitwise_equal(reference_tensors, killed)


def test_a_tight_budget_groups_machines_and_replays_the_whole_group(
    grouped: JobRun, reference_tensors: dict[str, torch.Tensor], boundary_bytes: int
) -> None:
    (line,) = plan_lines(grouped)
    assert (line.group(2), line.group(3)) == ("2", "[[0, 1], [2, 3]]") and int(line.group(4)) == boundary_bytes
    tl = assert_replayed(grouped, machine=3, group=[2, 3], helpers=[0, 1])
    assert tl["replay"]["machines"] == [2, 3] and "rolling back survivors [2]" in tl["reason"]
    assert loads(grouped) == {2: ["global_step8"]}  # the survivor in the failed group rolled back
    assert loads(grouped, "replacement") == {3: ["global_step8"]}
    # only the boundary between the groups is logged after iteration 0
    logs = {p.name.split("_it")[0] for p in (grouped.dir / "swift-logs").glob("*.swlog")}
    assert logs == {"act_s001-s002_dp0000_tp000", "grad_s002-s001_dp0000_tp000"}, logs
    assert_bitwise_equal(reference_tensors, grouped)


def test_a_budget_that_cannot_be_met_stops_the_job_naming_the_field(tmp_path: Path, boundary_bytes: int) -> None:
    job = launch(tmp_path, [], swift={"logging": {"storage_budget_gb": 1e-6}}, iterations=3)
    assert job.code != 0
    errors = re.findall(r"ConfigError: (swift config: logging.storage_budget_gb=1e-06 cannot be met: .*)", job.output)
    assert errors, job.output[-6000:]
    smallest = float(re.search(r"set logging.storage_budget_gb to at least ([\d.e-]+)", errors[0]).group(1))
    assert 8 * boundary_bytes / 1e9 <= smallest <= 1.01 * 8 * boundary_bytes / 1e9
    assert "iteration 3/3" not in job.output  # stopped after the first iteration


def test_a_full_log_disk_stops_logging_loudly_and_a_later_failure_falls_back(
    tmp_path: Path, small_log_disk: Path, reference_tensors: dict[str, torch.Tensor]
) -> None:
    """The log fills its disk around iteration 3: training goes on, each sender says its sends
    are no longer logged, and machine 1's failure in iteration 12 (whose inbound messages are
    gone) recovers from the global checkpoint, announced, bitwise equal to the reference."""
    job = launch(
        tmp_path / "job",
        ["--spares", "1", "--inject", "machine=1,iteration=12,phase=backward"],
        swift={"logging": {"storage": f"file://{small_log_disk}"}},
    )
    assert job.code == 0, job.output[-8000:]
    stopped = re.findall(
        r"rank (\d+): message log on rank \d+ lost records: .*No space left on device.*; message "
        r"logging of this rank's sends stops, training goes on",
        job.output,
    )
    assert {"1", "2"} <= set(stopped), job.output[-6000:]  # both senders across the machine boundary
    (tl,) = job.timelines()
    assert tl["strategy"] == "checkpoint" and tl["checkpoint_step"] == 8, tl
    assert "stopped covering their sends to the failed group" in tl["reason"], tl["reason"]
    assert "checkpoint fallback" in job.output
    assert_bitwise_equal(reference_tensors, job)
