"""End to end for ``benchmarks/scale.py --end-to-end``: kill -> back of the tiny GPT with real ranks.

The replication job of benchmarks/recovery_time.py (``examples/pretrain_gpt.py``,
``configs/gpt_tiny_pp2_dp2.json``: machines of 2 ranks, each a pipeline of 2 stages, so N ranks are
pp 2 x dp N/2) on N/2 simulated machines under ``ds-swift-launch --fork-server`` with one warm
spare; machine 1 is killed in a backward pass. Each run's recovery timeline (written by the job)
gives kill -> back and its phases. On a machine of few cores the ranks share them: the figures grow
with N for that reason too, which the model's error at the largest N then shows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ds_swift.testing.jobs import JobSpec, run_job

__all__ = ["end_to_end"]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"
CONFIG = ROOT / "configs" / "gpt_tiny_pp2_dp2.json"
INTERVAL = 4
KILL_AT = INTERVAL + INTERVAL // 2


def one(work: Path, ranks: int, timeout_s: float) -> dict[str, Any]:
    spec = JobSpec(
        EXAMPLE,
        CONFIG,
        KILL_AT + 2,
        ["--spares", "1", "--inject", f"machine=1,iteration={KILL_AT},phase=backward"],
        swift={"strategy": "auto", "checkpoint": {"interval": INTERVAL}},
        nnodes=ranks // 2,
        nproc_per_node=2,
        save=False,
        fork_server=True,
    )
    job = run_job(work, spec, timeout_s)
    if job.code != 0:
        raise RuntimeError(f"{ranks} ranks: the job failed with exit code {job.code}:\n{job.output[-3000:]}")
    kills = [t for t in job.timelines() if t.get("failed_machine") is not None]
    if len(kills) != 1:
        raise RuntimeError(f"{ranks} ranks: {len(kills)} machine recoveries, not the one injected")
    (tl,) = kills
    keep = ("total_s", "initialization_s", "recovery_s", "strategy", "phases")
    return {k: tl.get(k) for k in keep}


def end_to_end(work: Path, ranks: list[int], timeout_s: float = 600.0) -> dict[str, Any]:
    """{N: kill -> back and its phases} for each N (an even number of ranks, 4 or more)."""
    return {str(n): one(work / f"ranks{n}", n, timeout_s) for n in ranks}
