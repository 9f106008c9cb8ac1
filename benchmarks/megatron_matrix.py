"""The fault matrix on the real Megatron-DeepSpeed: shapes x precisions x strategies x kill points.

Each case runs Megatron-DeepSpeed's own ``pretrain_gpt.py`` (the pinned commit, patched by
``ds-swift megatron-patch``) through ``scripts/megatron_deepspeed_cpu.sh``, with one failure
injected by ``ds-swift-launch --inject``, and passes when the job ends bitwise equal to the
failure-free run of its shape and precision (recovered exactly, or through a fallback it
announced), or, for an approximate strategy, on a recovery announced approximate within its stated
bound; never silently different. The verdict and the table are the example's fault matrix's
(``fault_matrix_run.verdict``, ``report``). One failure-free run per shape and precision serves
every strategy and point (``--reference``: a strategy does not change the failure-free arithmetic).

Shapes (``SHAPES``): ``pp2dp2`` (4 machines of 1 rank), ``tp2pp2dp2`` (4 machines of 2 ranks: a
tensor-parallel pair per machine), ``pp4`` (4 stages over 2 machines). Precisions: ``bf16`` and
``fp16`` (ZeRO-1; fp16 with a first loss scale of 2**20: the first steps overflow and are skipped,
so the loss scaler must come back too), ``fp32`` (ZeRO-0). Strategies: ``auto``, ``buddy``,
``replication``, ``logging``, ``checkpoint``, ``elastic`` (approximate: no spare, the job shrinks).
Points (``POINTS``): the five phases of iteration 6 (after the first global checkpoint, at 4) on
the last machine; ``first`` (the backward pass of iteration 2, before any checkpoint: a reload is
of the initial state); ``m0`` (machine 0, iteration 6); ``two`` (machine 0 and the last one at
the same instant, iteration 6; two spares).

    python benchmarks/megatron_matrix.py CHECKOUT                           # everything (many hours)
    python benchmarks/megatron_matrix.py CHECKOUT --shapes pp2dp2 --precisions bf16 --points first,backward
    python benchmarks/megatron_matrix.py CHECKOUT --cases pp2dp2/bf16/checkpoint/first --work DIR --json

One line per case as it ends, then the table and ``N passed, M failed`` (exit 1 if any failed).
Cases another run of the same ``--work`` finished are run again. Needs Megatron-DeepSpeed's deps
(``pip install regex nltk pybind11``) and a checkout at the series' commit.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_matrix_run import report, verdict  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "megatron_deepspeed_cpu.sh"
ITERS, SAVE_INTERVAL, LATE, EARLY = 8, 4, 6, 2

SHAPES: dict[str, list[str]] = {
    "pp2dp2": ["--tp", "1", "--pp", "2", "--dp", "2", "--machines", "4"],
    "tp2pp2dp2": ["--tp", "2", "--pp", "2", "--dp", "2", "--machines", "4"],
    "pp4": ["--tp", "1", "--pp", "4", "--dp", "1", "--machines", "2"],
}
PRECISIONS: dict[str, list[str]] = {
    "bf16": ["--precision", "bf16", "--zero", "1"],
    "fp16": ["--precision", "fp16", "--zero", "1", "--initial-scale-power", "20"],
    "fp32": ["--precision", "fp32", "--zero", "0"],
}
STRATEGIES = ("auto", "buddy", "replication", "logging", "checkpoint", "elastic")
#: point -> (script options of the kill, spares)
POINTS: dict[str, tuple[list[str], int]] = {
    **{
        p: (["--kill-phase", p, "--kill-iteration", str(LATE)], 1)
        for p in ("forward", "backward", "step", "send", "recv")
    },
    "first": (["--kill-phase", "backward", "--kill-iteration", str(EARLY)], 1),
    "m0": (["--kill-phase", "backward", "--kill-iteration", str(LATE), "--kill-machine", "0"], 1),
    "two": (["--kill-phase", "forward", "--kill-iteration", str(LATE), "--kill-machine", "0", "--kill-also", "-1"], 2),
}
#: strategies approximate by design: (largest relative distance, must shrink), as in fault_matrix_cases
APPROXIMATE: dict[str, tuple[float, bool]] = {"elastic": (1e-2, True)}
#: the CI subset (tests/dist/test_megatron_matrix.py): a reload of the initial state (issue 52's
#: case, on the smallest shape) and the default strategy's recovery mid-backward
CI_CASES = ("pp2dp2/bf16/checkpoint/first", "pp2dp2/bf16/auto/backward")


@dataclass(frozen=True)
class MegatronCase:
    shape: str
    precision: str
    strategy: str
    point: str

    @property
    def name(self) -> str:
        return f"{self.shape}/{self.precision}/{self.strategy}/{self.point}"

    def options(self) -> list[str]:
        """The script's options of this case (without the checkout, the work dir and --reference)."""
        kill, spares = POINTS[self.point]
        machines = int(SHAPES[self.shape][SHAPES[self.shape].index("--machines") + 1])
        kill = [str(machines - 1) if k == "-1" else k for k in kill]
        if self.strategy == "elastic":
            spares = 0  # no spare: the job goes on without the machine (or a restart of it)
        opts = [*SHAPES[self.shape], *PRECISIONS[self.precision], "--strategy", self.strategy, *kill]
        return [*opts, "--spares", str(spares), "--iters", str(ITERS), "--save-interval", str(SAVE_INTERVAL)]


