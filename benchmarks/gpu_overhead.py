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
    # the CPU acceptance: the tiny GPT, 4 ranks (pp 2 x dp 2), bf16 + ZeRO-1, torch's AdamW; steps
    # after iteration 25, past the buddy interval "auto" chooses at iteration 18 (the steady state)
    python benchmarks/gpu_overhead.py --tiny --nproc 4 --pp 2 --rounds 6 --iterations 50 --warmup 25
    # a quick run of the same code on CPU
    python benchmarks/gpu_overhead.py --tiny --rounds 1 --iterations 6 --warmup 2

One rank per pipeline stage prints its protections' costs at start-up (``protection costs``); the
last "on" job's lines are shown here. Every job's process tree is also sampled for CPU time (ds_swift.testing.
cpu_sampler): CPU seconds per iteration per thread, summed over the ranks; on a loaded machine the
wall clock is noisy, CPU time says where the cost is.

``--breakdown`` runs, interleaved, "off", the defaults, and the defaults with one protection
switched off at a time (through its config field where it has one, else through
``SWIFT_BENCH_WITHOUT``: ds_swift.protect.costs), plus the defaults with a checkpoint every
10 iterations (the default interval, 1000, saves none in a short job; its cost is shown per save and
at the default interval). Each row: the step time (median and mean: a cost that comes every 10th
iteration, a digest or a save, moves the mean, not the median), the ratio to "off", CPU ms per
iteration, and what switching the protection off saved against the defaults (its cost)::

    python benchmarks/gpu_overhead.py --tiny --nproc 4 --pp 2 --rounds 1 --iterations 30 --warmup 5 --breakdown
    python benchmarks/gpu_overhead.py --tiny --nproc 4 --pp 2 --breakdown off,defaults,-buddy   # some rows
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds_swift.config import SwiftConfig  # noqa: E402
from ds_swift.protect.costs import ENV as WITHOUT_ENV  # noqa: E402
from ds_swift.testing.jobs import JobSpec  # noqa: E402
from ds_swift.testing.overhead import Interleaved, bench_main, interleave  # noqa: E402

EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"
GPU_SHAPE = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "512"]
TINY_SHAPE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]


#: --breakdown's variants: name -> (swift overrides, protections switched off by SWIFT_BENCH_WITHOUT)
VARIANTS: dict[str, tuple[dict[str, Any], str]] = {
    "off": ({"enabled": False}, ""),
    "defaults": ({"enabled": True}, ""),
    "-digests": ({"enabled": True, "verify": {"enabled": False}}, ""),
    "-buddy": ({"enabled": True, "buddy": {"enabled": False}}, ""),
    "-logging": ({"enabled": True}, "logging"),
    "-watchdog": ({"enabled": True}, "watchdog"),
    "-undo": ({"enabled": True}, "undo"),
    "-determinism": ({"enabled": True}, "determinism"),
    "-rng": ({"enabled": True}, "rng"),
    "-wakeup": ({"enabled": True}, "wakeup"),
    "ckpt@10": ({"enabled": True, "checkpoint": {"interval": 10}}, ""),
    "buddy@2": ({"enabled": True, "buddy": {"interval": 2}}, ""),
    "buddy@5": ({"enabled": True, "buddy": {"interval": 5}}, ""),
    "buddy@10": ({"enabled": True, "buddy": {"interval": 10}}, ""),
}
#: the interval of the ckpt@10 variant
CKPT_EVERY = 10


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
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 5},
        },
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
    script_args = [
        *shape,
        "--pipeline-model-parallel-size",
        str(args.pp),
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        str(args.global_batch),
        "--log-interval",
        "1000",
    ]
    if args.tiny:
        from ds_swift.testing.jobs import build_deepspeed_shm_op

        build_deepspeed_shm_op(work / "warm")

    def spec(name: str) -> JobSpec:
        swift, without = VARIANTS[name]
        return JobSpec(
            EXAMPLE,
            config,
            args.iterations,
            script_args=script_args,
            swift=swift,
            env={WITHOUT_ENV: without} if without else {},
            nnodes=nnodes,
            nproc_per_node=args.nproc // nnodes,
            save=False,
            loss_log=True,
        )

    names = _variants(args.breakdown)
    runs = interleave(work, {n: spec(n) for n in names}, args.rounds, args.warmup)
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    return {
        "command": command,
        "device": "cpu" if args.tiny else "cuda",
        "ranks": args.nproc,
        "step_s_on": runs.median("defaults"),
        "step_s_off": runs.median("off"),
        "ratio": runs.ratio("defaults", "off"),
        "round_ratios": runs.round_ratios("defaults", "off"),
        "median_round_ratio": runs.median_round_ratio("defaults", "off"),
        "steps_timed": {"on": len(runs.steps["defaults"]), "off": len(runs.steps["off"])},
        "cpu_ms_per_iteration": {n: _cpu_ms(runs, n) for n in names},
        "breakdown": [_row(runs, n) for n in names] if args.breakdown else [],
        "startup_costs": _cost_lines(runs.last["defaults"]),
        "dir": str(work),
    }


