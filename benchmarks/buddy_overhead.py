"""Cost of buddy copies of ZeRO-1 / BF16_Optimizer partitions (ds_swift.protect.buddy), failure-free.

Runs the tiny GPT (``configs/gpt_tiny_pp2_dp2_bf16_zero1.json``: bf16, ZeRO-1, pp 2 x dp 2 on 2
simulated machines) under ``ds-swift-launch``, alternately with ``buddy.enabled`` on and off
(``--rounds`` pairs, in rotated order, all started from this one process: ds_swift.testing.overhead), and reports:

- step time: the median interval between consecutive iterations' loss lines (after ``--warmup``
  iterations), per variant, and the ratio on / off (1.0 = no overhead);
- buddy bytes per rank per iteration: what each rank logged it sends per round (``buddy copies:
  N bytes per iteration``), against the analytic figure of ``ds-swift plan``
  (ds_swift.plan.buddy_cost: params / (pp x tp x dp) x 12 bytes for AdamW), with the model's
  parameter count read from the final checkpoint.

    python benchmarks/buddy_overhead.py            # table
    python benchmarks/buddy_overhead.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from ds_swift.config import SwiftConfig
from ds_swift.plan.buddy_cost import buddy_cost
from ds_swift.plan.layout import ParallelLayout
from ds_swift.testing.jobs import JobRun, JobSpec, build_deepspeed_shm_op
from ds_swift.testing.overhead import alternate, bench_main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"
CONFIG = ROOT / "configs" / "gpt_tiny_pp2_dp2_bf16_zero1.json"
_SENT = re.compile(r"buddy copies: (\d+) bytes per copy")


def sent_per_rank(job: JobRun) -> list[int]:
    text = "\n".join(p.read_text(errors="replace") for p in sorted(job.proc_logs.glob("*")) if p.is_file())
    return [int(m) for m in _SENT.findall(text)]


def model_params(job: JobRun) -> int:
    """Parameters of the whole model: the layer files of the final checkpoint (one per layer)."""
    total = 0
    for path in sorted(job.final_tag.glob("layer_*-model_states.pt")):
        state = torch.load(path, map_location="cpu", weights_only=False)
        total += sum(t.numel() for t in state.values() if isinstance(t, torch.Tensor) and t.is_floating_point())
    return total


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.dir or tempfile.mkdtemp(prefix="buddy-overhead-"))
    build_deepspeed_shm_op(work / "warm")
    runs = alternate(
        work,
        lambda on: JobSpec(EXAMPLE, CONFIG, args.iterations, swift={"buddy": {"enabled": on}}, loss_log=True),
        args.rounds,
        args.warmup,
    )
    last = runs.last[True]
    sent = sent_per_rank(last)
    ds = json.loads(CONFIG.read_text())
    layout = ParallelLayout(tp=1, pp=2, dp=2, gpus_per_node=2, order="tp-pp-dp")
    params = model_params(last)
    analytic = buddy_cost(ds, SwiftConfig.from_dict(ds["swift"]), layout, params)
    on_s, off_s = runs.median(True), runs.median(False)
    return {
        "step_s_buddy_on": on_s,
        "step_s_buddy_off": off_s,
        "step_ratio": on_s / off_s,
        "steps_timed": {"on": len(runs.steps[True]), "off": len(runs.steps[False])},
        "model_params": params,
        "buddy_bytes_per_rank_per_iteration_measured": statistics.mean(sent) if sent else None,
        "buddy_bytes_per_rank_per_iteration_measured_all": sorted(set(sent)),
        "buddy_bytes_per_rank_per_iteration_analytic": analytic.network_bytes_per_rank_per_iteration,
        "buddy_host_bytes_per_rank_analytic": analytic.host_bytes_per_rank,
        "dir": str(work),
    }


def table(out: dict[str, Any]) -> None:
    print(f"step time, buddy on : {out['step_s_buddy_on'] * 1e3:.1f} ms (median of {out['steps_timed']['on']})")
    print(f"step time, buddy off: {out['step_s_buddy_off'] * 1e3:.1f} ms (median of {out['steps_timed']['off']})")
    print(f"ratio on/off        : {out['step_ratio']:.3f}")
    print(
        f"buddy bytes / rank / iteration: measured {out['buddy_bytes_per_rank_per_iteration_measured']} "
        f"(per rank {out['buddy_bytes_per_rank_per_iteration_measured_all']}), "
        f"analytic {out['buddy_bytes_per_rank_per_iteration_analytic']} ({out['model_params']} params)"
    )


if __name__ == "__main__":
    bench_main(__doc__, run, table)
