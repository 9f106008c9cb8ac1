"""``ds-swift bench`` as a new user runs it (issue 34 item 6): every strategy's requirements are
checked before any job runs, and a strategy whose job fails costs its own row only. A fake runner
stands in for the jobs (they run for real in tests/dist/test_bench_cli.py)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ds_swift.bench.run as bench
from ds_swift.testing.jobs import JobRun, JobSpec


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


class FakeRunner:
    """Writes what a finished job leaves (loss log, final state, a timeline); fails the jobs named."""

    def __init__(self, fail: set[str]) -> None:
        self.fail, self.ran = fail, []  # type: list[str]

    def __call__(
        self, directory: str | Path, spec: JobSpec, timeout_s: float, on_poll: Callable[[JobRun], None] | None = None
    ) -> JobRun:
        job = JobRun(Path(directory), spec.iterations, code=0, seconds=1.0)
        self.ran.append(job.dir.name)
        if job.dir.name in self.fail:
            job.code, job.output = 1, "worker 3 exited 1\nBuddyError: boom"
        job.final_tag.mkdir(parents=True)
        torch.save({"module": {"w": torch.ones(3)}}, job.final_tag / "mp_rank_00_model_states.pt")
        job.loss_log.write_text(
            "".join(
                json.dumps({"iteration": i, "loss": 3.0 - i / 10, "time": 100.0 + i}) + "\n"
                for i in range(spec.iterations)
            )
        )
        (job.run_dir / "usage").mkdir(parents=True)
        if "--inject" in spec.launcher_args:
            tl = {
                "strategy": "checkpoint",
                "reason": "forced",
                "total_s": 2.0,
                "initialization_s": 1.0,
                "recovery_s": 1.0,
            }
            (job.run_dir / "timeline-gen0.json").write_text(json.dumps(tl))
        return job


@pytest.fixture(autouse=True)
def no_shm_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "build_deepspeed_shm_op", lambda where: None)


def test_a_strategy_the_machines_cannot_serve_is_refused_before_any_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runner = FakeRunner(set())
    args = parse("--strategies", "global_checkpoint,checkfreq,tranlogs,pipechurn", "--run-dir", str(tmp_path))
    assert bench.run(args, runner=runner) == 2
    err = capsys.readouterr().err
    assert "pipechurn cannot run" in err and "--nnodes 4" in err, err
    assert runner.ran == []  # nothing trained for minutes first
    runner = FakeRunner(set())
    args = parse(
        "--strategies",
        "global_checkpoint,pipechurn",
        "--nnodes",
        "4",
        "--iterations",
        "4",
        "--kill-iteration",
        "2",
        "--run-dir",
        str(tmp_path / "four"),
    )
    assert bench.run(args, runner=runner) == 0
    assert "pipechurn-failure" in runner.ran


def test_a_failed_strategy_keeps_the_rows_that_finished(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runner = FakeRunner({"global_checkpoint-failure"})
    args = parse(
        "--strategies",
        "checkpoint,global_checkpoint,checkfreq",
        "--iterations",
        "4",
        "--kill-iteration",
        "2",
        "--run-dir",
        str(tmp_path),
    )
    assert bench.run(args, runner=runner) == 1
    out, err = capsys.readouterr()
    assert "checkfreq-failure" in runner.ran  # the strategy after the failed one still ran
    rows = [line.split()[0] for line in out.splitlines() if line.split()]
    assert "checkpoint" in rows and "checkfreq" in rows
    failed = [line for line in out.splitlines() if line.startswith("global_checkpoint")]
    assert len(failed) == 1 and "FAILED: global_checkpoint (failure): exit 1" in failed[0], out
    assert "global_checkpoint failed" in err
    result = json.loads((tmp_path / "bench.json").read_text())
    assert [d["strategy"] for d in result["details"]] == ["checkpoint", "checkfreq"]
    assert list(result["failed"]) == ["global_checkpoint"]


def test_only_failures_still_say_which_and_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runner = FakeRunner({"checkpoint-clean"})
    args = parse("--strategies", "checkpoint", "--iterations", "4", "--kill-iteration", "2", "--run-dir", str(tmp_path))
    assert bench.run(args, runner=runner) == 1
    assert "checkpoint   FAILED: checkpoint (no failure): exit 1" in capsys.readouterr().out
