"""Real processes for tests and demos: start, wait with a deadline, always kill.

Every process starts in its own session, so ``kill_all`` can SIGKILL it together with anything
it spawned (a launcher's agents and workers). Output goes to one file per process: pipes that
nobody drains fill up and hang the writer, which is the classic way a multi-process test hangs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from ds_swift.launch.fork_client import ZygoteChild

__all__ = ["ProcessSet", "free_port", "worker_env"]


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child: one OpenMP thread (2-core machines oversubscribe badly)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


class ProcessSet:
    """Processes started by one test; all of them are SIGKILLed on exit, also on failure."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes] | ZygoteChild] = {}

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> subprocess.Popen[bytes]:
        if name in self.procs:
            raise ValueError(f"process name {name!r} already used")
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed by the child's exit
        try:
            proc = subprocess.Popen(
                list(argv),
                env=dict(env) if env is not None else worker_env(),
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()
        self.procs[name] = proc
        return proc

    def spawn_python(self, name: str, args: Sequence[str], **kw: object) -> subprocess.Popen[bytes]:
        return self.spawn(name, [sys.executable, *args], **kw)  # type: ignore[arg-type]

    def fork_module(
        self,
        name: str,
        zygote: str,
        module: str,
        args: Sequence[str],
        env: Mapping[str, str],
        cwd: str | os.PathLike[str],
    ) -> ZygoteChild:
        """``python -m module *args`` forked by the zygote at ``zygote`` (its imports done), in a
        session of its own, its output in the log as :meth:`spawn`'s; killed on exit as the others."""
        if name in self.procs:
            raise ValueError(f"process name {name!r} already used")
        with open(self.log_dir / f"{name}.log", "wb") as log:
            fds = (log.fileno(), log.fileno())
            proc = ZygoteChild.fork(zygote, list(args), env, fds, module=module, cwd=str(cwd))
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs_tail(self, lines: int = 40) -> str:
        out = []
        for name in self.procs:
            tail = "\n".join(self.log(name).splitlines()[-lines:])
            out.append(f"----- {name} (rc={self.procs[name].poll()}) -----\n{tail}")
        return "\n".join(out)

    def wait(self, name: str, timeout_s: float) -> int:
        try:
            return self.procs[name].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{name} still running after {timeout_s:.0f} s\n{self.logs_tail()}") from None

    def wait_all(self, timeout_s: float, fail_fast: bool = False) -> dict[str, int]:
        """Exit codes of every process, within one deadline. With ``fail_fast`` the first non-zero
        exit kills the rest at once (their codes are then the kill's): ranks of one job would
        otherwise sit in a collective with the dead one until the deadline."""
        deadline = time.monotonic() + timeout_s
        if not fail_fast:
            return {name: self.wait(name, max(0.1, deadline - time.monotonic())) for name in list(self.procs)}
        while True:
            codes = {name: proc.poll() for name, proc in self.procs.items()}
            if all(c is not None for c in codes.values()):
                return {name: int(c) for name, c in codes.items() if c is not None}
            if any(c for c in codes.values()):
                self.kill_all()
                return {
                    name: -signal.SIGKILL if p.returncode is None else p.returncode for name, p in self.procs.items()
                }
            if time.monotonic() > deadline:
                running = [name for name, c in codes.items() if c is None]
                raise TimeoutError(f"{', '.join(running)} still running after {timeout_s:.0f} s\n{self.logs_tail()}")
            time.sleep(0.1)

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    proc.kill()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> ProcessSet:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.kill_all()
