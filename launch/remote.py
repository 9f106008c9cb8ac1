"""pdsh / ssh: start one node agent per hostfile host, the way the ``deepspeed`` launcher starts its own.

Same hostfile and ``--include``/``--exclude`` (:mod:`.hostfile`), same
``.deepspeed_env`` (``KEY=VALUE`` lines, from ``$DS_ENV_FILE`` or ``.deepspeed_env`` in the home
and working directories) and the same exported prefixes (NCCL, PYTHON, MV2, UCX). Each host runs
``cd <cwd>; export ...; python -m ds_swift.launch.cli --node-host <host> ...``; the agent finds
its rank from its host name in the ordered ``--agent-hosts`` list, so pdsh may start them in
any order.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .args import LaunchArgs

__all__ = [
    "EXPORT_PREFIXES",
    "agent_argv",
    "agent_command",
    "deepspeed_env",
    "run_remote",
    "start_agents",
    "visible_devices_case",
]

EXPORT_PREFIXES = ("NCCL", "PYTHON", "MV2", "UCX")


def deepspeed_env(environ: Mapping[str, str], cwd: str | None = None) -> dict[str, str]:
    """What every host's agent gets exported: ``.deepspeed_env`` files, then the exported prefixes."""
    out = {k: v for k, v in environ.items() if k.startswith(EXPORT_PREFIXES)}
    name = environ.get("DS_ENV_FILE", ".deepspeed_env")
    home = environ.get("HOME") or os.path.expanduser("~")
    for folder in (home, cwd or os.getcwd()):
        path = name if os.path.isabs(name) else os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            for raw in f:
                line = raw.strip()
                if line and not line.startswith("#") and "=" in line:
                    key, _, value = line.partition("=")
                    out[key.strip()] = value.strip()
    return out


def agent_command(
    agent_argv: Sequence[str], exports: Mapping[str, str], cwd: str, python: str = sys.executable
) -> str:
    """One shell line that a host runs: cd, export, then the agent (``%h`` stays for pdsh to fill)."""
    parts = [f"cd {shlex.quote(cwd)};"]
    parts += [f"export {k}={shlex.quote(v)};" for k, v in sorted(exports.items())]
    parts.append(shlex.join([python, "-u", "-m", "ds_swift.launch.cli", *agent_argv]))
    return " ".join(parts)


def start_agents(
    launcher: str, hosts: Sequence[str], command: str, env: Mapping[str, str] | None = None
) -> list[subprocess.Popen[bytes]]:
    """pdsh: one process for all hosts; ssh: one per host. ``command`` holds ``%h`` for the host name."""
    if launcher == "pdsh":
        # -S: pdsh exits with the largest remote exit code; -f: all hosts at once.
        argv = ["pdsh", "-S", "-f", str(max(len(hosts), 32)), "-w", ",".join(hosts), command]
        return [subprocess.Popen(argv, env=None if env is None else dict(env), stdin=subprocess.DEVNULL)]
    if launcher == "ssh":
        return [
            subprocess.Popen(
                ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new", host,
                 command.replace("%h", shlex.quote(host))],
                env=None if env is None else dict(env),
                stdin=subprocess.DEVNULL,
            )
            for host in hosts
        ]
    raise ValueError(f"unknown launcher {launcher!r}")


def agent_argv(args: LaunchArgs, store_url: str, token: str, secret_file: str) -> list[str]:
    """The flags every host's agent gets (``%h``: the host name, filled in by pdsh or by us for ssh).
    The job secret goes by ``secret_file`` (mode 0600), never on the command line."""
    argv = [
        "--job-secret-file", secret_file,
        "--launcher", "local", "--nnodes", str(args.nnodes), "--nproc-per-node", str(args.nproc_per_node),
        "--spares", str(args.spares), "--max-failures", str(args.max_failures), "--store", store_url,
        "--job-token", token, "--run-dir", args.run_dir, "--agent-timeout", repr(args.agent_timeout_s),
        "--agent-hosts", ",".join(args.agent_hosts), "--node-host", "%h",
    ]
    if args.restart_delay_s is not None:
        argv += ["--restart-delay", repr(args.restart_delay_s)]
    if args.op_timeout_s is not None:
        argv += ["--op-timeout", repr(args.op_timeout_s)]
    for spec in args.inject:
        argv += ["--inject", str(spec)]
    cmd = args.command
    argv += ["--cold-spares"] if args.cold_spares else []
    argv += ["--no_local_rank"] if not cmd.local_rank_arg else []
    argv += ["--module"] if cmd.module else []
    argv += ["--no_python"] if cmd.no_python else []
    return [*argv, cmd.script, *cmd.args]


def visible_devices_case(args: LaunchArgs) -> str:
    """A shell ``case`` that gives each host the GPU slots --include/--exclude left it (empty if all)."""
    arms = [
        f"{shlex.quote(h)}) export CUDA_VISIBLE_DEVICES={','.join(map(str, slots))};;"
        for h, slots in zip(args.agent_hosts, args.agent_slots)
        if list(slots) != list(range(len(slots)))
    ]
    return f"case %h in {' '.join(arms)} esac; " if arms else ""


def run_remote(args: LaunchArgs) -> int:
    """Serve the job store here (unless --store names one), start every host's agent, wait for them."""
    import secrets
    import signal
    import time

    from ds_swift.membership import JobStore
    from ds_swift.store_auth import write_secret_file

    from .control import EventLog, JobControl

    events = EventLog(args.run_dir)
    token = args.job_token or secrets.token_hex(16)
    secret_file = args.job_secret_file
    if secret_file is None:
        # pdsh passes no stdin and exports only what is on the command line: a 0600 file in the run
        # directory (shared by the hosts, as DeepSpeed's own launcher assumes of the working directory).
        secret_file = os.path.join(args.run_dir, "job.secret")
        write_secret_file(secret_file, args.job_secret)
    if args.store_url is None:
        store = JobStore.host(token, port=args.master_port or 0, addr=args.master_addr, secret=args.job_secret)
        store_url = f"tcp://{args.master_addr}:{store.port}"
    else:
        store = JobStore.open(args.store_url, token, create=True, secret=args.job_secret)
        store_url = args.store_url
    control = JobControl(store)
    argv = agent_argv(args, store_url, token, secret_file)
    command = visible_devices_case(args) + agent_command(argv, deepspeed_env(os.environ), os.getcwd())
    events(f"{args.launcher}: starting {len(args.agent_hosts)} agent(s) on {', '.join(args.agent_hosts)}; "
           f"job store {store_url}", event="start", hosts=list(args.agent_hosts), store=store_url)
    procs = start_agents(args.launcher, args.agent_hosts, command)
    got: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: got.append(signum)) for sig in (signal.SIGINT, signal.SIGTERM)}
    deadline: float | None = None
    try:
        while any(p.poll() is None for p in procs):
            if got and deadline is None:
                name = signal.Signals(got[0]).name
                events(f"got {name}: asking every agent to stop", event="signal", signal=name)
                control.abort(f"{name} to the {args.launcher} launcher")
                deadline = time.monotonic() + 20.0
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    codes = [p.returncode for p in procs]
    code = max((abs(c) for c in codes), default=1) if not got else 128 + got[0]
    events(f"{args.launcher}: agents ended with exit codes {codes}", event="end", exit_code=code)
    return code
