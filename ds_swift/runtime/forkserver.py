"""A fork server: one interpreter that imports what the script needs once, then forks every worker.

Started by ``ds-swift-launch --fork-server`` (``launch/fork_client.py``) as
``python -m ds_swift.runtime.forkserver --requests FD --reports FD [--module] SCRIPT``. A rank started
cold spends most of its start-up importing torch, DeepSpeed and megatron-core (~6 CPU-seconds each):
on a host with fewer cores than ranks (CPU tests, CI) every rank and warm spare pays it at once.
Here they are imported once (what :mod:`ds_swift.runtime.warm` imports for a warm spare), and each
worker is a ``fork()`` of this process that runs the script as ``__main__`` with its own environment
and arguments. A warm spare's worker is forked too: it then waits for its assignment on the pipe
the request came with, exactly as :mod:`ds_swift.runtime.warm` does on its stdin.

Fork safety: this process starts no thread (the fork would copy a lock another thread holds) and
never touches CUDA (a CUDA context does not survive a fork; a warm spare's worker creates its own
after the fork): it checks both before it serves, and refuses with a message otherwise.

Protocol. Requests, one JSON message each on the ``--requests`` socket (``SOCK_SEQPACKET``: one
message, one request): ``{"id": N, "args": [...], "env": {...}, "warm": false}``; a warm request
carries the read end of its assignment pipe (``SCM_RIGHTS``). Reports on the ``--reports`` pipe, one
line each: ``ready 0 0`` once it imported, ``pid ID PID`` once request ID is forked, ``exit PID CODE`` once worker PID ended (CODE as
``subprocess`` gives it: negative for a signal). When the launcher closes its end of the socket this
process exits, and every worker still running dies with it (``PR_SET_PDEATHSIG``), as a worker dies
with its launcher.

A zygote (``--zygote PATH``, :func:`zygote`) serves harnesses that launch many jobs one after the
other (the multi-process tests, the fault matrix): it imports once for all of them, listens on the
Unix socket ``PATH``, and forks a fork server per launcher that asks (``SWIFT_FORK_ZYGOTE=PATH`` in
the launcher's environment, :class:`launch.fork_client.ForkServer`). The launcher sends what it
would have started the server with: its arguments, environment, working directory, and the request
socket, report pipe, stdout and stderr as file descriptors; the zygote answers with the server's
pid, and with its exit code once it ended. The forked server is the one a launcher starts itself,
less the imports: the same requests, reports and workers. A harness may have the zygote fork the
launcher itself too (``python -m ds_swift.launch.cli ...``: a request that names a ``module``), which
then imports nothing either.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ds_swift.logs import say
from ds_swift.runtime.warm import (
    BASE_MODULES,
    MEGATRON_IMPORT,
    WarmTarget,
    _detach_stdin,
    await_assignment,
    held_words,
    preload,
    preload_ops,
    run_assigned,
)

__all__ = ["main"]

_PR_SET_PDEATHSIG = 1


class _Server:
    """The serving loop's state: the request socket, the report pipe, the SIGCHLD wake-up pipe."""

    def __init__(self, requests: int, reports: int) -> None:
        self.requests = socket.socket(fileno=requests)
        self.reports = reports
        # A worker's death wakes the loop at once (the launcher sees it within its own tick).
        self.wake_r, self.wake_w = _woken_by_children()

    def report(self, line: str) -> None:
        os.write(self.reports, line.encode() + b"\n")

    def reap(self) -> None:
        for pid, code in _ended_children():
            self.report(f"exit {pid} {code}")

    def serve(self) -> dict[str, object] | None:
        """Fork a worker per request. Returns the request in the forked worker; None in this
        process once the launcher closed its end of the request socket."""
        while True:
            self.reap()
            ready, _, _ = select.select([self.requests.fileno(), self.wake_r], [], [], 1.0)
            if self.wake_r in ready:
                while _read_some(self.wake_r):
                    pass
            if self.requests.fileno() not in ready:
                continue
            message, fds, _, _ = socket.recv_fds(self.requests, 1 << 20, 1)
            if not message:
                return None
            request = json.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                self.become_worker(fds[0] if fds else None)
                return dict(request)
            for fd in fds:  # the worker's now
                os.close(fd)
            self.report(f"pid {request['id']} {pid}")

    def become_worker(self, stdin: int | None) -> None:
        """In the forked child: its own session (the agent kills the machine by process group), death
        with this server, none of the server's pipes or signal handling; stdin the assignment pipe
        (a warm spare's worker), else /dev/null as a cold worker's."""
        os.setsid()
        parent = os.getppid()
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the server died between the fork and the prctl
            os._exit(111)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.requests.close()
        for fd in (self.reports, self.wake_r, self.wake_w):
            os.close(fd)
        if stdin is None:
            _detach_stdin()
        else:
            os.dup2(stdin, 0)
            os.close(stdin)


def _woken_by_children() -> tuple[int, int]:
    """A non-blocking pipe that a child's end (SIGCHLD) writes to: (read end, write end)."""
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    return wake_r, wake_w


