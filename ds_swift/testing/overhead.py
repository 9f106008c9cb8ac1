"""Failure-free overhead of a feature: the same job in two or more variants, side by side.

All variants run from one process, interleaved (``rounds`` rounds, the order rotated each round,
so that drift of a shared noisy machine hits every variant alike); the step time of a run is the
interval between consecutive iterations' loss lines (``--loss-log``), after ``warmup`` iterations.

Each job's process tree is also sampled for CPU time (ds_swift.testing.cpu_sampler) once its loss
log passes ``warmup`` and again a few iterations before its end: CPU seconds per iteration per
thread name, summed over the ranks. On a loaded machine the wall clock is noisy; CPU time says
where the cost is.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds_swift.testing.cpu_sampler import CpuSample, per_iteration, sample_tree
from ds_swift.testing.jobs import JobRun, JobSpec, run_job

__all__ = ["Interleaved", "OnOff", "add_arguments", "alternate", "bench_main", "interleave", "step_times"]

#: iterations before a job's last at which its second CPU sample is taken (before its teardown)
_END_MARGIN = 2


def step_times(job: JobRun, warmup: int) -> list[float]:
    """Seconds between consecutive iterations' loss lines, from iteration ``warmup`` on."""
    lines = [json.loads(line) for line in job.loss_log.read_text().splitlines() if line.strip()]
    times = [r["time"] for r in sorted(lines, key=lambda r: r["iteration"]) if r["iteration"] >= warmup]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def _last_iteration(job: JobRun) -> int:
    """The newest iteration in the job's loss log (-1: none yet)."""
    try:
        text = job.loss_log.read_text()
    except OSError:
        return -1
    last = -1
    for line in text.splitlines():
        try:
            last = max(last, int(json.loads(line)["iteration"]))
        except (ValueError, KeyError):
            continue  # a line being written
    return last


class _CpuWindow:
    """Samples a running job's CPU time at iteration ``warmup`` and near its end (its on_poll)."""

    def __init__(self, warmup: int, iterations: int) -> None:
        self.start_at, self.end_at = warmup, max(warmup + 1, iterations - 1 - _END_MARGIN)
        self.a: tuple[int, CpuSample] | None = None
        self.b: tuple[int, CpuSample] | None = None

    def __call__(self, job: JobRun) -> None:
        if self.b is not None or job.pid is None:
            return
        it = _last_iteration(job)
        if self.a is None and it >= self.start_at:
            self.a = (it, sample_tree(job.pid))
        elif self.a is not None and it >= self.end_at:
            self.b = (it, sample_tree(job.pid))

    def result(self) -> dict[tuple[str, str], float] | None:
        """CPU seconds per iteration by (role, thread), or None where the window was not seen."""
        if self.a is None or self.b is None or self.b[0] <= self.a[0]:
            return None
        return per_iteration(self.a[1], self.b[1], self.b[0] - self.a[0])


@dataclass
class Interleaved:
    """Step times and CPU time per iteration of each variant, and the last job of each."""

    steps: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    cpu: dict[str, list[dict[tuple[str, str], float]]] = field(default_factory=lambda: defaultdict(list))
    """Per job of the variant: CPU seconds per iteration by (role, thread name)."""
    last: dict[str, JobRun] = field(default_factory=dict)
    job_medians: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    """Per job of the variant, in round order: its median step time (NaN: no step timed)."""

    def median(self, name: str) -> float:
        return statistics.median(self.steps[name])

    def round_ratios(self, name: str, base: str) -> list[float]:
        """Round by round: ``name``'s job median step / ``base``'s. Their spread is the noise the
        machine adds between jobs (which cores the ranks share, what else runs): a difference
        between variants smaller than it is not measured by these rounds."""
        return [a / b for a, b in zip(self.job_medians[name], self.job_medians[base], strict=True)]

    def median_round_ratio(self, name: str, base: str) -> float:
        """The median of :meth:`round_ratios` (rounds with no timed step left out): each round's own
        comparison, so a job whose machine was slower throughout moves it less than the pooled ratio."""
        ratios = [r for r in self.round_ratios(name, base) if not math.isnan(r)]
        return statistics.median(ratios) if ratios else math.nan

    def ratio(self, name: str, base: str) -> float:
        """Median step time of ``name`` / that of ``base`` (1.0: no overhead)."""
        return self.median(name) / self.median(base)

    def cpu_per_iteration(self, name: str) -> dict[tuple[str, str], float]:
        """CPU seconds per iteration by (role, thread name), the median over the variant's jobs."""
        jobs = self.cpu.get(name, [])
        keys = {k for j in jobs for k in j}
        return {k: statistics.median(j.get(k, 0.0) for j in jobs) for k in sorted(keys)} if jobs else {}

    def cpu_total(self, name: str, role: str | None = None) -> float | None:
        """CPU seconds per iteration of the whole tree (or of ``role``), median over the jobs."""
        jobs = self.cpu.get(name, [])
        if not jobs:
            return None
        return statistics.median(sum(v for (r, _), v in j.items() if role is None or r == role) for j in jobs)


def interleave(
    work: Path, specs: Mapping[str, JobSpec], rounds: int, warmup: int, timeout_s: float = 600.0
) -> Interleaved:
    """Run every spec ``rounds`` times, interleaved: round ``r`` starts at the ``r``-th variant."""
    out = Interleaved()
    names = list(specs)
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(i + r) % len(names)]
            spec = specs[name]
            window = _CpuWindow(warmup, spec.iterations)
            job_dir = work / f"round{r}-{name}"
            # The example appends to its loss log: a job directory left by an earlier run with the same
            # --dir would mix that run's lines into this one's step times (seen: 180 s "steps").
            shutil.rmtree(job_dir, ignore_errors=True)
            job = run_job(job_dir, spec, timeout_s=timeout_s, on_poll=window)
            if job.code != 0:
                raise SystemExit(f"job {name} failed ({job.code}):\n{job.output[-3000:]}")
            steps = step_times(job, warmup)
            out.steps[name] += steps
            # NaN for a job with no timed steps: round r's medians stay paired with round r's.
            out.job_medians[name].append(statistics.median(steps) if steps else math.nan)
            # One line per job as it ends: a run stopped at its time limit still says what it measured.
            print(
                f"round {r} {name}: median step {out.job_medians[name][-1]:.4f} s over {len(steps)} steps",
                file=sys.stderr,
                flush=True,
            )
            cpu = window.result()
            if cpu is not None:
                out.cpu[name].append(cpu)
            out.last[name] = job
    return out


@dataclass
class OnOff:
    """Step times of both variants, and the last job of each."""

    steps: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})
    last: dict[bool, JobRun] = field(default_factory=dict)
    runs: Interleaved | None = None
    """The same runs by variant name (``on``/``off``), with their CPU time."""

    def median(self, on: bool) -> float:
        return statistics.median(self.steps[on])

    @property
    def ratio(self) -> float:
        """Median step time on / off (1.0: no overhead)."""
        return self.median(True) / self.median(False)


def alternate(work: Path, spec_for: Callable[[bool], JobSpec], rounds: int, warmup: int) -> OnOff:
    """Run ``spec_for(True)`` and ``spec_for(False)`` ``rounds`` times each, alternately."""
    runs = interleave(work, {"on": spec_for(True), "off": spec_for(False)}, rounds, warmup)
    out = OnOff(runs=runs)
    for on, name in ((True, "on"), (False, "off")):
        out.steps[on] = list(runs.steps[name])
        out.last[on] = runs.last[name]
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
