"""``ds-swift simulate CONFIG.yaml``: end-to-end training time with failures, per strategy."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

__all__ = ["main", "register", "run"]


def register(subparsers: Any) -> None:
    """Add the ``simulate`` sub-command."""
    p = subparsers.add_parser(
        "simulate",
        help="what-if simulation of end-to-end training time with failures",
        description=(
            "Simulate each workload of a YAML file under its failure process with every strategy "
            "(global checkpoint, CheckFreq, Elastic Horovod, SWIFT replication/logging). "
            "See configs/sim/swift_table5.yaml and ds_swift/sim/schema.py for the format."
        ),
    )
    p.add_argument("config", help="simulation YAML file")
    p.add_argument(
        "--profile",
        metavar="BENCH.json",
        help="take each strategy's costs from a bench profile (ds-swift bench --json; format in "
        "ds_swift/sim/profile.py); the YAML still gives the workloads and failures",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print {workload: {strategy: mean hours}}")
    out.add_argument(
        "--json-full",
        action="store_true",
        help="print means, 95%% CIs, failure-free times, speed-ups (and recommendations)",
    )
    p.add_argument("--plot", metavar="DIR", help="write interval_sweep.png and mtbf_sweep.png (Figures 13, 14)")
    p.add_argument(
        "--recommend",
        action="store_true",
        help="optimal checkpoint/snapshot interval per strategy, with Young's and Daly's approximations",
    )
    p.add_argument("--repeats", type=int, help="override simulation.repeats")
    p.add_argument("--seed", type=int, help="override simulation.seed")
    p.add_argument("--workload", action="append", metavar="NAME", help="only this workload (repeatable)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ds_swift.config import ConfigError
    from ds_swift.sim.schema import load_sim_config
    from ds_swift.sim.study import full_json, run_study, summary_json, write_plots

    cfg = load_sim_config(args.config)
    if args.profile:
        from ds_swift.sim.profile import apply_profile, load_profile

        cfg = apply_profile(cfg, load_profile(args.profile))
    if args.repeats is not None and args.repeats < 1:
        raise ConfigError(f"--repeats={args.repeats} is invalid: a positive integer")
    if args.seed is not None and args.seed < 0:
        raise ConfigError(f"--seed={args.seed} is invalid: an integer >= 0")
    repeats = cfg.repeats if args.repeats is None else args.repeats
    seed = cfg.seed if args.seed is None else args.seed
    reports = run_study(cfg, repeats=repeats, seed=seed, workloads=args.workload, with_recommendations=args.recommend)
    plots = write_plots(cfg, reports, args.plot, repeats=repeats, seed=seed) if args.plot else []
    if args.json:
        print(json.dumps(summary_json(reports)))
    elif args.json_full:
        doc = full_json(reports)
        if plots:
            doc["_plots"] = [str(p) for p in plots]
        print(json.dumps(doc))
    else:
        if args.profile:
            print(f"per-strategy costs measured in {args.profile} (strategies it does not name: from the YAML)")
        _print_tables(reports, repeats)
        for path in plots:
            print(f"wrote {path}")
    return 0


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def _print_tables(reports: list[Any], repeats: int) -> None:
    from rich.console import Console
    from rich.table import Table

    # A pipe gets rich's 80 columns, which truncates the names; give it room.
    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 150)
    table = Table(title=f"End-to-end training time with failures (mean of {repeats} repeats, 95% CI)")
    for col in ("workload", "strategy", "kind", "failures", "failure-free h", "mean h", "95% CI h", "speed-up"):
        table.add_column(col, justify="left" if col in ("workload", "strategy", "kind") else "right")
    for r in reports:
        for name, res in r.results.items():
            sp = r.speedup(name)
            table.add_row(
                r.name,
                name,
                res.kind,
                _fmt(res.mean_failures),
                _fmt(res.failure_free_hours),
                _fmt(res.mean_hours),
                f"{_fmt(res.ci_low_hours)}..{_fmt(res.ci_high_hours)}",
                "-" if sp is None else f"{sp:.2f}x",
            )
        table.add_section()
    console.print(table)
    if not any(r.recommendations for r in reports):
        return
    rec_table = Table(title="Optimal intervals (expected time; Young sqrt(2CM) and Daly for comparison)")
    for col in (
        "workload",
        "strategy",
        "interval",
        "configured",
        "h at configured",
        "optimal",
        "h at optimal",
        "Young",
        "Daly",
    ):
        rec_table.add_column(col, justify="left" if col in ("workload", "strategy", "interval") else "right")
    for r in reports:
        for rec in r.recommendations:
            rec_table.add_row(
                r.name,
                rec.strategy,
                rec.field or "(fixed)",
                str(rec.configured),
                _fmt(rec.configured_hours),
                str(rec.optimal) if rec.optimal else "-",
                _fmt(rec.optimal_hours),
                _fmt(rec.young, 0),
                _fmt(rec.daly, 0),
            )
        rec_table.add_section()
    console.print(rec_table)


def main(argv: list[str] | None = None) -> int:
    """``python -m ds_swift.sim.cli CONFIG ...``: the sub-command on its own, with the same
    one-line error for a bad config as ``ds-swift``."""
    from ds_swift.config import ConfigError

    parser = argparse.ArgumentParser(prog="ds-swift")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["simulate", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"ds-swift simulate: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
