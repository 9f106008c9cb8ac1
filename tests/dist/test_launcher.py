"""ds-swift-launch with real processes and real SIGKILLs, on a stand-in worker (no DeepSpeed).

The worker (``workers/store_worker.py``) runs lockstep "iterations" through the job store, calls
the injector, and joins the next generation when the current one failed; rank 0 writes what it
saw to ``result.json``. Each test checks the launcher's exit code, what the replacement workers
were told, the timeline keys, and that no process the launcher started outlives it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from ds_swift.testing.procs import ProcessSet, free_port, worker_env

WORKER = Path(__file__).parent / "workers" / "store_worker.py"
WAIT_S = 60.0

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def launcher_argv(run_dir: Path, launcher_args: list[str], worker_args: list[str] | None = None) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ds_swift.launch.cli",
        "--run-dir",
        str(run_dir),
        *launcher_args,
        str(WORKER),
        "--result",
        str(run_dir / "result.json"),
        *(worker_args or []),
    ]


def run_launcher(tmp_path: Path, launcher_args: list[str], worker_args: list[str] | None = None) -> tuple[int, str]:
    """Run one launcher to its end; returns (exit code, its output). Checks that nothing it started survives."""
    run_dir = tmp_path / "run"
    with ProcessSet(tmp_path / "logs") as procs:
        procs.spawn("launcher", launcher_argv(run_dir, launcher_args, worker_args), env=worker_env())
        try:
            code = procs.wait("launcher", WAIT_S)
        finally:
            pids = spawned_pids(run_dir)
        output = procs.log("launcher")
    assert_gone(pids, output)
    return code, output


def spawned_pids(run_dir: Path) -> set[int]:
    """Every worker pid: from the launcher's events (all spawns) and the workers' own pid files."""
    pids: set[int] = set()
    for events in run_dir.glob("launcher-events*.jsonl"):
        for line in events.read_text().splitlines():
            pids.update(json.loads(line).get("pids", []))
    pid_dir = run_dir / "pids"
    if pid_dir.exists():
        pids.update(int(p.name) for p in pid_dir.iterdir())
    return pids


def _alive(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        # A reused pid is not our worker: only a live process running the worker script counts.
        return proc.status() != psutil.STATUS_ZOMBIE and str(WORKER) in " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def assert_gone(pids: set[int], output: str) -> None:
    # SIGKILLed processes are gone once reaped; allow the kernel a moment to tear them down.
    deadline = time.monotonic() + 10
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)  # do not leak them into the next test, but fail this one
    assert not alive, f"worker processes outlived the launcher: {alive}\n{output}"


def result(tmp_path: Path) -> dict[str, Any]:
    return json.loads((tmp_path / "run" / "result.json").read_text())


def events(tmp_path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted((tmp_path / "run").glob("launcher-events*.jsonl")):
        out.extend(json.loads(line) for line in path.read_text().splitlines())
    return out


def test_two_machines_run_to_completion(tmp_path: Path) -> None:
    code, out = run_launcher(
        tmp_path, ["--nnodes", "2", "--nproc-per-node", "2", "--op-timeout", "7"], ["--iters", "4"]
    )
    assert code == 0, out
    res = result(tmp_path)
    assert res["final_generation"] == 0
    assert sorted(res["envs"]) == ["0/0", "0/1", "0/2", "0/3"]
    for key, env in res["envs"].items():
        rank = int(key.split("/")[1])
        assert env["RANK"] == str(rank)
        assert env["LOCAL_RANK"] == str(rank % 2) and env["local_rank_arg"] == rank % 2
        assert env["SWIFT_MACHINE"] == str(rank // 2)
        assert env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2" and env["SWIFT_NUM_MACHINES"] == "2"
        assert env["SWIFT_GENERATION"] == "0" and env["SWIFT_REPLACEMENT"] == "0"
        assert env["OMP_NUM_THREADS"] == "1" and env["PYTHONUNBUFFERED"] == "1"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"].isdigit()
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["SWIFT_OP_TIMEOUT_S"] == "7.0"
    assert "job finished" in out


def test_a_spare_never_taken_over_has_its_warm_workers_stopped_at_the_end(tmp_path: Path) -> None:
    """The idle warm workers wait on their pipe for an assignment that never comes: the launcher
    stops them at the job's end, before it returns (it used to wait out its reap timeout for them)."""
    run_dir = tmp_path / "run"
    with ProcessSet(tmp_path / "logs") as procs:
        procs.spawn(
            "launcher",
            launcher_argv(run_dir, ["--nnodes", "1", "--nproc-per-node", "2", "--spares", "1"], ["--iters", "2"]),
            env=worker_env(),
        )
        try:
            code = procs.wait("launcher", WAIT_S)
            ev = events(tmp_path)
            warm = [p for e in ev if e.get("event") == "warm_started" for p in e["pids"]]
            still_alive = [p for p in warm if _alive(p)]  # right as the launcher returned: no grace
        finally:
            pids = spawned_pids(run_dir)
        output = procs.log("launcher")
    assert_gone(pids, output)
    assert code == 0 and "job finished" in output, output
    assert len(warm) == 2, ev
    (stopped,) = [e for e in ev if e.get("event") == "warm_stopped"]
    assert sorted(stopped["pids"]) == sorted(warm) and ev[-1]["event"] == "end", ev
    assert still_alive == [], output


