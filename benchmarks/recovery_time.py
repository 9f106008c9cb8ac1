"""Time to recover from a machine failure: replication and logging vs a global-checkpoint restart.

Every variant runs ``examples/pretrain_gpt.py`` under ``ds-swift-launch`` on 2 simulated machines of
2 ranks with one spare, a global checkpoint every K iterations, and machine 1 killed at iteration
K + K/2 (backward pass):

- ``replication`` (``configs/gpt_tiny_pp2_dp2.json``, pp 2 x dp 2, each stage's replica on the
  other machine): the survivors keep their state; the replacement gets it from the surviving
  replicas; the spare's workers are warm (started and imported before the failure, the default);
- ``replication_cold``: the same with ``ds-swift-launch --cold-spares``: the spare starts its
  workers only when the machine fails (interpreter, imports, CUDA context: the cost warm spares hide);
- ``buddy`` and ``buddy_cold``: the same in the configuration users run
  (``configs/gpt_tiny_pp2_dp2_bf16_zero1.json``: bf16, ZeRO-1, gradient clipping, an LR schedule):
  the replacement's ZeRO-1 optimizer partitions come from their buddy copies, its bf16
  parameters from the replica;
- ``checkpoint``: the same pp 2 x dp 2 job with ``strategy: checkpoint``: every rank reloads the
  last global checkpoint (iteration K) and trains the K/2 lost iterations again;
- ``logging`` (``configs/gpt_tiny_pp4.json``, pp 4, stages 2 and 3 on machine 1, no replica): the
  survivors keep their state; the replacements load the last global checkpoint and replay the
  K/2 lost iterations of their stages from the message log (SWIFT section 5.1);
- ``logging_parallel``: the same with ``parallel_recovery`` (exact mode): machine 0's survivors
  host a copy of the lost stages and replay half of every iteration's micro-batches (section 5.2);
- ``checkpoint_pp4``: the same pp 4 job with ``strategy: checkpoint`` (the restart the logging
  variants are compared with). Survivors reload in their running processes; a restart that also
  relaunched every survivor would only add to the checkpoint variants' times.

The variants alternate (one of each per round) in one process tree, so load from other jobs on the
machine hits all alike. Each run's recovery timeline (written by the job into its run directory)
gives the paper's three durations: initialization (first detection -> replacements joined, groups
re-formed), recovery (-> every rank back at the pre-failure iteration), total (kill -> back).
``replication_vs_checkpoint`` is the ratio of the median totals, replication / checkpoint (0.5 =
back in half the time); ``logging_vs_checkpoint`` and ``logging_parallel_vs_checkpoint`` the same
for the logging variants against ``checkpoint_pp4``; the ``..._recovery`` keys the same ratios for
the recovery part alone (the initialization, mostly the replacement's process start, is common to
all of them). SWIFT reports 0.64 for logging and 0.24-0.43 with parallel recovery (recovery time).

    python benchmarks/recovery_time.py                          # table, every variant
    python benchmarks/recovery_time.py --json                   # {"logging_vs_checkpoint": ..., ...}
    python benchmarks/recovery_time.py --variants logging,logging_parallel,checkpoint_pp4 --rounds 2
    # issue 15's figure: a ~25M-parameter GPT, warm vs cold spares
    python benchmarks/recovery_time.py --variants replication,replication_cold,buddy,buddy_cold \\
        --model-args '--hidden-size 512 --num-layers 8 --num-attention-heads 8'
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from ds_swift.testing.jobs import JobSpec, run_job

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"
PP2_DP2 = ROOT / "configs" / "gpt_tiny_pp2_dp2.json"
PP4 = ROOT / "configs" / "gpt_tiny_pp4.json"
PP2_DP2_BF16 = ROOT / "configs" / "gpt_tiny_pp2_dp2_bf16_zero1.json"
#: variant -> (config, swift overrides, the strategy its timeline must report, extra ds-swift-launch flags)
VARIANTS: dict[str, tuple[Path, dict[str, Any], str, tuple[str, ...]]] = {
    "replication": (PP2_DP2, {"strategy": "auto"}, "replication", ()),
    "replication_cold": (PP2_DP2, {"strategy": "auto"}, "replication", ("--cold-spares",)),
    "checkpoint": (PP2_DP2, {"strategy": "checkpoint"}, "checkpoint", ()),
    "buddy": (PP2_DP2_BF16, {"strategy": "auto"}, "buddy", ()),
    "buddy_cold": (PP2_DP2_BF16, {"strategy": "auto"}, "buddy", ("--cold-spares",)),
    "logging": (PP4, {"strategy": "logging", "parallel_recovery": False}, "logging", ()),
    "logging_parallel": (
        PP4,
        {"strategy": "logging", "parallel_recovery": True, "parallel_recovery_mode": "exact"},
        "logging",
        (),
    ),
    "checkpoint_pp4": (PP4, {"strategy": "checkpoint"}, "checkpoint", ()),
}
#: ratio key -> (numerator variant, denominator variant)
RATIOS = {
    "warm_vs_cold_spares": ("replication", "replication_cold"),
    "bf16_warm_vs_cold_spares": ("buddy", "buddy_cold"),
    "replication_vs_checkpoint": ("replication", "checkpoint"),
    "logging_vs_checkpoint": ("logging", "checkpoint_pp4"),
    "logging_parallel_vs_checkpoint": ("logging_parallel", "checkpoint_pp4"),
}
PAPER = ("initialization_s", "recovery_s", "total_s")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="runs of each variant (alternating)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--interval", type=int, default=8, help="K: iterations between global checkpoints")
    p.add_argument("--model-args", default="", help="extra arguments for pretrain_gpt.py (e.g. '--hidden-size 256')")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one job may take")
    p.add_argument("--keep", default=None, help="keep run directories here (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="exit 1 when a variant's median kill -> back exceeds this many seconds (the regression guard: "
        "a benchmark-side check, since the tests hold no timed assertion)",
    )
    return p.parse_args(argv)


def run_one(work: Path, variant: str, interval: int, model_args: list[str], timeout: float) -> dict[str, Any]:
    """One job with one injected machine failure; returns its recovery timeline."""
    config, swift, expected, flags = VARIANTS[variant]
    kill_at = interval + interval // 2
    spec = JobSpec(
        EXAMPLE,
        config,
        kill_at + 2,
        ["--spares", "1", *flags, "--inject", f"machine=1,iteration={kill_at},phase=backward"],
        model_args,
        swift={**swift, "checkpoint": {"interval": interval}},
        save=False,
    )
    job = run_job(work, spec, timeout)
    if job.code != 0:
        raise RuntimeError(f"{variant} job failed with exit code {job.code}:\n{job.output[-4000:]}")
    timelines = job.timelines()
    # The injected kill's recovery is the one measured. Under load an op may also time out with every
    # rank alive (a stall, issue 30): the same ranks re-form the job, no machine is lost; such
    # recoveries are counted and shown, not measured.
    kills = [t for t in timelines if t.get("failed_machine") is not None]
    if len(kills) != 1:
        raise RuntimeError(f"{variant}: {len(kills)} machine recoveries, not the one injected:\n{job.output[-4000:]}")
    (tl,) = kills
    tl["stalls"] = len(timelines) - 1
    # A recovery by another strategy (a fallback, say) is a result, not a crash of the benchmark:
    # it is counted and shown, and left out of the variant's medians.
    tl["expected_strategy"] = expected
    return tl


def summarize(runs: dict[str, list[dict[str, Any]]], interval: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant, all_tls in runs.items():
        tls = [t for t in all_tls if t["strategy"] == t.get("expected_strategy", t["strategy"])]
        other = [f"{t['strategy']}: {t['reason']}" for t in all_tls if t not in tls]
        if not tls:
            out[variant] = {"other_recoveries": other}
            continue
        out[variant] = {k: statistics.median(t[k] for t in tls) for k in PAPER}
        names = dict.fromkeys(name for t in tls for name in t.get("phases", {}))
        out[variant]["phases"] = {n: statistics.median(t.get("phases", {}).get(n, 0.0) for t in tls) for n in names}
        out[variant]["other_recoveries"] = other
        keep = (*PAPER, "phases", "consensus", "checkpoint_step", "replay")
        out[variant]["runs"] = [{k: t.get(k) for k in keep} for t in tls]
        replays = [t["replay"]["replay_s"] for t in tls if t.get("replay")]
        if replays:
            out[variant]["replay_s"] = statistics.median(replays)
    for key, (num, den) in RATIOS.items():
        if num in out and den in out and "total_s" in out[num] and "total_s" in out[den]:
            out[key] = out[num]["total_s"] / out[den]["total_s"]
            # The part the strategy decides (state transfer, or checkpoint load + replay, vs checkpoint
            # load + re-training everywhere): the initialization before it is the same for all.
            out[f"{key}_recovery"] = out[num]["recovery_s"] / out[den]["recovery_s"]
    out["config"] = {
        "checkpoint_interval": interval,
        "kill_iteration": interval + interval // 2,
        "rounds": max((len(v) for v in runs.values()), default=0),
        "variants": list(runs),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.interval < 2:
        raise SystemExit("--interval must be at least 2 (the kill is at K + K/2)")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise SystemExit(f"--variants: unknown {unknown or 'nothing given'}; choose from {', '.join(VARIANTS)}")
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="ds-swift-recovery-bench-") as tmp:
        base = Path(args.keep) if args.keep else Path(tmp)
        for r in range(args.rounds):
            for variant in variants:
                tl = run_one(base / f"{variant}-{r}", variant, args.interval, args.model_args.split(), args.timeout)
                runs[variant].append(tl)
                if not args.json:
                    by = (
                        ""
                        if tl["strategy"] == tl["expected_strategy"]
                        else f" RECOVERED BY {tl['strategy']}, not counted"
                    )
                    stalls = f"; {tl['stalls']} stall(s) re-formed in-process before it" if tl["stalls"] else ""
                    print(
                        f"round {r} {variant:16s}: total {tl['total_s']:.2f} s (initialization "
                        f"{tl['initialization_s']:.2f} s, recovery {tl['recovery_s']:.2f} s){by}{stalls}; "
                        f"{phase_words(tl.get('phases', {}))}",
                        flush=True,
                    )
    result = summarize(runs, args.interval)
    over = over_budget(result, variants, args.budget_s)
    if args.json:
        print(json.dumps({**result, "over_budget": over}, sort_keys=True))
        return 1 if over else 0
    print(
        f"\nmedian over {args.rounds} round(s), checkpoint every {args.interval}, kill at "
        f"iteration {args.interval + args.interval // 2}:"
    )
    print(f"{'variant':17s} {'initialization':>15s} {'recovery':>10s} {'total':>8s} {'replay':>8s}")
    for variant in variants:
        m = result[variant]
        others = m["other_recoveries"]
        if "total_s" not in m:
            print(f"{variant:17s} no run recovered as expected: {others}")
            continue
        replay = f"{m['replay_s']:7.2f}s" if "replay_s" in m else f"{'-':>8s}"
        also = f"  ({len(others)} other recover(y/ies) left out: {[o.split(':')[0] for o in others]})" if others else ""
        print(
            f"{variant:17s} {m['initialization_s']:14.2f}s {m['recovery_s']:9.2f}s {m['total_s']:7.2f}s {replay}{also}"
        )
    for variant in variants:
        if "phases" in result[variant]:
            print(f"{variant:17s} median per phase: {phase_words(result[variant]['phases'])}")
    for key, (num, den) in RATIOS.items():
        if key in result:
            print(
                f"{key} = {result[key]:.3f} ({num} total / {den} total); recovery part only: "
                f"{result[key + '_recovery']:.3f}"
            )
    for line in over:
        print(f"OVER BUDGET: {line}")
    return 1 if over else 0


def phase_words(phases: dict[str, float]) -> str:
    """The recovery's phases (ds_swift.recovery.timeline's, in their order) as ``name seconds``."""
    return ", ".join(f"{name} {float(s):.2f}" for name, s in phases.items()) or "no phases"


def over_budget(result: dict[str, Any], variants: list[str], budget_s: float | None) -> list[str]:
    """The variants whose median kill -> back exceeds ``budget_s`` (none without a budget)."""
    if budget_s is None:
        return []
    return [
        f"{v}: median kill -> back {result[v]['total_s']:.2f} s > {budget_s:g} s ({phase_words(result[v]['phases'])})"
        for v in variants
        if "total_s" in result[v] and result[v]["total_s"] > budget_s
    ]


if __name__ == "__main__":
    sys.exit(main())
