"""Per-stage choice between logging activations (SWIFT) and logging updates (TranLogs).

A pipeline stage without a data-parallel replica elsewhere is recovered from the global
checkpoint plus a replay of the iterations since. Two logs make that replay possible:

- **activation logging** (SWIFT section 5): the messages that cross into the stage's machines
  (activations forward, gradients backward), so the replacement *recomputes* each iteration;
  their bytes grow with the micro-batches, the sequence length and the data-parallel replicas;
- **update logging** (TranLogs): each step's update of the stage (its reduced gradient plus the
  step's scalars, which re-applies bitwise), so the replacement only *applies* them, no
  recompute; its bytes are the stage's parameters, once, whatever the batch.

:func:`choose_stage_logging` compares the two per stage, at machine granularity (every machine
its own logging group, SWIFT's per-machine setting): it takes the option with fewer bytes per
iteration, then, under a storage budget between two checkpoints, switches stages to the option
that replays faster while the total still fits, the largest replay time saved per extra byte
first. Example from the issue: a machine of 8 BERT-large layers (~100 M parameters) logs
~400 MB of fp32 updates per iteration against 537 MB of inbound boundary messages in SWIFT's
BERT-128 setting, so update logging is the cheaper one there.

At runtime the same choice is made per stage with ``logging.kinds: auto`` (or forced per stage
with a list), from the bytes the first iteration measured rather than from a model shape
(ds_swift.plan.stage_logging): the stages it assigns to update logging log their updates, the
others their inbound messages, in one job. ``"strategy": "tranlogs"`` logs updates everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from ds_swift.config import ConfigError
from ds_swift.plan.layout import ParallelLayout, positive_float
from ds_swift.plan.sizes import GB, ModelShape, pipeline_edges, stage_times

if TYPE_CHECKING:
    from ds_swift.plan.analysis import Plan

__all__ = ["StageLogChoice", "choose_for_plan", "choose_stage_logging", "print_choices", "stage_params_even"]

LogKind = Literal["activation", "update"]


@dataclass(frozen=True)
class StageLogChoice:
    """The two ways to log one stage, and the one chosen."""

    stage: int
    activation_bytes: int
    """Inbound cross-machine activations and gradients per iteration, every replica."""
    update_bytes: int
    """The stage's update per iteration (all its tensor-parallel shards, logged once)."""
    recompute_s: float | None
    """Replay time per iteration from activation logs (the stage's compute), if known."""
    apply_s: float | None
    """Replay time per iteration from update logs (reading them back), if known."""
    choice: LogKind
    reason: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def stage_params_even(num_params: int, pp: int) -> list[int]:
    """The model's parameters split evenly over ``pp`` stages (the remainder to the first ones)."""
    base, extra = divmod(num_params, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def choose_stage_logging(
    layout: ParallelLayout,
    shape: ModelShape,
    stages: Sequence[int],
    stage_params: Sequence[int],
    *,
    update_bytes_per_param: float = 4.0,
    stage_compute_s: Sequence[float] | None = None,
    read_gbps: float | None = None,
    storage_budget_gb: float | None = None,
    checkpoint_interval: int | None = None,
) -> list[StageLogChoice]:
    """Activation or update logging for each of ``stages`` (the ones recovered by logging).

    Args:
        layout: the 3D plan and its machines.
        shape: the model shape (message sizes).
        stages: the pipeline stages to choose for.
        stage_params: parameters of each pipeline stage (all ``pp`` of them, one replica).
        update_bytes_per_param: bytes logged per parameter and step: 4 for the fp32 reduced
            gradient that re-applies bitwise, 2 for a bf16 one.
        stage_compute_s: compute seconds per iteration of each stage (the recompute cost).
        read_gbps: bandwidth in GB/s at which a replacement reads logs back (the apply cost).
        storage_budget_gb: log bytes allowed between two checkpoints; needs ``checkpoint_interval``.
        checkpoint_interval: iterations between global checkpoints.
    """
    _check(
        layout,
        stages,
        stage_params,
        update_bytes_per_param,
        stage_compute_s,
        read_gbps,
        storage_budget_gb,
        checkpoint_interval,
    )
    inbound = {s: 0 for s in stages}
    for edge in pipeline_edges(layout, shape):
        if edge.dst_stage in inbound:
            inbound[edge.dst_stage] += edge.bytes_per_iteration
    rows: list[StageLogChoice] = []
    for s in stages:
        update = int(stage_params[s] * update_bytes_per_param)
        recompute = stage_compute_s[s] if stage_compute_s is not None else None
        apply = update / (read_gbps * GB) if read_gbps is not None else None
        if update < inbound[s]:
            kind: LogKind = "update"
            why = f"updates {update / GB:.3g} GB < inbound messages {inbound[s] / GB:.3g} GB per iteration"
        else:
            kind = "activation"
            why = f"inbound messages {inbound[s] / GB:.3g} GB <= updates {update / GB:.3g} GB per iteration"
        rows.append(StageLogChoice(s, inbound[s], update, recompute, apply, kind, why))
    if storage_budget_gb is not None and checkpoint_interval is not None:
        rows = _spend_budget_on_speed(rows, storage_budget_gb * GB / checkpoint_interval)
    return rows


def _bytes(row: StageLogChoice, kind: LogKind) -> int:
    return row.update_bytes if kind == "update" else row.activation_bytes


def _replay_s(row: StageLogChoice, kind: LogKind) -> float | None:
    return row.apply_s if kind == "update" else row.recompute_s


def _spend_budget_on_speed(rows: list[StageLogChoice], per_iteration: float) -> list[StageLogChoice]:
    """Switch stages to the faster-replaying option while the total bytes fit ``per_iteration``."""
    total = sum(_bytes(r, r.choice) for r in rows)
    if total > per_iteration:
        return [
            StageLogChoice(
                **{
                    **asdict(r),
                    "reason": r.reason + f"; even the cheaper logs exceed the budget "
                    f"({total / GB:.3g} > {per_iteration / GB:.3g} GB per iteration)",
                }
            )
            for r in rows
        ]
    swaps: list[tuple[float, int]] = []
    for i, r in enumerate(rows):
        other: LogKind = "activation" if r.choice == "update" else "update"
        now, then = _replay_s(r, r.choice), _replay_s(r, other)
        if now is None or then is None or then >= now:
            continue
        extra = _bytes(r, other) - _bytes(r, r.choice)
        swaps.append(((now - then) / max(extra, 1), i))
    out = list(rows)
    for _, i in sorted(swaps, reverse=True):
        r = out[i]
        other = "activation" if r.choice == "update" else "update"
        extra = _bytes(r, other) - _bytes(r, r.choice)
        if total + extra > per_iteration:
            continue
        total += extra
        why = (
            f"{other} logs replay faster ({_replay_s(r, other):.3g} s < {_replay_s(r, r.choice):.3g} s per "
            f"iteration) and the {extra / GB:.3g} GB more per iteration fit the storage budget"
        )
        out[i] = StageLogChoice(**{**asdict(r), "choice": other, "reason": why})
    return out


def _check(
    layout: ParallelLayout,
    stages: Sequence[int],
    stage_params: Sequence[int],
    update_bytes_per_param: float,
    stage_compute_s: Sequence[float] | None,
    read_gbps: float | None,
    storage_budget_gb: float | None,
    checkpoint_interval: int | None,
) -> None:
    if len(stage_params) != layout.pp:
        raise ConfigError(f"stage_params has {len(stage_params)} values: give one per stage (pp={layout.pp})")
    if stage_compute_s is not None and len(stage_compute_s) != layout.pp:
        raise ConfigError(f"stage_compute_s has {len(stage_compute_s)} values: give one per stage (pp={layout.pp})")
    for s in stages:
        if not 0 <= s < layout.pp:
            raise ConfigError(f"stage {s} is outside 0..{layout.pp - 1}")
    positive_float("update_bytes_per_param", update_bytes_per_param, allow_none=False)
    positive_float("read_gbps", read_gbps)
    positive_float("storage_budget_gb", storage_budget_gb)
    if storage_budget_gb is not None and checkpoint_interval is None:
        raise ConfigError("storage_budget_gb needs checkpoint_interval (the iterations the logs are held)")


def choose_for_plan(
    plan: Plan,
    *,
    iteration_time_s: float | None = None,
    stage_compute_s: float | Sequence[float] | None = None,
    read_gbps: float | None = None,
    storage_budget_gb: float | None = None,
    checkpoint_interval: int | None = None,
) -> list[StageLogChoice]:
    """:func:`choose_stage_logging` for the stages ``plan`` recovers by logging; empty without a
    model shape that gives the parameter count, or without such a stage."""
    shape = plan.shape
    stages = [s for s, v in sorted(plan.stage_strategy.items()) if v == "logging"]
    if shape is None or shape.num_params is None or not stages:
        return []
    times, unit = stage_times(plan.layout.pp, shape, iteration_time_s, stage_compute_s)
    return choose_stage_logging(
        plan.layout,
        shape,
        stages,
        stage_params_even(shape.num_params, plan.layout.pp),
        stage_compute_s=times if unit == "s" else None,
        read_gbps=read_gbps,
        storage_budget_gb=storage_budget_gb,
        checkpoint_interval=checkpoint_interval,
    )


def print_choices(rows: Sequence[StageLogChoice]) -> None:
    """A rich table of the choice per stage, saying what the runtime can do of it."""
    import sys

    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 120)
    table = Table(title="Per-stage log: activations (SWIFT) or fp32 updates (TranLogs), parameters split evenly")
    for col in ("stage", "activations / it", "updates / it", "recompute / it", "apply / it", "cheaper"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            str(r.stage),
            f"{r.activation_bytes / GB:.3g} GB",
            f"{r.update_bytes / GB:.3g} GB",
            "?" if r.recompute_s is None else f"{r.recompute_s:.3g} s",
            "?" if r.apply_s is None else f"{r.apply_s:.3g} s",
            r.choice,
        )
    console.print(table)
    for r in rows:
        console.print(f"stage {r.stage}: {r.choice} logging: {r.reason}")
    if any(r.choice == "update" for r in rows):
        console.print(
            'note: to log this mix at runtime set "logging": {"kinds": "auto"} (the runtime chooses from the bytes '
            "its first iteration measures, which may differ from these estimates) or a list of messages/updates "
            "per stage"
        )
