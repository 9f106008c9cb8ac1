"""The digest publisher: every ``verify.digest_interval`` iterations, this rank's state digest goes to
the job store, where it outlives the rank (ds_swift.recovery.verify reads it to check a replay).

Off the critical path, as the buddy copier (ds_swift.protect.buddy): the optimizer step's hook
only takes references to the state's tensors (a copy of the module's buffers, which a forward pass
may change) and hands them to a background thread, which computes the digest on the tensors'
device (ds_swift.recovery.state.digest: integer sums, a few bytes per tensor come back) and stores it
through a store connection of its own. A digest that fails (the store unreachable for a moment) is
skipped, said loudly once per outage (a publish that succeeds again ends it): verification is a
safety net and must never stop training.

Before the next step changes the tensors, the digest must have read them:
- on a GPU the thread queues the digest's kernels on a side stream that first waits for the step
  (a CUDA event recorded after it), and the next step's stream waits for the digest's kernels by
  another event: the GPU orders the two, the training thread waits for neither (only, for the few
  milliseconds after a step, until the kernels are queued);
- on CPU the next step waits until the digest is done (normally long done by then).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ds_swift.background_thread import BackgroundThread
from ds_swift.jobstore.membership import JobStore
from ds_swift.logs import say
from ds_swift.protect.base import CostInputs, Protection, Site
from ds_swift.recovery.state.digest import digest_state, engine_state, named_tensors, start_digest
from ds_swift.recovery.verify import DigestSlots, publish_digest

__all__ = ["DigestPublisher"]


class DigestPublisher(Protection):
    """Publishes this rank's state digest after every ``interval``-th optimizer step (the protection
    ``digests``).

    Args:
        rank: this rank.
        interval: iterations between digests (``verify.digest_interval``).
        store_factory: opens the thread's own job-store connection (the training thread may sit in
            a store call of its own).
    """

    def __init__(self, rank: int, interval: int, store_factory: Callable[[], JobStore]) -> None:
        self.rank = rank
        self.interval = interval
        self._store_factory = store_factory
        # A digest that fails is said once per outage and skipped (a missing digest only makes a later
        # check fall back): the worker records it and goes on.
        self._worker: BackgroundThread[Any] = BackgroundThread(
            f"ds-swift-digest-{rank}", self._digest, on_error_hook=self._failed
        )
        self._store: JobStore | None = None
        self.slots = DigestSlots(rank)
        """What this process wrote in the rank's digest slots (lent to the recovery: ds_swift.recovery.verify)."""
        self._iteration = -1  # the digest in hand (the thread's)
        self._queued = threading.Event()
        """On a GPU: the last digest's kernels are queued (``_read`` then says when they are done)."""
        self._queued.set()
        self._read: Any = None
        self._side: Any = None
        self._on_gpu = False
        self._warned = False
        self.wait_s = 0.0
        """Time the training thread waited for a digest before a step."""
        self.handoff_s = 0.0
        """Time the training thread spent handing the state over (references, a copy of the buffers)."""
        self._site: Site | None = None

    name = "digests"
    label = "state digests"

    @classmethod
    def build(cls, site: Site) -> DigestPublisher | str:
        # Published digests check what is rebuilt without a donor (a replay, re-applied updates, a
        # state decoded from chunks), and what a donor sends (replication, buddy copies: the donor's
        # digest proves the transport, the lost rank's own the copy) or an elastic resize reshards.
        env = site.ctx.env
        if not site.cfg.verify.enabled:
            return "verify.enabled false"
        if not site.services.digests:
            return f"no recovery of strategy {site.cfg.strategy!r} checks against them"
        if env is None or site.ctx.store is None:
            return "no job store to publish them in (not started by ds-swift-launch)"
        made = cls(env.rank, site.cfg.verify.digest_interval, lambda: JobStore.from_env(env))
        made._site = site
        return made

    def start_generation(self, engine: Any) -> None:
        from ds_swift.patches.instructions import hook_instructions

        if self._site is not None:
            self._site.hooks.add(hook_instructions(engine, "ds_swift.digest", self.hooks()))

    def quiesce(self, timeout_s: float) -> None:
        if not self.wait(timeout_s) and self._site is not None:
            self._site.ctx.log("the state digest of the last step did not finish before the teardown")

    def usage(self) -> dict[str, Any]:
        return {"digest_wait_s": self.wait_s}  # what the training thread waited for: a digest still running

    def close(self, timeout_s: float) -> None:
        self.stop()

    def lent(self, kept: Any) -> DigestSlots:
        return self.slots  # the recovery's forget_from reads only the slots this process did not write

    def forget(self) -> None:
        self.slots.forget()  # renumbered: the slots of this rank number were another process's

    def cost_line(self, engine: Any, costs: CostInputs) -> str:
        from ds_swift.protect.costs import mb, timed

        seconds = timed(lambda: digest_state(costs.state), costs.device)
        where, wait = (
            ("in kernels on a side CUDA stream", "the training thread does not wait for them")
            if costs.device != "cpu"
            else ("in a background thread", "the next step waits only for one still running")
        )
        return (
            f"  state digests: every {self.interval} iteration(s), {seconds * 1e3:.1f} ms each {where} (measured "
            f"at start-up) = {seconds * 1e3 / self.interval:.2f} ms per iteration; reads {mb(costs.total_bytes)} "
            f"where it lives per digest, stores {16 * len(named_tensors(costs.state))} bytes in the job store; {wait}"
        )

    def hooks(self) -> dict[type, Callable[..., Any]]:
        """The optimizer-step hook (ds_swift.patches.instructions) that drives the publisher."""
        from ds_swift.patches.instructions import schedule

        def step(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
            self.before_step()
            out = call_next(**kw)
            self.after_step(eng)
            return out

        return {schedule.OptimizerStep: step}

    @property
    def published(self) -> int:
        return self._worker.stats.items

    @property
    def digest_s(self) -> float:
        """Time the thread spent computing and storing digests."""
        return self._worker.stats.busy_s

    def after_step(self, engine: Any) -> None:
        """Hand the state after the step just taken (iteration ``global_steps - 1``) to the thread."""
        iteration = int(engine.global_steps) - 1
        if iteration % self.interval:
            return
        t0 = time.perf_counter()
        state = engine_state(engine)
        params = {n for n, _ in engine.module.named_parameters()}
        # Buffers may change in a forward pass (running statistics): digest a copy of them.
        state["module"] = {
            k: v.clone() if isinstance(v, torch.Tensor) and k not in params else v for k, v in state["module"].items()
        }
        stepped = None
        device = _device_of(state)
        self._on_gpu = device is not None
        if device is not None:
            stepped = torch.cuda.Event()
            stepped.record(torch.cuda.current_stream(device))
            self._queued.clear()
        if not self._worker.submit((iteration, state, device, stepped)):
            self._queued.set()  # stopped (the job ended): nothing for the next step to wait for
        self.handoff_s += time.perf_counter() - t0

    def before_step(self) -> None:
        """Before a step changes the tensors: on a GPU its stream waits (on the device) for the last
        digest's kernels; on CPU this thread waits for the digest."""
        t0 = time.perf_counter()
        if not self._on_gpu:
            self._worker.wait_idle()
        else:
            self._queued.wait()  # the kernels are queued a few ms after the step
            read = self._read
            if read is not None:
                torch.cuda.current_stream(read[0]).wait_event(read[1])
        self.wait_s += time.perf_counter() - t0

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until the last digest is done (before the tensors change: the next step, an undo). False
        if ``timeout_s`` passed first."""
        t0 = time.perf_counter()
        done = self._worker.wait_idle(timeout_s)
        self.wait_s += time.perf_counter() - t0
        return done

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the thread (the job ends) after the digest in flight, and say what the digests cost."""
        self._worker.stop(timeout_s)
        if self.published:
            say(
                f"state digests: {self.published} published, {1e3 * self.digest_s / self.published:.2f} ms each "
                f"in the background; the training thread spent {1e3 * self.handoff_s / self.published:.2f} ms each "
                f"handing them over and waited {1e3 * self.wait_s:.1f} ms for them in all",
                self.rank,
                name=__name__,
            )

    def _digest(self, item: tuple[int, Any, Any, Any]) -> None:
        self._iteration, state, device, stepped = item
        try:
            finish = self._start(state, device, stepped)
            self._store = self._store or self._store_factory()
            publish_digest(self._store, self.rank, self._iteration, self.interval, finish(), self.slots)
        finally:
            self._queued.set()
        if self._warned:
            # The outage is over: a later one is said again, not lost behind this one's warning.
            self._warned = False
            say(f"state digests are published again (iteration {self._iteration})", self.rank, name=__name__)

    def _failed(self, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            say(
                "state digests are not being published: a recovery's restored state will be unverified: "
                f"the digest of iteration {self._iteration} not published ({type(exc).__name__}: {exc})",
                self.rank,
                level=logging.WARNING,
                name=__name__,
            )

    def _start(self, state: Any, device: Any, stepped: Any) -> Callable[[], Any]:
        """Queue the digest's device work (on a GPU: on the side stream, after the step's event)."""
        if device is None:
            return start_digest(state)
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        with torch.cuda.device(device), torch.cuda.stream(self._side):
            self._side.wait_event(stepped)
            finish = start_digest(state)
            read = torch.cuda.Event()
            read.record(self._side)
        self._read = (device, read)
        self._queued.set()
        return finish


def _device_of(state: Any) -> torch.device | None:
    """The CUDA device of a state's tensors (None: on the host, where the digest runs on the thread)."""
    for t in named_tensors(state).values():
        if t.device.type == "cuda":
            return t.device
    return None
