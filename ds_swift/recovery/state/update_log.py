"""TranLogs' update log: what re-applying one optimizer step needs, one record per rank and step.

After each optimizer step a rank records, from the update-undo record of that step
(ds_swift.undo.records.StepRecord), the gradient its torch optimizer read (ZeRO-1's fp32 gradient
partition, BF16_Optimizer's fp32 gradients, ``param.grad``: unscaled and clipped, as the step saw
it), each parameter group's hyper-parameters in force (lr, betas, FusedAdam's step...) and what the
step left in the engine (counters, LR scheduler, loss scaler). Re-applying it is calling the same
torch optimizer on the same inputs, so the result is bitwise that of the failure-free run: no
forward or backward pass is recomputed (TranLogs' recovery), against SWIFT's message log, which
re-executes the iterations. The bytes are the rank's gradient partition (4 bytes x parameters / dp)
per iteration, whatever the batch size (ds_swift.plan.update_logging compares the two per stage).

Records live in the log store (``logging.storage``), named ``upd_r<rank>_it<iteration>.pt``
(torch.save of plain data and tensors, loaded with ``weights_only=True``; the store keeps a
crc32c sidecar per object, so a corrupt or truncated record is refused, never applied). Recovery
(ds_swift.recovery.strategies.tranlogs): a lost rank's replacement loads the global checkpoint and re-applies
the records of its rank from the checkpoint's iteration to the consensus.
"""

from __future__ import annotations

import copy
import io
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ds_swift.patches.deepspeed_engine import restore_step_state, step_state

__all__ = [
    "UpdateLogError",
    "UpdateLogStore",
    "UpdateRecord",
    "capture_update",
    "load_record",
    "newest_in_run",
    "record_gradients",
    "record_name",
    "records_before",
    "redo_update",
    "restore_after",
    "save_record",
]

FORMAT = 1
_NAME = re.compile(r"^upd_r(\d{5})_it(\d{10})\.pt$")


class UpdateLogError(RuntimeError):
    """A step that cannot be recorded, or a record that cannot be re-applied (the message says why)."""


def record_name(rank: int, iteration: int) -> str:
    """The store name of ``rank``'s record of ``iteration``'s step."""
    return f"upd_r{rank:05d}_it{iteration:010d}.pt"


def parse_name(name: str) -> tuple[int, int] | None:
    """``(rank, iteration)`` of a record name; None for any other object of the store."""
    m = _NAME.match(os.path.basename(name))
    return (int(m.group(1)), int(m.group(2))) if m else None


def newest_in_run(stored: Callable[[int], bool], since: int) -> int:
    """The newest iteration ``n`` such that ``stored(i)`` for every ``since <= i <= n``, in O(log n)
    calls (``since - 1`` where ``since`` is not stored). A rank's records run without a gap from
    the newest complete checkpoint: older ones are deleted, newer ones stored in order (a logger
    that fails stops for good), so probing finds the newest without listing every rank's records."""
    if not stored(since):
        return since - 1
    lo, step = since, 1  # lo: stored
    while stored(lo + step):
        lo += step
        step *= 2
    hi = lo + step  # not stored
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if stored(mid):
            lo = mid
        else:
            hi = mid
    return lo


def records_before(names: Iterable[str], iteration: int) -> list[str]:
    """The records of steps before ``iteration`` (what a global checkpoint there makes unneeded)."""
    return [n for n in names if (p := parse_name(n)) is not None and p[1] < iteration]


@dataclass(frozen=True)
class UpdateLogStore:
    """Where this job's update log lives (``logging.storage``): what the runtime lends TranLogs at a
    recovery (``RankContext.lent``) where it logged the updates."""

    url: str


@dataclass
class UpdateRecord:
    """One rank's record of one optimizer step (plain data: see :func:`capture_update`)."""

    iteration: int
    skipped: bool
    groups: list[dict[str, Any]]
    """Per torch-optimizer call: ``group`` (index in ``param_groups``), ``hyper`` (its entries but
    ``params`` as the step saw them), ``kwargs`` (extra step arguments) and ``grads``: ``[(index of
    the parameter in the group, the gradient the step read)]``."""
    counters: dict[str, Any]
    """The engine's after the step (iterations, samples, skipped steps, the gradient norm)."""
    scheduler: dict[str, Any] | None
    scalars: dict[str, Any] | None
    """The optimizer wrapper's loss scaler and flags after the step (None: no wrapper)."""

    @property
    def nbytes(self) -> int:
        return sum(g.numel() * g.element_size() for grp in self.groups for _, g in grp["grads"])


def _index(items: list[Any], obj: Any, what: str) -> int:
    for i, item in enumerate(items):
        if item is obj:
            return i
    raise UpdateLogError(f"the step's {what} is not in the optimizer any more")


