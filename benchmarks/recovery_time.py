"""Time to recover from a machine failure: replication vs a global-checkpoint restart of the same job.

Both variants run the same job (``examples/pretrain_gpt.py``, ``configs/gpt_tiny_pp2_dp2.json``:
pp 2 x dp 2 on 2 simulated machines, each stage's replica on the other machine) under
``ds-swift-launch`` with one spare, a global checkpoint every K iterations, and machine 1 killed
at iteration K + K/2 (backward pass):

- ``replication``: the survivors keep their state; the replacement gets it from the surviving
  replicas (ds-swift's plan for this layout);
- ``checkpoint``: the same job with ``strategy: checkpoint``: every rank reloads the last global
  checkpoint (iteration K) and trains the K/2 lost iterations again. Survivors do this in their
  running processes; a restart that also relaunched every survivor would only add to this time.

The variants alternate (replication, checkpoint, replication, ...) in one process tree, so load
from other jobs on the machine hits both alike. Each run's recovery timeline (written by the job
into its run directory) gives the paper's three durations: initialization (first detection ->
replacements joined, groups re-formed), recovery (-> every rank back at the pre-failure
iteration), total (kill -> back). ``replication_vs_checkpoint`` is the ratio of the median
totals, replication / checkpoint (0.5 = back in half the time); ``..._recovery`` the same for
the recovery part alone (the initialization, mostly the replacement's process start, is common).

    python benchmarks/recovery_time.py                 # table
    python benchmarks/recovery_time.py --json          # {"replication_vs_checkpoint": ..., ...}
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from ds_swift.testing.procs import ProcessSet, worker_env

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"
CONFIG = ROOT / "configs" / "gpt_tiny_pp2_dp2.json"
VARIANTS = ("replication", "checkpoint")
PAPER = ("initialization_s", "recovery_s", "total_s")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="runs of each variant (alternating)")
    p.add_argument("--interval", type=int, default=8, help="K: iterations between global checkpoints")
    p.add_argument("--model-args", default="", help="extra arguments for pretrain_gpt.py (e.g. '--hidden-size 256')")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one job may take")
    p.add_argument("--keep", default=None, help="keep run directories here (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def run_one(work: Path, variant: str, interval: int, model_args: list[str], timeout: float) -> dict[str, Any]:
    """One job with one injected machine failure; returns its recovery timeline."""
    kill_at = interval + interval // 2
    cfg = json.loads(CONFIG.read_text())
    cfg["swift"]["strategy"] = "auto" if variant == "replication" else "checkpoint"
    cfg["swift"]["checkpoint"] = {"dir": str(work / "ckpt"), "interval": interval}
    work.mkdir(parents=True)
    (work / "ds_config.json").write_text(json.dumps(cfg))
    argv = [
        sys.executable, "-m", "ds_swift.launch.cli", "--run-dir", str(work / "run"), "--nnodes", "2",
        "--nproc-per-node", "2", "--spares", "1", "--inject", f"machine=1,iteration={kill_at},phase=backward",
        str(EXAMPLE), "--deepspeed_config", str(work / "ds_config.json"), "--train-iters", str(kill_at + 2),
        *model_args,
    ]
    with ProcessSet(work / "logs") as procs:
        procs.spawn("launcher", argv, env=worker_env(), cwd=work)
        code = procs.wait("launcher", timeout)
        if code != 0:
            raise RuntimeError(f"{variant} job failed with exit code {code}:\n{procs.log('launcher')[-4000:]}")
    (path,) = sorted((work / "run").glob("timeline-gen*.json"))
    tl: dict[str, Any] = json.loads(path.read_text())
    if tl["strategy"] != variant:
        raise RuntimeError(f"{variant} job recovered by {tl['strategy']}: {tl['reason']}")
    return tl


def summarize(runs: dict[str, list[dict[str, Any]]], interval: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        tls = runs[variant]
        out[variant] = {k: statistics.median(t[k] for t in tls) for k in PAPER}
        out[variant]["runs"] = [{k: t[k] for k in (*PAPER, "phases", "consensus", "checkpoint_step")} for t in tls]
    out["replication_vs_checkpoint"] = out["replication"]["total_s"] / out["checkpoint"]["total_s"]
    # The part the strategy decides (state transfer vs checkpoint load + re-training): the
    # initialization before it (replacement process start, rendezvous) is the same for both.
    out["replication_vs_checkpoint_recovery"] = out["replication"]["recovery_s"] / out["checkpoint"]["recovery_s"]
    out["config"] = {"checkpoint_interval": interval, "kill_iteration": interval + interval // 2,
                     "rounds": len(runs["replication"])}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.interval < 2:
        raise SystemExit("--interval must be at least 2 (the kill is at K + K/2)")
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="ds-swift-recovery-bench-") as tmp:
        base = Path(args.keep) if args.keep else Path(tmp)
        for r in range(args.rounds):
            for variant in VARIANTS:
                tl = run_one(base / f"{variant}-{r}", variant, args.interval, args.model_args.split(), args.timeout)
                runs[variant].append(tl)
                if not args.json:
                    print(f"round {r} {variant:11s}: total {tl['total_s']:.2f} s (initialization "
                          f"{tl['initialization_s']:.2f} s, recovery {tl['recovery_s']:.2f} s)", flush=True)
    result = summarize(runs, args.interval)
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    print(f"\nmedian over {args.rounds} round(s), checkpoint every {args.interval}, kill at "
          f"iteration {args.interval + args.interval // 2}:")
    print(f"{'variant':12s} {'initialization':>15s} {'recovery':>10s} {'total':>8s}")
    for variant in VARIANTS:
        m = result[variant]
        print(f"{variant:12s} {m['initialization_s']:14.2f}s {m['recovery_s']:9.2f}s {m['total_s']:7.2f}s")
    print(f"replication_vs_checkpoint = {result['replication_vs_checkpoint']:.3f} (replication total / checkpoint total)")
    print(f"replication_vs_checkpoint_recovery = {result['replication_vs_checkpoint_recovery']:.3f} (recovery part only)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
