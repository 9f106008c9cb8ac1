"""Whether a running machine is sound, beyond its ranks being alive: the node agent's look at its
GPUs and at its ranks' progress (:class:`MachineHealth`).

A GPU with uncorrectable ECC errors or a critical Xid computes wrong numbers or hangs: as good as a
dead machine. A rank that is alive but makes no progress is too: a watchdog's verdict in the job
store says so (ds_swift.detect.watchdog), or the rank stops beating: its beat file on this machine
(ds_swift.detect.beats.BeatFile) has not moved for its heartbeat timeout on this agent's own clock
(a rank beating in the job store instead: one observer's suspicion that this agent confirms from
its heartbeat counter). Either is a reason to kill the machine's ranks.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from ds_swift.detect.beats import CounterClock, read_beat
from ds_swift.detect.watchdog import hung_machine_key, suspect_key
from ds_swift.jobstore.membership import JobStore

from .control import EventLog
from .inject_group import GroupKill
from .spawn import Worker

#: seconds between GPU health polls (NVML queries are cheap, but not free on 8 GPUs)
GPU_POLL_S = 2.0
#: seconds between looks at the job store for a watchdog's verdict that a rank here is hung (the
#: launcher's look at the store: launch/launcher.py LOOK_S)
HUNG_POLL_S = 1.0

#: a look at the ranks' beats longer than this after the last one starts every silence afresh
LOCAL_GAP_S = 5.0

#: the beat directories' names (``<prefix><node>-<random>``, in /dev/shm where there is one)
BEAT_DIR_PREFIX = "ds-swift-beats-"
#: a beat directory nothing wrote in for this long is a dead launcher's (a live one's ranks beat every
#: second or so): removed when an agent makes its own
STALE_BEAT_DIR_S = 3600.0


def sweep_stale_beat_dirs(root: str, now: float | None = None) -> list[str]:
    """Remove the beat directories under ``root`` (this user's) that nothing wrote in for
    :data:`STALE_BEAT_DIR_S`: a launcher SIGKILLed (a cancelled job, a test's kill) cannot remove its
    own, and /dev/shm kept every one (beats, the relay's FIFOs and failure files). Judged by age, not
    by the launcher's pid: containers sharing /dev/shm (``--ipc=host``) do not share pids. Returns
    what was removed."""
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(BEAT_DIR_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        try:
            st = os.stat(path)
            if st.st_uid != os.getuid():
                continue
            newest = max([st.st_mtime, *(e.stat().st_mtime for e in os.scandir(path))])
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if now - newest > STALE_BEAT_DIR_S:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


__all__ = ["GPU_POLL_S", "HUNG_POLL_S", "MachineHealth"]


class MachineHealth:
    """One agent's checks of its machine; each polls at its own pace and never blocks.

    Args:
        nproc_per_node: the machine's GPU slots (the GPU monitor watches these).
        groups: machines an injected fault kills together (a machine of a fired group is as good as hung).
        gpu_monitor: something with ``poll() -> GpuHealth``; None: a
            :class:`~.gpu_health.GpuMonitor` made on the first poll (NVML; healthy without it).
    """

    def __init__(
        self,
        node: int,
        nproc_per_node: int,
        store: JobStore,
        events: EventLog,
        groups: GroupKill,
        gpu_monitor: Any | None = None,
    ) -> None:
        self.node = node
        self.nproc_per_node = nproc_per_node
        self.store = store
        self.events = events
        self._groups = groups
        # Without NVML (CPU machines) the monitor reports healthy.
        self._gpu = gpu_monitor
        self._gpu_next = 0.0
        self._hung_next = 0.0
        self._suspicion: tuple[int, CounterClock[int], str] | None = None  # (generation, own clock, by whom)
        self._beat_dir: str | None = None  # where this machine's ranks beat (made at their first spawn)
        # The ranks' beats on this agent's clock; a look more than LOCAL_GAP_S after the last (this
        # agent was descheduled) starts every silence afresh.
        self._local: CounterClock[int] = CounterClock(math.inf, max_gap_s=LOCAL_GAP_S)

    def problem(self, name: str, machine: int | None, spawn_generation: int, workers: Sequence[Worker]) -> str | None:
        """What is wrong with ``machine`` (run by agent ``name``, its ranks started in
        ``spawn_generation``), or None: a failing GPU first, then a hang."""
        return self._gpu_problem() or self._hung_problem(name, machine, spawn_generation, workers)

    def _gpu_problem(self) -> str | None:
        if time.monotonic() < self._gpu_next:
            return None
        self._gpu_next = time.monotonic() + GPU_POLL_S
        if self._gpu is None:
            from .gpu_health import GpuMonitor

            # Local slots, mapped through this agent's CUDA_VISIBLE_DEVICES (the monitor's default
            # environ), which its workers inherit; ECC errors count from here, not from boot.
            self._gpu = GpuMonitor(indices=list(range(self.nproc_per_node)))
        health = self._gpu.poll()
        return None if health.healthy else f"failing GPU ({'; '.join(health.problems)})"

    def _hung_problem(
        self, name: str, machine: int | None, spawn_generation: int, workers: Sequence[Worker]
    ) -> str | None:
        """A watchdog found a rank of this machine hung, or two observers found it stopped
        (ds_swift.detect.watchdog), or one did and this agent finds its ranks' heartbeats silent
        too: a process that is alive but makes no progress is as good as dead, and is killed as such."""
        if machine is None or time.monotonic() < self._hung_next:
            return None
        self._hung_next = time.monotonic() + HUNG_POLL_S
        fired = self._groups.fired_for(machine, spawn_generation) if self._groups.groups else None
        if fired is not None:
            return self._groups.describe(fired[0])
        value = self.store.get(hung_machine_key(machine))
        if value:
            generation, _, reason = value.partition(" ")
            if int(generation) >= spawn_generation:
                return f"hung ({reason})"
        if self._beat_dir is not None:
            return self._silent_rank(workers)
        return self._suspected_problem(name, machine, spawn_generation, workers)

    # ------------------------------------------------------------------ the ranks' own beats
    def fresh_beats(self, ranks: Sequence[int]) -> str:
        """The directory ``ranks`` beat in (made on first use, on this machine: /dev/shm where there
        is one), their previous workers' beats gone: a new worker is judged from its first beat."""
        if self._beat_dir is None:
            shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
            sweep_stale_beat_dirs(shm or tempfile.gettempdir())
            self._beat_dir = tempfile.mkdtemp(prefix=f"{BEAT_DIR_PREFIX}{self.node}-", dir=shm)
        for rank in ranks:
            self._local.forget(rank)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self._beat_dir, str(rank)))
        return self._beat_dir

    def close(self) -> None:
        if self._beat_dir is not None:
            shutil.rmtree(self._beat_dir, ignore_errors=True)

    def _silent_rank(self, workers: Sequence[Worker]) -> str | None:
        """A rank of this machine whose beat file has not moved for the rank's heartbeat timeout, on
        this agent's clock: alive (its process did not exit) but stopped, as good as dead. No job
        store: the ranks beat for their agent alone (ds_swift.detect.beats.BeatFile)."""
        assert self._beat_dir is not None
        now = self._local.begin_round()
        for w in workers:
            beat = read_beat(os.path.join(self._beat_dir, str(w.rank)))
            if beat is None:
                continue  # no beat yet: starting, not stopped
            count, timeout_s, note = beat
            silent = self._local.observe(w.rank, count, now)
            if silent > timeout_s:
                where = f", last in {note}" if note else ""
                return f"hung (rank {w.rank}: no heartbeat for {silent:.1f} s{where}, on its agent's clock)"
        self._local.end_round()
        return None

    def _suspected_problem(
        self, name: str, machine: int, spawn_generation: int, workers: Sequence[Worker]
    ) -> str | None:
        """One observer suspects this machine (no verdict alone: its clock, its store view, its
        link may be what is wrong): this agent reads its own ranks' beat counters on its own clock
        and fails the machine only if one of them is silent for the observer's timeout here too."""
        g = self.store.generation()
        raw = self.store.get(suspect_key(g, machine))
        if not raw or g < spawn_generation:
            self._suspicion = None
            return None
        if self._suspicion is None or self._suspicion[0] != g:
            timeout_s, _, why = raw.partition(" ")
            self._suspicion = (g, CounterClock(float(timeout_s)), why)
            self.events(
                f"machine {machine}: suspected in generation {g} ({why}); {name} checks its "
                "ranks' heartbeats on its own clock",
                event="suspected",
                node=self.node,
                machine=machine,
                generation=g,
            )
        _, beats, why = self._suspicion
        now = beats.begin_round()
        for w in workers:
            beat = self.store.heartbeat_of(w.rank)
            silent = beats.stale(w.rank, beat[0], now) if beat is not None else None
            if beat is not None and silent is not None:
                where = f", last in {beat[1]}" if beat[1] else ""
                return f"hung (rank {w.rank}: no heartbeat for {silent:.1f} s{where}, on its agent's clock; suspected: {why})"
        beats.end_round()
        return None
