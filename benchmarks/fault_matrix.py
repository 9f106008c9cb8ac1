"""The fault matrix: every strategy config x machine x injection point, through the real launcher.

Each case runs the tiny GPT (``examples/pretrain_gpt.py`` under ``tests/dist/workers/gpt_fault_worker.py``,
which adds the injection points the launcher's ``--inject`` cannot reach) with a spare, injects one
fault, and passes when the job either ends bitwise equal to the failure-free run of its config
(recovered exactly, or through a fallback it announced) or, for a bad config value, stops before
training with a message that names the field. Anything else fails the case: a non-zero exit, a
final state that differs, a hang (the job's deadline: its whole process tree is SIGKILLed).

Configs (``CONFIGS``): ``replication`` (bf16 + ZeRO-1, pp 2 x dp 2: buddy copies and replicas),
``logging`` (bf16 + ZeRO-1, pp 4 over 2 machines, a storage budget), ``global_checkpoint`` and
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
``recv_state`` / ``send_state`` (the replacement dies mid-receive of its buddy copy: a second spare
and a retried recovery; the survivor sending it dies: both machines lost, the checkpoint),
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
is 1 if any case failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds_swift.testing.checkpoints import checkpoint_tensors, compare_tensors, relative_distance
from ds_swift.testing.jobs import JobRun, JobSpec, JobTimeout, build_deepspeed_shm_op, run_job

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist" / "workers" / "gpt_fault_worker.py"
BF16 = ROOT / "configs" / "gpt_tiny_pp2_dp2_bf16_zero1.json"
FP32 = ROOT / "configs" / "gpt_tiny_pp2_dp2.json"  # fp32, ZeRO-0
PP4_BUDGET = ROOT / "configs" / "gpt_tiny_pp4_bf16_zero1_budget.json"
ITERS = 12
KILL_AT = 7  # after the checkpoint at 4 (interval 4), before the one at 8
#: the stall case's watchdog: its 8 s stop outlasts the op timeout, not the heartbeat or hang timeouts
#: (a stop past those is, rightly, a dead or hung machine)
STALL_WATCHDOG = {"op_timeout_s": 4.0, "heartbeat_timeout_s": 20.0, "hang_timeout_s": 25.0}

#: config -> (DeepSpeed JSON, swift overrides)
CONFIGS: dict[str, tuple[Path, dict[str, Any]]] = {
    "replication": (BF16, {"checkpoint": {"interval": 4}}),
    "logging": (PP4_BUDGET, {"checkpoint": {"interval": 4}}),
    "global_checkpoint": (BF16, {"strategy": "global_checkpoint", "checkpoint": {"interval": 4}}),
    "checkfreq": (BF16, {"strategy": "checkfreq", "checkfreq": {"profile_at": 3}}),
    "elastic": (BF16, {"strategy": "elastic", "checkpoint": {"interval": 4}}),
    # The elastic shrink on fp32 + ZeRO-0 (issue 30: it hung in the rendezvous once): one case.
    "elastic_fp32": (FP32, {"strategy": "elastic", "checkpoint": {"interval": 4}}),
    # The other seed systems' strategies, on the same job.
    "tranlogs": (BF16, {"strategy": "tranlogs", "checkpoint": {"interval": 4}}),
    "pipechurn": (
        BF16,
        {
            "strategy": "pipechurn",
            "pipechurn": {"data_chunks": 2, "parity_chunks": 1},
            "machines": {"gpus_per_node": 1},
            "checkpoint": {"interval": 4},
        },
    ),
    "scar": (BF16, {"strategy": "scar", "checkpoint": {"interval": 4, "running_fraction": 0.25}}),
    "immediate_rollback": (BF16, {"strategy": "immediate_rollback", "checkpoint": {"interval": 4}}),
}
#: configs on more machines than 2 (pipechurn's (k, r) = (2, 1) chunks need 3 other machines)
NNODES: dict[str, int] = {"pipechurn": 4}
#: configs whose recoveries are approximate by design: (largest relative distance, must shrink). A
#: case passes bitwise, or on a recovery announced approximate that ends within the distance.
APPROXIMATE: dict[str, tuple[float, bool]] = {
    "elastic": (1e-2, True),
    "elastic_fp32": (1e-2, True),
    "scar": (2e-2, False),
    "immediate_rollback": (1e-2, False),
}
#: launcher flags instead of ``--spares N``
LAUNCH: dict[str, list[str]] = {"elastic": ["--elastic"], "elastic_fp32": ["--spares", "0", "--elastic"]}
#: configs with one case only (machine 1 killed in iteration KILL_AT's backward pass), not every point
ONE_CASE = {"elastic_fp32"}
PHASES = ("forward", "backward", "step", "send", "recv")
#: one bad value per section: (swift overrides, the field the error must name)
BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"strategy": "fastest"}, "strategy"),
    ({"checkpoint": {"interval": 0}}, "checkpoint.interval"),
    ({"logging": {"storage_budget_gb": -1}}, "logging.storage_budget_gb"),
    ({"buddy": {"replication_factor": 0}}, "buddy.replication_factor"),
    ({"watchdog": {"op_timeout_s": "soon"}}, "watchdog.op_timeout_s"),
    ({"checkfreq": {"max_overhead": 2}}, "checkfreq.max_overhead"),
    ({"machines": {"gpus_per_node": 3}}, "machines.gpus_per_node"),
    ({"verify": {"digest_interval": 0}}, "verify.digest_interval"),
]


@dataclass
class Case:
    config: str
    point: str
    machine: int | None = None
    inject: str = ""
    env: dict[str, str] = field(default_factory=dict)
    swift: dict[str, Any] = field(default_factory=dict)
    nnodes: int = 0
    """Machines; 0: the config's (``NNODES``, else 2)."""
    spares: int = 1
    bad_field: str | None = None
    """A bad config value: the job must stop naming this field."""
    small_disk: str | None = None
    """"ckpt" or "log": that directory on a small tmpfs that fills up."""
    disk_size: str = "2m"
    must_say: tuple[str, ...] = ()
    """Lines the job's output must hold (the fault really happened; the fallback was announced)."""

    def __post_init__(self) -> None:
        self.nnodes = self.nnodes or NNODES.get(self.config, 2)

    @property
    def name(self) -> str:
        where = f" m{self.machine}" if self.machine is not None else ""
        return f"{self.config}/{self.point}{where}"