def test_spare_replaces_a_killed_machine(tmp_path: Path) -> None:
    code, out = run_launcher(
        tmp_path,
        ["--nnodes", "2", "--nproc-per-node", "2", "--spares", "1", "--inject", "machine=1,iteration=3,phase=backward"],
    )
    assert code == 0, out
    res, tl = result(tmp_path), result(tmp_path)["timeline"]
    assert res["final_generation"] == 1
    # Survivors keep running (no new process for ranks 0, 1); machine 1's ranks are replaced in generation 1.
    assert sorted(res["envs"]) == ["0/0", "0/1", "0/2", "0/3", "1/2", "1/3"]
    for rank in (2, 3):
        env = res["envs"][f"1/{rank}"]
        assert (env["RANK"], env["SWIFT_MACHINE"], env["SWIFT_GENERATION"], env["SWIFT_REPLACEMENT"]) == (
            str(rank),
            "1",
            "1",
            "1",
        )
        assert env["SWIFT_INJECT"] == "machine=1,iteration=3,phase=backward"
    assert tl["gen0/failed_machine"] == "1"
    assert "SIGKILL" in tl["gen0/failed"]
    assert tl["inject/0/rank"] in ("2", "3")
    t_fire, t_detected, t_declared, t_spawned = (
        float(tl[k]) for k in ("inject/0/t_fire", "gen0/t/detected", "gen0/t/declared", "gen0/t/replacement_spawned")
    )
    assert t_fire <= t_detected <= t_declared <= t_spawned
    # Both survivors learnt of the failure through the flag and moved on.
    assert "test/seen/0/0" in tl and "test/seen/0/1" in tl
    takeover = [e for e in events(tmp_path) if e.get("event") == "takeover"]
    assert [(e["node"], e["machine"]) for e in takeover] == [(2, 1)]
    print(
        f"\ndetection: SIGKILL -> agent saw it {1e3 * (t_detected - t_fire):.1f} ms, -> gen0/failed set "
        f"{1e3 * (t_declared - t_fire):.1f} ms, -> replacement spawned {1e3 * (t_spawned - t_fire):.1f} ms"
    )


def test_no_spare_and_no_restart_fails_the_job(tmp_path: Path) -> None:
    code, out = run_launcher(tmp_path, ["--nnodes", "2", "--nproc-per-node", "1", "--inject", "machine=1,iteration=2"])
    assert code == 1, out
    assert "no replacement" in out and "--spares 0" in out and "--restart-delay" in out
    assert not (tmp_path / "run" / "result.json").exists()


def test_restart_delay_restarts_on_the_same_agent(tmp_path: Path) -> None:
    # A crash (exit code 3) rather than a signal: any non-zero exit is the machine's failure.
    code, out = run_launcher(
        tmp_path, ["--nnodes", "2", "--nproc-per-node", "1", "--restart-delay", "0.2"], ["--crash-once", "1:2:3"]
    )
    assert code == 0, out
    res = result(tmp_path)
    assert res["final_generation"] == 1
    assert "exited with code 3" in res["timeline"]["gen0/failed"]
    env = res["envs"]["1/1"]
    assert (env["RANK"], env["SWIFT_GENERATION"], env["SWIFT_REPLACEMENT"], env["SWIFT_MACHINE"]) == (
        "1",
        "1",
        "1",
        "1",
    )
    restarts = [e for e in events(tmp_path) if e.get("event") == "replacement_spawned"]
    assert [(e["node"], e["machine"], e["generation"]) for e in restarts] == [(1, 1, 1)]


