"""One recovery of ``benchmarks/scale.py``: the job-store requests from a machine's death to every
rank back, for N simulated ranks on threads (real blocking waits, an in-process store).

What runs is the real code of each step that talks to the job store, called as the runtime calls
it (ds_swift.runtime.rebuild ``as_survivor``/``rejoin``/``_recover``, ds_swift.recovery.coordinator
``run_recovery``), in this order:

- the failed machine's agent: launch/fate.py ``MachineFate.handle`` (declare, timeline, fate, the
  spare's request); the spare's agent: ``MachineAgent.poll_store`` (claim, replacement started);
- each survivor: its watchdog's turn that sees the flag (``Watchdog.turn``), the failed machine's
  name (``FailedMachine``: the generation moved on where no agent recorded it), the join of g+1
  (``JobStore.join``);
- each replacement, :data:`REPLACEMENT_DELAY_S` later (a warm spare handed its ranks): its store
  connection and the same join;
- every rank: the recovery protocol itself (ds_swift.recovery.coordinator ``run_recovery``: its
  rounds, the consensus and the choice of strategy, whose CPU time is measured, verification, the
  digests of undone iterations dropped: every rank published its ring of digests while it trained,
  and a survivor's process knows what it wrote there), with a restore that does what a replication or buddy
  restore asks of the store (the donors' digests of what they send, the replacements' check of
  them: ds_swift.recovery.verify); then rank 0's ``resumed`` key, the post-recovery guard's reference
  (``LossGuard.after_recovery``, agreed in the restore round) and the timeline (each rank's part, rank 0's ``collect_timeline``).

Not here: the state itself (sent on the transport, measured by benchmarks/recovery_time.py) and
the process groups (gloo rendezvous: :func:`scale_groups.group_costs`). The watchdogs' own polling
during the recovery is the steady state's and is not counted twice.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from scale_common import LAUNCH, PER_MACHINE, SECRET, TOKEN, Layout, StoreSet, quiet
from scale_steady import _HealthyGpus, _spawn

from ds_swift.detect.beats import BeatFile
from ds_swift.detect.failed_machine import FailedMachine
from ds_swift.detect.progress import Progress
from ds_swift.detect.watchdog import Watchdog
from ds_swift.jobstore.membership import JobStore, resumed_key
from ds_swift.launch.agent import MachineAgent
from ds_swift.launch.args import Command
from ds_swift.launch.control import EventLog, JobControl
from ds_swift.launch.fate import MachineFate
from ds_swift.launch.job import JobSpec
from ds_swift.recovery import coordinator
from ds_swift.recovery.base import RankContext, RecoveryOutcome
from ds_swift.recovery.consensus import RankReport, RecoveryInputs, RecoveryPlan
from ds_swift.recovery.coordinator import run_recovery
from ds_swift.recovery.handover import Handover
from ds_swift.recovery.holdings import BuddyHeld
from ds_swift.recovery.registry import STRATEGIES
from ds_swift.recovery.state.digest import StateDigest
from ds_swift.recovery.timeline import RankTimeline
from ds_swift.recovery.verify import DigestSlots, check_received, publish_digest, publish_reference
from ds_swift.runtime.guard import LossGuard
from ds_swift.runtime.timeline import collect_timeline

__all__ = ["PHASES", "REPLACEMENT_DELAY_S", "recovery"]

#: the phases counted apart: the death seen and declared (agents, survivors' watchdogs), the join of
#: the next generation, the recovery's rounds
PHASES = ("detect", "join", "rounds")

#: a warm spare's workers are handed their ranks and reach the join about this long after the
#: death is declared (benchmarks/recovery_time.py measures the real figure)
REPLACEMENT_DELAY_S = 1.0
TIMEOUT_S = 300.0
ITERATION = 100
DIGEST_INTERVAL = 10


@dataclass
class _Run:
    layout: Layout
    stores: StoreSet
    failed_machine: int
    consensus_s: list[float]
    errors: list[BaseException]
    run_dir: str
    plan: Any = None
    slots: dict[int, DigestSlots] = field(default_factory=dict)
    """survivor rank -> what its digest publisher wrote in its slots (lent to its recovery)"""

    @property
    def lost(self) -> range:
        return range(self.failed_machine * PER_MACHINE, (self.failed_machine + 1) * PER_MACHINE)


def _job(layout: Layout) -> JobSpec:
    return JobSpec(
        command=Command("train.py"),
        num_machines=layout.machines,
        nproc_per_node=PER_MACHINE,
        num_spares=1,
        max_failures=3,
        restart_delay_s=None,
        store_addr="",
        store_port=0,
        token=TOKEN,
        run_dir=tempfile.mkdtemp(prefix="scale-"),
        secret=SECRET,
        launch=LAUNCH,
    )


def _report(run: _Run, rank: int) -> RankReport:
    stage, d, t = run.layout.coords(rank)
    survivor = rank not in run.lost
    # a survivor holds its buddy's partition copy (the next machine's rank of the same place)
    buddy = (rank + PER_MACHINE) % run.layout.ranks
    return RankReport(
        rank=rank,
        survivor=survivor,
        stage=stage,
        dp=d,
        tp=t,
        machine=run.layout.machine(rank),
        last_stepped=ITERATION if survivor else -1,
        can_undo=survivor,
        holdings={BuddyHeld.NAME: BuddyHeld(copies=((buddy, ITERATION),), own=(ITERATION,)).to_doc()}
        if survivor
        else {},
    )


class _StoreSide:
    """The registry run_recovery asks, in the harness: the real consensus and choice of strategy,
    whose restore then does only what a replication or buddy restore asks of the job store (the
    donor's digest of what it sends, the replacement's check of it); the state moves on the
    transport, which is not measured here."""

    def __init__(self, run: _Run) -> None:
        self.run = run

    def choose(self, inputs: RecoveryInputs) -> tuple[RecoveryPlan, Any]:
        # This thread's CPU time, not the wall clock: here every simulated rank computes its consensus
        # at once under one GIL (the wall time of one is then about all of theirs); on a cluster each
        # rank computes its own on its own host.
        t0 = time.thread_time()
        plan, _ = STRATEGIES.choose(inputs)
        self.run.consensus_s.append(time.thread_time() - t0)
        self.run.plan = plan
        return plan, self

    def fall_back(self, inputs: RecoveryInputs, reason: str) -> tuple[RecoveryPlan, Any]:
        raise RuntimeError(f"the harness's recovery fell back: {reason}")

    def restore(self, plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> RecoveryOutcome:
        state = {"module": {"w": torch.zeros(4)}}
        for recipient, donor in plan.donors.items():
            if donor == ctx.rank:
                publish_reference(ctx, recipient, state)
        verdict = check_received(ctx, plan.donors[ctx.rank], state, "state") if ctx.rank in plan.donors else None
        return RecoveryOutcome(plan, plan.consensus + 1, verdict=verdict)


def _rounds(run: _Run, rank: int, generation: int, store: JobStore) -> None:
    """Every rank, joined into ``generation``: the recovery protocol (coordinator.run_recovery), rank
    0's ``resumed`` key, the post-recovery guard's reference and the timeline."""
    now = time.time()
    tl = RankTimeline(rank, "survivor" if rank not in run.lost else "replacement", 0, t_detect=now, t_rebuilt=now)
    guard = LossGuard(20, 2.0, rank, store)
    # a survivor's digest publisher lends what it wrote; the guard agrees its losses in the restore round
    lent = Handover(run.slots.get(rank), guard.rider(generation))
    ctx = RankContext(store, generation, rank, None, None, None, tl, TIMEOUT_S, verify=True, lent=lent)
    outcome = run_recovery(
        ctx,
        world_size=run.layout.ranks,
        report=_report(run, rank),
        strategy="auto",
        zero_stage=1,
        optimizer_wrapper=None,
        partitioned=True,
    )
    plan = outcome.plan
    if rank == 0:
        store.set(resumed_key(generation), "1")
    engine = SimpleNamespace(global_steps=plan.consensus + 1, skipped_steps=0)
    guard.after_recovery(engine, outcome, generation, run.layout.ranks, TIMEOUT_S, rank)
    tl.t_back = time.time()
    store.publish(generation, "timeline", rank, tl.to_json())
    if rank == 0:
        with contextlib.redirect_stdout(io.StringIO()):
            collect_timeline(
                store,
                generation=generation,
                world_size=run.layout.ranks,
                plan=plan,
                checkpoint_step=outcome.latest_checkpoint,
                run_dir=run.run_dir,
                inject_specs=0,
                block=True,
            )


def _survivor(run: _Run, rank: int, clients: dict[str, JobStore]) -> None:
    store, waiting = clients["detect"], clients["watchdog"]
    wd = Watchdog(
        lambda: waiting,
        rank,
        0,
        0.1,
        10.0,
        (),
        progress=Progress(),
        ranks_per_machine=PER_MACHINE,
        beat_file=BeatFile(run.run_dir, rank, 10.0),
    )
    conn: JobStore | None = waiting
    while not wd.failed.is_set():  # its thread's turn, blocked on the flag when the machine dies
        conn, _ = wd.turn(conn)
    FailedMachine(store, 0, 2.0)()  # before the join (ds_swift.runtime.teardown: the generation moved too)
    clients["join"].join(1, rank, run.layout.ranks, TIMEOUT_S)
    _rounds(run, rank, 1, clients["rounds"])


def _replacement(run: _Run, rank: int, clients: dict[str, JobStore]) -> None:
    time.sleep(REPLACEMENT_DELAY_S)
    store = run.stores.client("join")  # JobStore.from_env: the launch's token read
    store.join(1, rank, run.layout.ranks, TIMEOUT_S)  # its watchdog beats for its agent: no store
    _rounds(run, rank, 1, clients["rounds"])


def _guarded(run: _Run, fn: Any, rank: int, clients: dict[str, JobStore]) -> None:
    try:
        fn(run, rank, clients)
    except BaseException as exc:  # noqa: BLE001 - reported by the caller
        run.errors.append(exc)


def _watchdogs_waiting(run: _Run, survivors: list[threading.Thread]) -> None:
    """Start the survivors: each one's watchdog blocks on the failure flag, as it does while nothing
    fails. Those waits are the steady state's (benchmarks/scale_steady.py counts them): once every
    one is asked, they are taken off the count; what the watchdogs ask after the flag is set is the
    recovery's (a slice that timed out meanwhile, at most WAIT_SLICE_S, would be counted too)."""
    counting = run.stores.counting("watchdog")
    for t in survivors:
        t.start()
    deadline = time.monotonic() + TIMEOUT_S
    while counting.tally.calls["wait"] < len(survivors):
        if run.errors or time.monotonic() > deadline:
            raise RuntimeError(f"the survivors' watchdogs did not start waiting: {run.errors[:1]!r}")
        time.sleep(0.01)
    run.stores.take("watchdog")