def cases() -> list[Case]:
    out: list[Case] = []
    for config in ONE_CASE:
        out.append(Case(config, "backward", 1, inject=f"machine=1,iteration={KILL_AT},phase=backward"))
    for config in (c for c in CONFIGS if c not in ONE_CASE):
        for machine in (0, 1):
            for phase in PHASES:
                out.append(Case(config, phase, machine, inject=f"machine={machine},iteration={KILL_AT},phase={phase}"))
        # Rank 3 (the last machine) dies as the periodic checkpoint after 8 iterations starts.
        at = 8 if config != "checkfreq" else 3
        out.append(Case(config, "save", 1, env={"SWIFT_TEST_KILL_IN_SAVE": f"rank=3,iteration={at}"}))
    out.append(
        Case(
            "logging",
            "replay",
            1,
            inject=f"machine=1,iteration={KILL_AT},phase=backward",
            env={"SWIFT_TEST_KILL_IN_REPLAY": "rank=2,iteration=5"},
            spares=2,
        )
    )
    # A damaged log: a corrupt record, a chunk cut short, a chunk lost. The replay must refuse it
    # and every rank fall back to the checkpoint, loudly.
    for point, env in (
        ("corrupt_log", "SWIFT_TEST_CORRUPT_LOG"),
        ("truncated_log", "SWIFT_TEST_TRUNCATE_LOG"),
        ("missing_log", "SWIFT_TEST_MISSING_LOG"),
    ):
        out.append(
            Case(
                "logging",
                point,
                1,
                inject=f"machine=1,iteration={KILL_AT},phase=backward",
                env={env: "rank=2,iteration=5,micro_batch=1,src=1"},
                must_say=("[test] ", "checkpoint fallback"),
            )
        )
    # A rank dies in the middle of writing a record of its log (machine 1's sender of gradients):
    # the torn tail is cut off when its replacement logs again; the recovery replays bitwise.
    out.append(
        Case(
            "logging",
            "log_write",
            1,
            env={"SWIFT_TEST_KILL_IN_LOG_WRITE": f"rank=2,iteration={KILL_AT}"},
            must_say=("in the middle of writing",),
        )
    )
    # The log's disk fills up mid-run: logging stops loudly, training goes on, and the failure
    # whose replay would need the lost messages falls back to the checkpoint.
    out.append(
        Case(
            "logging",
            "full_log_disk",
            1,
            inject=f"machine=1,iteration={KILL_AT},phase=backward",
            small_disk="log",
            disk_size="256k",  # the tiny GPT logs ~130 KB an iteration (bf16)
            must_say=("No space left on device", "checkpoint fallback"),
        )
    )
    # A peer vanishing mid-transfer during a replication recovery: the replacement receiving its
    # state (a second spare takes its place; the recovery is retried) or the survivor sending it
    # (both machines lost now: the checkpoint, announced).
    out.append(
        Case(
            "replication",
            "recv_state",
            1,
            inject=f"machine=1,iteration={KILL_AT},phase=backward",
            spares=2,
            env={"SWIFT_TEST_KILL_IN_RECV_STATE": "rank=2"},
            must_say=("in the middle of receiving",),
        )
    )
    out.append(
        Case(
            "replication",
            "send_state",
            1,
            inject=f"machine=1,iteration={KILL_AT},phase=backward",
            spares=2,
            env={"SWIFT_TEST_KILL_IN_SEND_STATE": "rank=0"},
            must_say=("in the middle of sending", "checkpoint fallback"),
        )
    )
    out.append(
        Case(
            "replication",
            "two_machines",
            None,
            nnodes=4,
            spares=2,
            inject=f"machine=0+2,iteration={KILL_AT},phase=forward",  # both at one instant
            swift={"machines": {"gpus_per_node": 1, "rank_order": "tp-pp-dp"}, "watchdog": {"op_timeout_s": 60.0}},
        )
    )
    for config in ("replication", "global_checkpoint"):  # synchronous and asynchronous saves
        out.append(
            Case(config, "full_ckpt_disk", 1, inject=f"machine=1,iteration={KILL_AT},phase=backward", small_disk="ckpt")
        )
    # A checkpoint fallback (forced, synchronous saves) meets a corrupt / a missing file of rank 0 in
    # the newest checkpoint (8): every rank must step back to 4 together, loudly, and end bitwise.
    for point, env in (("corrupt_ckpt", "SWIFT_TEST_CORRUPT_CKPT"), ("missing_ckpt", "SWIFT_TEST_MISSING_CKPT")):
        out.append(
            Case(
                "replication",
                point,
                1,
                inject="machine=1,iteration=10,phase=backward",
                env={env: "rank=0,iteration=8"},
                swift={"strategy": "checkpoint"},
            )
        )
    # A stall, not a death (issue 30): rank 0 stops (SIGSTOP) past the op timeout, then resumes; its
    # peers' ops time out with every rank alive: one agreed verdict (a stall), the same ranks re-form
    # the next generation with their state, and the job ends bitwise, no machine replaced.
    out.append(
        Case(
            "replication",
            "stall",
            0,
            env={"SWIFT_TEST_PAUSE": f"rank=0,iteration={KILL_AT},seconds=8"},
            swift={"watchdog": STALL_WATCHDOG},
            must_say=("resumed (SIGCONT)", "(a stall: no rank died, none replaced)"),
        )
    )
    for swift, name in BAD_VALUES:
        out.append(Case("replication", f"bad {name}", None, swift=swift, bad_field=name))
    return out


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for k, v in extra.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@contextlib.contextmanager
def small_disk(where: Path, size: str = "2m") -> Iterator[Path | None]:
    """A size-limited tmpfs (None where this machine cannot mount one: the case is skipped)."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
    )
    if done.returncode != 0:
        yield None
        return
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def spec_for(case: Case, config_swift: dict[str, Any] | None = None) -> JobSpec:
    path, swift = CONFIGS[case.config]
    spares = LAUNCH.get(case.config, ["--spares", str(case.spares)])
    args = [*spares, "--max-failures", "4"] + (["--inject", case.inject] if case.inject else [])
    return JobSpec(
        WORKER,
        path,
        ITERS,
        args,
        swift=merged(merged(swift, case.swift), config_swift or {}),
        env=case.env,
        nnodes=case.nnodes,
        nproc_per_node=4 // case.nnodes,
    )


def reference(work: Path, config: str, timeout: float) -> JobRun:
    job = run_job(work / f"reference-{config}", spec_for(Case(config, "none")), timeout)
    if job.code != 0 or job.timelines():
        raise RuntimeError(f"the failure-free run of {config} failed (exit {job.code}):\n{job.output[-3000:]}")
    return job


def judge(case: Case, job: JobRun, ref: JobRun | None) -> tuple[bool, str]:
    """(passed, how it ended) for one case's job."""
    if case.bad_field is not None:
        named = f"swift config: {case.bad_field}" in job.output or f"'{case.bad_field}'" in job.output
        return job.code != 0 and named, f"exit {job.code}, " + ("names the field" if named else "field not named")
    if job.code != 0:
        return False, f"exit {job.code}"
    missing = [m for m in case.must_say if m not in job.output]
    if missing:
        return False, f"exit 0, but the output lacks {missing}"
    tls = job.timelines()
    how = ",".join(t["strategy"] for t in tls) or "no recovery"
    fallback = "checkpoint fallback" in job.output
    assert ref is not None
    ref_state, state = checkpoint_tensors(ref.final_tag), checkpoint_tensors(job.final_tag)
    diff = compare_tensors(ref_state, state)
    if case.config in APPROXIMATE and tls and not fallback and (APPROXIMATE[case.config][1] or not diff.bitwise_equal):
        bound, must_shrink = APPROXIMATE[case.config]
        shrank = any((t.get("resize") or {}).get("kind") == "shrink" for t in tls)
        said = "APPROXIMATE RECOVERY" in job.output
        distance = relative_distance(ref_state, state) if not diff.bitwise_equal else 0.0
        ok = (shrank or not must_shrink) and said and distance is not None and distance < bound
        shrink = ("shrank, " if shrank else "NO SHRINK, ") if must_shrink else ""
        return ok, (
            f"{how}: {shrink}{'announced' if said else 'NOT ANNOUNCED'} "
            f"approximate, {'?' if distance is None else f'{distance:.2g}'} from the failure-free run (< {bound:g})"
        )
    if not diff.bitwise_equal:
        return False, f"{how}: NOT bitwise ({diff.describe()[:120]})"
    return True, f"{how}{' (announced fallback)' if fallback else ''}, bitwise"


