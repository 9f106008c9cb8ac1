"""Cost of verified recovery's state digests (ds_swift.protect.digest_publisher), failure-free.

Runs the tiny GPT under ``ds-swift-launch`` (default ``configs/gpt_tiny_pp4.json``: pp 4 on 2
simulated machines, message logging on: the strategy whose replays are checked against these
digests), alternately with ``verify.enabled`` on and off (``--rounds`` pairs, in rotated order, all
started from this one process: ds_swift.testing.overhead), every rank publishing its digest every
``--interval`` iterations, and reports:

- step time: the median interval between consecutive iterations' loss lines (after ``--warmup``
  iterations), per variant, and the ratio on / off (1.0 = no overhead);
- the digest's own cost per rank, as each rank logged it at the end (``state digests: N
  published, X ms each in the background; training waited Y ms for them in all``).

    python benchmarks/digest_overhead.py                      # table
    python benchmarks/digest_overhead.py --rounds 1 --iterations 20 --json
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

from ds_swift.testing.jobs import JobRun, JobSpec, build_deepspeed_shm_op
from ds_swift.testing.overhead import alternate, bench_main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"
CONFIG = ROOT / "configs" / "gpt_tiny_pp4.json"
_COST = re.compile(
    r"state digests: (\d+) published, ([\d.]+) ms each in the background; the training thread "
    r"spent ([\d.]+) ms each handing them over and waited ([\d.]+) ms for them in all"
)


def digest_costs(job: JobRun) -> list[dict[str, float]]:
    """Each rank's digests: how many, ms each in the background, ms each of the training thread's
    hand-over, ms the training thread waited in all."""
    text = "\n".join(p.read_text(errors="replace") for p in sorted(job.proc_logs.glob("*")) if p.is_file())
    keys = ("published", "background_ms", "handoff_ms", "waited_ms")
    return [dict(zip(keys, map(float, m), strict=True)) for m in _COST.findall(text)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.dir or tempfile.mkdtemp(prefix="digest-overhead-"))
    build_deepspeed_shm_op(work / "warm")
    config = Path(args.config)

    def spec(on: bool) -> JobSpec:
        verify = {"enabled": on, "digest_interval": args.interval}
        return JobSpec(EXAMPLE, config, args.iterations, swift={"verify": verify}, loss_log=True)

    runs = alternate(work, spec, args.rounds, args.warmup)
    costs = digest_costs(runs.last[True])
    on_s, off_s = runs.median(True), runs.median(False)
    return {
        "config": str(config),
        "digest_interval": args.interval,
        "step_s_verify_on": on_s,
        "step_s_verify_off": off_s,
        "step_ratio": on_s / off_s,
        "steps_timed": {"on": len(runs.steps[True]), "off": len(runs.steps[False])},
        "digest_costs_per_rank": costs,
        "digest_ms_mean": statistics.mean(c["background_ms"] for c in costs) if costs else None,
        # what the training thread itself paid per digest: the hand-over, and any wait before a step
        "training_thread_ms_per_digest": (
            statistics.mean(c["handoff_ms"] + c["waited_ms"] / c["published"] for c in costs) if costs else None
        ),
        "dir": str(work),
    }


def table(out: dict[str, Any]) -> None:
    print(f"config: {out['config']}, a digest every {out['digest_interval']} iteration(s)")
    print(f"step time, verify on : {out['step_s_verify_on'] * 1e3:.1f} ms (median of {out['steps_timed']['on']})")
    print(f"step time, verify off: {out['step_s_verify_off'] * 1e3:.1f} ms (median of {out['steps_timed']['off']})")
    print(f"ratio on/off         : {out['step_ratio']:.3f}")
    if out["digest_ms_mean"] is not None:
        per_rank = [round(c["background_ms"], 2) for c in out["digest_costs_per_rank"]]
        print(
            f"digest per rank      : {out['digest_ms_mean']:.2f} ms in the background (per rank {per_rank}); "
            f"the training thread paid {out['training_thread_ms_per_digest']:.3f} ms per digest"
        )


def more_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(CONFIG), help=f"the DeepSpeed config (default {CONFIG.relative_to(ROOT)})")
    p.add_argument("--interval", type=int, default=1, help="verify.digest_interval (default 1, the config's)")


if __name__ == "__main__":
    bench_main(__doc__, run, table, more_arguments)