def test_cascading_failure_replacement_killed_too(tmp_path: Path) -> None:
    # First kill: the spare takes machine 1 over. Second kill hits that replacement: no spare is left,
    # so the spare's agent restarts the ranks. Generation 0 -> 1 -> 2.
    inject = "machine=1,iteration=2;machine=1,iteration=5,phase=step"
    code, out = run_launcher(
        tmp_path,
        ["--nnodes", "2", "--nproc-per-node", "1", "--spares", "1", "--restart-delay", "0", "--inject", inject],
    )
    assert code == 0, out
    res, tl = result(tmp_path), result(tmp_path)["timeline"]
    assert res["final_generation"] == 2
    assert tl["gen0/failed_machine"] == "1" and tl["gen1/failed_machine"] == "1"
    assert (res["envs"]["1/1"]["SWIFT_GENERATION"], res["envs"]["2/1"]["SWIFT_GENERATION"]) == ("1", "2")
    assert res["envs"]["2/1"]["SWIFT_REPLACEMENT"] == "1" and "2/0" not in res["envs"]
    spawned = [(e["node"], e["generation"]) for e in events(tmp_path) if e.get("event") == "replacement_spawned"]
    assert spawned == [(2, 1), (2, 2)]
    assert tl["inject/0/fired"] != "0" and tl["inject/1/fired"] != "0"


def test_max_failures_bounds_a_crash_loop(tmp_path: Path) -> None:
    inject = "machine=1,iteration=1;machine=1,iteration=3"
    code, out = run_launcher(
        tmp_path,
        ["--nnodes", "2", "--nproc-per-node", "1", "--restart-delay", "0", "--max-failures", "1", "--inject", inject],
    )
    assert code == 1, out
    assert "failure 2, more than --max-failures 1" in out


@pytest.mark.parametrize(
    ("sig", "expected", "nproc"), [(signal.SIGTERM, 143, 2), (signal.SIGINT, 130, 1), (signal.SIGKILL, -9, 1)]
)
def test_signal_to_the_launcher_stops_every_worker(
    tmp_path: Path, sig: signal.Signals, expected: int, nproc: int
) -> None:
    # The workers block without touching the store, as ranks stuck in a collective would: the job
    # store going away with the launcher does not end them, only the launcher's kill (or, for a
    # SIGKILLed launcher, their parent-death signal) does.
    run_dir = tmp_path / "run"
    argv = launcher_argv(run_dir, ["--nnodes", "2", "--nproc-per-node", str(nproc)], ["--block"])
    with ProcessSet(tmp_path / "logs") as procs:
        try:
            launcher = procs.spawn("launcher", argv, env=worker_env())
            deadline = time.monotonic() + WAIT_S
            while len(list((run_dir / "pids").glob("*")) if (run_dir / "pids").exists() else []) < 2 * nproc:
                assert launcher.poll() is None and time.monotonic() < deadline, procs.logs_tail()
                time.sleep(0.05)
            launcher.send_signal(sig)
            code = procs.wait("launcher", WAIT_S)
        finally:
            pids = spawned_pids(run_dir)
        output = procs.log("launcher")
    assert code == expected, output
    assert len(pids) == 2 * nproc
    # SIGKILL gives the launcher no chance to clean up: the workers' parent-death signal must.
    assert_gone(pids, output)
    if sig != signal.SIGKILL:
        assert f"got {sig.name}: stopping every worker" in output


@pytest.mark.slow  # CI: tests/dist/test_multihost.py (hosts, their agents, a spare host taking a machine over)
def test_multi_host_agents_with_a_spare(tmp_path: Path) -> None:
    """Three launchers (--node-rank 0, 1 and a spare 2) share the store that agent 0 hosts."""
    run_dir = tmp_path / "run"
    port, token = free_port(), "t" * 32
    common = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--spares",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        "--job-token",
        token,
        "--inject",
        "machine=1,iteration=3,phase=forward",
    ]
    with ProcessSet(tmp_path / "logs") as procs:
        try:
            for node in range(3):
                env = worker_env({"SWIFT_JOB_SECRET": "s" * 32})  # the same on every host, never in argv
                procs.spawn(f"node{node}", launcher_argv(run_dir, [*common, "--node-rank", str(node)]), env=env)
            codes = procs.wait_all(WAIT_S)
        finally:
            pids = spawned_pids(run_dir)
        output = procs.logs_tail(lines=60)
    assert codes == {"node0": 0, "node1": 0, "node2": 0}, output
    assert_gone(pids, output)
    res = result(tmp_path)
    assert res["final_generation"] == 1
    assert res["envs"]["1/1"]["SWIFT_REPLACEMENT"] == "1" and res["envs"]["1/1"]["SWIFT_GENERATION"] == "1"
    node2 = [json.loads(line) for line in (run_dir / "launcher-events.node2.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "takeover" and e["machine"] == 1 for e in node2)


def test_usage_errors_name_the_flag(tmp_path: Path) -> None:
    with ProcessSet(tmp_path / "logs") as procs:
        procs.spawn("launcher", launcher_argv(tmp_path / "run", ["--nnodes", "2", "--inject", "machine=5,iteration=1"]))
        assert procs.wait("launcher", WAIT_S) == 2
        out = procs.log("launcher")
    assert "--inject" in out and "machine=5" in out
