"""Failure-free overhead of a feature: the same job with it on and off, side by side.

Both variants run from one process, alternately (``rounds`` pairs, the order rotated each round,
so that drift of a shared noisy machine hits both alike); the step time of a run is the interval
between consecutive iterations' loss lines (``--loss-log``), after ``warmup`` iterations.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds_swift.testing.jobs import JobRun, JobSpec, run_job

__all__ = ["OnOff", "add_arguments", "alternate", "bench_main", "step_times"]


def step_times(job: JobRun, warmup: int) -> list[float]:
    """Seconds between consecutive iterations' loss lines, from iteration ``warmup`` on."""
    lines = [json.loads(line) for line in job.loss_log.read_text().splitlines() if line.strip()]
    times = [r["time"] for r in sorted(lines, key=lambda r: r["iteration"]) if r["iteration"] >= warmup]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


@dataclass
class OnOff:
    """Step times of both variants, and the last job of each."""

    steps: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})
    last: dict[bool, JobRun] = field(default_factory=dict)

    def median(self, on: bool) -> float:
        return statistics.median(self.steps[on])

    @property
    def ratio(self) -> float:
        """Median step time on / off (1.0: no overhead)."""
        return self.median(True) / self.median(False)


def alternate(work: Path, spec_for: Callable[[bool], JobSpec], rounds: int, warmup: int) -> OnOff:
    """Run ``spec_for(True)`` and ``spec_for(False)`` ``rounds`` times each, alternately."""
    out = OnOff()
    for r in range(rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            job = run_job(work / f"round{r}-{'on' if on else 'off'}", spec_for(on), timeout_s=600)
            if job.code != 0:
                raise SystemExit(f"job failed ({job.code}):\n{job.output[-3000:]}")
            out.steps[on] += step_times(job, warmup)
            out.last[on] = job
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """An overhead benchmark's flags: --rounds, --iterations, --warmup, --dir, --json."""
    p.add_argument("--rounds", type=int, default=2, help="on/off pairs (default 2)")
    p.add_argument("--iterations", type=int, default=40, help="iterations per job (default 40)")
    p.add_argument("--warmup", type=int, default=5, help="iterations not timed (default 5)")
    p.add_argument("--dir", default=None, help="where the jobs run (default: a temporary directory)")
    p.add_argument("--json", action="store_true")


def bench_main(
    doc: str,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    table: Callable[[dict[str, Any]], None],
    more_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> None:
    """An overhead benchmark's command line: its flags (and ``more_arguments``' own), then a table or
    (``--json``) one JSON object."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_arguments(p)
    if more_arguments is not None:
        more_arguments(p)
    args = p.parse_args()
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        table(out)
