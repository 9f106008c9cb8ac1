"""The buddy copier: after every optimizer step (or every ``buddy.interval``-th), this rank's optimizer
partition goes to its buddies.

What is copied: everything the rank's optimizer wrapper holds of its partition (fp32 masters, the
inner optimizer's state, loss scaler, flags: ds_swift.patches.deepspeed_optim_state), the LR
scheduler, the engine's counters and the module's non-parameter buffers, as a tensor-only payload
(JSON manifest + tensors, ds_swift.recovery.state.transfer.encode). Who holds whose copy:
ds_swift.recovery.state.buddies.assign_buddies.

Off the critical path: the step's hook only hands references to a background thread, which first
stages the state into host memory of its own (the rank's *own copy*, the newest two kept) and then
sends the staged tensors on the copier channel of ds-swift's transport, a gloo group of its own
(``isend``/``irecv``: the transfer runs in gloo's threads) while the next iteration's forward and backward passes run. A buddy receives into
a spare buffer and keeps the newest two complete copies per owner, so a copy being overwritten is
never reported as complete.

How often: after every step, or after the steps of every ``buddy.interval``-th iteration; under
``"auto"`` (the default) every step for the first rounds of a generation, then the interval rank 0
chooses from the step time it measured, carried to every rank by the round's landing
(ds_swift.protect.buddy_interval).

When a round has landed: after its receives, each rank writes its key for the round in the job store
(its own connection: a blocking wait must not hold up the heartbeats); the leader waits for every
rank's key and marks the round done, the others wait for that key (StoreLanding), so ``landed`` says that every rank's copy of the
step is held (not only that this rank's copy has left). Not a collective on the copier's group: a
rank tearing down after a failure must be able to destroy that group at once, and a gloo barrier in
flight held its destruction up for the op timeout. The next optimizer step waits for it (normally
long done by then): no rank is ever more than one step ahead of any copy.

Why the own copy: a failure between a step and the landing of its round can find a lost rank's copy
one step behind, and the survivors that took the step must go back to the iteration before it.
Update-undo's inverse arithmetic gets there only to within 2 ulp (rounding in the forward step merges
neighbouring pre-images: measured on a 120k-element AdamW partition, 4% of the masters and 27% of
``exp_avg`` are not recovered bit for bit), and the job would then go on from a state the
failure-free run never had. The own copy of the previous step is still complete at that moment (a
step waits for the previous round, and staging the next round fills the older of the two buffers),
so the survivor takes it back bitwise (:meth:`BuddyHoldings.own_state`, used by
``ds_swift.recovery.kept.KeptState.undo_to``). It costs two more copies of the partition in host
memory and one host copy per step on the copier thread; on a GPU that copy is the device-to-host
staging gloo needs anyway.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ds_swift import transport
from ds_swift.background_thread import BackgroundThread, OnError
from ds_swift.jobstore.membership import JobStore
from ds_swift.logs import say, say_here
from ds_swift.patches.deepspeed_optim_state import is_partitioned
from ds_swift.plan.buddy_cost import copies_kept
from ds_swift.protect.base import CostInputs, Protection, Site
from ds_swift.protect.buddy_holdings import BuddyHoldings, StoreLanding, stage
from ds_swift.protect.buddy_interval import DECIDE_AFTER, PERIOD_S, AutoInterval, decided
from ds_swift.protect.buddy_payload import round_bytes, state_payload
from ds_swift.recovery.base import loud
from ds_swift.recovery.holdings import BuddyHeld, buddy_held
from ds_swift.recovery.kept import KeptState
from ds_swift.recovery.state.buddies import Member, assign_buddies
from ds_swift.recovery.state.erasure import assign_holders, split_payload
from ds_swift.recovery.state.transfer import encode, flat_sizes, flat_views

__all__ = ["BuddyCopier", "partition_copies"]

_HEADER, _MANIFEST, _DATA = 1, 2, 16  # message tags; buffer (or chunk tensor) i of a payload uses _DATA + i


class _CopierRounds:
    """One generation's copier: its group, placement, queue and thread (a stale thread of a failed
    generation only ever touches its own worker)."""

    def __init__(
        self,
        channel: transport.Transport | None,
        buddies: tuple[int, ...],
        owners: tuple[int, ...],
        holdings: BuddyHoldings,
        split: Callable[[bytes, list[torch.Tensor]], list[tuple[bytes, list[torch.Tensor]]]] | None = None,
        landing: StoreLanding | None = None,
        auto: AutoInterval | None = None,
    ) -> None:
        self.channel = channel
        """The generation's transport (its copier channel); None once stopped."""
        self.landing = landing
        self.stopped = False
        self.split = split
        self.buddies = buddies
        self.owners = owners
        self.holdings = holdings
        self.landed = threading.Event()
        """Every rank's copy of the last round is held (the round's closing barrier passed)."""
        self.landed.set()
        self.rounds = 0
        self.bytes_sent = 0
        self.auto = auto
        """The leader's measurements under ``buddy.interval: "auto"`` (None on the other ranks)."""
        self.decided: int | None = None
        """The interval "auto" chose, from a round's ``done`` key (the training thread adopts it)."""
        # A round that fails stops the copier; the training thread turns copying off, loudly, at its
        # next step (BuddyCopier._turn_off): a copier error must not end a healthy job.
        self.worker: BackgroundThread[tuple[int, bytes, list[torch.Tensor], Any, float]] = BackgroundThread(
            "ds-swift-buddy", self._one, on_error=OnError.STOP, on_error_hook=lambda exc: self.landed.set()
        )
        self.worker.start()

    @property
    def error(self) -> BaseException | None:
        """What ended the copier (handed to the training thread at its next step)."""
        return self.worker.error

    def _one(self, item: tuple[int, bytes, list[torch.Tensor], Any, float]) -> None:
        sent = self._round(*item)
        self.rounds += 1
        if self.rounds == 2:  # the first round after a step: what every later one costs
            say_here(
                f"{'buddy copies' if self.split is None else 'erasure-coded chunks'}: {sent} bytes per "
                f"copy to rank(s) {list(self.buddies)} (iteration {item[0]})",
                name=__name__,
            )

    def _round(
        self, version: int, manifest: bytes, live: list[torch.Tensor], ready: Any = None, submitted: float = 0.0
    ) -> int:
        t = self.channel
        if t is None:
            raise transport.TransportError("ds-swift buddy copier: stopped before its round began")
        isend = functools.partial(t.isend, channel=transport.COPIER)
        irecv = functools.partial(t.irecv, channel=transport.COPIER)
        tensors, flats = stage(self.holdings, version, manifest, live, ready)
        # One part per buddy: the same payload for each (buddy copies: its flat buffers, one message
        # per dtype instead of one per tensor), or chunk j for the j-th (pipechurn's erasure coding,
        # done here on the copier thread).
        parts = (
            self.split(manifest, tensors)
            if self.split is not None
            else [(manifest, _in_order(manifest, flats))] * len(self.buddies)
        )
        sends, sent, alive = [], 0, []
        for buddy, (m, ts) in zip(self.buddies, parts, strict=True):
            header = torch.tensor([version, len(m)], dtype=torch.int64)
            blob = torch.frombuffer(bytearray(m), dtype=torch.uint8)
            alive += [header, blob]  # until the sends are done
            sends += [isend(header, buddy, tag=_HEADER), isend(blob, buddy, tag=_MANIFEST)]
            sends += [isend(x, buddy, tag=_DATA + i) for i, x in enumerate(ts)]
            sent += blob.numel() + sum(x.numel() * x.element_size() for x in ts)
        headers = {o: torch.zeros(2, dtype=torch.int64) for o in self.owners}
        _wait([irecv(h, o, tag=_HEADER) for o, h in headers.items()])
        blobs = {o: torch.empty(int(h[1]), dtype=torch.uint8) for o, h in headers.items()}
        _wait([irecv(b, o, tag=_MANIFEST) for o, b in blobs.items()])
        received, works = [], []
        for o, b in blobs.items():
            theirs = b.numpy().tobytes()
            flats = self.holdings.spare(o, theirs)
            into = flat_views(theirs, flats) if self.split is not None else _in_order(theirs, flats)
            works += [irecv(v, o, tag=_DATA + i) for i, v in enumerate(into)]
            received.append((o, int(headers[o][0]), theirs, flats))
        _wait(sends)
        del alive
        self.bytes_sent += sent
        _wait(works)
        for owner, v, theirs, flats in received:
            self.holdings.put(owner, v, theirs, flats)
        if self.landing is None:
            self.landed.set()
            return sent
        note = self.auto.before_landing(version, submitted) if self.auto is not None else None
        if self.landing(version, lambda: self.stopped, note or "1"):
            if self.auto is not None:
                self.auto.after_landing(submitted, time.perf_counter())
            chosen = decided(self.landing.done_value)
            if chosen is not None:
                self.decided = chosen
                if self.auto is not None:
                    say_here(
                        f"buddy copies: every {chosen} iteration(s) from iteration {version + 1} on (buddy.interval "
                        f"auto: {self.auto.why}); a failure trains again at most the {chosen - 1} iteration(s) before the one "
                        "it interrupts",
                        name=__name__,
                    )
            self.landed.set()
        return sent


