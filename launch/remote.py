"""pdsh / ssh: start one node agent per hostfile host, the way the ``deepspeed`` launcher starts its own.

Same hostfile and ``--include``/``--exclude`` (:mod:`.hostfile`), same ``.deepspeed_env``
(``KEY=VALUE`` lines, from ``$DS_ENV_FILE`` or ``.deepspeed_env`` in the home and working
directories) and the same exported prefixes (NCCL, PYTHON, MV2, UCX). Unlike DeepSpeed's launcher,
nothing a host needs that could be a secret goes on a command line, where every user of the host
sees it (``ps``): the exports go to ``<run-dir>/agent.env`` (mode 0600), the job secret to
``<run-dir>/job.secret``, and each host runs
``cd <cwd> && . <run-dir>/agent.env && exec python -m ds_swift.launch.cli --node-host <host> ...``.
The agent finds its rank from its host name in the ordered ``--agent-hosts`` list, so pdsh may
start them in any order.

Nothing from the hostfile or ``.deepspeed_env`` can inject a command: host names are checked
(:func:`.hostfile.check_host`), variable names must be shell names, values are quoted, ssh gets
``--`` before the host, and the host name fills only the launcher's own slot: pdsh replaces ``%h``,
``%u`` and ``%n`` anywhere in its command, so every other ``%`` (the user's arguments too) goes to
it doubled, which pdsh turns back into one.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from .placement import LaunchUsageError

if TYPE_CHECKING:
    from .args import LaunchArgs
    from .control import EventLog

__all__ = [
    "ENV_FILE",
    "EXPORT_PREFIXES",
    "agent_argv",
    "agent_command",
    "deepspeed_env",
    "render",
    "run_remote",
    "start_agents",
    "visible_devices_case",
    "write_env_file",
]

EXPORT_PREFIXES = ("NCCL", "PYTHON", "MV2", "UCX")
#: in the run directory: what every host's agent exports (mode 0600: .deepspeed_env may hold tokens)
ENV_FILE = "agent.env"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

#: a command as pieces of shell text, ``None`` where the host's name goes (see :func:`render`)
Segments = Sequence["str | None"]


def _env_line(path: str, n: int, raw: str) -> tuple[str, str] | None:
    line = raw.strip()
    if not line or line.startswith("#"):
        return None
    key, eq, value = line.partition("=")
    key = key.strip()
    if not eq or not _ENV_NAME.match(key):
        # A name such as 'FOO;cmd;BAR' would run cmd on every host if it were spliced into a shell line.
        raise LaunchUsageError(
            f"{path}:{n}: {line!r} is not KEY=VALUE with KEY a variable name (letters, digits and '_', "
            "not starting with a digit); fix or remove that line (the value after '=' may hold anything)"
        )
    return key, value.strip()


def deepspeed_env(environ: Mapping[str, str], cwd: str | None = None) -> dict[str, str]:
    """What every host's agent gets exported: ``.deepspeed_env`` files, then the exported prefixes.

    Raises LaunchUsageError naming the file and line of a name that is not a shell variable name."""
    out: dict[str, str] = {}
    for key, value in environ.items():
        if key.startswith(EXPORT_PREFIXES):
            if not _ENV_NAME.match(key):
                raise LaunchUsageError(
                    f"environment variable {key!r} would be exported to every host (it starts with one of "
                    f"{', '.join(EXPORT_PREFIXES)}) but is not a shell variable name: unset it"
                )
            out[key] = value
    name = environ.get("DS_ENV_FILE", ".deepspeed_env")
    home = environ.get("HOME") or os.path.expanduser("~")
    for folder in (home, cwd or os.getcwd()):
        path = name if os.path.isabs(name) else os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            for n, raw in enumerate(f, 1):
                item = _env_line(path, n, raw)
                if item is not None:
                    out[item[0]] = item[1]
    return out


def write_env_file(path: str, exports: Mapping[str, str]) -> None:
    """``export KEY='value'`` lines that each host's shell sources (mode 0600, like the job secret)."""
    from ds_swift.jobstore.auth import write_secret_file

    for key in exports:
        if not _ENV_NAME.match(key):  # deepspeed_env checked them already; a caller's own mapping too
            raise LaunchUsageError(f"cannot export {key!r} to the hosts: not a shell variable name")
    lines = ["# ds-swift-launch: exported on every host before its agent starts (mode 0600)"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(exports.items())]
    write_secret_file(path, "\n".join(lines))


