"""torchft 0.2.0 beside ds-swift, in one run: kill -> back in training after a replica's SIGKILL.

torchft (CPU, gloo): a lighthouse and 2 replica groups of one process each (``replica.py``), each
training a ~25M-parameter model (6 x Linear(2048, 2048), AdamW) under torchft's DDP and manager,
as shipped but for the workaround ``replica.py`` describes (without it the surviving group ends at
the kill). Replica 1 is SIGKILLed once both have committed ``--kill-step`` steps together and is
started again at once (a supervisor's restart: a new process); measured: the kill -> the first step
the restarted replica commits with both replicas participating ("first contributing step"), and
the survivor's first committed step alone (torchft's heartbeat timeout, 5 s by default, is in it).

ds-swift: ``benchmarks/recovery_time.py``'s ``replication`` variant with a ~25M-parameter GPT
(``--model-args``): pp 2 x dp 2 on 2 simulated machines, warm spares, machine 1 killed; measured:
the kill -> every rank back at the pre-failure iteration.

Set-up: ``pip install torchft==0.2.0`` (a wheel for CPython 3.11 on Linux; it needs torch >= 2.7
and opentelemetry, nothing else). Then::

    python benchmarks/peers/torchft/compare.py                 # one torchft run, one ds-swift run
    python benchmarks/peers/torchft/compare.py --rounds 3 --json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
GPT_25M = "--hidden-size 512 --num-layers 8 --num-attention-heads 8 --seq-length 128"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1, help="runs of each side (alternating)")
    p.add_argument("--kill-step", type=int, default=5, help="torchft: steps committed by both before the kill")
    p.add_argument("--model-args", default=GPT_25M, help="ds-swift: the GPT's shape (pretrain_gpt.py flags)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run of either side may take")
    p.add_argument("--side", choices=("both", "torchft", "ds_swift"), default="both", help="run one side only")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def torchft_run(work: Path, kill_step: int, timeout: float) -> dict[str, float]:
    """One torchft run: two replicas, replica 1 killed and restarted; its kill -> back figures."""
    from torchft._torchft import LighthouseServer

    work.mkdir(parents=True, exist_ok=True)
    out = work / "steps.jsonl"
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    steps = kill_step + 25

    def start(replica: int) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, str(HERE / "replica.py"), "--replica", str(replica)]
        cmd += ["--lighthouse", lighthouse.address(), "--steps", str(steps), "--out", str(out)]
        log = open(work / f"replica{replica}.log", "ab")  # noqa: SIM115 - closed with the process
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    procs = [start(0), start(1)]
    deadline = time.time() + timeout
    try:
        while not any(r["committed"] and r["participants"] == 2 and r["step"] >= kill_step for r in lines(out)):
            if time.time() > deadline or any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(f"torchft: the two replicas did not reach step {kill_step} together ({work})")
            time.sleep(0.05)
        t_kill = time.time()
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        procs.append(start(1))
        restarted = procs[-1].pid
        while True:
            rows = lines(out)
            back = [r for r in rows if r["pid"] == restarted and r["committed"] and r["participants"] == 2]
            if back:
                break
            if time.time() > deadline or procs[-1].poll() not in (None, 0) or procs[0].poll() not in (None, 0):
                raise RuntimeError(f"torchft: the restarted replica never contributed ({work})")
            time.sleep(0.05)
        alone = [r for r in rows if r["replica"] == 0 and r["t"] > t_kill and r["committed"]]
        return {
            "kill_to_first_contributing_step_s": back[0]["t"] - t_kill,
            "kill_to_survivor_committing_alone_s": (alone[0]["t"] - t_kill) if alone else float("nan"),
        }
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.shutdown()


def ds_swift_run(work: Path, model_args: str, timeout: float) -> dict[str, float]:
    """One ds-swift run of benchmarks/recovery_time.py's replication variant; its kill -> back."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import recovery_time

    tl = recovery_time.run_one(work, "replication", 8, model_args.split(), timeout)
    return {"kill_to_back_s": float(tl["total_s"]), **{f"phase_{k}_s": float(v) for k, v in tl["phases"].items()}}


def round_words(runs: dict[str, list[dict[str, float]]], r: int) -> str:
    words = []
    if len(runs["torchft"]) > r:
        ft = runs["torchft"][r]
        words.append(
            f"torchft kill -> first contributing step {ft['kill_to_first_contributing_step_s']:.2f} s (the survivor "
            f"committing alone after {ft['kill_to_survivor_committing_alone_s']:.2f} s)"
        )
    if len(runs["ds_swift"]) > r:
        words.append(f"ds-swift kill -> back {runs['ds_swift'][r]['kill_to_back_s']:.2f} s")
    return "; ".join(words)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    runs: dict[str, list[dict[str, float]]] = {"torchft": [], "ds_swift": []}
    with tempfile.TemporaryDirectory(prefix="ds-swift-vs-torchft-") as tmp:
        for r in range(args.rounds):
            if args.side in ("both", "torchft"):
                runs["torchft"].append(torchft_run(Path(tmp) / f"torchft-{r}", args.kill_step, args.timeout))
            if args.side in ("both", "ds_swift"):
                runs["ds_swift"].append(ds_swift_run(Path(tmp) / f"ds-swift-{r}", args.model_args, args.timeout))
            if not args.json:
                print(f"round {r}: {round_words(runs, r)}", flush=True)
    result: dict[str, Any] = {"runs": runs}
    if runs["torchft"]:
        result["torchft_s"] = statistics.median(r["kill_to_first_contributing_step_s"] for r in runs["torchft"])
    if runs["ds_swift"]:
        result["ds_swift_s"] = statistics.median(r["kill_to_back_s"] for r in runs["ds_swift"])
    if runs["torchft"] and runs["ds_swift"]:
        result["ratio"] = result["ds_swift_s"] / result["torchft_s"]
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    said = [f"median over {args.rounds} round(s):"]
    if "torchft_s" in result:
        said.append(f"torchft 0.2.0 kill -> first contributing step {result['torchft_s']:.2f} s;")
    if "ds_swift_s" in result:
        said.append(f"ds-swift kill -> back {result['ds_swift_s']:.2f} s;")
    if "ratio" in result:
        said.append(f"ratio {result['ratio']:.2f} (ds-swift / torchft)")
    print(" ".join(said).rstrip(";"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
