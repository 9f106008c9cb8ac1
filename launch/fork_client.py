"""``--fork-server``: the launcher's workers forked from one pre-imported interpreter.

:class:`ForkServer` starts :mod:`ds_swift.runtime.forkserver` once per launcher process (all the
agents of a simulated job share it) and asks it for each worker it would otherwise start as a fresh
``python``: the imports of torch, DeepSpeed and megatron-core are paid once, not per rank. A spare's
warm workers (:mod:`ds_swift.runtime.warm`) are forked too, each with a pipe for its assignment as its stdin. The
agent sees a forked worker as it sees any other (:class:`ForkedProcess` has what it uses of a
``Popen``): its own process group, killed with ``killpg``; its exit code comes from the server,
which is its parent and reaps it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from ds_swift.jobstore.worker_env import WorkerEnv

from .args import Command
from .spawn import Worker, dies_with_us, warm_environ, worker_argv, worker_environ

__all__ = ["ZYGOTE_ENV", "ForkServer", "ForkedProcess", "ZygoteChild"]

#: how long the first worker may wait for the server's imports (a busy host of 2 cores: ~10 s)
READY_TIMEOUT_S = 300.0
#: the Unix socket of a fork server zygote (``python -m ds_swift.runtime.forkserver --zygote PATH``):
#: where set, the server is forked from it, imports done, instead of started and importing
ZYGOTE_ENV = "SWIFT_FORK_ZYGOTE"


class ForkedProcess:
    """A worker the fork server forked, as its agent sees it (``pid``, ``poll``, ``returncode``, ``send_signal``)."""

    def __init__(self, server: ForkServer, pid: int, stdin: IO[bytes] | None = None) -> None:
        self._server = server
        self.pid = pid
        self.stdin = stdin
        """A warm spare's worker: the pipe its assignment is written to (:func:`.spawn.assign_warm`)."""
        self._code: int | None = None

    @property
    def returncode(self) -> int | None:
        if self._code is None:
            self._code = self._server.exit_code(self.pid)
        return self._code

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


