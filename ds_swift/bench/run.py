"""``ds-swift bench``: every recovery strategy on the same GPT job, under the same failure, in one table.

For each strategy named with ``--strategies``, two jobs of ``examples/pretrain_gpt.py`` under
``ds-swift-launch`` (``ds_swift.testing.jobs``), from the same seed: one without a failure (what the
strategy costs while nothing fails) and one with a spare and an injected SIGKILL of a machine (what
it costs to get back). One more job, ``none`` (ds-swift off: no fault tolerance at all), is the
reference every row is compared with. Per strategy the table gives:

- ``throughput``: failure-free throughput / the reference's (median step time, from the loss log);
- ``total`` (kill -> back at the pre-failure iteration), split into ``init`` (detection ->
  replacements joined) and ``recovery`` (joined -> back), from the recovery timeline;
- ``lost``: iterations trained twice; ``loss delta``: final loss minus the reference's;
- ``exact``: the final parameters and optimizer state (fp32 masters included) against the
  reference's: ``bitwise``, or else the model parameters' relative L2 distance from the reference's
  (``1.3e-02 rel``: what an approximate strategy such as ``scar`` costs; ``max_ulp`` in the JSON);
- ``bytes/it``: bytes written per iteration in the failure-free run (global checkpoints, and the
  message log from each rank's ``usage/rank<r>.json``), ``rss/rank``: the largest resident memory
  a rank reached (sampled from /proc every 0.2 s, the same for every job), and the buddy copies
  held in host memory;
- ``recomputed``: the work a logging replay recomputed, in micro-batch passes (one forward and one
  backward of one stage): all replayers / the busiest one (the replay's critical path); for
  PipeChurn, the passes of the iteration in flight run again (``pipechurn_full``: every rank's;
  ``pipechurn_partial``: only those the failure lost, at any ``--phase``: the lost ranks' and the
  survivors' not finished yet). The
  variants ``logging_sequential`` and ``logging_parallel`` run logging-based recovery without and
  with parallel recovery (forced, ``parallel_recovery_force``: also where the plan finds that the
  helpers would only share the replacements' CPU cores), so one run measures the two side by side.

It writes ``bench.json`` and ``loss_vs_time.png`` (the loss of each strategy's failure run
against wall-clock time: where the time lost to the failure shows). ``bench.json`` is a bench
profile (``ds_swift/sim/profile.py``): its ``strategies`` key holds one row per strategy in the
form ``ds-swift simulate --profile bench.json`` reads (``checkpoint`` is named
``global_checkpoint`` there, and a logging row's ``iterations_lost`` counts the iterations the
replacement replayed; an elastic shrink's row is kind ``elastic`` with its ``shrunk_throughput``,
the median step before the failure over the one after it); ``details`` holds every figure above and each run's directory. ``--json``
prints it as the last line. The jobs run one after another: compare the rows of one run, not across machines.

Before any job runs, every strategy's requirements are checked against ``--nnodes`` /
``--nproc-per-node`` (``ds_swift.bench.jobs``: pipechurn needs k + r + 1 machines, say); a strategy
whose job fails all the same gets a ``FAILED`` row saying why, the others' rows are kept, and the
exit code is 1.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_swift.bench.demo import CONFIGS, DemoError, find_repo
from ds_swift.bench.demo_report import iterations_lost, read_loss_log
from ds_swift.bench.jobs import BenchError, Runner, failed_rows, infeasible_strategies, run_strategies
from ds_swift.bench.measure import PeakRss, final_loss, loss_series, shrunk_throughput, step_seconds, usage
from ds_swift.bench.profile import bench_profile, profile_row
from ds_swift.bench.table import fmt_mb, fmt_value, format_table, plot_loss_vs_time
from ds_swift.bench.variants import REFERENCE, bench_strategies, has_spare, strategy_overrides
from ds_swift.recovery.registry import strategy_names
from ds_swift.testing.checkpoints import checkpoint_tensors, compare_tensors, relative_distance
from ds_swift.testing.faults import PHASES
from ds_swift.testing.jobs import JobRun, JobSpec, JobTimeout, build_deepspeed_shm_op, run_job

__all__ = [
    "BenchError",
    "PeakRss",
    "bench_profile",
    "bench_rows",
    "final_loss",
    "format_table",
    "loss_series",
    "profile_row",
    "register",
    "shrunk_throughput",
    "step_seconds",
    "strategy_overrides",
    "usage",
]


@dataclass(frozen=True)
class BenchSetup:
    example: Path
    config: Path
    iterations: int
    kill_iteration: int
    machine: int
    phase: str
    interval: int
    nnodes: int
    nproc: int
    script_args: tuple[str, ...] = ()

    def spec(self, strategy: str, failure: bool) -> JobSpec:
        launcher: list[str] = []
        if failure:
            inject = f"machine={self.machine},iteration={self.kill_iteration},phase={self.phase}"
            launcher = [*(["--spares", "1"] if has_spare(strategy) else ["--elastic"]), "--inject", inject]
        # The swift section's machines are the launcher's (PipeChurn's chunks go to other machines).
        pp = int(json.loads(self.config.read_text()).get("pipeline", {}).get("stages", 1))
        swift = {**strategy_overrides(strategy, self.interval, pp), "machines": {"gpus_per_node": self.nproc}}
        return JobSpec(
            self.example,
            self.config,
            self.iterations,
            launcher,
            self.script_args,
            swift=swift,
            nnodes=self.nnodes,
            nproc_per_node=self.nproc,
            loss_log=True,
        )


# ---------------------------------------------------------------------------- the rows
def bench_rows(reference: JobRun, runs: dict[str, tuple[JobRun, JobRun]]) -> list[dict[str, Any]]:
    """One row per strategy from its failure-free and failure runs, against the reference."""
    ref_step, ref_loss = step_seconds(reference), final_loss(reference)
    ref_usage = usage(reference)
    ref_state = checkpoint_tensors(reference.final_tag)
    rows = []
    for name, (clean, failed) in runs.items():
        step = step_seconds(clean)
        timelines = failed.timelines()
        clean_diff = compare_tensors(ref_state, checkpoint_tensors(clean.final_tag))
        failed_state = checkpoint_tensors(failed.final_tag)
        diff = compare_tensors(ref_state, failed_state)
        u = usage(clean)
        loss = final_loss(failed)
        rows.append(
            {
                "strategy": name,
                "recovered_by": [tl["strategy"] for tl in timelines],
                "why": [tl.get("reason", "") for tl in timelines],
                "step_s": step,
                "throughput_ratio": ref_step / step if ref_step and step else None,
                "total_s": sum(tl["total_s"] for tl in timelines) if timelines else None,
                "initialization_s": sum(tl["initialization_s"] for tl in timelines) if timelines else None,
                "recovery_s": sum(tl["recovery_s"] for tl in timelines) if timelines else None,
                "iterations_lost": iterations_lost(read_loss_log(failed.loss_log)),
                # The work recomputed: micro-batch forward/backward passes the replay ran (all replayers;
                # the busiest one's, the critical path), None where the recovery replayed nothing.
                "recomputed_passes": _replay_sum(timelines, "micro_batch_passes"),
                "recomputed_passes_busiest": _replay_sum(timelines, "micro_batch_passes_busiest"),
                "replay_s": _replay_sum(timelines, "replay_s"),
                "parallel_replay": [(tl.get("replay") or {}).get("parallel") for tl in timelines],
                "shrunk_throughput": shrunk_throughput(failed, timelines),
                "final_loss_delta": loss - ref_loss if loss is not None and ref_loss is not None else None,
                "bitwise": diff.bitwise_equal,
                "max_ulp": diff.max_ulp,
                "param_distance": 0.0 if diff.bitwise_equal else relative_distance(ref_state, failed_state),
                "failure_free_bitwise": clean_diff.bitwise_equal,
                "bytes_per_iteration": (u["log_bytes"] + u["checkpoint_bytes"]) / max(1, clean.iterations),
                "log_bytes_per_iteration": u["log_bytes"] / max(1, clean.iterations),
                "checkpoint_bytes_per_iteration": u["checkpoint_bytes"] / max(1, clean.iterations),
                "max_rss_bytes": u["max_rss_bytes"],
                "rss_vs_reference": u["max_rss_bytes"] / ref_usage["max_rss_bytes"]
                if ref_usage["max_rss_bytes"]
                else None,
                # What protection holds in host memory per rank: the peak's excess over no protection.
                "host_memory_per_rank": max(0, u["max_rss_bytes"] - ref_usage["max_rss_bytes"]),
                "buddy_host_bytes": u["buddy_host_bytes_max"],
                "runs": {"failure_free": str(clean.dir), "failure": str(failed.dir)},
            }
        )
    return rows


def _replay_sum(timelines: list[dict[str, Any]], key: str) -> float | None:
    values = [(tl.get("replay") or {}).get(key) for tl in timelines]
    return sum(v for v in values if v is not None) if any(v is not None for v in values) else None


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="run the GPT job once per recovery strategy under the same failure and compare them in one table",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--strategies",
        default="auto,checkpoint",
        help=f"comma-separated, of {', '.join(strategy_names())} or a bench variant a strategy declares "
        f"(ds_swift.bench.variants; default %(default)s; '{REFERENCE}' always runs)",
    )
    p.add_argument("--config", default="pp2_dp2_bf16", help=f"{' | '.join(CONFIGS)} or a DeepSpeed JSON path")
    p.add_argument("--iterations", type=int, default=16)
    p.add_argument("--kill-iteration", type=int, default=11, help="iteration (from 0) during which the machine dies")
    p.add_argument("--machine", type=int, default=1, help="the machine killed (default %(default)s)")
    p.add_argument("--phase", default="backward", choices=PHASES)
    p.add_argument("--checkpoint-interval", type=int, default=8, help="iterations between global checkpoints")
    p.add_argument("--nnodes", type=int, default=2, help="simulated machines (default %(default)s)")
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks per machine (default %(default)s)")
    p.add_argument("--script-args", default="", help="extra pretrain_gpt.py arguments, e.g. '--hidden-size 256'")
    p.add_argument("--run-dir", default="./swift-bench", help="where the jobs, bench.json and the plot go")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one job may take")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object, last")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> list[str]:
    names = [s.strip() for s in args.strategies.split(",") if s.strip() and s.strip() != REFERENCE]
    if not names:
        raise BenchError(f"--strategies: name at least one of {', '.join(bench_strategies())}")
    for name in names:
        strategy_overrides(name, 1)
    if not 0 <= args.kill_iteration < args.iterations:
        raise BenchError(f"--kill-iteration {args.kill_iteration} must be in [0, --iterations {args.iterations})")
    if not 0 <= args.machine < args.nnodes:
        raise BenchError(f"--machine {args.machine} must be in [0, --nnodes {args.nnodes})")
    if args.checkpoint_interval < 1:
        raise BenchError("--checkpoint-interval must be at least 1")
    return list(dict.fromkeys(names))


def run(args: argparse.Namespace, runner: Runner = run_job) -> int:
    """The sub-command; ``runner`` runs one job (``ds_swift.testing.jobs.run_job``; a fake in the tests)."""
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if args.json else print
    try:
        names, setup = _setup(args)
    except (BenchError, DemoError) as exc:
        print(f"ds-swift bench: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.run_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    build_deepspeed_shm_op(out / "warm-up")
    job = _job_runner(args, setup, runner, out, say)
    try:
        reference = job(REFERENCE, False)
    except BenchError as exc:
        print(f"ds-swift bench: failed: the reference job, nothing to compare with: {exc}", file=sys.stderr)
        return 1
    runs, failed = run_strategies(names, job)  # a strategy that fails costs its own row only
    for name, why in failed.items():
        print(f"ds-swift bench: {name} failed: {why}", file=sys.stderr)
    if not runs:
        for line in failed_rows(failed):
            say(line)
        return 1
    rows = bench_rows(reference, runs)
    title = f"{setup.config.name}: machine {args.machine} killed at iteration {args.kill_iteration}"
    png = plot_loss_vs_time(reference, runs, out / "loss_vs_time.png", title)
    result = _result(args, setup, reference, runs, rows, failed)
    result |= {"plot": str(png), "seconds": time.monotonic() - t0}
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    _say_result(say, result, rows, failed)
    say(f"bench.json and {png.name} in {out} ({result['seconds']:.0f} s)")
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 1 if failed else 0


def _setup(args: argparse.Namespace) -> tuple[list[str], BenchSetup]:
    """The strategies to run and the job they share; BenchError where any cannot run (said before
    any job runs, not as a failure after the others trained)."""
    names = _check(args)
    repo = find_repo()
    setup = BenchSetup(
        repo.example,
        repo.config(args.config),
        args.iterations,
        args.kill_iteration,
        args.machine,
        args.phase,
        args.checkpoint_interval,
        args.nnodes,
        args.nproc_per_node,
        tuple(shlex.split(args.script_args)),
    )
    refused = infeasible_strategies(setup, names)
    if refused:
        raise BenchError("; ".join(f"{name} cannot run: {why}" for name, why in refused.items()))
    return names, setup


def _job_runner(
    args: argparse.Namespace, setup: BenchSetup, runner: Runner, out: Path, say: Callable[[str], None]
) -> Callable[[str, bool], JobRun]:
    """``job(name, failure)``: one job of the bench, run to its end; BenchError unless it exits 0."""

    def job(name: str, failure: bool) -> JobRun:
        where = out / f"{name}-{'failure' if failure else 'clean'}"
        say(f"[bench] {name}: {'machine ' + str(args.machine) + ' killed' if failure else 'no failure'} ...")
        try:
            rss = PeakRss()
            done = runner(where, setup.spec(name, failure), args.timeout, on_poll=rss)
            (done.dir / "peak_rss.json").write_text(json.dumps({"max_rss_bytes": rss.peak}))
        except JobTimeout as exc:
            raise BenchError(
                f"{name}: still running after {args.timeout:.0f} s (killed); see {exc.job.proc_logs}"
            ) from None
        if done.code != 0:
            tail = "\n".join(done.output.splitlines()[-30:])
            raise BenchError(
                f"{name} ({'failure' if failure else 'no failure'}): exit {done.code}; see {done.proc_logs}\n{tail}"
            )
        say(f"[bench] {name}: exit 0 after {done.seconds:.1f} s")
        return done

    return job


def _result(
    args: argparse.Namespace,
    setup: BenchSetup,
    reference: JobRun,
    runs: Any,
    rows: list[dict[str, Any]],
    failed: dict[str, str],
) -> dict[str, Any]:
    """bench.json's content (the plot and the total time are added by the caller)."""
    return {
        **bench_profile(reference, runs, rows, args.checkpoint_interval),
        "details": rows,
        "reference": {
            "step_s": step_seconds(reference),
            "final_loss": final_loss(reference),
            "run": str(reference.dir),
            **usage(reference),
        },
        "config": {
            "config": str(setup.config),
            "iterations": args.iterations,
            "kill_iteration": args.kill_iteration,
            "machine": args.machine,
            "phase": args.phase,
            "checkpoint_interval": args.checkpoint_interval,
            "nnodes": args.nnodes,
            "nproc_per_node": args.nproc_per_node,
            "script_args": list(setup.script_args),
        },
        "command": "ds-swift bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
        "failed": failed,
    }