def visible_devices_case(args: LaunchArgs) -> list[str | None]:
    """A shell ``case`` on the host's name that gives each host the GPU slots --include/--exclude
    left it (no pieces if every host keeps all its slots)."""
    arms = [
        f"{shlex.quote(h)}) export CUDA_VISIBLE_DEVICES={','.join(map(str, slots))};;"
        for h, slots in zip(args.agent_hosts, args.agent_slots)
        if list(slots) != list(range(len(slots)))
    ]
    return ["case ", None, f" in {' '.join(arms)} esac; "] if arms else []


def agent_command(agent_argv: Sequence[str], env_file: str, cwd: str, python: str | None = None) -> list[str | None]:
    """What a host runs: cd, source the exports, then the agent; ``None``: the host's name."""
    q = shlex.quote
    f = q(env_file)
    missing = (
        f"[ -r {f} ] || {{ printf 'ds-swift-launch: %s is not readable on this host: "
        f"--run-dir must be a folder every host sees at the same path\\n' {f} >&2; exit 2; }}; "
    )
    # Sourced, the file runs as shell code with this user's rights: only a regular file this user
    # owns that nobody else may write (the launch host writes it 0600) is sourced. A file another
    # user of the shared run directory put there, or made writable, would run their commands here.
    private = (
        f'{{ [ -O {f} ] && [ ! -L {f} ] && case "$(ls -ln {f})" in -rw-------*|-r--------*) true;; *) false;; '
        f"esac; }} || {{ printf 'ds-swift-launch: %s is not a mode-0600 file of this user on this host: not "
        f"sourced (ls -ln %s)\\n' {f} {f} >&2; exit 2; }}; "
    )
    cli = shlex.join([python or sys.executable, "-u", "-m", "ds_swift.launch.cli", "--node-host"])
    return [missing, private, f"cd {q(cwd)} && . {f} && exec {cli} ", None, " " + shlex.join(agent_argv)]


def render(segments: Segments, host: str | None) -> str:
    """The shell line for ``host``; ``None``: for pdsh, which puts each host's name where ``%h`` is.

    pdsh expands ``%h``, ``%u``, ``%n`` and ``%%`` anywhere in the line, so every ``%`` of the
    launcher's own text (paths, the user's arguments) is doubled and comes out as it was."""
    if host is None:
        return "".join("%h" if s is None else s.replace("%", "%%") for s in segments)
    return "".join(shlex.quote(host) if s is None else s for s in segments)


def start_agents(
    launcher: str, hosts: Sequence[str], command: Segments, env: Mapping[str, str] | None = None
) -> list[subprocess.Popen[bytes]]:
    """pdsh: one process for all hosts; ssh: one per host (``--`` before it: never an option)."""
    popen_env = None if env is None else dict(env)
    if launcher == "pdsh":
        # -S: pdsh exits with the largest remote exit code; -f: all hosts at once. pdsh's own ssh call
        # (PDSH_SSH_ARGS, by default '-2 -a -x -l%u %h') has no '--': the host names were checked, so
        # none starts with '-', and none holds -w's list syntax ('[1-3]', '^file', '@group', 'user@').
        argv = ["pdsh", "-S", "-f", str(max(len(hosts), 32)), "-w", ",".join(hosts), render(command, None)]
        return [subprocess.Popen(argv, env=popen_env, stdin=subprocess.DEVNULL)]
    if launcher == "ssh":
        return [
            subprocess.Popen(
                [
                    "ssh",
                    "-o",
                    "BatchMode=yes",
                    "-o",
                    "StrictHostKeyChecking=accept-new",
                    "--",
                    host,
                    render(command, host),
                ],
                env=popen_env,
                stdin=subprocess.DEVNULL,
            )
            for host in hosts
        ]
    raise ValueError(f"unknown launcher {launcher!r}")