def _plain(value: Any) -> Any:
    """A hyper-parameter as plain data (tensors detached to the CPU)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, tuple | list):
        return type(value)(_plain(v) for v in value)
    return copy.deepcopy(value)


def capture_update(engine: Any, undo: Any) -> UpdateRecord:
    """The record of the step ``engine`` just took, from its update-undo handle ``undo``
    (ds_swift.undo.engine.EngineUndoHandle). On the training thread, before the next backward
    overwrites the gradients: the gradients are copied (to the CPU), everything else is scalars."""
    rec = undo.last_record
    if rec is None or rec.iteration != int(engine.global_steps) - 1:
        raise UpdateLogError(f"no update-undo record of iteration {int(engine.global_steps) - 1}")
    if not rec.complete:
        raise UpdateLogError(f"the step of iteration {rec.iteration} raised part-way")
    inner = undo.kind.inner
    groups = []
    for grec in rec.groups:
        params = grec.group["params"]
        grads = []
        for pr in grec.params:
            if pr.grad_mutated:
                raise UpdateLogError(
                    "the optimizer step writes into its gradients (torch's foreach SGD with nesterov): "
                    "the gradient it read is gone when the step ends"
                )
            g = pr.grad()
            if g is None:
                raise UpdateLogError(f"the gradient of the step of iteration {rec.iteration} is gone")
            grads.append((_index(params, pr.param, "parameter"), g.detach().to("cpu", copy=True)))
        groups.append(
            {
                "group": _index(inner.param_groups, grec.group, "parameter group"),
                "hyper": {k: _plain(v) for k, v in grec.hyper.items()},
                "kwargs": {k: _plain(v) for k, v in grec.call_kwargs.items()},
                "grads": grads,
            }
        )
    from ds_swift.patches.deepspeed_optim_state import optimizer_scalars

    sched = getattr(engine, "lr_scheduler", None)
    state = step_state(engine)  # micro_steps follows from global_steps; _step_applied is reset by every step
    counters = {n: int(state.get(n, 0)) for n in ("global_steps", "global_samples", "skipped_steps")}
    return UpdateRecord(
        iteration=rec.iteration,
        skipped=rec.skipped,
        groups=groups,
        counters={**counters, "_global_grad_norm": _plain(state.get("_global_grad_norm"))},
        scheduler=copy.deepcopy(sched.state_dict()) if sched is not None else None,
        scalars=None if engine.optimizer is inner else optimizer_scalars(engine.optimizer),
    )


def save_record(record: UpdateRecord, path: str | os.PathLike[str]) -> int:
    """Write ``record`` to the local file ``path``; returns its size in bytes."""
    data = {"format": FORMAT, **vars(record)}
    buf = io.BytesIO()
    torch.save(data, buf)
    with open(path, "wb") as f:
        f.write(buf.getbuffer())
    return buf.tell()


def load_record(store: Any, rank: int, iteration: int) -> UpdateRecord:
    """``rank``'s record of ``iteration`` from the log store, checked against its checksum.

    Raises UpdateLogError naming the record when it is missing, corrupt or of another format."""
    name = record_name(rank, iteration)
    with tempfile.TemporaryDirectory(prefix="ds-swift-upd-") as tmp:
        try:
            path = store.get_file(name, os.path.join(tmp, name))
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - missing, corrupt, unreadable: the same verdict
            raise UpdateLogError(f"update record {store.url}/{name}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UpdateLogError(f"update record {store.url}/{name} is not format {FORMAT}")
    data.pop("format")
    record = UpdateRecord(**data)
    if record.iteration != iteration:
        raise UpdateLogError(f"update record {store.url}/{name} holds iteration {record.iteration}")
    return record


def record_gradients(inner: torch.optim.Optimizer, record: UpdateRecord) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(parameter of inner, the gradient the step read)`` for every gradient ``record`` holds."""
    return [(inner.param_groups[call["group"]]["params"][i], g) for call in record.groups for i, g in call["grads"]]


def redo_update(inner: torch.optim.Optimizer, record: UpdateRecord) -> None:
    """Re-apply ``record``'s step to ``inner`` (the torch optimizer inside DeepSpeed's wrapper,
    holding the state after the previous step): each recorded call again, on the recorded
    gradients and hyper-parameters, through the optimizer class's own ``step`` (never a patched
    instance attribute). A skipped step (fp16 overflow) changes nothing here."""
    step = type(inner).step
    for call in record.groups:
        try:
            group = inner.param_groups[call["group"]]
        except IndexError:
            raise UpdateLogError(
                f"iteration {record.iteration}: the optimizer has no parameter group {call['group']}"
            ) from None
        params = group["params"]
        for p in params:
            p.grad = None
        for i, grad in call["grads"]:
            if i >= len(params) or params[i].shape != grad.shape:
                raise UpdateLogError(
                    f"iteration {record.iteration}: the recorded gradient {i} of group {call['group']} "
                    f"({tuple(grad.shape)}) does not fit the optimizer's parameters (a different partition layout?)"
                )
            params[i].grad = grad.to(params[i].device, params[i].dtype)
        group.update({k: _plain(v) for k, v in call["hyper"].items()})
        everything = inner.param_groups
        inner.param_groups = [group]  # as DeepSpeed's ZeRO steps one group at a time
        try:
            step(inner, **call["kwargs"])
        finally:
            inner.param_groups = everything
            for p in params:
                p.grad = None


def restore_after(engine: Any, record: UpdateRecord) -> None:
    """Leave ``engine`` as the step of ``record`` left it: counters, LR scheduler, loss scaler, flags."""
    from ds_swift.patches.deepspeed_optim_state import load_optimizer_scalars

    restore_step_state(engine, {n: _plain(v) for n, v in record.counters.items()}, realign_micro_steps=True)
    sched = getattr(engine, "lr_scheduler", None)
    if sched is not None and record.scheduler is not None:
        sched.load_state_dict(copy.deepcopy(record.scheduler))
    if record.scalars is not None:
        load_optimizer_scalars(engine.optimizer, record.scalars)