def _say_result(
    say: Callable[[str], None], result: dict[str, Any], rows: list[dict[str, Any]], failed: dict[str, str]
) -> None:
    """The table and one line per thing a reader must not miss (no recovery, a differing run, a shrink)."""
    ref = result["reference"]
    say(
        f"reference ({REFERENCE}: ds-swift off, no failure): {fmt_value(ref['step_s'], '.3f')} s per iteration, final loss "
        f"{fmt_value(ref['final_loss'], '.4f')}, peak rss/rank {fmt_mb(ref['max_rss_bytes'])}"
    )
    for line in format_table(rows) + failed_rows(failed):
        say(line)
    for r in rows:
        if not r["recovered_by"]:
            say(f"{r['strategy']}: no recovery timeline: the failure run did not recover (see {r['runs']['failure']})")
        for how, why in zip(r["recovered_by"], r["why"], strict=False):
            say(f"{r['strategy']}: recovered by {how}: {why}")
        if not r["failure_free_bitwise"]:
            say(f"{r['strategy']}: the failure-free run differs from the reference (ds-swift off): a bug, report it")
        shrunk = r.get("shrunk_throughput")
        if shrunk is not None:
            say(
                f"{r['strategy']}: after the elastic shrink the job ran at {shrunk:.3f} of its speed before"
                + (
                    " (faster: its ranks shared fewer cores; the profile row caps it at 0.999, measure it on the real "
                    "machines)"
                    if shrunk >= 1
                    else ""
                )
            )
