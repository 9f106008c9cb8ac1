"""Steady state of ``benchmarks/scale.py``: the job-store requests per rank per second while nothing fails.

One thread plays the whole job on a fake clock: every rank's real watchdog
(ds_swift.detect.watchdog, its threads' own turns: ``Watchdog.turn`` waiting on the flag,
``Watchdog.local_turn`` beating for the agent), every machine's real
launcher loop (launch/launcher.py's ``Supervisor.step`` with its ``MachineAgent``, its health
checks and, multi-host, its ``AgentLiveness``), a spare's, and every rank's digest publication
(ds_swift.recovery.verify.publish_digest) take their turns when their own pacing says: an event
loop on simulated time. A blocking wait of the code on a key that never comes is counted as one
request and advances its actor by the time it would have blocked (CountingStore's virtual
waits). Workers are stand-ins that never exit (the agents see live processes), GPUs healthy.

The buddy copies' landing rounds need ranks that block on each other: :func:`buddy_round` runs
them on threads with real blocking waits, and the rate follows from rounds per second.
"""

from __future__ import annotations

import heapq
import itertools
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from scale_common import LAUNCH, PER_MACHINE, SECRET, TOKEN, FakeClock, Layout, StoreSet, quiet

from ds_swift.detect.beats import BeatFile
from ds_swift.detect.progress import Progress
from ds_swift.detect.watchdog import Watchdog
from ds_swift.launch.agent import MachineAgent
from ds_swift.launch.args import Command
from ds_swift.launch.control import EventLog
from ds_swift.launch.job import JobSpec
from ds_swift.launch.launcher import Supervisor
from ds_swift.launch.liveness import AgentLiveness
from ds_swift.launch.spawn import Worker
from ds_swift.protect.buddy_holdings import StoreLanding
from ds_swift.protect.buddy_interval import PERIOD_S
from ds_swift.recovery.state.digest import StateDigest
from ds_swift.recovery.verify import publish_digest

__all__ = ["SteadyConfig", "buddy_round", "steady_state"]


@dataclass(frozen=True)
class SteadyConfig:
    """The job's settings (the defaults of ds_swift.config and ds-swift-launch)."""

    poll_interval_s: float = 0.1
    heartbeat_timeout_s: float = 10.0
    hang_timeout_s: float = 120.0
    agent_timeout_s: float = 10.0
    spares: int = 1
    step_s: float = 0.1
    """The training step the digest and buddy rates are quoted at (a GPU step of ~100 ms)."""
    digest_interval: int = 10
    simulated_s: float = 20.0
    warmup_s: float = 3.0


class _Proc:
    """A worker process that stays alive and is never signalled (returncode 0: "reaped" for signals)."""

    pid = -1
    returncode = 0

    def poll(self) -> None:
        return None

    def send_signal(self, sig: int) -> None:
        pass


#: what the simulated agents leave behind (their ranks' beat directories)
CLOSE: list[Callable[[], None]] = []
#: rank -> the environment its agent last started it with (the sim's workers read their beat dirs there)
SPAWNED: dict[int, Any] = {}


def _spawn(command: Any, wenv: Any, nproc: int, op_timeout_s: float | None) -> Worker:
    SPAWNED[wenv.rank] = wenv
    return Worker(wenv.rank, wenv.local_rank, wenv.generation, _Proc())  # type: ignore[arg-type]


class _HealthyGpus:
    def poll(self) -> Any:
        return SimpleNamespace(healthy=True, problems=[])


@dataclass(order=True)
class _Turn:
    at: float
    seq: int
    run: Callable[[], float] = field(compare=False)


class _RelayedWake:
    """A rank's wake-up FIFO (ds_swift.detect.relay.WakeFifo) on the fake clock: its wait blocks for
    its timeout and asks the store nothing (no failure is relayed in the steady state). The agent's
    own wait on the flag, one per machine, times out once an hour (relay.RELAY_WAIT_S): not counted."""

    def __init__(self, counting: Any) -> None:
        self.counting = counting

    def wait(self, generation: int, timeout_s: float) -> str | None:
        self.counting.slept_s += timeout_s
        return None

    def poke(self) -> None:
        pass

    def close(self) -> None:
        pass


def _watchdogs(stores: StoreSet, layout: Layout, cfg: SteadyConfig) -> list[Callable[[], float]]:
    turns = []
    counting = stores.counting("watchdog")
    for rank in range(layout.ranks):
        client = stores.client("watchdog")
        beat_dir = SPAWNED[rank].beat_dir  # as FailureMonitor.start_watchdog: the rank beats for its agent
        wd = Watchdog(
            lambda c=client: c,
            rank,
            0,
            cfg.poll_interval_s,
            cfg.heartbeat_timeout_s,
            layout.watched(rank),
            progress=Progress(),
            hang_timeout_s=cfg.hang_timeout_s,
            ranks_per_machine=PER_MACHINE,
            beat_file=BeatFile(beat_dir, rank, cfg.heartbeat_timeout_s) if beat_dir else None,
        )
        if wd.beat_file is not None:
            wd._wake = _RelayedWake(counting)  # type: ignore[assignment]  # its agent relays the flag
        state: dict[str, Any] = {"store": client}

        def turn(wd: Watchdog = wd, state: dict[str, Any] = state) -> float:
            before = counting.slept_s
            state["store"], pause = wd.turn(state["store"])
            return pause + (counting.slept_s - before)

        def beat(wd: Watchdog = wd) -> float:  # its beater thread: the beat file, the hang check
            wd.local_turn()
            return wd.beat_every_s

        turns += [turn, beat] if wd.beat_file is not None else [turn]
    return turns


