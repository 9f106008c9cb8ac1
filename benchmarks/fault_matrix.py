"""The fault matrix: every strategy config x machine x injection point, through the real launcher.

Each case runs the tiny GPT (``examples/pretrain_gpt.py`` under ``tests/dist/workers/gpt_fault_worker.py``,
which adds the injection points the launcher's ``--inject`` cannot reach) with a spare, injects one
fault, and passes when the job either ends bitwise equal to the failure-free run of its config
(recovered exactly, or through a fallback it announced) or, for a bad config value, stops before
training with a message that names the field. Anything else fails the case: a non-zero exit, a
final state that differs, a hang (the job's deadline: its whole process tree is SIGKILLed).

Configs (``CONFIGS``): ``replication`` (bf16 + ZeRO-1, pp 2 x dp 2: buddy copies and replicas),
``buddy_k5`` (the same with a buddy round every 5th step, the steady state of the default
``buddy.interval: "auto"`` on a GPU: every rank goes back to the newest round),
``logging`` (bf16 + ZeRO-1, pp 4 over 2 machines, a storage budget), ``fp16`` (replication in fp16
+ ZeRO-1 with a dynamic loss scale that overflows every few steps: the loss scaler must come back
too), ``global_checkpoint`` and
``checkfreq`` (asynchronous checkpoints, every rank reloads), ``elastic`` (lossy forward without a
spare: the job goes on without the failed machine), and the other seed systems' strategies on the
same job: ``tranlogs``, ``pipechurn`` (on 4 machines of one rank: its (2, 1) chunks need 3 other
machines), ``scar`` and ``immediate_rollback``. The approximate ones (``APPROXIMATE``: elastic, scar,
immediate_rollback) pass bitwise, or on a recovery announced approximate that ends within a relative
distance of the failure-free run (elastic must also have shrunk the job).

Points: ``forward``, ``backward``, ``step``, ``send``, ``recv`` of an iteration, ``save`` (a rank dies
as the periodic checkpoint starts), and per config its own. Logging: ``replay`` (a replacement dies
mid-replay), ``corrupt_log`` / ``truncated_log`` / ``missing_log`` (a record of the log corrupt, its
chunk cut short, its chunk and index deleted: the replay must refuse it and fall back, loudly),
``log_write`` (a rank dies in the middle of writing a record: the torn tail is cut off when its
replacement logs again) and ``full_log_disk`` (the log on a 256 KB tmpfs: logging stops loudly, a
later failure falls back). Replication: ``two_machines`` (machines 0 and 2 of four die at once),
``recv_state`` / ``send_state``, also for ``buddy_k5`` (the replacement dies mid-receive of its
buddy copy: a second spare and a retried recovery; the survivor sending it dies: both machines lost,
the checkpoint),
``corrupt_ckpt`` / ``missing_ckpt`` (a checkpoint fallback whose newest checkpoint has a corrupt or
missing file of one rank: every rank must step back to the one before it). ``full_ckpt_disk`` (the
checkpoint directory on a 2 MB tmpfs: training goes on, a later failure reloads an older complete
checkpoint, or restarts) for replication (synchronous saves) and global_checkpoint (asynchronous).
``stall`` (replication): rank 0 stops (SIGSTOP) past the op timeout and resumes: a stall, not a
death; every rank agrees on it, the same ranks re-form the next generation with their state, and
the job ends bitwise with no machine replaced. And one bad value per config section.

    python benchmarks/fault_matrix.py                         # everything (~45 min on 2 cores)
    python benchmarks/fault_matrix.py --configs logging --points backward,replay,corrupt_log
    python benchmarks/fault_matrix.py --cases "replication/recv_state m1,replication/bad strategy" --shared-reference
    python benchmarks/fault_matrix.py --json                  # last line: {"cases": [...], "passed": N, ...}
    python benchmarks/fault_matrix.py --cases ... --reference DIR   # a failure-free bf16 run done already

It prints one line per case as it ends, then the table, then ``N passed, M failed``; the exit code
is 1 if any case failed. The configs and cases are in ``fault_matrix_cases.py``, one case's job
and verdict in ``fault_matrix_run.py`` (beside this script); this one picks and reports.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

# The matrix's other modules sit beside this script: importable also where it is loaded by path
# (tests/dist/test_fault_matrix.py), not run.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_matrix_cases import BAD_VALUES, BF16, CONFIGS, ITERS, NNODES, Case, cases  # noqa: E402
from fault_matrix_run import reference, report, run_case  # noqa: E402

from ds_swift.testing.jobs import JobRun, build_deepspeed_shm_op  # noqa: E402

__all__ = ["BAD_VALUES", "ITERS", "main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of the configs")
    p.add_argument(
        "--points",
        default="",
        help="comma-separated points (phases, save, replay, corrupt_log, "
        "two_machines, full_ckpt_disk, bad); default: all",
    )
    p.add_argument("--machines", default="0,1", help="machines to kill in the phase cases")
    p.add_argument(
        "--cases",
        default="",
        help="comma-separated case names as the table prints them "
        '("replication/recv_state m1,replication/bad strategy"): these, instead of the filters above',
    )
    p.add_argument("--timeout", type=float, default=240.0, help="seconds one job may take (then: a hang)")
    p.add_argument("--keep", default=None, help="keep the jobs' directories here")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    p.add_argument(
        "--shared-reference",
        action="store_true",
        help="one failure-free run per DeepSpeed config and machine count, not per strategy config "
        "(a strategy does not change the arithmetic: `ds-swift bench` checks each one's failure-free "
        "run bitwise against ds-swift off)",
    )
    p.add_argument(
        "--reference",
        default=None,
        metavar="DIR",
        help=f"a failure-free run of {BF16.name} on 2 machines, {ITERS} iterations, done already (its "
        "job directory, as ds_swift.testing.jobs writes it): the shared reference of the configs on it, "
        "instead of running one (implies --shared-reference)",
    )
    return p


def _chosen(args: argparse.Namespace, p: argparse.ArgumentParser) -> list[Case]:
    """The cases the command line picks (``--cases``, else the filters), in the matrix's order."""
    configs, machines = set(args.configs.split(",")), {int(m) for m in args.machines.split(",")}
    points = {x.strip() for x in args.points.split(",") if x.strip()}
    chosen = [
        c
        for c in cases()
        if c.config in configs
        and (c.machine is None or c.machine in machines)
        and (not points or c.point in points or (c.bad_field is not None and "bad" in points))
    ]
    if args.cases:
        names = {n.strip() for n in args.cases.split(",") if n.strip()}
        chosen = [c for c in cases() if c.name in names]
        unknown = names - {c.name for c in chosen}
        if unknown:
            p.error(f"--cases: no such case {sorted(unknown)}; the names are those of the table")
    return chosen


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    chosen = _chosen(args, p)
    base = Path(args.keep or tempfile.mkdtemp(prefix="fault-matrix-"))
    build_deepspeed_shm_op(base / "warm")  # once, not in every job's start-up
    refs: dict[str, JobRun] = {}
    if args.reference:
        args.shared_reference = True
        refs[f"{BF16.stem}-2"] = JobRun(Path(args.reference).resolve(), ITERS)
    rows = []
    for i, case in enumerate(chosen):
        ref = None
        if case.bad_field is None:
            key = (
                f"{CONFIGS[case.config][0].stem}-{NNODES.get(case.config, 2)}" if args.shared_reference else case.config
            )
            if key not in refs:
                refs[key] = reference(base, case.config, args.timeout)
            ref = refs[key]
        row = run_case(case, base / f"{i:02d}", ref, args.timeout)
        rows.append(row)
        mark = {True: "pass", False: "FAIL", None: "skip"}[row["passed"]]
        print(f"[{mark}] {case.name:36s} {row['how']} ({row['seconds']} s)", file=sys.stderr, flush=True)
    passed, failed = report(rows)
    if args.json:
        print(json.dumps({"cases": rows, "passed": passed, "failed": failed, "dir": str(base)}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
