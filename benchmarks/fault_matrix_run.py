"""One case of the fault matrix: its job through the real launcher, and its verdict.

A case passes when its job ends bitwise equal to the failure-free run of its config (recovered
exactly, or through a fallback it announced), within its bound where the config's recoveries are
approximate, or, for a bad config value, stops before training naming the field.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fault_matrix_cases import APPROXIMATE, CONFIG_ENV, CONFIGS, ITERS, LAUNCH, WORKER, Case

from ds_swift.testing.checkpoints import checkpoint_tensors, compare_tensors, relative_distance
from ds_swift.testing.jobs import JobRun, JobSpec, JobTimeout, run_job


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for k, v in extra.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@contextlib.contextmanager
def small_disk(where: Path, size: str = "2m") -> Iterator[Path | None]:
    """A size-limited tmpfs (None where this machine cannot mount one: the case is skipped)."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
    )
    if done.returncode != 0:
        yield None
        return
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def spec_for(case: Case, config_swift: dict[str, Any] | None = None) -> JobSpec:
    path, swift = CONFIGS[case.config]
    spares = LAUNCH.get(case.config, ["--spares", str(case.spares)])
    args = [*spares, "--max-failures", "4"] + (["--inject", case.inject] if case.inject else [])
    return JobSpec(
        WORKER,
        path,
        ITERS,
        args,
        swift=merged(merged(swift, case.swift), config_swift or {}),
        env={**CONFIG_ENV.get(case.config, {}), **case.env},
        nnodes=case.nnodes,
        nproc_per_node=4 // case.nnodes,
    )


def reference(work: Path, config: str, timeout: float) -> JobRun:
    job = run_job(work / f"reference-{config}", spec_for(Case(config, "none")), timeout)
    if job.code != 0 or job.timelines():
        raise RuntimeError(f"the failure-free run of {config} failed (exit {job.code}):\n{job.output[-3000:]}")
    return job


def judge(case: Case, job: JobRun, ref: JobRun | None) -> tuple[bool, str]:
    """(passed, how it ended) for one case's job."""
    if case.bad_field is not None:
        named = f"swift config: {case.bad_field}" in job.output or f"'{case.bad_field}'" in job.output
        return job.code != 0 and named, f"exit {job.code}, " + ("names the field" if named else "field not named")
    if job.code != 0:
        return False, f"exit {job.code}"
    missing = [m for m in case.must_say if m not in job.output]
    if missing:
        return False, f"exit 0, but the output lacks {missing}"
    assert ref is not None
    return verdict(
        checkpoint_tensors(ref.final_tag),
        checkpoint_tensors(job.final_tag),
        job.output,
        job.timelines(),
        APPROXIMATE.get(case.config),
    )


def verdict(
    ref_state: dict[str, Any],
    state: dict[str, Any],
    output: str,
    timelines: list[dict[str, Any]],
    approximate: tuple[float, bool] | None = None,
) -> tuple[bool, str]:
    """(passed, how it ended) of a job that exited 0, from its final state against the failure-free
    run's: bitwise (after an exact recovery, or a fallback it announced), or, where its strategy is
    approximate (``approximate``: the largest relative distance, and whether the job must have
    shrunk), a recovery announced approximate that ends within that distance. Anything else fails:
    never silently different. Shared by the fault matrix of the example (benchmarks/fault_matrix.py)
    and of the real Megatron-DeepSpeed script (benchmarks/megatron_matrix.py)."""
    how = ",".join(t["strategy"] for t in timelines) or "no recovery"
    fallback = "checkpoint fallback" in output
    diff = compare_tensors(ref_state, state)
    if approximate is not None and timelines and not fallback and (approximate[1] or not diff.bitwise_equal):
        bound, must_shrink = approximate
        shrank = any((t.get("resize") or {}).get("kind") == "shrink" for t in timelines)
        said = "APPROXIMATE RECOVERY" in output
        distance = relative_distance(ref_state, state) if not diff.bitwise_equal else 0.0
        ok = (shrank or not must_shrink) and said and distance is not None and distance < bound
        shrink = ("shrank, " if shrank else "NO SHRINK, ") if must_shrink else ""
        return ok, (
            f"{how}: {shrink}{'announced' if said else 'NOT ANNOUNCED'} "
            f"approximate, {'?' if distance is None else f'{distance:.2g}'} from the failure-free run (< {bound:g})"
        )
    if not diff.bitwise_equal:
        return False, f"{how}: NOT bitwise ({diff.describe()[:120]})"
    return True, f"{how}{' (announced fallback)' if fallback else ''}, bitwise"


def report(rows: list[dict[str, Any]], width: int = 36) -> tuple[int, int]:
    """Print the table of a matrix's rows (``case``, ``passed``: True, False or None for skipped,
    ``seconds``, ``how``) and its last line; returns (passed, failed)."""
    marks = {True: "pass", False: "FAIL", None: "skip"}
    print(f"\n{'case':{width}s} {'result':6s} {'seconds':>8s}  how it ended")
    for r in rows:
        print(f"{r['case']:{width}s} {marks[r['passed']]:6s} {r['seconds']:8.1f}  {r['how']}")
    passed = sum(1 for r in rows if r["passed"])
    failed = sum(1 for r in rows if r["passed"] is False)
    skipped = len(rows) - passed - failed
    print(f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    return passed, failed


def run_case(case: Case, work: Path, ref: JobRun | None, timeout: float) -> dict[str, Any]:
    t0 = time.monotonic()
    row: dict[str, Any] = {"case": case.name}
    try:
        if case.small_disk:
            with small_disk(work / f"{case.small_disk}fs", case.disk_size) as disk:
                if disk is None:
                    return {**row, "passed": None, "how": "skipped: cannot mount a tmpfs here", "seconds": 0.0}
                where = (
                    {"checkpoint": {"dir": str(disk)}}
                    if case.small_disk == "ckpt"
                    else {"logging": {"storage": f"file://{disk}"}}
                )
                job = run_job(work / "job", spec_for(case, where), timeout)
                row["ckpt_disk_full_said"] = "could not be written" in job.output
        else:
            job = run_job(work / "job", spec_for(case), timeout)
        passed, how = judge(case, job, ref)
        row.update(passed=passed, how=how, exit=job.code)
    except JobTimeout:
        row.update(passed=False, how=f"HANG: no end within {timeout:.0f} s", exit=None)
    row["seconds"] = round(time.monotonic() - t0, 1)
    return row
