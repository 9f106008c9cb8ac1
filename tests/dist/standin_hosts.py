"""Stand-in cluster launchers for the multi-host tests (test_multihost.py, test_multihost_gpt.py).

Hosts are loopback addresses (127.0.0.2, 127.0.0.3, ...). The stand-in ``srun``, ``pdsh`` and
``ssh`` executables, put on PATH by the ``standins`` fixture (conftest.py), run each host's command locally,
with that host's environment (SLURM's variables for srun, ``%h`` filled in for pdsh), each in its
own session, and record each host's pid so that a test can kill a whole "machine": its agent, and
with it (parent-death signal) the agent's workers.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from ds_swift.testing.procs import worker_env

JOB_SECRET = "multihost-test-secret-" + "0" * 16

# Each host's command runs in its own session; its pid is written to $STANDIN_DIR/<host>.pid so
# that the test can kill that "machine". Exit code: the largest of the hosts' (like pdsh -S).
_COMMON = """
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
"""

SRUN = (
    _COMMON
    + """
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
"""
)

PDSH = (
    _COMMON
    + """
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
"""
)

SSH = (
    _COMMON
    + """
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
"""
)


def write_standins(bin_dir: Path) -> None:
    """The stand-in srun, pdsh and ssh executables, in ``bin_dir`` (which goes first on PATH)."""
    for name, body in (("srun", SRUN), ("pdsh", PDSH), ("ssh", SSH)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(0o755)


def kill_hosts(standin: Path) -> None:
    """SIGKILL every host's session whose pid a stand-in recorded in ``standin`` (its workers follow
    by their parent-death signal)."""
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


def slurm_env(
    tmp_path: Path, standin: Path, hosts: list[str], nodelist: str, extra: dict[str, str] | None = None
) -> dict[str, str]:
    """What sbatch gives the batch script (srun adds the per-task variables)."""
    env = host_env(tmp_path, standin, extra)
    # As examples/slurm/train_gpt.sbatch does: srun passes the job secret on to every task.
    env.update(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST=nodelist,
        SLURM_NNODES=str(len(hosts)),
        STANDIN_HOSTS=",".join(hosts),
        SWIFT_JOB_SECRET=JOB_SECRET,
    )
    return env


def host_logs(standin: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(standin.glob("*.log")))