def all_cases() -> list[MegatronCase]:
    return [MegatronCase(*c) for c in itertools.product(SHAPES, PRECISIONS, STRATEGIES, POINTS)]


def _script(
    checkout: Path, work: Path, case: MegatronCase, reference: Path | None, timeout_s: float
) -> tuple[int, str]:
    """Run the script for ``case``; (exit code, its output). The whole process tree goes at the deadline."""
    argv = ["bash", str(SCRIPT), str(checkout), str(work), *case.options()]
    if reference is not None:
        argv += ["--reference", str(reference)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -1, out + f"\nHANG: no end within {timeout_s:.0f} s"
    return proc.returncode, out


def run_case(
    checkout: Path, work: Path, case: MegatronCase, reference: Path | None, timeout_s: float
) -> dict[str, Any]:
    """One case: the script (its failure-free run too, without ``reference``), then the verdict."""
    from ds_swift.testing.checkpoints import checkpoint_tensors

    t0 = time.monotonic()
    code, out = _script(checkout, work, case, reference, timeout_s)
    row: dict[str, Any] = {"case": case.name, "exit": code, "seconds": round(time.monotonic() - t0, 1)}
    tag = f"global_step{ITERS}"
    ref_tag, kill_tag = (reference or work) / "ref" / "ckpt" / tag, work / "kill" / "ckpt" / tag
    log = work / "kill" / "log"
    output = log.read_text(errors="replace") if log.exists() else out
    refused = next((ln for ln in output.splitlines() if ln.startswith("ds-swift-launch: error:")), None)
    if refused is not None and not kill_tag.is_dir():
        # The launcher's check refused the case's configuration before any worker started (an
        # elastic shrink that would cut a replica, say): what it must do; not a recovery to judge.
        return {
            **row,
            "passed": None,
            "how": f"refused at launch: {refused.removeprefix('ds-swift-launch: error: ')[:150]}",
        }
    if code == -1 or not kill_tag.is_dir() or not ref_tag.is_dir():
        last = [ln for ln in out.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        return {**row, "passed": False, "how": f"exit {code}: {last[0][:160]}"}
    timelines = [json.loads(p.read_text()) for p in sorted((work / "kill" / "run").glob("timeline-gen*.json"))]
    passed, how = verdict(
        checkpoint_tensors(ref_tag), checkpoint_tensors(kill_tag), output, timelines, APPROXIMATE.get(case.strategy)
    )
    return {**row, "passed": passed, "how": how}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkout", metavar="PATH_TO_CHECKOUT", help="deepspeedai/Megatron-DeepSpeed at the series' commit")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--points", default=",".join(POINTS))
    p.add_argument("--cases", default="", help="comma-separated case names (shape/precision/strategy/point)")
    p.add_argument("--work", default=None, help="where the runs go (default: a new temporary directory)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds one case's script may take")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    return p


def chosen(args: argparse.Namespace, p: argparse.ArgumentParser) -> list[MegatronCase]:
    if args.cases:
        names = {n.strip() for n in args.cases.split(",") if n.strip()}
        picked = [c for c in all_cases() if c.name in names]
        unknown = names - {c.name for c in picked}
        if unknown:
            p.error(f"--cases: no such case {sorted(unknown)} (shape/precision/strategy/point)")
        return picked
    want = {k: set(getattr(args, k).split(",")) for k in ("shapes", "precisions", "strategies", "points")}
    for key, known in (("shapes", SHAPES), ("precisions", PRECISIONS), ("strategies", STRATEGIES), ("points", POINTS)):
        if want[key] - set(known):
            p.error(f"--{key}: unknown {sorted(want[key] - set(known))}; known: {', '.join(known)}")
    return [
        c
        for c in all_cases()
        if c.shape in want["shapes"]
        and c.precision in want["precisions"]
        and c.strategy in want["strategies"]
        and c.point in want["points"]
    ]


def main(argv: list[str] | None = None) -> int:
    import tempfile

    p = _parser()
    args = p.parse_args(argv)
    cases = chosen(args, p)
    base = Path(args.work or tempfile.mkdtemp(prefix="megatron-matrix-")).resolve()
    checkout = Path(args.checkout).resolve()
    refs: dict[tuple[str, str], Path] = {}
    rows = []
    for i, case in enumerate(cases):
        work = base / f"{i:03d}-{case.name.replace('/', '-')}"
        key = (case.shape, case.precision)
        row = run_case(checkout, work, case, refs.get(key), args.timeout)
        if key not in refs and (work / "ref" / "ckpt" / f"global_step{ITERS}").is_dir():
            refs[key] = work  # this case ran the failure-free run: the shape's reference from now on
        rows.append(row)
        mark = {True: "pass", False: "FAIL", None: "skip"}[row["passed"]]
        print(f"[{mark}] {case.name:40s} {row['how']} ({row['seconds']} s)", file=sys.stderr, flush=True)
    passed, failed = report(rows, width=40)
    if args.json:
        print(json.dumps({"cases": rows, "passed": passed, "failed": failed, "dir": str(base)}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