class BuddyCopier(Protection):
    """Keeps this rank's optimizer partition on its buddies; holds its owners' copies (the protection
    ``buddy``: buddy copies, or PipeChurn's erasure-coded chunks of the whole state).

    Args:
        factor: buddies per rank (``buddy.replication_factor``).
        failure_domains: machines that fail together (``machines.failure_domains``).
        interval: copy after the steps of iterations divisible by it only (``buddy.interval``), and
            at :meth:`start`; None: ``"auto"``, chosen in each generation from the measured step time
            (ds_swift.protect.buddy_interval).
    """

    def __init__(
        self,
        factor: int,
        failure_domains: tuple[tuple[int, ...], ...],
        erasure: tuple[int, int] | None = None,
        interval: int | None = 1,
    ) -> None:
        self.factor = factor if erasure is None else sum(erasure)
        self.erasure = erasure
        self.auto = interval is None
        self.interval = 1 if interval is None else interval
        """Iterations between rounds in force (under "auto": 1 until the leader's choice lands)."""
        self.failure_domains = failure_domains
        self.holdings = BuddyHoldings()
        self._worker: _CopierRounds | None = None
        self.off: str | None = None
        """Why copying stopped in this generation (a copier error), or None while it protects."""
        self.wait_s = 0.0
        """Time the training thread waited for a round's sends before a step (the overhead)."""
        self._site: Site | None = None  # where it was built (:meth:`build`): what a generation's start needs

    name = "buddy"
    label = "buddy copies"

    @classmethod
    def build(cls, site: Site) -> BuddyCopier | str:
        cfg, services = site.cfg, site.services
        if services.erasure_chunks:  # the same copier, sending erasure-coded chunks
            copier = cls(
                1, cfg.machines.failure_domains, erasure=(cfg.pipechurn.data_chunks, cfg.pipechurn.parity_chunks)
            )
        elif not cfg.buddy.enabled:
            return "buddy.enabled false"
        elif not services.buddy_copies:
            if site.ctx.env is None or site.ctx.env.rank == 0:
                # A strategy that never reads buddy copies does not pay for them.
                site.ctx.log(
                    f"buddy copies off: strategy {cfg.strategy!r} does not use them (set strategy auto to use them)"
                )
            return f"strategy {cfg.strategy!r} does not use them"
        else:
            copier = cls(cfg.buddy.replication_factor, cfg.machines.failure_domains, interval=cfg.buddy.fixed_interval)
        copier._site = site
        return copier

    def start_generation(self, engine: Any) -> None:
        """Start copying this rank's state to its buddies after every step (collective: every rank)."""
        from ds_swift.patches.instructions import hook_instructions, schedule

        site = self._site
        env = site.ctx.env if site is not None else None
        if site is None or env is None:
            return
        generation = site.generation()

        def landing(world: int) -> StoreLanding:
            return StoreLanding(JobStore.from_env(env), generation, world)

        if not self.start(engine, site.machine(), landing if site.ctx.store is not None else None):
            return
        check = site.check_after_receive

        def step(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
            self.before_step(check)
            out = call_next(**kw)
            self.after_step(eng)
            return out

        site.hooks.add(hook_instructions(engine, "ds_swift.buddy", {schedule.OptimizerStep: step}))

    def quiesce(self, timeout_s: float) -> None:
        self.stop()  # a round a failure cut short fails with its group: it is not waited for

    def held(self, kept: KeptState | None) -> BuddyHeld:
        k = self.erasure[0] if self.erasure is not None else 0
        return buddy_held(self.holdings, kept.own_copies if kept is not None else (), k)

    def forget(self) -> None:
        self.holdings = BuddyHoldings()

    def usage(self) -> dict[str, Any]:
        return {
            "buddy_bytes_sent": self.bytes_sent,
            "buddy_host_bytes": self.holdings.nbytes(),
            "buddy_off": self.off,  # a copier error stopped the copies
            "buddy_wait_s": self.wait_s,  # what the training thread waited for: the last round to land
        }

    def close(self, timeout_s: float) -> None:
        # Every rank ends its last round (peers send theirs anyway): no exit inside a gloo op.
        if not self.stop(finish_s=timeout_s) and self._site is not None:
            self._site.ctx.log(f"buddy copies: the last round did not finish within {timeout_s:g} s")

    def cost_line(self, engine: Any, costs: CostInputs) -> str:
        if costs.machines == 1:
            return "  buddy copies: none (one machine: no other machine to hold them): 0"
        from ds_swift.protect.costs import mb

        part, counted = round_bytes(engine)
        every = int(self.interval)
        per = part * self.factor // every
        when = "after every step" if every == 1 else f"after every {every}th step ({part * self.factor} bytes each)"
        if self.auto:
            when += (
                f" for the first {DECIDE_AFTER} rounds, then every k-th (buddy.interval auto: k of 1, 2, 5, 10, ... "
                f"from the step time rank 0 measures, at least {PERIOD_S:g} s between rounds; said when chosen)"
            )
        return (
            f"  buddy copies: {mb(per)} ({per} bytes) per iteration sent to {self.factor} buddy rank(s) on other "
            f"machines {when} in a background thread ({counted}; the training thread waits only if the "
            "previous round is still sending; measured totals at the end)"
        )

    @property
    def buddies(self) -> tuple[int, ...]:
        return self._worker.buddies if self._worker is not None else ()

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank sent to its buddies in this generation."""
        return self._worker.bytes_sent if self._worker is not None else 0

    @property
    def rounds(self) -> int:
        return self._worker.rounds if self._worker is not None else 0

    def start(self, engine: Any, machine: int, landing: Callable[[int], StoreLanding] | None = None) -> bool:
        """Collective on every rank of the generation: place the buddies (an all-gather of every
        rank's coordinates), send the current state on the transport's copier channel. False (and nothing started) where the optimizer state is not
        partitioned: a replica then holds it whole (erasure coding copies it whatever the layout).

        ``landing(world)``: the store round that says when every rank's copies are held (None: only
        this rank's own receives count, for runs without a job store)."""
        if self.erasure is None and not is_partitioned(engine.optimizer):
            return False  # the same answer on every rank (one config): no rank enters the all-gather
        grid = engine.grid
        tp = grid.get_slice_parallel_rank() if hasattr(grid, "get_slice_parallel_rank") else 0
        me = torch.tensor(
            [dist.get_rank(), machine, int(engine.stage_id), int(grid.get_data_parallel_id()), int(tp)],
            dtype=torch.int64,
        )
        channel = transport.current()
        table = [torch.zeros_like(me) for _ in range(dist.get_world_size())]
        channel.all_gather(table, me)
        members = [Member(*(int(x) for x in t)) for t in table]
        split = None
        if self.erasure is None:
            placement = assign_buddies(members, self.factor, self.failure_domains)
        else:
            placement = assign_holders(members, *self.erasure, self.failure_domains)
            split = functools.partial(_erasure_parts, *self.erasure)
        rank = dist.get_rank()
        owners = tuple(sorted(o for o, bs in placement.items() if rank in bs))
        landed = landing(dist.get_world_size()) if landing is not None else None
        auto = AutoInterval() if self.auto and landed is not None and landed.rank == StoreLanding.LEADER else None
        self._worker = _CopierRounds(channel, placement[rank], owners, self.holdings, split, landed, auto)
        self.off = None
        what = "buddy copies" if self.erasure is None else "erasure-coded chunks (k={}, r={})".format(*self.erasure)
        every = f", after the steps of every {self.interval}th iteration" if self.interval > 1 else ""
        if self.auto:
            self.interval = 1
            every = (
                f", after every step for {DECIDE_AFTER} rounds, then at the interval rank 0 chooses from the "
                "measured step time (buddy.interval auto)"
                if landed is not None
                else ", after every step (buddy.interval auto needs the job store to agree on an interval)"
            )
        say(
            f"{what}: rank(s) {list(placement[rank])} hold mine; I hold those of {list(owners)}{every}",
            rank,
            name=__name__,
        )
        self.after_step(engine, always=True)
        return True

    def before_step(self, check: Callable[[], None] | None = None) -> None:
        """The optimizer step is about to change the tensors the last round stages: wait until that
        round has landed everywhere (``landed``; normally long done by then).

        ``check`` raises if the generation failed meanwhile; it is called every 0.1 s of waiting. A
        round sending to a dead holder waits for gloo's op timeout, and so would training: the
        failure flag ends the wait as soon as the job knows."""
        self._wait(lambda w: w.landed, check)
        w = self._worker
        if self.auto and w is not None and w.decided is not None:
            self.interval = w.decided  # the same round on every rank: each adopts it before this step

    def _wait(self, event: Callable[[_CopierRounds], threading.Event], check: Callable[[], None] | None) -> None:
        w = self._worker
        if w is None:
            return
        t0 = time.perf_counter()
        while not event(w).wait(0.1):
            if check is not None:
                check()
        self.wait_s += time.perf_counter() - t0
        if w.error is not None:
            if check is not None:
                check()  # the generation failed: that, not the copier, is what the job must act on
            self._turn_off(w, w.error)

    def _turn_off(self, w: _CopierRounds, error: BaseException) -> None:
        """A copier error (a slow round past its group's op timeout, say) is not the job's: copying
        stops for this generation and the job trains on without it, said loudly (the next recovery
        starts copying again). Raised on the training thread, it would end a healthy job."""
        self._worker = None
        w.stopped, w.channel = True, None
        self.off = f"{type(error).__name__}: {str(error)[:200]}"
        if isinstance(w.landing, StoreLanding):
            try:
                w.landing.turn_off(f"rank {dist.get_rank() if dist.is_initialized() else -1}: {self.off}")
            except Exception:  # noqa: BLE001 - the peers' copiers then stop on their own op timeout
                pass
        loud(
            dist.get_rank() if dist.is_initialized() else -1,
            f"BUDDY COPIES OFF: the copier failed ({self.off}); training goes on WITHOUT buddy copies of this "
            "rank's optimizer partition until the next recovery (a failure meanwhile recovers from older copies "
            "or the global checkpoint)",
        )

    def after_step(self, engine: Any, always: bool = False) -> None:
        """Hand this rank's state after the step just taken (iteration ``global_steps - 1``) to the
        copier thread, if that iteration is a multiple of the interval (or ``always``); returns at once."""
        w = self._worker
        if w is None:
            return
        version = int(engine.global_steps) - 1
        if not always and version % self.interval:
            return
        manifest, tensors = state_payload(engine)
        ready = None
        if any(t.is_cuda for t in tensors):  # the copier's side stream starts after the step's kernels
            ready = torch.cuda.Event()
            ready.record()
        w.landed.clear()
        if not w.worker.submit((version, manifest, tensors, ready, time.perf_counter())):
            w.landed.set()  # the copier stopped on an error: the next step's wait reports it

    def stop(self, finish_s: float = 0.2) -> bool:
        """Let go of the generation's thread and group, after at most ``finish_s`` for the round in
        flight (a round a failure cut short fails with the group; the copies already complete stay
        in :attr:`holdings`). True when the thread ended: at the end of training, the process must
        not exit while it is inside a gloo op (the C++ runtime aborts the process)."""
        w, self._worker = self._worker, None
        if w is None:
            return True
        w.stopped = True
        ended = w.worker.stop(timeout_s=finish_s)
        w.channel = None
        return ended


def partition_copies(cfg: Any, engine: Any) -> bool:
    """Whether the copier keeps every rank's optimizer state on other machines (buddy copies of a
    partitioned state, or PipeChurn's chunks): the topology analyzer then logs nothing for a stage
    those copies restore (ds_swift.plan.analysis.analyze)."""
    return copies_kept(cfg, is_partitioned(getattr(engine, "optimizer", None)))


def _in_order(manifest: bytes, flats: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
    """A payload's flat buffers in the order both ends derive from its manifest (what goes on the wire)."""
    return [flats[d] for d in flat_sizes(manifest)]


def _erasure_parts(
    k: int, r: int, manifest: bytes, tensors: list[torch.Tensor]
) -> list[tuple[bytes, list[torch.Tensor]]]:
    """Holder j's part of one round: chunk j of the payload, as a payload of its own."""
    return [encode(record) for record in split_payload(manifest, tensors, k, r)]


def _wait(works: list[Any]) -> None:
    for w in works:
        if w is not None:  # None only for a rank outside the group, which none of ours is
            w.wait()
