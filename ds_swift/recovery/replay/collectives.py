"""Collectives during a replay: recording a step's results in training, guarding them in replay.

A replayed stage runs its part of the schedule without the survivors. Collectives inside the
replayed group stay live. The optimizer step's collectives that reach over the whole pipeline
(DeepSpeed clips gradients by default and all-reduces the norm over the model-parallel group;
ZeRO and fp16/bf16 reduce an overflow flag) cannot be recomputed, but every member got the same
result: :class:`CollectiveRecorder` keeps those results in training on every rank, a survivor
hands them to the replacements, and :class:`CollectiveGuard` substitutes them during the replay.
Any other collective leaving the group is refused (it would wait forever on ranks not replaying).

This module is the protocol (which results, keyed how, when a substitute is allowed); the
wrapping of ``torch.distributed`` itself is done by ``ds_swift.patches.step_collectives``.
"""

from __future__ import annotations

import inspect
import io
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ds_swift.patches._base import PatchHandle
from ds_swift.patches.step_collectives import arg_reader, call_ranks, group_ranks, record_step_collectives
from ds_swift.recovery.replay.log import LogUnavailable
from ds_swift.recovery.replay.plan import unwrap_engine

__all__ = [
    "SUBSTITUTABLE",
    "CollectiveGuard",
    "CollectiveRecord",
    "CollectiveRecorder",
    "DoneWork",
    "ReplayUnsupported",
]


class ReplayUnsupported(RuntimeError):
    """This engine/group cannot be replayed from the log (a collective leaves the group, tied weights...)."""


#: collectives whose whole result is their (one, in-place) tensor: those a record can stand in for
SUBSTITUTABLE = ("all_reduce", "broadcast")


@dataclass(frozen=True)
class CollectiveRecord:
    """The result of one collective of an optimizer step: which, over which ranks, the tensor it left."""

    name: str
    ranks: tuple[int, ...]
    tensor: torch.Tensor


class CollectiveRecorder:
    """Records the results of the collectives every optimizer step issues (a few scalars per iteration).

    Gradient clipping (DeepSpeed's default: 1.0), ZeRO and fp16/bf16 reduce a norm or an overflow
    flag over the model-parallel group, i.e. every stage of the pipeline, inside the step. A replayed
    stage cannot recompute the survivors' shares of a lost iteration, but every member of the group
    received the same result: a survivor of the same pipeline replica hands its records to the
    replacements (:meth:`to_bytes`), and :func:`replay` uses them instead of waiting for ranks that
    are not replaying. Records are keyed by (iteration, position among the step's collectives).
    """

    HOOK_NAME = "ds_swift.collectives"

    def __init__(self, records: dict[tuple[int, int], CollectiveRecord] | None = None) -> None:
        self.records: dict[tuple[int, int], CollectiveRecord] = dict(records or {})
        self._iteration, self._thread, self._seq = -1, threading.get_ident(), 0
        self._ranks: dict[int, tuple[int, ...]] = {}

    def install(self, engine: Any) -> PatchHandle:
        """Record ``engine``'s optimizer-step collectives; returns the handle that stops it."""
        return record_step_collectives(unwrap_engine(engine), self.HOOK_NAME, self._make, self._begin_step)

    def _begin_step(self, eng: Any) -> None:
        # Only the training thread's collectives, numbered in call order within the step.
        self._iteration, self._thread, self._seq = int(eng.global_steps), threading.get_ident(), 0
        self._ranks = {}  # by group id, for this step only: no reference to a group outlives it

    def _make(self, name: str, fn: Callable[..., Any], sig: inspect.Signature) -> Callable[..., Any]:
        tensor_of, group_of, async_of = (arg_reader(sig, a) for a in ("tensor", "group", "async_op"))
        keep = name in SUBSTITUTABLE  # only results a record can stand in for; every call is numbered

        def call(*args: Any, **k: Any) -> Any:
            if threading.get_ident() != self._thread:
                return fn(*args, **k)
            n, self._seq = self._seq, self._seq + 1
            out = fn(*args, **k)
            if not keep:
                return out
            group = group_of(args, k)
            ranks = self._ranks.get(id(group))
            if ranks is None:
                ranks = self._ranks[id(group)] = group_ranks(group)
            if async_of(args, k) and out is not None:
                out.wait()  # NCCL: the current stream waits for the collective's, not the host
            # A copy where the tensor lives, on the current stream: a copy to the host here
            # would make the training thread wait for the GPU in the middle of every step.
            # Records leave the device only when they are sent (to_bytes).
            result = tensor_of(args, k).detach().clone()
            self.records[(self._iteration, n)] = CollectiveRecord(name, ranks, result)
            return out

        return call

    def discard_before(self, iteration: int) -> None:
        """Forget iterations before ``iteration`` (a global checkpoint of it completed)."""
        self.records = {k: v for k, v in self.records.items() if k[0] >= iteration}

    def to_bytes(self) -> bytes:
        rows = [(it, n, r.name, list(r.ranks), r.tensor.cpu()) for (it, n), r in sorted(self.records.items())]
        buf = io.BytesIO()
        torch.save(rows, buf)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> CollectiveRecorder:
        rows = torch.load(io.BytesIO(data), weights_only=True)
        return cls({(int(it), int(n)): CollectiveRecord(str(name), tuple(ranks), t) for it, n, name, ranks, t in rows})


