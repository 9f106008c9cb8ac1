"""The control plane at scale: job-store requests per rank in steady state and per recovery, measured
for simulated jobs of N ranks, the store server's capacity, and a fitted model of kill -> back.

    python benchmarks/scale.py --store-only --ranks 16,64,256 --json     # the issue's figures
    python benchmarks/scale.py --store-only --ranks 16,64,256,1024 --model-out configs/sim/scale_model.json
    python benchmarks/scale.py --capacity                                  # TCPStore and etcd, alone

``--store-only`` drives the real control-plane code for each N (benchmarks/scale_steady.py: every
rank's watchdog, every machine's launcher loop, agent liveness, digests, the buddy landing rounds;
benchmarks/scale_recovery.py: one machine's death to every rank back; benchmarks/scale_groups.py:
ds-swift's gloo groups) against counting stores, measures the TCPStore server's capacity (or reads
it from ``--capacity-from``), fits each phase's requests and bytes (ds_swift.sim.scale_model) and
evaluates the model at 1,024 and 16,384 ranks. The model's error is stated at the largest N
measured: the phases fitted without it, against what was measured there.

Assumptions the model names (options): a warm spare's workers reach the join
``--replacement-start-s`` after the death is declared, the lost machine's state moves in
``--state-s``, NCCL's own communicators form in ``--nccl-init-s`` (none measured here: no GPU), and
an iteration is redone in ``--step-s``. ``--e2e FILE`` (benchmarks/recovery_time.py --json of real
ranks) replaces the first two with measured ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

# DeepSpeed's loggers write to the stdout of their import (its accelerator's warning among them):
# imported with stdout on stderr, so that --json prints one JSON object and nothing else.
with contextlib.redirect_stdout(sys.stderr):
    from scale_capacity import capacity
    from scale_common import Layout
    from scale_e2e import end_to_end
    from scale_groups import group_costs
    from scale_recovery import PHASES as RECOVERY_PHASES
    from scale_recovery import recovery
    from scale_steady import buddy_round, steady_state

    from ds_swift.sim.scale_model import Phase, Poly, ScaleModel, fit_phase, relative_error

PHASES = (*RECOVERY_PHASES, "groups")
ROUND_TRIPS = {"detect": 4, "join": 4, "groups": 4, "rounds": 30}
PREDICT = (1024, 16384)


def measure(ranks: list[int]) -> dict[str, Any]:
    """Steady state, buddy rounds, one recovery and the groups, per N."""
    out: dict[str, Any] = {"steady": {}, "buddy": {}, "recovery": {}, "groups": {}}
    for n in ranks:
        t0 = time.monotonic()
        layout = Layout(n)
        out["steady"][n] = steady_state(layout)
        out["buddy"][n] = buddy_round(layout)
        out["recovery"][n] = recovery(layout)
        groups = group_costs(n)
        if groups is not None:
            out["groups"][n] = groups
        print(f"[scale] {n} ranks measured in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    measured = {n: g for n, g in out["groups"].items() if g["measured"]}
    for n in ranks:  # too many gloo threads to measure here: the fit of the measured sizes
        if n not in out["groups"] and len(measured) >= 2:
            keys = ("create_requests", "create_bytes", "use_requests", "use_bytes")
            fits = {k: Poly.fit({m: g[k] for m, g in measured.items()}, 2) for k in keys}
            out["groups"][n] = {"measured": False, **{k: int(f(n)) for k, f in fits.items()}}
    return out


def _per_phase(measured: dict[str, Any]) -> dict[str, dict[int, tuple[float, float]]]:
    """phase -> N -> (requests, bytes) of one recovery (measured N only)."""
    out: dict[str, dict[int, tuple[float, float]]] = {p: {} for p in PHASES}
    for n, rec in measured["recovery"].items():
        for phase, t in rec["phases"].items():
            out[phase][n] = (t["requests"], t["bytes"])
    for n, g in measured["groups"].items():
        if g["measured"]:
            out["groups"][n] = (g["create_requests"] + g["use_requests"], g["create_bytes"] + g["use_bytes"])
    return out


def build_model(
    measured: dict[str, Any], cap: dict[str, Any], args: argparse.Namespace, only: list[int] | None = None
) -> ScaleModel:
    """The fitted model (``only``: fit these N alone: the error check leaves the largest out)."""
    fixed = {"detect": 0.1, "join": args.replacement_start_s, "groups": args.nccl_init_s, "rounds": 0.0}
    phases = []
    for name, points in _per_phase(measured).items():
        pts = {n: v for n, v in points.items() if only is None or n in only}
        phases.append(
            fit_phase(
                name,
                {n: r for n, (r, _) in pts.items()},
                {n: b for n, (_, b) in pts.items()},
                round_trips=ROUND_TRIPS[name],
                fixed_s=fixed[name],
            )
        )
    cpu = {n: rec["consensus_cpu_s"] for n, rec in measured["recovery"].items() if only is None or n in only}
    phases.append(Phase("consensus", cpu_s=Poly.fit(cpu, degree=2), note="every rank's consensus over N reports"))
    phases.append(Phase("state", fixed_s=args.state_s, note="the lost machine's state over the network"))
    phases.append(Phase("back", fixed_s=args.step_s, note="the in-flight iteration redone"))
    tcp = cap["tcpstore"]
    return ScaleModel(
        tuple(phases),
        server_requests_per_s=min(tcp["writes_per_s"], tcp["reads_per_s"]),
        server_bytes_per_s=tcp["bytes_per_s"],
        initialization=("detect", "join", "groups", "rounds", "consensus"),
        source="benchmarks/scale.py",
    )


def _slope(points: dict[int, float]) -> float:
    """log-log slope between the smallest and the largest N (0: flat, 1: linear, 2: quadratic)."""
    lo, hi = min(points), max(points)
    if points[lo] <= 0 or points[hi] <= 0 or lo == hi:
        return 0.0
    return math.log(points[hi] / points[lo]) / math.log(hi / lo)


def summary(measured: dict[str, Any], cap: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    ranks = sorted(measured["recovery"])
    model = build_model(measured, cap, args)
    steady = {
        n: sum(measured["steady"][n][p]["requests_per_rank_per_s"] for p in ("watchdog", "launcher")) for n in ranks
    }
    protections = {
        n: measured["steady"][n]["digests"]["requests_per_rank_per_s"]
        + measured["buddy"][n]["requests_per_rank_per_s_at_most"]
        for n in ranks
    }
    groups = measured["groups"]
    rec = {
        n: measured["recovery"][n]["requests"]
        + (groups[n]["create_requests"] + groups[n]["use_requests"] if n in groups else 0)
        for n in ranks
    }
    out: dict[str, Any] = {
        "steady_requests_per_rank_per_s": {str(n): round(v, 3) for n, v in steady.items()},
        "steady_protections_requests_per_rank_per_s": {str(n): round(v, 3) for n, v in protections.items()},
        "recovery_requests": {str(n): int(v) for n, v in rec.items()},
        "recovery_requests_per_rank": {str(n): round(v / n, 1) for n, v in rec.items()},
        "predicted_recovery_s": {str(n): round(model.recovery_s(n), 2) for n in PREDICT},
        "predicted_breakdown_s": {str(n): {k: round(v, 3) for k, v in model.breakdown(n).items()} for n in PREDICT},
        "steady_slope": round(_slope(steady), 3),
        "recovery_slope": round(_slope(rec), 3),
        "steady_total_at_16384_vs_capacity": round(steady[max(ranks)] * 16384 / model.server_requests_per_s, 3),
        "capacity": cap,
        "assumptions": {
            "replacement_start_s": args.replacement_start_s,
            "state_s": args.state_s,
            "nccl_init_s": args.nccl_init_s,
            "step_s": args.step_s,
        },
    }
    if len(ranks) >= 3:
        out["model_error_at_largest_n"] = _model_error(measured, cap, args, ranks)
    out["measured"] = {k: {str(n): v for n, v in per.items()} for k, per in measured.items()}
    return out


def _model_error(measured: dict[str, Any], cap: dict[str, Any], args: argparse.Namespace, ranks: list[int]) -> Any:
    """The model fitted without the largest N, against what was measured there (requests per phase)."""
    largest = max(ranks)
    partial = build_model(measured, cap, args, only=[n for n in ranks if n != largest])
    actual = _per_phase(measured)
    errors = {}
    for phase in partial.phases:
        if phase.name in actual and largest in actual[phase.name]:
            errors[phase.name] = round(relative_error(phase.requests, [(largest, actual[phase.name][largest][0])]), 3)
    total_pred = sum(p.requests(largest) for p in partial.phases)
    total = sum(v[largest][0] for v in actual.values() if largest in v)
    return {"n": largest, "per_phase": errors, "total": round(abs(total_pred - total) / max(1.0, total), 3)}


def e2e_check(model: ScaleModel, e2e: dict[str, Any]) -> dict[str, Any]:
    """The model against kill -> back measured with real ranks: its parts that no store request
    explains (a replacement's start, the state's transfer, the redone iteration, the ranks' own
    work) are taken from the smallest N measured; the model's kill -> back at the largest N is then
    compared with the one measured there."""
    sizes = sorted(int(n) for n in e2e)
    small, large = sizes[0], sizes[-1]
    store_s = {n: sum(model.phase_s(p, n) - p.fixed_s for p in model.phases) for n in sizes}
    rest = float(e2e[str(small)]["total_s"]) - store_s[small]
    predicted = rest + store_s[large]
    measured = float(e2e[str(large)]["total_s"])
    return {
        "measured_total_s": {str(n): e2e[str(n)]["total_s"] for n in sizes},
        "fixed_from_smallest_s": round(rest, 3),
        "predicted_total_s_at_largest": round(predicted, 3),
        "error_at_largest": round((predicted - measured) / measured, 3),
        "largest": large,
    }


def table(out: dict[str, Any]) -> None:
    print("ranks | steady req/rank/s (control) | protections req/rank/s | recovery requests | per rank")
    for n in out["recovery_requests"]:
        print(
            f"{n:>5} | {out['steady_requests_per_rank_per_s'][n]:>27} | "
            f"{out['steady_protections_requests_per_rank_per_s'][n]:>22} | {out['recovery_requests'][n]:>17} | "
            f"{out['recovery_requests_per_rank'][n]}"
        )
    print(f"slopes (log-log): steady {out['steady_slope']}, recovery {out['recovery_slope']}")
    for n, s in out["predicted_recovery_s"].items():
        parts = ", ".join(f"{k} {v:g}" for k, v in out["predicted_breakdown_s"][n].items())
        print(f"modelled kill -> back at {n} ranks: {s} s ({parts})")
    if "model_error_at_largest_n" in out:
        err = out["model_error_at_largest_n"]
        print(
            f"model error at {err['n']} ranks (fitted without it): requests {err['total']:.1%}, by phase {err['per_phase']}"
        )
    tcp = out["capacity"]["tcpstore"]
    print(
        f"TCPStore here: {tcp['writes_per_s']:.0f} writes/s, {tcp['reads_per_s']:.0f} reads/s, "
        f"{tcp['bytes_per_s'] / 1e6:.0f} MB/s; steady load at 16,384 ranks: "
        f"{out['steady_total_at_16384_vs_capacity']:.0%} of it"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--store-only", action="store_true", help="simulated ranks against counting stores")
    mode.add_argument("--capacity", action="store_true", help="the store servers' capacity alone (TCPStore, etcd)")
    mode.add_argument("--end-to-end", action="store_true", help="kill -> back with real ranks (--ranks 4,8,16)")
    p.add_argument("--ranks", default="16,64,256", help="comma-separated rank counts (multiples of 8)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--capacity-from", metavar="FILE", help="a --capacity --json result instead of measuring")
    p.add_argument("--model-out", metavar="FILE", help="write the fitted model (ds-swift simulate's scale_model)")
    p.add_argument("--e2e", metavar="FILE", help="an --end-to-end --json result: the model's error against it")
    p.add_argument("--replacement-start-s", type=float, default=1.0)
    p.add_argument("--state-s", type=float, default=0.5)
    p.add_argument("--nccl-init-s", type=float, default=0.0)
    p.add_argument("--step-s", type=float, default=0.1)
    args = p.parse_args(argv)
    if args.capacity:
        cap = capacity(clients=4, seconds=3.0)
        print(json.dumps(cap, indent=None if args.json else 1))
        return 0
    ranks = sorted({int(x) for x in args.ranks.split(",")})
    if args.end_to_end:
        if any(n % 2 or n < 4 for n in ranks):
            p.error(f"--ranks {args.ranks}: even counts of 4 or more (machines of 2 ranks)")
        with tempfile.TemporaryDirectory(prefix="ds-swift-scale-e2e-") as tmp:
            print(json.dumps(end_to_end(Path(tmp), ranks)))
        return 0
    if any(n % 8 or n < 16 for n in ranks):
        p.error(f"--ranks {args.ranks}: every count a multiple of 8, at least 16 (machines of 8 ranks)")
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's import prints on stdout: the JSON stays alone
        measured = measure(ranks)
        cap = json.loads(Path(args.capacity_from).read_text()) if args.capacity_from else capacity(2, 2.0, etcd=False)
        out = summary(measured, cap, args)
        if args.e2e:
            out["end_to_end"] = e2e_check(build_model(measured, cap, args), json.loads(Path(args.e2e).read_text()))
    if args.model_out:
        Path(args.model_out).write_text(build_model(measured, cap, args).to_json() + "\n")
    if args.json:
        print(json.dumps(out))
    else:
        table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