def _variants(breakdown: str | None) -> list[str]:
    """The variants to run: on and off, or --breakdown's (all of them, or the ones it names)."""
    if breakdown is None:
        return ["defaults", "off"]
    names = list(VARIANTS) if breakdown == "all" else [n.strip() for n in breakdown.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--breakdown: unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    return names + [n for n in ("defaults", "off") if n not in names]


def _cpu_ms(runs: Interleaved, name: str) -> dict[str, float]:
    """CPU ms per iteration by thread ("ranks main", "ranks sw-buddy", "launcher other", ...) and in all."""
    out = {f"{role} {thread}": 1e3 * v for (role, thread), v in runs.cpu_per_iteration(name).items()}
    total = runs.cpu_total(name)
    if total is not None:
        out["total"] = 1e3 * total
    return out


def _row(runs: Interleaved, name: str) -> dict[str, Any]:
    """One --breakdown row: step times, ratio to off, CPU, and the saving against the defaults."""
    steps = runs.steps[name]
    cpu, base = runs.cpu_total(name), runs.cpu_total("defaults")
    row: dict[str, Any] = {
        "variant": name,
        "switched_off": VARIANTS[name][1] or None,
        "median_s": runs.median(name),
        "mean_s": statistics.fmean(steps),
        "ratio_median": runs.ratio(name, "off"),
        "ratio_mean": statistics.fmean(steps) / statistics.fmean(runs.steps["off"]),
        "cpu_ms": None if cpu is None else 1e3 * cpu,
        # What this protection costs with every other one on: the defaults' CPU minus this variant's.
        "cost_cpu_ms": None if cpu is None or base is None or name in ("defaults", "off") else 1e3 * (base - cpu),
    }
    if name == "ckpt@10" and row["cost_cpu_ms"] is not None:
        per_save = -row["cost_cpu_ms"] * CKPT_EVERY
        row["per_save_cpu_ms"] = per_save
        row["at_default_interval_cpu_ms"] = per_save / SwiftConfig().checkpoint.interval
    return row


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
    if len(out["round_ratios"]) > 1:  # the spread says how much of a difference these rounds can see
        print(f"  round by round   : {' '.join(f'{r:.3f}' for r in out['round_ratios'])}")
        print(f"  their median     : {out['median_round_ratio']:.3f}")
    cpu = out["cpu_ms_per_iteration"]
    if cpu.get("defaults") and cpu.get("off"):
        print("CPU ms per iteration (all ranks, and the launcher with its job store), defaults / off:")
        for key in sorted(set(cpu["defaults"]) | set(cpu["off"]), key=lambda k: (k == "total", k)):
            print(f"  {key:24s} {cpu['defaults'].get(key, 0.0):8.1f} {cpu['off'].get(key, 0.0):8.1f}")
        if cpu["off"].get("total"):
            # steadier than the wall ratio on a shared host (the same tree's wall ratio moved 0.1 in an hour)
            print(f"CPU ratio on/off   : {cpu['defaults'].get('total', 0.0) / cpu['off']['total']:.3f}")
    if out["breakdown"]:
        print("variant       median s  mean s  ratio(median/mean)  CPU ms/it  cost (CPU ms/it saved when off)")
        for r in out["breakdown"]:
            cost = "" if r["cost_cpu_ms"] is None else f"{r['cost_cpu_ms']:8.1f}"
            print(
                f"{r['variant']:13s} {r['median_s']:8.4f} {r['mean_s']:7.4f}  {r['ratio_median']:6.3f} / "
                f"{r['ratio_mean']:6.3f}    {r['cpu_ms'] or float('nan'):8.1f}  {cost}"
            )
            if "per_save_cpu_ms" in r:
                print(
                    f"{'':13s} a save: {r['per_save_cpu_ms']:.0f} CPU ms = {r['at_default_interval_cpu_ms']:.2f} "
                    "ms per iteration at the default checkpoint.interval"
                )
    for line in out["startup_costs"]:
        print(line)


def more_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiny", action="store_true", help="the tiny GPT on CPU (gloo, torch's AdamW)")
    p.add_argument("--nproc", type=int, default=1, help="ranks (default 1; more are split over 2 machines)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    p.add_argument("--global-batch", type=int, default=32, help="global batch (default 32)")
    p.add_argument(
        "--breakdown",
        nargs="?",
        const="all",
        default=None,
        metavar="VARIANTS",
        help=f"one protection off at a time (all variants, or a comma list of {', '.join(VARIANTS)})",
    )
    p.set_defaults(warmup=10)  # s/iteration over iterations 10-40, as the H100 figures of issue 29


if __name__ == "__main__":
    bench_main(__doc__, run, table, more_arguments)