class DoneWork:
    """What an ``async_op=True`` collective returns when its result came from a record."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class CollectiveGuard:
    """During replay: collectives inside the group run; a step's collective leaving it takes its recorded
    result; any other collective leaving it raises (it would wait forever on ranks that are not replaying)."""

    def __init__(self, group_ranks: frozenset[int], records: dict[tuple[int, int], CollectiveRecord] | None) -> None:
        self.group = group_ranks
        self.records = records
        self.thread = threading.get_ident()
        self.iteration = -1
        self.in_step = False
        self.seq = 0
        self.substituted = 0

    def begin_step(self, iteration: int) -> None:
        self.iteration, self.in_step, self.seq = iteration, True, 0

    def end_step(self) -> None:
        self.in_step = False

    def make(self, name: str, fn: Callable[..., Any], sig: inspect.Signature) -> Callable[..., Any]:
        def call(*args: Any, **kw: Any) -> Any:
            if threading.get_ident() != self.thread:
                return fn(*args, **kw)
            n = None
            if self.in_step:
                n, self.seq = self.seq, self.seq + 1
            try:
                bound, ranks = call_ranks(sig, args, kw)
            except Exception:  # noqa: BLE001 - an unknown group type: let the call decide
                return fn(*args, **kw)
            outside = sorted(set(ranks) - self.group)
            if not outside:
                return fn(*args, **kw)
            where = f"torch.distributed.{name} over ranks {list(ranks)} in iteration {self.iteration}"
            if n is None or name not in SUBSTITUTABLE:
                raise ReplayUnsupported(f"{where}: ranks {outside} are not replaying and would never join it")
            if self.records is None:
                raise ReplayUnsupported(
                    f"{where} (optimizer step collective #{n}): ranks {outside} are not replaying; pass a survivor's "
                    "CollectiveRecorder records to replay(collectives=...)"
                )
            rec = self.records.get((self.iteration, n))
            tensor = bound.arguments["tensor"]
            if rec is None:
                raise LogUnavailable(
                    f"{where}: no recorded result of optimizer step collective #{n}", iteration=self.iteration
                )
            # Shapes may differ between members (DeepSpeed's clip norm is () on one rank, (1,) on others).
            have = (rec.name, tuple(rec.ranks), rec.tensor.dtype, rec.tensor.numel())
            want = (name, tuple(ranks), tensor.dtype, tensor.numel())
            if have != want:
                raise LogUnavailable(
                    f"{where}: the record of step collective #{n} is {have}, this collective is {want}",
                    iteration=self.iteration,
                )
            with torch.no_grad():
                tensor.copy_(rec.tensor.reshape(tensor.shape))
            self.substituted += 1
            return DoneWork() if bound.arguments.get("async_op") else None

        return call