class ForkServer:
    """The fork server of one launcher process, for ``command`` (a Python script or module)."""

    def __init__(self, command: Command, base_env: Mapping[str, str] | None = None) -> None:
        if command.no_python:
            raise ValueError("--fork-server forks a Python interpreter: it cannot run a --no_python command")
        self.command = command
        env = dict(os.environ if base_env is None else base_env)
        env.setdefault("OMP_NUM_THREADS", "1")  # read when torch is imported, as in worker_environ
        env["PYTHONUNBUFFERED"] = "1"
        for key in WorkerEnv.ENV_KEYS:
            env.pop(key, None)  # no rank yet: each worker gets its whole environment with its request
        self._env = env
        self.proc: subprocess.Popen[bytes] | ZygoteChild | None = None  # started at the first worker
        self._requests: socket.socket | None = None
        self._reports = -1
        self._pending = b""
        self._next_id = 0
        self._forked: dict[int, int] = {}  # request id -> pid
        self._exits: dict[int, int] = {}  # pid -> exit code
        self._gone = False  # the server ended: its workers died with it (PR_SET_PDEATHSIG)
        self._ready = False  # it imported, and serves

    def _start(self) -> subprocess.Popen[bytes] | ZygoteChild:
        # One message, one request (SOCK_SEQPACKET), and a warm spare's assignment pipe with it.
        self._requests, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        reports_r, reports_w = os.pipe()
        script = [*(["--module"] if self.command.module else []), self.command.script]
        zygote = self._env.get(ZYGOTE_ENV)
        try:
            proc: subprocess.Popen[bytes] | ZygoteChild
            if zygote:
                fds = (theirs.fileno(), reports_w, sys.stdout.fileno(), sys.stderr.fileno())
                proc = ZygoteChild.fork(zygote, script, self._env, fds)
            else:
                argv = [sys.executable, "-u", "-m", "ds_swift.runtime.forkserver", "--requests", str(theirs.fileno())]
                proc = subprocess.Popen(
                    dies_with_us([*argv, "--reports", str(reports_w), *script]),
                    env=self._env,
                    stdin=subprocess.DEVNULL,
                    pass_fds=(theirs.fileno(), reports_w),
                    start_new_session=True,
                )
        finally:
            theirs.close()
            os.close(reports_w)
        self._reports = reports_r
        os.set_blocking(reports_r, False)
        return proc

    # ------------------------------------------------------------------ reports
    def reports_fd(self) -> int:
        """The pipe the server reports on (a worker's exit among them), for a ``select`` that must
        wake when one ends (the launcher's loop: its workers are the server's children, so no
        SIGCHLD reaches the launcher); -1 once the server is gone. Read it with :meth:`pump`."""
        return -1 if self._gone else self._reports

    def pump(self) -> None:
        """Read what the server reported (exits, pids), without waiting."""
        self._pump()

    def _pump(self, timeout_s: float = 0.0) -> None:
        """Read what the server reported (waiting up to ``timeout_s`` for something)."""
        if self._gone or self._reports < 0:
            return
        if timeout_s > 0:
            select.select([self._reports], [], [], timeout_s)
        while True:
            try:
                chunk = os.read(self._reports, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                self._gone = True
                break
            self._pending += chunk
        while b"\n" in self._pending:
            line, self._pending = self._pending.split(b"\n", 1)
            kind, a, b = line.decode().split()
            if kind == "ready":
                self._ready = True
            elif kind == "pid":
                self._forked[int(a)] = int(b)
            else:
                self._exits[int(a)] = int(b)

    def exit_code(self, pid: int) -> int | None:
        """Worker ``pid``'s exit code once it ended, else None."""
        self._pump()
        if pid in self._exits:
            return self._exits[pid]
        if self._gone:
            # The server is gone and cannot reap: its workers got SIGKILL with it; wait for the kernel.
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return -signal.SIGKILL
        return None

    def start(self) -> None:
        """Start the server, without waiting for its imports (``ds-swift-launch`` starts it before it
        imports torch itself, for its job store: the two imports overlap)."""
        self.proc = self.proc or self._start()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Start the server and wait for its imports: before the agents' first tick, so that no agent
        stops beating its liveness counter (multi-host) for that long. OSError if it does not serve."""
        self.start()
        self._wait_until(lambda: self._ready, timeout_s, "not ready")

    def _wait_until(self, done: Callable[[], bool], timeout_s: float, missed: str) -> None:
        """Read the server's reports until ``done()``. OSError once the server ended, or after
        ``timeout_s`` (``missed`` says what did not happen)."""
        server = self.proc
        assert server is not None
        deadline = time.monotonic() + timeout_s
        while not done():
            if self._gone or server.poll() is not None or time.monotonic() > deadline:
                code = server.poll()
                why = f"exited with code {code}" if code is not None else f"{missed} in {timeout_s:.0f} s"
                raise OSError(f"the fork server (pid {server.pid}) {why}; see its message above")
            self._pump(timeout_s=0.5)

    # ------------------------------------------------------------------ workers
    def _fork(self, command: Command, request: dict[str, object], stdin: int | None = None) -> int:
        """Send one request; wait for its pid (the first waits for the server's imports). OSError if none comes."""
        if command != self.command:
            raise ValueError(f"this fork server runs {self.command.script}, not {command.script}")
        request_id, self._next_id = self._next_id, self._next_id + 1
        server = self.proc = self.proc or self._start()
        assert self._requests is not None
        try:
            socket.send_fds(
                self._requests, [json.dumps({"id": request_id, **request}).encode()], [] if stdin is None else [stdin]
            )
        except OSError as exc:
            raise OSError(f"the fork server (pid {server.pid}) is gone: {exc}") from None
        self._wait_until(lambda: request_id in self._forked, READY_TIMEOUT_S, "forked nothing")
        return self._forked.pop(request_id)

    @staticmethod
    def _script_args(command: Command, local_rank: int) -> list[str]:
        argv = worker_argv(command, local_rank)  # [python, -u, (-m,) script, args...]
        return argv[4:] if command.module else argv[3:]

    def spawn(
        self,
        command: Command,
        wenv: WorkerEnv,
        nproc_per_node: int,
        op_timeout_s: float | None = None,
        base_env: Mapping[str, str] | None = None,
    ) -> Worker:
        """Fork one rank's worker (what :func:`.spawn.spawn_worker` starts). Raises OSError if it cannot."""
        env = worker_environ(wenv, nproc_per_node, op_timeout_s, base_env)
        pid = self._fork(command, {"args": self._script_args(command, wenv.local_rank), "env": env})
        return Worker(
            rank=wenv.rank, local_rank=wenv.local_rank, generation=wenv.generation, proc=ForkedProcess(self, pid)
        )

    def spawn_warm(
        self, command: Command, local_rank: int, nproc_per_node: int, base_env: Mapping[str, str] | None = None
    ) -> ForkedProcess:
        """Fork a warm spare's worker for ``local_rank`` (what :func:`.spawn.spawn_warm` starts): it waits
        for the assignment that :func:`.spawn.assign_warm` writes to its ``stdin``."""
        env = warm_environ(local_rank, nproc_per_node, base_env)
        theirs, ours = os.pipe()
        try:
            request = {"args": self._script_args(command, local_rank), "env": env, "warm": True}
            pid = self._fork(command, request, stdin=theirs)
        except BaseException:
            os.close(ours)
            raise
        finally:
            os.close(theirs)
        return ForkedProcess(self, pid, stdin=os.fdopen(ours, "wb"))

    def close(self) -> None:
        """End the server (its workers, if any still ran, die with it) and reap it."""
        if self.proc is None or self._requests is None:
            return
        self._requests.close()
        self._requests = None  # closed once: a second close() does nothing
        if not self._ready and not self._forked:
            self.proc.kill()  # still importing, and nothing forked: a launcher that stopped early
        try:
            self.proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._reports)
        self._reports, self._gone = -1, True


class ZygoteChild:
    """A process forked by a zygote (a fork server, or a harness's launcher), as its requester uses a
    ``Popen`` (``pid``, ``poll``, ``returncode``, ``wait``, ``kill``): the zygote is its parent, and says
    its exit code on the connection the request came on."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self._conn = conn
        self.pid = pid
        self.returncode: int | None = None

    @classmethod
    def fork(
        cls,
        path: str,
        argv: list[str],
        env: Mapping[str, str],
        fds: Sequence[int],
        module: str | None = None,
        cwd: str | None = None,
    ) -> ZygoteChild:
        """Ask the zygote at ``path`` for a fork server with arguments ``argv`` (its script) and ``fds``
        (its request socket and report pipe, then stdout and stderr), or with ``module``, for
        ``python -m module *argv`` with ``fds`` its stdout and stderr. OSError where the zygote does
        not answer."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.settimeout(30.0)
            conn.connect(path)
            request = {"argv": argv, "env": dict(env), "cwd": cwd or os.getcwd()}
            if module is not None:
                request["module"] = module
            socket.send_fds(conn, [json.dumps(request).encode()], list(fds))
            answer = conn.recv(256).decode().split()
            if answer[:1] != ["pid"]:
                raise OSError(f"the fork server zygote at {path} ({ZYGOTE_ENV}) answered {answer!r}")
            conn.setblocking(False)
            return cls(conn, int(answer[1]))
        except BaseException as exc:
            conn.close()
            if isinstance(exc, OSError):
                raise OSError(f"the fork server zygote at {path} ({ZYGOTE_ENV}): {exc}") from None
            raise

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                answer = self._conn.recv(256).decode().split()
            except BlockingIOError:
                return None
            except OSError:
                answer = []
            # "exit CODE"; a closed connection without it: the zygote is gone, and its server with it
            self.returncode = int(answer[1]) if answer[:1] == ["exit"] else -signal.SIGKILL
            self._conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout or 0.0)
            select.select([self._conn], [], [], 0.1)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