def _ended_children() -> Iterator[tuple[int, int]]:
    """(pid, exit code as ``subprocess`` gives it) of each child that ended, reaped; none left: stops."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def _read_some(fd: int) -> bytes:
    try:
        return os.read(fd, 4096)
    except BlockingIOError:
        return b""


def _fork_unsafe() -> str | None:
    """Why this process must not fork its workers (None: it may)."""
    if threading.active_count() > 1 or len(os.listdir("/proc/self/task")) > 1:
        return "the imports started a thread (a fork copies the locks it holds)"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "the imports initialised CUDA (a CUDA context does not survive a fork)"
    return None


def _run_request(target: WarmTarget, request: dict[str, object], held: str) -> int:
    """In a forked worker: run the script with the request's environment and arguments; a warm spare's
    worker first waits for its assignment, as :func:`ds_swift.runtime.warm.main` does."""
    env = request["env"]
    assert isinstance(env, dict) and isinstance(request["args"], list)
    os.environ.clear()  # the worker's whole environment, nothing of the server's
    os.environ.update({str(k): str(v) for k, v in env.items()})
    target = WarmTarget(target.script, tuple(str(a) for a in request["args"]), target.module)
    if not request.get("warm"):
        return run_assigned(target, {})
    return await_assignment(target, f"forked from a server that holds {held}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--zygote"] and len(argv) == 2:
        argv = zygote(argv[1])  # returns in a forked child only: a server's arguments from its launcher
    p = argparse.ArgumentParser(prog="python -m ds_swift.runtime.forkserver")
    p.add_argument("--requests", type=int, required=True, help="the fd of the socket requests come on")
    p.add_argument("--reports", type=int, required=True, help="the fd of the pipe the launcher reads reports from")
    p.add_argument("--module", action="store_true", help="SCRIPT is a module name (python -m)")
    p.add_argument("script")
    ns = p.parse_args(argv)
    target = WarmTarget(ns.script, (), ns.module)
    if not target.module:
        # As `python script.py` does: the script's directory first on the path (-m put the cwd there).
        sys.path[0] = str(Path(target.script).resolve().parent)
    t0 = time.monotonic()
    modules = preload([*BASE_MODULES, *target.imports()])
    held = held_words(modules, preload_ops(), time.monotonic() - t0)
    why = _fork_unsafe()
    if why is not None:
        say(f"fork server: cannot fork workers here: {why}; run without --fork-server", name=__name__)
        return 1
    # No gc.freeze() before the forks: it would spare each worker's collector the imported objects,
    # so that a forked rank's pauses (and its timing against its own background threads) would differ
    # from a cold one's. The tests are to see the timing users get.
    server = _Server(ns.requests, ns.reports)
    server.report("ready 0 0")
    request = server.serve()
    if request is None:  # the launcher closed the socket: the job is over, and the launcher waits
        from ds_swift.interpreter import exit_process

        exit_process(0)  # for this, not for the teardown of torch and DeepSpeed (seconds)
    return _run_request(target, request, held)


# ---------------------------------------------------------------------------- the zygote
#: what a zygote imports for every job's server (the example GPT's imports, megatron-core's included)
ZYGOTE_MODULES = (*BASE_MODULES, MEGATRON_IMPORT, "megatron.core", "megatron.core.parallel_state")


def zygote(path: str) -> list[str]:
    """Import :data:`ZYGOTE_MODULES`, listen on the Unix socket ``path`` (it appears once the imports
    are done: a harness waits for it) and fork a child per connection: a fork server (the request's
    descriptors: its request socket, report pipe, stdout, stderr) or ``python -m`` a module (stdout,
    stderr). Returns only in a forked server: the arguments of :func:`main` its launcher sent, with
    its environment, working directory and descriptors in place; a module's child runs the module and
    exits. The zygote itself serves until it is killed."""
    t0 = time.monotonic()
    preload(ZYGOTE_MODULES)
    preload_ops()
    why = _fork_unsafe()
    if why is not None:
        say(f"fork server zygote: cannot fork servers here: {why}", name=__name__)
        sys.exit(1)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    staging = f"{path}.{os.getpid()}"
    listener.bind(staging)
    listener.listen(64)
    os.rename(staging, path)  # the path appears listening: a client that sees it can connect
    say(f"fork server zygote: ready in {time.monotonic() - t0:.1f} s on {path}", name=__name__)
    wake_r, wake_w = _woken_by_children()
    clients: dict[int, socket.socket] = {}  # server pid -> its launcher's connection (for its exit code)
    while True:
        _reap_servers(clients)
        ready, _, _ = select.select([listener.fileno(), wake_r], [], [], 1.0)
        if wake_r in ready:
            while _read_some(wake_r):
                pass
        if listener.fileno() not in ready:
            continue
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 4)
        request = json.loads(message) if message else {}
        if len(fds) != (2 if "module" in request else 4):
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for open_socket in (listener, conn, *clients.values()):
                open_socket.close()
            for fd in (wake_r, wake_w):
                os.close(fd)
            return _become_child(request, fds)
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(f"pid {pid}\n".encode())
            clients[pid] = conn
        except OSError:  # the launcher is gone already: its server ends at its closed request socket
            conn.close()


def _reap_servers(clients: dict[int, socket.socket]) -> None:
    for pid, code in _ended_children():
        conn = clients.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(f"exit {code}\n".encode())
            conn.close()


def _become_child(request: dict[str, object], fds: list[int]) -> list[str]:
    """In the zygote's forked child: a session of its own, the requester's environment, working
    directory, stdout and stderr (a server's workers write there, as they would); then a module runs
    here (``python -m``, exiting with its code), or a server's arguments are returned."""
    os.setsid()
    sys.stdout.flush()
    sys.stderr.flush()
    *passed, stdout, stderr = fds
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.close(stdout)
    os.close(stderr)
    env, cwd, argv = request["env"], request["cwd"], request["argv"]
    assert isinstance(env, dict) and isinstance(cwd, str) and isinstance(argv, list)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in env.items()})
    os.chdir(cwd)
    module = request.get("module")
    if isinstance(module, str):
        sys.argv = [module, *(str(a) for a in argv)]
        sys.path[0] = cwd  # as `python -m` puts it
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        sys.exit(0)
    requests, reports = passed
    return ["--requests", str(requests), "--reports", str(reports), *(str(a) for a in argv)]


if __name__ == "__main__":
    sys.exit(main())