def agent_argv(args: LaunchArgs, store_url: str, token: str, secret_file: str) -> list[str]:
    """The flags every host's agent gets after ``--node-host <host>`` (:func:`agent_command`).
    The job secret goes by ``secret_file`` (mode 0600), never on the command line."""
    argv = [
        "--job-secret-file",
        secret_file,
        "--launcher",
        "local",
        "--nnodes",
        str(args.nnodes),
        "--nproc-per-node",
        str(args.nproc_per_node),
        "--spares",
        str(args.spares),
        "--max-failures",
        str(args.max_failures),
        "--store",
        store_url,
        "--job-token",
        token,
        "--run-dir",
        args.run_dir,
        "--agent-timeout",
        repr(args.agent_timeout_s),
        "--agent-hosts",
        ",".join(args.agent_hosts),
    ]
    if args.restart_delay_s is not None:
        argv += ["--restart-delay", repr(args.restart_delay_s)]
    if args.op_timeout_s is not None:
        argv += ["--op-timeout", repr(args.op_timeout_s)]
    for spec in args.inject:
        argv += ["--inject", str(spec)]
    cmd = args.command
    argv += ["--cold-spares"] if args.cold_spares else []
    argv += ["--fork-server"] if args.fork_server else []
    argv += ["--no_local_rank"] if not cmd.local_rank_arg else []
    argv += ["--module"] if cmd.module else []
    argv += ["--no_python"] if cmd.no_python else []
    return [*argv, cmd.script, *cmd.args]


def run_remote(args: LaunchArgs) -> int:
    """Serve the job store here (unless --store names one), start every host's agent, wait for them."""
    import secrets

    from ds_swift.jobstore.auth import write_secret_file

    from .control import EventLog

    try:
        exports = deepspeed_env(os.environ)
    except LaunchUsageError as exc:
        print(f"ds-swift-launch: error: {exc}", file=sys.stderr)
        return 2
    events = EventLog(args.run_dir)
    token = args.job_token or secrets.token_hex(16)
    secret_file = args.job_secret_file
    written: list[str] = []  # what this launcher wrote into the run directory: deleted when the agents end
    if secret_file is None:
        # pdsh passes no stdin and exports only what is on the command line: a 0600 file in the run
        # directory (shared by the hosts, as DeepSpeed's own launcher assumes of the working directory).
        secret_file = os.path.join(args.run_dir, "job.secret")
        write_secret_file(secret_file, args.job_secret)
        written.append(secret_file)
    try:
        return _serve_agents(args, exports, events, token, secret_file, written)
    finally:
        # Every agent read both at its start. Left in the run directory (often kept for the job's
        # logs, and shared), the secret would let whoever reads it later forge the store's values of
        # a relaunch with the same secret; the exports may hold tokens.
        for path in written:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _serve_agents(
    args: LaunchArgs, exports: dict[str, str], events: EventLog, token: str, secret_file: str, written: list[str]
) -> int:
    import signal
    import time

    from ds_swift.jobstore.membership import JobStore

    from .control import JobControl

    if args.store_url is None:
        store = JobStore.host(token, port=args.master_port or 0, addr=args.master_addr, secret=args.job_secret)
        store_url = f"tcp://{args.master_addr}:{store.port}"
    else:
        store = JobStore.open(args.store_url, token, create=True, secret=args.job_secret)
        store_url = args.store_url
    control = JobControl(store)
    argv = agent_argv(args, store_url, token, secret_file)
    # Like the secret: the exports may hold tokens (.deepspeed_env), so by file, never on a command line.
    env_file = os.path.join(args.run_dir, ENV_FILE)
    written.append(env_file)
    write_env_file(env_file, exports)
    command = [*visible_devices_case(args), *agent_command(argv, env_file, os.getcwd())]
    events(
        f"{args.launcher}: starting {len(args.agent_hosts)} agent(s) on {', '.join(args.agent_hosts)}; "
        f"job store {store_url}",
        event="start",
        hosts=list(args.agent_hosts),
        store=store_url,
    )
    procs = start_agents(args.launcher, args.agent_hosts, command)
    got: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, frame: got.append(signum)) for sig in (signal.SIGINT, signal.SIGTERM)
    }
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
