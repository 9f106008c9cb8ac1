"""Failure-free cost of ds-swift with its defaults: the same GPT job with swift on and off, interleaved.

Both variants go through ``ds-swift-launch`` and ``examples/pretrain_gpt.py``, alternately
(``--rounds`` pairs in rotated order: ds_swift.testing.overhead); a step is the interval between
consecutive iterations' loss lines after ``--warmup`` iterations. "On" is ``"swift": {"enabled":
true}`` with nothing else set but ``machines.gpus_per_node`` (every other value is ds-swift's
default: strategy auto, a digest every ``verify.digest_interval`` iterations, a checkpoint every
``checkpoint.interval``); "off" is ``"enabled": false`` (plain DeepSpeed). The budget is 2 % on a GPU
and 5 % on the tiny CPU GPT.

    # the GPU figure (issue 29): 1 rank, GPT 8 x 1024, seq 512, global batch 32, bf16 + ZeRO-1 +
    # DeepSpeed's FusedAdam, 40 iterations, s/iteration over iterations 10-40
    python benchmarks/gpu_overhead.py
    # the CPU acceptance: the tiny GPT, 4 ranks (pp 2 x dp 2), bf16 + ZeRO-1, torch's AdamW
    python benchmarks/gpu_overhead.py --tiny --nproc 4 --pp 2 --rounds 3 --iterations 30 --warmup 5
    # a quick run of the same code on CPU (tests/unit/test_gpu_overhead.py)
    python benchmarks/gpu_overhead.py --tiny --rounds 1 --iterations 6 --warmup 2

Each rank prints its protections' costs at start-up (``protection costs``); the last "on" job's
lines are shown here.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds_swift.testing.jobs import JobSpec  # noqa: E402
from ds_swift.testing.overhead import alternate, bench_main  # noqa: E402

EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"
GPU_SHAPE = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "512"]
TINY_SHAPE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]


def ds_config(tiny: bool, nproc: int, pp: int) -> dict[str, Any]:
    """bf16 + ZeRO-1 + AdamW (DeepSpeed's FusedAdam on a GPU, torch's on CPU), clipping, warm-up LR."""
    params: dict[str, Any] = {"lr": 3e-4, "weight_decay": 0.01}
    if tiny:
        params["torch_adam"] = True  # FusedAdam needs CUDA
    return {
        # micro-batch and accumulation: from --micro-batch-size and --global-batch-size (the example's plan)
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "pipeline": {"stages": pp},
        "steps_per_print": 1_000_000,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4,
                                                     "warmup_num_steps": 5}},  # fmt: skip
        # Nothing but the machine layout: every other swift value is the default.
        "swift": {"enabled": True, "machines": {"gpus_per_node": max(1, nproc // 2) if nproc > 1 else 1}},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.dir or tempfile.mkdtemp(prefix="gpu-overhead-"))
    work.mkdir(parents=True, exist_ok=True)
    config = work / "ds_config_defaults.json"
    config.write_text(json.dumps(ds_config(args.tiny, args.nproc, args.pp), indent=2))
    nnodes = 2 if args.nproc > 1 else 1
    shape = TINY_SHAPE if args.tiny else GPU_SHAPE
    script_args = [*shape, "--pipeline-model-parallel-size", str(args.pp), "--micro-batch-size", "4",
                   "--global-batch-size", str(args.global_batch), "--log-interval", "1000"]  # fmt: skip
    if args.tiny:
        from ds_swift.testing.jobs import build_deepspeed_shm_op

        build_deepspeed_shm_op(work / "warm")

    def spec(on: bool) -> JobSpec:
        return JobSpec(EXAMPLE, config, args.iterations, script_args=script_args, swift={"enabled": on},
                       nnodes=nnodes, nproc_per_node=args.nproc // nnodes, save=False, loss_log=True)  # fmt: skip

    runs = alternate(work, spec, args.rounds, args.warmup)
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    return {
        "command": command,
        "device": "cpu" if args.tiny else "cuda",
        "ranks": args.nproc,
        "step_s_on": runs.median(True),
        "step_s_off": runs.median(False),
        "ratio": runs.ratio,
        "steps_timed": {"on": len(runs.steps[True]), "off": len(runs.steps[False])},
        "startup_costs": _cost_lines(runs.last[True]),
        "dir": str(work),
    }


def _cost_lines(job: Any) -> list[str]:
    """The "protection costs" block each rank printed at start-up (rank 0's, or the first found)."""
    out: list[str] = []
    text = job.output
    for p in sorted(job.proc_logs.glob("*")):
        if p.is_file():
            text += "\n" + p.read_text(errors="replace")
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "protection costs" in line:
            out.append(line)
            for more in lines[i + 1 :]:
                if ":   " not in more:
                    break
                out.append(more)
            break
    return out


def table(out: dict[str, Any]) -> None:
    print(f"command: {out['command']}")
    print(f"swift on (defaults): {out['step_s_on']:.4f} s/iteration (median of {out['steps_timed']['on']})")
    print(f"swift off          : {out['step_s_off']:.4f} s/iteration (median of {out['steps_timed']['off']})")
    print(f"ratio on/off       : {out['ratio']:.3f} ({out['ranks']} rank(s) on {out['device']})")
    for line in out["startup_costs"]:
        print(line)


def more_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiny", action="store_true", help="the tiny GPT on CPU (gloo, torch's AdamW)")
    p.add_argument("--nproc", type=int, default=1, help="ranks (default 1; more are split over 2 machines)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    p.add_argument("--global-batch", type=int, default=32, help="global batch (default 32)")
    p.set_defaults(warmup=10)  # s/iteration over iterations 10-40, as the H100 figures of issue 29


if __name__ == "__main__":
    bench_main(__doc__, run, table, more_arguments)
