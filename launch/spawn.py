"""Starting, watching and killing one machine's worker processes.

Each worker gets its own process group (``start_new_session``), so that killing a machine
kills everything its ranks started (data-loader workers, compile jobs) with one ``killpg``,
and a Ctrl-C in the terminal reaches the launcher only, which then shuts the job down in
order. On Linux each worker also asks the kernel for SIGKILL when its launcher dies
(``PR_SET_PDEATHSIG``): even a SIGKILLed launcher leaves no orphan workers behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO, Protocol

from ds_swift.jobstore.worker_env import WorkerEnv

from .args import Command

__all__ = [
    "Worker",
    "WarmWorkerProcess",
    "WorkerProcess",
    "assign_warm",
    "describe_exit",
    "signal_group",
    "spawn_warm",
    "spawn_worker",
    "supports_warm",
    "warm_argv",
    "warm_environ",
    "worker_argv",
    "worker_environ",
]

# Runs before the user's interpreter: set the parent-death signal, then exec the real command
# (same pid, so the launcher's Popen and killpg keep working). The ppid check closes the race
# where the launcher died between fork and prctl. -S skips site: ~10 ms instead of ~30.
_PDEATHSIG_BOOTSTRAP = (
    "import ctypes,os,sys\n"
    "ctypes.CDLL(None).prctl(1, 9)\n"  # PR_SET_PDEATHSIG = 1, SIGKILL = 9
    "os.getppid() == int(sys.argv[1]) or os._exit(111)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def worker_argv(command: Command, local_rank: int, python: str = sys.executable) -> list[str]:
    """The command line of one worker, built the way the ``deepspeed`` launcher builds it."""
    if command.no_python:
        argv = [command.script]
    elif command.module:
        argv = [python, "-u", "-m", command.script]
    else:
        argv = [python, "-u", command.script]
    if command.local_rank_arg:
        argv.append(f"--local_rank={local_rank}")
    argv.extend(command.args)
    return argv


def worker_environ(
    wenv: WorkerEnv,
    nproc_per_node: int,
    op_timeout_s: float | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of one worker: the launcher's own plus what ds-swift and torch expect."""
    env = dict(os.environ if base is None else base)
    # The deepspeed launcher leaves OpenMP at one thread per core per rank, and steps get ~10x
    # slower from oversubscription; torchrun sets 1 too. A user's explicit value wins.
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(wenv.to_env())
    # torch's env:// rendezvous and DeepSpeed read these; they point at the job store, which outlives workers.
    env["MASTER_ADDR"] = wenv.store_addr
    env["MASTER_PORT"] = str(wenv.store_port)
    env["LOCAL_WORLD_SIZE"] = str(nproc_per_node)
    # Without this, a stock script's env:// init (deepspeed.init_distributed) makes rank 0 *host* a
    # TCPStore on MASTER_PORT, which the agent already serves: EADDRINUSE. torchrun sets it for the
    # same reason; every rank then connects to the agent's store as a client.
    env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    if op_timeout_s is not None:
        env["SWIFT_OP_TIMEOUT_S"] = repr(op_timeout_s)
    else:
        env.pop("SWIFT_OP_TIMEOUT_S", None)
    return env


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exited with code {returncode}"


class WorkerProcess(Protocol):
    """What an agent uses of a worker's process: a ``subprocess.Popen``, or a worker that the fork
    server forked (:class:`launch.fork_client.ForkedProcess`)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...


class WarmWorkerProcess(WorkerProcess, Protocol):
    """A warm spare's worker: also the pipe its assignment is written to."""

    stdin: IO[bytes] | None


@dataclass
class Worker:
    """One rank's process, as its agent sees it."""

    rank: int
    local_rank: int
    generation: int
    proc: WorkerProcess
    started_at: float = field(default_factory=time.time)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal) once it ended, else None. Reaps it."""
        return self.proc.poll()

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the worker and everything it started; a no-op once it is gone."""
        signal_group(self.proc, sig)