def run_case(case: Case, work: Path, ref: JobRun | None, timeout: float) -> dict[str, Any]:
    t0 = time.monotonic()
    row: dict[str, Any] = {"case": case.name}
    try:
        if case.small_disk:
            with small_disk(work / f"{case.small_disk}fs", case.disk_size) as disk:
                if disk is None:
                    return {**row, "passed": None, "how": "skipped: cannot mount a tmpfs here", "seconds": 0.0}
                where = (
                    {"checkpoint": {"dir": str(disk)}}
                    if case.small_disk == "ckpt"
                    else {"logging": {"storage": f"file://{disk}"}}
                )
                job = run_job(work / "job", spec_for(case, where), timeout)
                row["ckpt_disk_full_said"] = "could not be written" in job.output
        else:
            job = run_job(work / "job", spec_for(case), timeout)
        passed, how = judge(case, job, ref)
        row.update(passed=passed, how=how, exit=job.code)
    except JobTimeout:
        row.update(passed=False, how=f"HANG: no end within {timeout:.0f} s", exit=None)
    row["seconds"] = round(time.monotonic() - t0, 1)
    return row


def main(argv: list[str] | None = None) -> int:
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
    args = p.parse_args(argv)
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
    print(f"\n{'case':36s} {'result':6s} {'seconds':>8s}  how it ended")
    for r in rows:
        print(
            f"{r['case']:36s} {({True: 'pass', False: 'FAIL', None: 'skip'})[r['passed']]:6s} {r['seconds']:8.1f}  {r['how']}"
        )
    passed = sum(1 for r in rows if r["passed"])
    failed = sum(1 for r in rows if r["passed"] is False)
    print(
        f"{passed} passed, {failed} failed"
        + (f", {len(rows) - passed - failed} skipped" if len(rows) > passed + failed else "")
    )
    if args.json:
        print(json.dumps({"cases": rows, "passed": passed, "failed": failed, "dir": str(base)}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