def _launchers(stores: StoreSet, layout: Layout, cfg: SteadyConfig, clock: FakeClock) -> list[Callable[[], float]]:
    """One launcher process per machine and per spare, multi-host (each with its agent's liveness)."""
    job = JobSpec(
        command=Command("train.py"),
        num_machines=layout.machines,
        nproc_per_node=PER_MACHINE,
        num_spares=cfg.spares,
        max_failures=3,
        restart_delay_s=None,
        store_addr="",
        store_port=0,
        token=TOKEN,
        run_dir=tempfile.mkdtemp(prefix="scale-"),
        secret=SECRET,
        launch=LAUNCH,
    )
    counting = stores.counting("launcher")
    agents = layout.machines + cfg.spares
    turns = []
    for node in range(agents):
        store = stores.client("launcher")
        agent = MachineAgent(node, job, store, EventLog(None), spawn=_spawn, gpu_monitor=_HealthyGpus())
        agent.start()
        liveness = AgentLiveness(store, [node], agents, cfg.agent_timeout_s, clock=clock)
        sup = Supervisor([agent], store, EventLog(None), layout.machines, hosts_store=node == 0, liveness=liveness)

        def turn(sup: Supervisor = sup) -> float:
            before = counting.slept_s
            code = sup.step()
            if code is not None:
                raise RuntimeError(f"the simulated launcher ended the job (exit {code}): a harness bug")
            return sup.pause_s() + (counting.slept_s - before)

        turns.append(turn)
        CLOSE.append(agent.close)
    return turns


def _digests(stores: StoreSet, layout: Layout, cfg: SteadyConfig) -> list[Callable[[], float]]:
    digest = StateDigest(("w", "b"), ("0" * 16, "1" * 16))
    turns = []
    for rank in range(layout.ranks):
        store = stores.client("digests")
        count = itertools.count()

        def turn(store: Any = store, rank: int = rank, count: Any = count) -> float:
            iteration = next(count) * cfg.digest_interval
            publish_digest(store, rank, iteration, cfg.digest_interval, digest)
            return cfg.digest_interval * cfg.step_s

        turns.append(turn)
    return turns


def steady_state(layout: Layout, cfg: SteadyConfig = SteadyConfig()) -> dict[str, Any]:
    """Requests per rank per second of each part, over ``cfg.simulated_s`` after a warm-up."""
    stores = StoreSet(virtual_waits=True)
    clock = FakeClock()
    with quiet(), clock.installed():
        launchers = _launchers(stores, layout, cfg, clock)  # first: they start the ranks
        parts = {
            "watchdog": _watchdogs(stores, layout, cfg),
            "launcher": launchers,
            "digests": _digests(stores, layout, cfg),
        }
        for part in parts:
            stores.take(part)
        queue = [_Turn(clock.now, i, run) for i, run in enumerate(itertools.chain(*parts.values()))]
        heapq.heapify(queue)
        seq = itertools.count(len(queue))
        measure_from, end = clock.now + cfg.warmup_s, clock.now + cfg.warmup_s + cfg.simulated_s
        measuring = False
        while queue[0].at < end:
            turn = heapq.heappop(queue)
            clock.now = turn.at
            if not measuring and clock.now >= measure_from:
                measuring = True
                for part in parts:
                    stores.take(part)
            pause = turn.run()
            heapq.heappush(queue, _Turn(clock.now + max(pause, 1e-3), next(seq), turn.run))
        while CLOSE:
            CLOSE.pop()()
    out: dict[str, Any] = {"ranks": layout.ranks, "machines": layout.machines, "simulated_s": cfg.simulated_s}
    for part in parts:
        tally = stores.take(part)
        out[part] = {
            "requests_per_rank_per_s": tally.total_requests / layout.ranks / cfg.simulated_s,
            "bytes_per_rank_per_s": tally.total_bytes / layout.ranks / cfg.simulated_s,
            "families": {f: n / cfg.simulated_s for f, n in tally.requests.most_common(8)},
        }
    return out


def buddy_round(layout: Layout, rounds: int = 3, cfg: SteadyConfig = SteadyConfig()) -> dict[str, Any]:
    """Requests per rank of one buddy landing round (ds_swift.protect.buddy_holdings.StoreLanding,
    every rank on its own thread, real blocking waits), and per second at the most rounds
    ``buddy.interval: "auto"`` allows (one per PERIOD_S)."""
    stores = StoreSet()
    counting = stores.counting("buddy")
    errors: list[BaseException] = []

    def rank_rounds(rank: int) -> None:
        try:
            landing = StoreLanding(stores.client("buddy"), 0, layout.ranks, rank)
            for version in range(rounds + 2):
                landing(version, stopped=lambda: False)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    with quiet():
        threads = [threading.Thread(target=rank_rounds, args=(r,), daemon=True) for r in range(layout.ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"buddy rounds did not finish: {errors[:1]}")
    tally = counting.take()
    per_round = tally.total_requests / layout.ranks / (rounds + 2)
    return {
        "requests_per_rank_per_round": per_round,
        "bytes_per_rank_per_round": tally.total_bytes / layout.ranks / (rounds + 2),
        "requests_per_rank_per_s_at_most": per_round / max(PERIOD_S, cfg.step_s),
    }
