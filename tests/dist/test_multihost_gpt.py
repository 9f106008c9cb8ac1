"""The GPT example on 3 "hosts" under SLURM with an etcd store: machine 0 dies whole, agent included.

The job (pp 2 x dp 2, 2 ranks per machine, the allocation's third node a spare) stores nothing
in agent 0: ``--store etcd+https://``, an etcd with TLS, client certificates and authentication on
(tests/dist/etcd_server.py), whose CA, certificate, user and password file every agent and worker
finds in its environment (``SWIFT_STORE_*``, passed on by srun). Machine 0's two ranks stall before the gradient all-reduce of
iteration STALL_AT (nobody steps it); the test then SIGKILLs agent 0's session, and the workers
die with it (parent-death signal). The survivors' watchdogs see the broken connections, the
other agents see agent 0's liveness counter stop, one of them fails machine 0 for it, the spare
takes machine 0 over, and the replicas (machine 1) restore it. The final checkpoint must be
bitwise equal to the one of a failure-free run.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from etcd_server import Etcd
from standin_hosts import host_logs, slurm_env

from ds_swift.testing.checkpoints import compare_checkpoints
from ds_swift.testing.jobs import JobRun
from ds_swift.testing.procs import ProcessSet

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "workers" / "multihost_gpt_worker.py"
CONFIG = ROOT / "configs" / "gpt_tiny_pp2_dp2.json"
ITERS = 8
STALL_AT = 4
JOB_DEADLINE_S = 300.0  # generous: a loaded CI machine starts 7 Python processes with torch and DeepSpeed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(800)]


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[Etcd]:
    server = Etcd(tmp_path, tls=True)
    try:
        yield server
    finally:
        server.stop()


def ds_config(tmp: Path) -> Path:
    cfg = json.loads(CONFIG.read_text())
    cfg["swift"]["checkpoint"]["dir"] = str(tmp / "ckpt")
    cfg["swift"]["strategy"] = "replication"
    path = tmp / "ds_config.json"
    path.write_text(json.dumps(cfg))
    return path


def script_args(tmp: Path, script: Path) -> list[str]:
    return [
        str(script),
        "--deepspeed_config",
        str(ds_config(tmp)),
        "--train-iters",
        str(ITERS),
        "--save",
        str(tmp / "final"),
    ]


def final(tmp: Path) -> Path:
    return tmp / "final" / f"global_step{ITERS}"


def stalled(log: Path, rank: int) -> bool:
    return log.exists() and f"rank {rank}: stalling before ReduceGrads" in log.read_text(errors="replace")


def test_machine_0_killed_with_its_agent_recovers_bitwise(
    tmp_path: Path,
    standins: Path,
    etcd: Etcd,
    fp32_baseline: JobRun,
) -> None:
    # The failure-free run: tests/dist/conftest.py's (the same config), its checkpoint after ITERS iterations.
    base = fp32_baseline.ckpt_dir / f"global_step{ITERS}"
    assert base.is_dir() and fp32_baseline.iterations >= ITERS, sorted(fp32_baseline.ckpt_dir.iterdir())
    job = tmp_path / "killed"
    job.mkdir()
    run_dir = job / "run"
    hosts = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    env = slurm_env(
        tmp_path,
        standins,
        hosts,
        "127.0.0.[2-4]",
        {
            "SWIFT_JOB_TOKEN": "gpt-etcd",
            "SWIFT_TEST_STALL_RANKS": f"0,1:{STALL_AT}",
            **etcd.env(tmp_path / "etcd.password"),
        },
    )
    argv = [
        "srun",
        "--ntasks-per-node=1",
        sys.executable,
        "-m",
        "ds_swift.launch.cli",
        "--run-dir",
        str(run_dir),
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--store",
        etcd.url,
        "--agent-timeout",
        "3",
        *script_args(job, WORKER),
    ]
    host0_log = standins / "127.0.0.2.log"
    with ProcessSet(job / "logs") as procs:
        procs.spawn("srun", argv, env=env, cwd=job)
        deadline = time.monotonic() + JOB_DEADLINE_S
        # Both ranks of machine 0 wait before their all-reduce of STALL_AT: nobody has stepped it.
        while not (stalled(host0_log, 0) and stalled(host0_log, 1)):
            assert procs.procs["srun"].poll() is None and time.monotonic() < deadline, host_logs(standins)
            time.sleep(0.05)
        os.killpg(int((standins / "127.0.0.2.pid").read_text()), signal.SIGKILL)
        code = procs.wait("srun", JOB_DEADLINE_S)
        output = procs.log("srun") + host_logs(standins)
    assert code == signal.SIGKILL, output
    assert json.loads((standins / "codes.json").read_text()) == [-signal.SIGKILL, 0, 0], output
    timelines: list[dict[str, Any]] = [json.loads(p.read_text()) for p in sorted(run_dir.glob("timeline-gen*.json"))]
    assert len(timelines) == 1, output[-6000:]
    (tl,) = timelines
    assert tl["strategy"] == "replication" and tl["failed_machine"] == 0, tl
    assert tl["consensus"] == STALL_AT - 1 and tl["undo_ranks"] == [], tl
    events = [json.loads(line) for p in run_dir.glob("launcher-events*.jsonl") for line in p.read_text().splitlines()]
    assert [(e["lost_node"], e["machine"]) for e in events if e.get("event") == "agent_lost"] == [(0, 0)], output
    assert any(e.get("event") == "takeover" and e["node"] == 2 and e["machine"] == 0 for e in events), output
    diff = compare_checkpoints(base, final(job))
    assert diff.bitwise_equal, diff.describe()
