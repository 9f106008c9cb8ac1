"""The replay's instruction hooks: which receives come from the log, which sends are dropped.

Per instruction of DeepSpeed's ``TrainSchedule`` on a replayed rank:

- ``RecvActivation`` / ``RecvGrad`` from a rank outside the group: DeepSpeed's handler runs with
  its receives served from the log record (iteration, micro-batch, edge); the first activation
  receive gets a synthesised tensor-meta message, exactly what ``_send_tensor_meta`` sent;
- ``SendActivation`` / ``SendGrad`` to a rank outside the group: the handler runs with its sends
  dropped (a message logger installed under it still re-logs the send: the failed machine's own
  log died with it);
- ``OptimizerStep``: brackets the step for the :class:`CollectiveGuard`, which substitutes the
  recorded results of the step's collectives that leave the group.

The p2p swaps themselves are ``ds_swift.patches.pipe_p2p``'s; the engine's handshake state and
metadata message ``ds_swift.patches.deepspeed_engine``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ds_swift.patches import deepspeed_engine
from ds_swift.patches.instructions import schedule
from ds_swift.patches.pipe_p2p import drop_sends, serve_recvs
from ds_swift.recovery.replay.collectives import CollectiveGuard
from ds_swift.recovery.replay.log import LogUnavailable, Message
from ds_swift.recovery.replay.plan import ReplayPlan, ReplayStats

__all__ = ["Replayer", "meta_message", "recv_from_log"]


def meta_message(engine: Any, msg: Message, what: str) -> torch.Tensor:
    """The tensor-meta message ``_send_tensor_meta`` sent before the first activation of an edge."""
    try:
        return deepspeed_engine.tensor_meta(engine, msg)
    except ValueError as exc:
        raise LogUnavailable(f"{what}: {exc}") from None


def recv_from_log(call_next: Callable[..., Any], kw: dict[str, Any], items: list[torch.Tensor], what: str) -> Any:
    """Run a DeepSpeed receive handler with its receives filled from ``items``, in order.

    Raises LogUnavailable when the handler receives more or fewer tensors than ``items``, or a
    buffer of another shape or dtype: the log does not hold what this stage expects.
    """
    pos = 0

    def fill(tensor: torch.Tensor) -> None:
        nonlocal pos
        if pos >= len(items):
            raise LogUnavailable(f"{what}: the stage receives more tensors than the log record holds")
        src = items[pos]
        pos += 1
        if tuple(tensor.shape) != tuple(src.shape) or tensor.dtype != src.dtype:
            raise LogUnavailable(
                f"{what}: tensor {pos - 1} of the log record is {src.dtype} {tuple(src.shape)}, "
                f"the receive buffer is {tensor.dtype} {tuple(tensor.shape)}"
            )
        tensor.copy_(src)

    with serve_recvs(fill):
        result = call_next(**kw)
    if pos != len(items):
        raise LogUnavailable(f"{what}: the log record holds {len(items)} tensors, the stage received {pos}")
    return result


class Replayer:
    """The instruction hooks of one replay: which receives come from the log, which sends are dropped."""

    def __init__(self, plan: ReplayPlan, stats: ReplayStats, guard: CollectiveGuard) -> None:
        self.plan = plan
        self.stats = stats
        self.guard = guard
        self.logged_kinds = {e.kind for e in plan.from_log}
        self.edge_of = {e.kind: e for e in plan.from_log}
        self.iteration = -1
        self.messages: dict[tuple[str, int], Message] = {}
        self.counters = {"act": 0, "grad": 0}

    def begin(self, iteration: int, messages: dict[tuple[str, int], Message]) -> None:
        self.iteration = iteration
        self.messages = dict(messages)
        self.counters = {"act": 0, "grad": 0}

    def end(self) -> None:
        for kind in self.logged_kinds:
            if self.counters[kind] != len(self.plan.mine):
                raise RuntimeError(
                    f"replay of iteration {self.iteration}: {self.counters[kind]} {kind} receives from the log, "
                    f"expected {len(self.plan.mine)}"
                )

    def _recv(self, kind: str) -> Callable[..., Any]:
        def hook(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
            if kind not in self.logged_kinds:
                self.stats.recvs_live += 1
                return call_next(**kw)
            mb = self.plan.mine[self.counters[kind]]
            self.counters[kind] += 1
            edge = self.edge_of[kind]
            what = f"iteration {self.iteration} micro-batch {mb} ({edge})"
            msg = self.messages.pop((kind, mb), None)
            if msg is None:
                raise LogUnavailable(
                    f"{what}: not read from the log", iteration=self.iteration, micro_batch=mb, edge=edge
                )
            items: list[torch.Tensor] = []
            if kind == "act":
                # A 1-tuple is logged as one record, like a bare tensor: the engine's buffer tells which.
                needs_meta, msg = deepspeed_engine.recv_needs_meta(eng, msg)
                if needs_meta:
                    items.append(meta_message(eng, msg, what))
            items += list(msg) if isinstance(msg, tuple) else [msg]
            self.stats.messages_from_log += 1
            return recv_from_log(call_next, kw, items, what)

        return hook

    def _send(self, kind: str) -> Callable[..., Any]:
        drop = self.plan.drop_act if kind == "act" else self.plan.drop_grad

        def hook(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
            if not drop:
                self.stats.sends_live += 1
                return call_next(**kw)
            try:
                # The survivor's rebuilt engine expects the tensor metadata with the first live
                # activation after recovery: keep "metadata not sent yet".
                with deepspeed_engine.keep_first_output_send(eng), drop_sends():
                    return call_next(**kw)
            finally:
                self.stats.sends_dropped += 1

        return hook

    def _step(self, eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
        self.guard.begin_step(int(eng.global_steps))
        try:
            return call_next(**kw)
        finally:
            self.guard.end_step()

    def hooks(self) -> dict[type, Callable[..., Any]]:
        return {
            schedule.OptimizerStep: self._step,
            schedule.RecvActivation: self._recv("act"),
            schedule.RecvGrad: self._recv("grad"),
            schedule.SendActivation: self._send("act"),
            schedule.SendGrad: self._send("grad"),
        }
