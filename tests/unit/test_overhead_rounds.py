"""The overhead benchmark's round-by-round ratios (ds_swift.testing.overhead.Interleaved)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ds_swift.testing import overhead
from ds_swift.testing.jobs import JobRun
from ds_swift.testing.overhead import Interleaved


def test_round_ratios_pair_each_rounds_jobs_and_the_pooled_ratio_stays_the_median_one() -> None:
    runs = Interleaved()
    for name, rounds in {"on": [[1.0, 1.2, 1.1], [2.0, 2.2, 2.4]], "off": [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]}.items():
        for steps in rounds:
            runs.steps[name] += steps
            runs.job_medians[name].append(sorted(steps)[1])
    assert runs.round_ratios("on", "off") == pytest.approx([1.1, 1.1])
    assert runs.median_round_ratio("on", "off") == pytest.approx(1.1)
    runs.job_medians["on"] += [4.0, float("nan")]  # a slow round, and one with no timed step (left out)
    runs.job_medians["off"] += [2.0, 3.0]
    assert runs.median_round_ratio("on", "off") == pytest.approx(1.1)  # of 1.1, 1.1 and 2.0 (mean: 1.4)
    assert runs.ratio("on", "off") == pytest.approx(1.6 / 1.5)  # medians of the pooled steps


def test_a_rerun_in_the_same_directory_times_only_its_own_steps(tmp_path: Path, monkeypatch: Any) -> None:
    calls = [0]

    def fake_job(directory: Path, spec: Any, timeout_s: float, on_poll: Any = None) -> JobRun:
        job = JobRun(Path(directory), 4)
        job.dir.mkdir(parents=True, exist_ok=True)
        with job.loss_log.open("a") as f:  # as the example writes it: appended
            for it in range(4):
                f.write(json.dumps({"iteration": it, "time": 1000.0 * calls[0] + 0.5 * it}) + "\n")
        calls[0] += 1
        job.code = 0
        return job

    monkeypatch.setattr(overhead, "run_job", fake_job)
    spec = SimpleNamespace(iterations=4)
    specs: dict[str, Any] = {"on": spec, "off": spec}
    for _ in range(2):  # the second run finds the first one's job directories
        runs = overhead.interleave(tmp_path, specs, rounds=1, warmup=1)
        assert runs.steps["on"] == [0.5, 0.5] and runs.steps["off"] == [0.5, 0.5]
