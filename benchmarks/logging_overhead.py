"""Failure-free cost of message logging: plain DeepSpeed vs bubble-time logging vs synchronous logging.

One process tree: 4 gloo ranks (pp 4 on 2 "machines" of 2 ranks, so stage 1 -> 2 activations and
stage 2 -> 1 gradients cross the machine boundary) build one DeepSpeed PipelineEngine each and
then run the variants *interleaved*: every round runs each variant for ``--steps`` iterations, in
an order rotated from round to round, so drift (other jobs on the machine, page cache, thermal)
hits every variant alike. Variants:

- ``plain``: DeepSpeed as is.
- ``async``: ds-swift bubble-time logging (``bubble_only: true``), the default (Python writer).
- ``native``: the same with cuda_ext's native writer (JIT-built on first use).
- ``eager``: ds-swift logging with ``bubble_only: false`` (handed to the writer at the send).
- ``clone``: bubble-time logging with ``copy_mode="clone"`` (a defensive copy at each send).
- ``sync``: the paper's baseline: ``torch.save`` of each logged tensor before it is sent.

A round's time runs from a barrier to a barrier and, for the logging variants, includes the
flush of everything logged in it, so no variant leaves work for later. The ratio of a variant is
the median over rounds of plain's time / its time (a throughput ratio: 1.0 = no overhead).

    python benchmarks/logging_overhead.py              # table
    python benchmarks/logging_overhead.py --json       # {"async_vs_plain": ..., "sync_vs_plain": ..., ...}
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VARIANTS = ("plain", "async", "native", "eager", "clone", "sync")
GPUS_PER_NODE = 2


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="train_batch calls per variant per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seq", type=int, default=256, help="tokens per sample (activations are micro x seq x hidden)")
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--gas", type=int, default=4)
    p.add_argument("--layers-per-stage", type=int, default=1)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--log-dir", default=None, help="where logs go (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    from ds_swift.testing.ranks import gloo_rank

    with gloo_rank() as rank:
        measure(args, rank)


def measure(args: argparse.Namespace, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from ds_swift.config import SwiftConfig
    from ds_swift.msglog import MachineBoundaryPlan, gc_before, install_message_logging
    from ds_swift.msglog.edge import pipeline_position
    from ds_swift.patches.instructions import hook_instructions, schedule
    from ds_swift.testing.pipeline_model import block_layers, pipeline_config, pipeline_engine

    out = Path(args.worker)
    h = args.hidden
    optimizer = {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}}
    engine = pipeline_engine(
        block_layers(h, 4 * args.layers_per_stage), pipeline_config(args.micro, args.gas, optimizer), seed=0
    )
    plan = MachineBoundaryPlan(GPUS_PER_NODE)
    pos = pipeline_position(engine)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.micro, args.seq, h, generator=g)
    y = torch.tanh(x)

    def data() -> Any:
        while True:
            yield x, y

    it = data()
    if "native" in args.variants.split(","):
        from ds_swift.cuda_ext import native_writer

        native_writer()  # build (or load the cached build) before anything is timed
    log_root = Path(args.log_dir) / f"rank{rank}"
    log_root.mkdir(parents=True, exist_ok=True)

    def sync_hooks(directory: Path) -> Any:
        # The paper's synchronous baseline: torch.save of each logged tensor before it is sent.
        # Capture the tensors the handler would send, save them, then send.
        counter = [0]

        def hook_for(kind: str, peer: int | None) -> Any:
            def hook(eng: Any, call_next: Any, **kw: Any) -> Any:
                if peer is None or not plan.is_logged(pos.rank, peer):
                    return call_next(**kw)
                buf = kw["buffer_id"]
                tensors = eng.pipe_buffers["outputs"][buf] if kind == "act" else eng.pipe_buffers["inputs"][buf].grad
                if isinstance(tensors, tuple):
                    tensors = tuple(t.detach() for t in tensors)
                else:
                    tensors = tensors.detach()
                torch.save(tensors, directory / f"{kind}-{eng.global_steps}-{counter[0]}.pt")
                counter[0] += 1
                return call_next(**kw)

            return hook

        return hook_instructions(
            engine,
            "bench.sync",
            {
                schedule.SendActivation: hook_for("act", pos.next_rank),
                schedule.SendGrad: hook_for("grad", pos.prev_rank),
            },
        )

    def run_variant(variant: str, directory: Path, steps: int) -> dict[str, float]:
        directory.mkdir(parents=True, exist_ok=True)
        handle: Any = None
        hooks: Any = None
        if variant in ("async", "native", "eager", "clone"):
            cfg = SwiftConfig.from_dict(
                {"logging": {"storage": str(directory), "bubble_only": variant != "eager", "chunk_iterations": 2}}
            )
            handle = install_message_logging(
                engine, plan, cfg, native=variant == "native", copy_mode="clone" if variant == "clone" else "ref"
            )
        elif variant == "sync":
            hooks = sync_hooks(directory)
        dist.barrier()
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.train_batch(data_iter=it)
        if handle is not None:
            handle.flush(300, sync=False)
        dist.barrier()
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
        extra: dict[str, float] = {"minflt": float(faults)}
        if handle is not None:
            st = handle.stats
            extra |= {
                "bytes": float(st.bytes),
                "records": float(st.records),
                "stall_s": st.stall_s,
                "writer_cpu": st.writer_cpu_s,
            }
            handle.remove()
            gc_before(directory, 10**12)
        if hooks is not None:
            hooks.remove()
            extra["bytes"] = float(sum(p.stat().st_size for p in directory.iterdir()))
        shutil.rmtree(directory, ignore_errors=True)
        return {"wall": wall, "cpu": cpu, **extra}

    variants = args.variants.split(",")
    run_variant("plain", log_root / "warmup", args.warmup)
    results: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for v in order:
            res = run_variant(v, log_root / f"r{r}-{v}", args.steps)
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, res)
            results.append({"round": r, "variant": v, "ranks": gathered})
    if rank == 0:
        (out / "results.json").write_text(json.dumps(results))


# --------------------------------------------------------------------------- driver
def summarize(results: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    by: dict[tuple[int, str], dict[str, Any]] = {(r["round"], r["variant"]): r for r in results}
    rounds = sorted({r["round"] for r in results})
    variants = [v for v in args.variants.split(",") if any(k[1] == v for k in by)]
    summary: dict[str, Any] = {}
    for v in variants:
        walls = [by[(r, v)]["ranks"][0]["wall"] for r in rounds]
        summary[f"{v}_s_per_iteration"] = statistics.median(walls) / args.steps
        cpu = [sum(x["cpu"] for x in by[(r, v)]["ranks"]) for r in rounds]
        summary[f"{v}_cpu_s_per_iteration"] = statistics.median(cpu) / args.steps
        summary[f"{v}_page_faults_per_iteration_by_rank"] = [
            statistics.median(by[(r, v)]["ranks"][k]["minflt"] for r in rounds) / args.steps
            for k in range(len(by[(rounds[0], v)]["ranks"]))
        ]
        summary[f"{v}_cpu_s_per_iteration_by_rank"] = [
            statistics.median(by[(r, v)]["ranks"][k]["cpu"] for r in rounds) / args.steps
            for k in range(len(by[(rounds[0], v)]["ranks"]))
        ]
        if v != "plain":
            ratios = [by[(r, "plain")]["ranks"][0]["wall"] / by[(r, v)]["ranks"][0]["wall"] for r in rounds]
            summary[f"{v}_vs_plain"] = statistics.median(ratios)
            summary[f"{v}_vs_plain_rounds"] = ratios
            logged = [sum(x.get("bytes", 0.0) for x in by[(r, v)]["ranks"]) for r in rounds]
            summary[f"{v}_log_bytes_per_iteration"] = statistics.median(logged) / args.steps
            stalls = [sum(x.get("stall_s", 0.0) for x in by[(r, v)]["ranks"]) for r in rounds]
            summary[f"{v}_writer_stall_s_per_iteration"] = statistics.median(stalls) / args.steps
            wcpu = [sum(x.get("writer_cpu", 0.0) for x in by[(r, v)]["ranks"]) for r in rounds]
            summary[f"{v}_writer_cpu_s_per_iteration"] = statistics.median(wcpu) / args.steps
    per_message = args.micro * args.seq * args.hidden * 4
    summary["analytic_log_bytes_per_iteration"] = 2 * args.gas * per_message
    summary["config"] = {
        k: getattr(args, k) for k in ("rounds", "steps", "hidden", "seq", "micro", "gas", "layers_per_stage")
    }
    summary["message_mb"] = per_message / 2**20
    summary["cpus"] = os.cpu_count()
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    from ds_swift.testing.ranks import RanksFailed, run_ranks

    work = Path(tempfile.mkdtemp(prefix="ds-swift-bench-logging-"))
    log_dir = Path(args.log_dir) if args.log_dir else work / "logs"
    try:
        passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--json"]
        try:
            run_ranks(
                4,
                [__file__, *passthrough, "--worker", str(work), "--log-dir", str(log_dir)],
                work / "proc-logs",
                args.timeout,
            )
        except RanksFailed as exc:
            print(f"benchmark workers failed: {exc}", file=sys.stderr)
            return 1
        summary = summarize(json.loads((work / "results.json").read_text()), args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"{'variant':<8} {'s/iter':>8} {'cpu s/iter':>10} {'writer ms':>9} {'vs plain':>9}  per-round ratios")
    for v in args.variants.split(","):
        ratio = summary.get(f"{v}_vs_plain", 1.0)
        rounds = " ".join(f"{x:.3f}" for x in summary.get(f"{v}_vs_plain_rounds", []))
        writer_ms = 1000 * summary.get(f"{v}_writer_cpu_s_per_iteration", 0.0)
        print(
            f"{v:<8} {summary[f'{v}_s_per_iteration']:8.3f} {summary[f'{v}_cpu_s_per_iteration']:10.3f} "
            f"{writer_ms:9.1f} {ratio:9.3f}  {rounds}"
        )
    print(
        f"message {summary['message_mb']:.1f} MB; logged bytes/iteration (async) "
        f"{summary.get('async_log_bytes_per_iteration', 0) / 2**20:.1f} MB vs analytic "
        f"{summary['analytic_log_bytes_per_iteration'] / 2**20:.1f} MB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
