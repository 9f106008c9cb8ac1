"""``ds-swift bench``'s jobs as a new user meets them: every strategy's requirements checked before
anything runs (a strategy the job's machines cannot serve is named with the flag that fixes it, not
found after the others trained for minutes), and a strategy whose job fails costs its own row only
(the table keeps the rows that finished, and says which strategy failed and why).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from ds_swift.testing.jobs import JobRun, JobSpec, job_config

__all__ = ["BenchError", "Runner", "failed_rows", "infeasible_strategies", "run_strategies"]


class BenchError(RuntimeError):
    """A job of the bench failed; the message names it and its log directory."""


class JobSetup(Protocol):
    """What the bench's jobs are built from (:class:`ds_swift.bench.run.BenchSetup`; a protocol, so that
    this module does not import the bench back)."""

    def spec(self, strategy: str, failure: bool) -> JobSpec: ...


class Runner(Protocol):
    """Runs one job to its end (:func:`ds_swift.testing.jobs.run_job`)."""

    def __call__(
        self, directory: str | Path, spec: JobSpec, timeout_s: float, on_poll: Callable[[JobRun], None] | None = None
    ) -> JobRun: ...


def infeasible_strategies(setup: JobSetup, names: Iterable[str]) -> dict[str, str]:
    """strategy -> why the bench's machines cannot serve it (the flag to change named), for those
    that cannot; each checked with its failure run's config and launcher flags, as ds-swift-launch
    would check it (:mod:`ds_swift.launch.preflight`)."""
    from ds_swift.launch.preflight import check_job

    out: dict[str, str] = {}
    for name in names:
        spec = setup.spec(name, failure=True)
        config = job_config(spec, JobRun(Path("bench-check"), spec.iterations))
        whys = check_job(config, spec.script_args, spec.nnodes, spec.nproc_per_node, "--elastic" in spec.launcher_args)
        if whys:
            out[name] = "; ".join(whys)
    return out


def run_strategies(
    names: Iterable[str], job: Callable[[str, bool], JobRun]
) -> tuple[dict[str, tuple[JobRun, JobRun]], dict[str, str]]:
    """Each strategy's failure-free then failure job; returns the strategies whose two jobs finished,
    and strategy -> why for those whose job failed (the next strategy runs all the same)."""
    runs: dict[str, tuple[JobRun, JobRun]] = {}
    failed: dict[str, str] = {}
    for name in names:
        try:
            runs[name] = (job(name, False), job(name, True))
        except BenchError as exc:
            failed[name] = str(exc)
    return runs, failed


def failed_rows(failed: dict[str, Any]) -> list[str]:
    """Table lines for the strategies whose job failed: the name and the first line of why."""
    if not failed:
        return []
    width = max(12, *(len(n) for n in failed))
    return [
        f"{name:{width}s} FAILED: {str(why).splitlines()[0] if why else 'no reason given'}"
        for name, why in failed.items()
    ]
