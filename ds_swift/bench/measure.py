"""What a finished ``ds-swift bench`` job shows: its step time, an elastic shrink's speed, the bytes
it wrote and held, its peak memory, its loss curve (``ds_swift.bench.run`` builds its rows from these)."""

from __future__ import annotations

import json
import statistics
from typing import Any

from ds_swift.bench.demo_report import read_loss_log
from ds_swift.testing.jobs import JobRun

__all__ = ["PeakRss", "final_loss", "loss_series", "peak_rss", "shrunk_throughput", "step_seconds", "usage"]


def step_seconds(job: JobRun, warmup: int = 2) -> float | None:
    """Median time between consecutive iterations' loss lines (first run of each iteration only)."""
    first: dict[int, float] = {}
    for line in job.loss_log.read_text().splitlines() if job.loss_log.exists() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        first.setdefault(int(rec["iteration"]), float(rec["time"]))
    times = [first[i] for i in sorted(first) if i >= warmup]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


def shrunk_throughput(job: JobRun, timelines: list[dict[str, Any]], warmup: int = 2) -> float | None:
    """An elastic shrink's speed: the median step time before the failure over the one after the
    job went on without the failed machine (None: no shrink, or too few steps on either side)."""
    shrink = next((tl for tl in timelines if (tl.get("resize") or {}).get("kind") == "shrink"), None)
    if shrink is None:
        return None
    first: dict[int, float] = {}
    for t, i, _ in loss_series(job):
        first.setdefault(i, t)
    resumed = int(shrink["consensus"]) + 1

    def median_gap(iters: list[int]) -> float | None:
        gaps = [first[b] - first[a] for a, b in zip(iters, iters[1:], strict=False) if b == a + 1]
        return statistics.median(gaps) if gaps else None

    before = median_gap([i for i in sorted(first) if warmup <= i <= resumed - 1])
    after = median_gap([i for i in sorted(first) if i > resumed])  # the first step after it pays the rebuild
    return before / after if before and after else None


def usage(job: JobRun) -> dict[str, int]:
    """Summed log/buddy bytes and the largest peak RSS over the ranks' usage records."""
    records = []
    for path in sorted((job.run_dir / "usage").glob("rank*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except ValueError:
            continue
    ckpt = sum(f.stat().st_size for f in job.ckpt_dir.rglob("*") if f.is_file()) if job.ckpt_dir.exists() else 0
    return {
        "ranks_reporting": len(records),
        "log_bytes": sum(int(r.get("log_bytes", 0)) for r in records),
        "checkpoint_bytes": ckpt,
        "buddy_host_bytes_max": max((int(r.get("buddy_host_bytes", 0)) for r in records), default=0),
        "buddy_bytes_sent": sum(int(r.get("buddy_bytes_sent", 0)) for r in records),
        "max_rss_bytes": peak_rss(job),
    }


def peak_rss(job: JobRun) -> int:
    """The largest resident memory of one of the job's ranks (``PeakRss``, written by the bench)."""
    try:
        return int(json.loads((job.dir / "peak_rss.json").read_text())["max_rss_bytes"])
    except (OSError, ValueError, KeyError):
        return 0


class PeakRss:
    """``run_job``'s on_poll: the largest resident memory any of the job's training processes
    reached (sampled every ~0.2 s; the processes are those whose command line names the job's
    config). The same sampling for every job, ds-swift on or off."""

    def __init__(self) -> None:
        self.peak = 0

    def __call__(self, job: JobRun) -> None:
        import psutil

        config = str(job.dir / "ds_config.json")
        for proc in psutil.process_iter(["cmdline", "memory_info"]):
            cmd, mem = proc.info.get("cmdline") or [], proc.info.get("memory_info")
            if mem is not None and config in cmd and "--local_rank" in " ".join(cmd):
                self.peak = max(self.peak, int(mem.rss))


def loss_series(job: JobRun) -> list[tuple[float, int, float]]:
    """``(seconds since the first loss line, iteration, loss)`` in the order written."""
    out = []
    for line in job.loss_log.read_text().splitlines() if job.loss_log.exists() else []:
        try:
            rec = json.loads(line)
            out.append((float(rec["time"]), int(rec["iteration"]), float(rec["loss"])))
        except (ValueError, KeyError):
            continue
    t0 = out[0][0] if out else 0.0
    return [(t - t0, i, loss) for t, i, loss in out]


def final_loss(job: JobRun) -> float | None:
    points = read_loss_log(job.loss_log)
    return points[-1].loss if points else None
