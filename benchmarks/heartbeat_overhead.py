"""Cost of the progress heartbeat (hang detection, ds_swift.detect.progress), failure-free.

Runs the tiny GPT (``configs/gpt_tiny_pp2_dp2_bf16_zero1.json``: bf16, ZeRO-1, pp 2 x dp 2 on 2
simulated machines) under ``ds-swift-launch``, alternately with ``watchdog.hang_timeout_s`` at its
default (every pipeline instruction beats the progress record; the watchdog publishes it with its
heartbeat) and ``null`` (off), ``--rounds`` pairs from this one process (ds_swift.testing.overhead),
and reports the median step time of each and the ratio on / off (1.0 = no overhead).

    python benchmarks/heartbeat_overhead.py            # table
    python benchmarks/heartbeat_overhead.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from ds_swift.testing.jobs import JobSpec, build_deepspeed_shm_op
from ds_swift.testing.overhead import alternate, bench_main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"
CONFIG = ROOT / "configs" / "gpt_tiny_pp2_dp2_bf16_zero1.json"


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.dir or tempfile.mkdtemp(prefix="heartbeat-overhead-"))
    build_deepspeed_shm_op(work / "warm")

    def spec(on: bool) -> JobSpec:
        watchdog = {} if on else {"hang_timeout_s": None}
        return JobSpec(EXAMPLE, CONFIG, args.iterations, swift={"watchdog": watchdog}, loss_log=True)

    runs = alternate(work, spec, args.rounds, args.warmup)
    return {
        "step_s_heartbeat_on": runs.median(True),
        "step_s_heartbeat_off": runs.median(False),
        "step_ratio": runs.ratio,
        "steps_timed": {"on": len(runs.steps[True]), "off": len(runs.steps[False])},
        "dir": str(work),
    }


def table(out: dict[str, Any]) -> None:
    print(
        f"step time, progress heartbeat on : {out['step_s_heartbeat_on'] * 1e3:.1f} ms "
        f"(median of {out['steps_timed']['on']})"
    )
    print(
        f"step time, progress heartbeat off: {out['step_s_heartbeat_off'] * 1e3:.1f} ms "
        f"(median of {out['steps_timed']['off']})"
    )
    print(f"ratio on/off                     : {out['step_ratio']:.3f}")


if __name__ == "__main__":
    bench_main(__doc__, run, table)
