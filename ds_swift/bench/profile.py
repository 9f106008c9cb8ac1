"""The bench's rows as a bench profile: what ``ds-swift simulate --profile bench.json`` reads
(``ds_swift/sim/profile.py``), with each strategy priced by the recovery model its timeline shows."""

from __future__ import annotations

import re
import statistics
from typing import Any

from ds_swift.bench.measure import loss_series, step_seconds
from ds_swift.config import SwiftConfig
from ds_swift.recovery.registry import FALLBACK, GLOBAL_CHECKPOINT, strategies
from ds_swift.recovery.services import StrategyServices
from ds_swift.testing.jobs import JobRun

__all__ = ["PROFILE_NAMES", "bench_profile", "checkpoint_stall_s", "profile_row"]

_CHECKFREQ_CHOICE = re.compile(r"checkfreq: .* a checkpoint every (\d+) iterations")

#: the simulator's strategy name of a bench strategy (``ds-swift simulate --profile`` matches by name):
#: the fallback's synchronous saves are the simulator's global checkpoint, unless the bench ran that too
PROFILE_NAMES = {FALLBACK[0]: GLOBAL_CHECKPOINT}


def _services_named(name: str) -> StrategyServices:
    """The services of the registered strategy ``name`` under the default config (none for a bench
    variant's own name)."""
    try:
        return strategies().get(name).services(SwiftConfig())
    except KeyError:
        return StrategyServices()


def sim_kind(used: str) -> str:
    """The simulator's recovery model of what the recovery timeline says happened: the services'
    ``sim_kind`` of the strategy it names (ds_swift.recovery.services)."""
    return _services_named(used).sim_kind


def checkpoint_stall_s(job: JobRun, interval: int, warmup: int = 2) -> float:
    """Training stall per global checkpoint: the step gaps' excess over the median step, per save."""
    first: dict[int, float] = {}
    for t, i, _ in loss_series(job):
        first.setdefault(i, t)
    iters = [i for i in sorted(first) if i >= warmup]
    gaps = [first[b] - first[a] for a, b in zip(iters, iters[1:], strict=False)]
    # A save after iteration i (global_steps i + 1 a multiple of the interval) falls in the gap after i.
    saves = sum(1 for i in iters[:-1] if (i + 1) % interval == 0)
    if not gaps or not saves:
        return 0.0
    median = statistics.median(gaps)
    return max(0.0, sum(g - median for g in gaps if g > median) / saves)


def profile_row(detail: dict[str, Any], failed: JobRun, clean: JobRun, interval: int) -> dict[str, Any]:
    """A row of the bench profile (``ds_swift.sim.profile.BenchRow``'s fields, nothing else)."""
    chosen = _CHECKFREQ_CHOICE.search(clean.output) if _services_named(detail["strategy"]).checkpoint_tuner else None
    interval = int(chosen.group(1)) if chosen else interval  # CheckFreq chose its own
    timelines = failed.timelines()
    used = timelines[-1]["strategy"] if timelines else FALLBACK[0]
    kind = "elastic" if detail.get("shrunk_throughput") is not None else sim_kind(used)
    lost = detail["iterations_lost"]
    restore = None
    if kind == "logging":  # (and tranlogs)
        # What the simulator calls lost for logging: the iterations the replacement replayed.
        tl = timelines[-1]
        start = int(tl.get("checkpoint_step") or 0)
        lost = max(1, int(tl["pre_failure_iteration"]) - start)
        replay = (tl.get("replay") or {}).get("replay_s")
        restore = max(0.0, detail["recovery_s"] - replay) if replay is not None else None
    ulp = detail["max_ulp"]
    return {
        "name": PROFILE_NAMES.get(detail["strategy"], detail["strategy"]),
        "kind": kind,  # CheckFreq's two phases as measured: a checkpoint with its snapshot stall
        "throughput_ratio": detail["throughput_ratio"],
        "init_s": detail["initialization_s"] or 0.0,
        "recovery_s": detail["recovery_s"] or 0.0,
        "restore_s": restore,
        "iterations_lost": lost,
        "bytes_per_iteration": detail["bytes_per_iteration"],
        "host_memory_per_rank": detail["host_memory_per_rank"],
        "exact": detail["bitwise"],
        "max_ulp": 0 if detail["bitwise"] else (int(ulp) if ulp != float("inf") else None),
        "final_loss_delta": detail["final_loss_delta"],
        "checkpoint_interval": interval,
        "checkpoint_cost_s": checkpoint_stall_s(clean, interval),
        **({"shrunk_throughput": min(0.999, detail["shrunk_throughput"])} if kind == "elastic" else {}),
    }


def bench_profile(
    reference: JobRun, runs: dict[str, tuple[JobRun, JobRun]], details: list[dict[str, Any]], interval: int
) -> dict[str, Any]:
    """What ``ds-swift simulate --profile`` reads (ds_swift/sim/profile.py)."""
    rows = [profile_row(d, runs[d["strategy"]][1], runs[d["strategy"]][0], interval) for d in details]
    if GLOBAL_CHECKPOINT in runs:  # then the fallback (synchronous saves) keeps its own name
        for row, d in zip(rows, details, strict=True):
            if d["strategy"] == FALLBACK[0]:
                row["name"], row["kind"] = f"{FALLBACK[0]}_sync", "checkpoint"
    costs = [r["checkpoint_cost_s"] for r in rows if r["name"] == GLOBAL_CHECKPOINT] or [
        statistics.median(r["checkpoint_cost_s"] for r in rows)
    ]
    return {
        "version": 1,
        "iteration_time_s": step_seconds(reference),
        "checkpoint_interval": interval,
        "checkpoint_cost_s": costs[0],
        "strategies": rows,
    }