def signal_group(proc: WorkerProcess, sig: int) -> None:
    """Send ``sig`` to the process group ``proc`` leads (``start_new_session``); a no-op once it is reaped."""
    if proc.returncode is not None:
        # Reaped: its pid may be reused, and a process group outliving its leader is left to PDEATHSIG.
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        # The group id went to an unrelated process (cannot happen while we have not reaped it,
        # but a kill must never hit a stranger): fall back to the pid we own.
        proc.send_signal(sig)


def dies_with_us(argv: list[str]) -> list[str]:
    """``argv`` started through the PDEATHSIG bootstrap (Linux): the process gets SIGKILL when this
    one dies."""
    if sys.platform.startswith("linux"):
        return [sys.executable, "-S", "-c", _PDEATHSIG_BOOTSTRAP, str(os.getpid()), *argv]
    return argv


def _popen(argv: list[str], env: dict[str, str], stdin: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(dies_with_us(argv), env=env, stdin=stdin, start_new_session=True)


def spawn_worker(
    command: Command,
    wenv: WorkerEnv,
    nproc_per_node: int,
    op_timeout_s: float | None = None,
    base_env: Mapping[str, str] | None = None,
) -> Worker:
    env = worker_environ(wenv, nproc_per_node, op_timeout_s, base_env)
    proc = _popen(worker_argv(command, wenv.local_rank), env, subprocess.DEVNULL)
    return Worker(rank=wenv.rank, local_rank=wenv.local_rank, generation=wenv.generation, proc=proc)


# ---------------------------------------------------------------------------- warm spares
def supports_warm(command: Command) -> bool:
    """Whether ``command`` can run in a warm worker (a Python script or module: not ``--no_python``)."""
    return not command.no_python


def warm_argv(command: Command, local_rank: int, python: str = sys.executable) -> list[str]:
    """A warm worker's command line: ds_swift.runtime.warm, then the script and its arguments."""
    script_argv = worker_argv(command, local_rank, python)
    # worker_argv is [python, -u, (-m,) script, args...]: the warm runner takes the script and args.
    rest = script_argv[4:] if command.module else script_argv[3:]
    return [
        python,
        "-u",
        "-m",
        "ds_swift.runtime.warm",
        *(["--module"] if command.module else []),
        command.script,
        *rest,
    ]


def warm_environ(local_rank: int, nproc_per_node: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A warm worker's environment before its assignment: no rank, generation or job secret yet, but
    everything that is read at import time (threads, the local GPU) as its cold counterpart has it."""
    env = dict(os.environ if base is None else base)
    env.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported, as in worker_environ
    env["PYTHONUNBUFFERED"] = "1"
    env["LOCAL_RANK"] = str(local_rank)
    env["LOCAL_WORLD_SIZE"] = str(nproc_per_node)
    env["SWIFT_WARM"] = "1"
    for key in WorkerEnv.ENV_KEYS:
        if key != "LOCAL_RANK":
            env.pop(key, None)  # a launcher started from inside a worker must not leak its job into the spare
    return env


def spawn_warm(
    command: Command, local_rank: int, nproc_per_node: int, base_env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start a warm worker for ``local_rank``; it imports and then waits on its stdin (see :func:`assign_warm`)."""
    return _popen(warm_argv(command, local_rank), warm_environ(local_rank, nproc_per_node, base_env), subprocess.PIPE)


def assign_warm(
    proc: WarmWorkerProcess,
    wenv: WorkerEnv,
    nproc_per_node: int,
    op_timeout_s: float | None = None,
    base_env: Mapping[str, str] | None = None,
) -> Worker | None:
    """Hand ``wenv`` to the warm worker ``proc``: it becomes that rank's worker. None if it is gone."""
    if proc.poll() is not None or proc.stdin is None:
        return None
    env = worker_environ(wenv, nproc_per_node, op_timeout_s, base_env)
    try:
        proc.stdin.write(json.dumps({"env": env}).encode() + b"\n")
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        return None  # it died a moment ago; the caller starts this rank cold
    return Worker(rank=wenv.rank, local_rank=wenv.local_rank, generation=wenv.generation, proc=proc)