def recovery(layout: Layout) -> dict[str, Any]:
    """Requests of one recovery by part (agents, ranks) and key family, its wall time here, and the
    consensus's CPU time per rank."""
    stores = StoreSet()
    run = _Run(layout, stores, layout.machines // 2, [], [], tempfile.mkdtemp(prefix="scale-timeline-"))
    job = _job(layout)
    agents = stores.client("detect")
    setup = stores.client("setup")
    digest = StateDigest(("w",), ("0" * 16,))
    for rank in range(layout.ranks):  # every rank beat once before the failure (replacements count on)
        setup.heartbeat(rank)
        # and published its digests while it trained (verify.digest_interval 10): its ring of slots
        run.slots[rank] = DigestSlots(rank)
        for iteration in range(0, ITERATION + 1, DIGEST_INTERVAL):
            publish_digest(setup, rank, iteration, DIGEST_INTERVAL, digest, run.slots[rank])
    for rank in run.lost:  # a replacement's process starts with nothing written: it reads its slots
        del run.slots[rank]
    spare = MachineAgent(layout.machines, job, agents, EventLog(None), spawn=_spawn, gpu_monitor=_HealthyGpus())
    # a rank's connection is its process's, opened before the failure (one per phase: counted apart;
    # its watchdog's own)
    clients = {r: {part: stores.client(part) for part in (*PHASES, "watchdog")} for r in range(layout.ranks)}
    for part in ("setup", "watchdog", *PHASES):
        stores.take(part)
    with quiet(), mock.patch.object(coordinator, "STRATEGIES", _StoreSide(run)):
        threads = {
            r: threading.Thread(
                target=_guarded, args=(run, _replacement if r in run.lost else _survivor, r, clients[r]), daemon=True
            )
            for r in range(layout.ranks)
        }
        _watchdogs_waiting(run, [threads[r] for r in range(layout.ranks) if r not in run.lost])
        t0 = time.monotonic()
        fate = MachineFate(run.failed_machine, job, agents, JobControl(agents), EventLog(None))
        fate.handle(run.failed_machine, f"machine {run.failed_machine}: rank died", time.time(), own=True)
        spare.poll_store()
        for r in run.lost:
            threads[r].start()
        for t in threads.values():
            t.join(TIMEOUT_S)
    wall_s = time.monotonic() - t0
    if run.errors or any(t.is_alive() for t in threads.values()):
        raise RuntimeError(f"the simulated recovery did not finish: {run.errors[:1]!r}")
    phases = {phase: stores.take(phase) for phase in PHASES}
    # what the survivors' watchdogs asked once the flag was set (their waits before: the steady state's)
    phases["detect"] = phases["detect"].merged(stores.take("watchdog"))
    total = phases["detect"].merged(phases["join"]).merged(phases["rounds"])
    return {
        "ranks": layout.ranks,
        "requests": total.total_requests,
        "bytes": total.total_bytes,
        "requests_per_rank": total.total_requests / layout.ranks,
        "phases": {
            phase: {"requests": t.total_requests, "bytes": t.total_bytes, "families": dict(t.requests.most_common())}
            for phase, t in phases.items()
        },
        "wall_s_here": wall_s,
        "replacement_delay_s": REPLACEMENT_DELAY_S,
        "consensus_cpu_s": max(run.consensus_s),
        "strategy": run.plan.strategy if run.plan is not None else None,
    }
