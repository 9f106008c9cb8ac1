"""A spare agent's pool of warm workers: one per local rank, started before any failure.

Each warm worker (:mod:`ds_swift.runtime.warm`) imports what the script needs and waits on its
stdin. When the spare takes over a machine, :meth:`WarmPool.take` hands every local rank's
assignment to its warm worker, which joins the job at once. A warm worker that dies while it
waits is started again (the pool stays full); one that keeps dying (the script cannot even be
imported) is given up after ``max_restarts`` and the spare starts its ranks cold, as it would
without a pool.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ds_swift.jobstore.membership import WorkerEnv

from .spawn import WarmWorkerProcess, Worker, WorkerProcess, assign_warm, describe_exit, signal_group

__all__ = ["WarmPool", "WarmProcess"]

#: warm workers that die within this many seconds of their start count towards giving up
QUICK_DEATH_S = 30.0


@dataclass
class WarmProcess:
    local_rank: int
    proc: WorkerProcess
    started_at: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal_group(self, sig: int) -> None:
        signal_group(self.proc, sig)


class WarmPool:
    """Warm workers for local ranks ``0..nproc_per_node-1``.

    Args:
        nproc_per_node: local ranks of a machine.
        start: starts the warm worker of one local rank.
        assign: hands an assignment to a warm worker (:func:`launch.spawn.assign_warm` by default).
        max_restarts: quick deaths (within :data:`QUICK_DEATH_S` of the start) before the pool gives up.
    """

    def __init__(
        self,
        nproc_per_node: int,
        start: Callable[[int], WarmWorkerProcess],
        assign: Callable[..., Worker | None] = assign_warm,
        max_restarts: int = 3,
    ) -> None:
        self.nproc_per_node = nproc_per_node
        self._start = start
        self._assign = assign
        self.max_restarts = max_restarts
        self.procs: dict[int, WarmProcess] = {}
        self._dying: list[WarmProcess] = []
        self.quick_deaths = 0
        self.gave_up = False

    def fill(self) -> list[int]:
        """Start the missing warm workers; returns their pids."""
        pids: list[int] = []
        if self.gave_up:
            return pids
        for local_rank in range(self.nproc_per_node):
            if local_rank not in self.procs:
                wp = WarmProcess(local_rank, self._start(local_rank))
                self.procs[local_rank] = wp
                pids.append(wp.pid)
        return pids

    def check(self) -> list[str]:
        """Reap warm workers that died, start them again; one line per death (for the event log)."""
        self._dying = [w for w in self._dying if w.poll() is None]
        lines = []
        for local_rank, wp in list(self.procs.items()):
            rc = wp.poll()
            if rc is None:
                continue
            del self.procs[local_rank]
            if time.monotonic() - wp.started_at < QUICK_DEATH_S:
                self.quick_deaths += 1
            lines.append(f"warm worker of local rank {local_rank} (pid {wp.pid}) {describe_exit(rc)}")
        if lines and self.quick_deaths > self.max_restarts:
            self.close()
            self.gave_up = True
            lines.append(f"{self.quick_deaths} warm workers died soon after their start: replacements start cold")
        elif lines:
            pids = self.fill()
            lines.append(f"warm workers restarted (pids {' '.join(map(str, pids))})")
        return lines

    def ready(self) -> bool:
        """Every local rank has a live warm worker."""
        return len(self.procs) == self.nproc_per_node and all(w.poll() is None for w in self.procs.values())

    def take(self, wenvs: list[WorkerEnv], assign_args: tuple[object, ...] = ()) -> list[Worker] | None:
        """Hand each assignment to its local rank's warm worker. None (and the pool emptied) when one is
        missing or refuses: the caller then starts the machine's ranks cold."""
        if not self.ready():
            self.close()
            return None
        workers: list[Worker] = []
        for wenv in wenvs:
            wp = self.procs.pop(wenv.local_rank)
            worker = self._assign(wp.proc, wenv, *assign_args)
            if worker is None:
                self._dying.append(wp)
                for w in workers:  # already assigned: they would wait for the rank that failed to start
                    w.signal_group(signal.SIGKILL)
                self._dying.extend(WarmProcess(w.local_rank, w.proc) for w in workers)
                self.close()
                return None
            workers.append(worker)
        self.close()  # a pool bigger than the machine: the rest is not needed any more
        return workers

    def close(self) -> None:
        """SIGKILL every warm worker (not reaped here: :meth:`alive` does it)."""
        for wp in self.procs.values():
            wp.signal_group(signal.SIGKILL)
        self._dying.extend(self.procs.values())
        self.procs = {}

    def signal_all(self, sig: int) -> None:
        for wp in [*self.procs.values(), *self._dying]:
            wp.signal_group(sig)

    def alive(self) -> list[WarmProcess]:
        """Warm workers not reaped yet (reaps the ones that ended)."""
        return [wp for wp in [*self.procs.values(), *self._dying] if wp.poll() is None]
