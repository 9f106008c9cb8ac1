"""Analytic sizes and times of a plan: pipeline messages, stage times, the section 5.4 verdict.

Bytes: per micro-batch, each logged stage boundary carries one activation forward and one
gradient backward of ``micro_batch_size * seq_len * hidden * dtype_bytes`` per sending TP rank
(Megatron sends the full hidden state from every TP rank) and per data-parallel replica.
GB are 1e9 bytes. A running engine knows no model shape (the DeepSpeed config has no hidden
size or sequence length): it measures the bytes it logged per send instead
(:class:`MeasuredSizes`), and either sizes a plan (:class:`Sizing`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ds_swift.config import ConfigError
from ds_swift.plan.layout import ParallelLayout, positive_float, positive_int

__all__ = [
    "DTYPE_BYTES",
    "GB",
    "Edge",
    "MeasuredSizes",
    "ModelShape",
    "Sizing",
    "bubble_ratio",
    "pipeline_edges",
    "sender_bytes",
    "stage_times",
    "worth_logging",
]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GB = 1e9


@dataclass(frozen=True)
class ModelShape:
    """What sets the size of a pipeline message (section 5.4)."""

    hidden: int
    seq_len: int
    micro_batch_size: int
    micro_batches: int
    """Micro-batches per iteration (gradient accumulation steps)."""
    dtype: str = "fp32"
    """Activation dtype: fp32, bf16 or fp16."""
    num_params: int | None = None
    """Parameters of the whole model, when known: sets the model-state size of section 5.4."""
    state_bytes_per_param: float = 16.0
    """Model-state bytes per parameter: 16 for mixed-precision Adam (fp16/bf16 weights and
    gradients, fp32 master weights and two moments)."""

    def __post_init__(self) -> None:
        for name in ("hidden", "seq_len", "micro_batch_size", "micro_batches"):
            positive_int(name, getattr(self, name))
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype={self.dtype!r} is invalid: one of {', '.join(DTYPE_BYTES)}")
        if self.num_params is not None:
            positive_int("num_params", self.num_params)
        positive_float("state_bytes_per_param", self.state_bytes_per_param, allow_none=False)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def message_bytes(self) -> int:
        """One activation (or gradient) of one micro-batch, from one TP rank."""
        return self.micro_batch_size * self.seq_len * self.hidden * self.dtype_bytes

    @property
    def model_state_bytes(self) -> int | None:
        return None if self.num_params is None else int(self.num_params * self.state_bytes_per_param)


class Sizing(Protocol):
    """What sizes a plan beyond its sends' bytes: a :class:`ModelShape` or :class:`MeasuredSizes`."""

    @property
    def micro_batches(self) -> int: ...

    @property
    def model_state_bytes(self) -> int | None: ...


@dataclass(frozen=True)
class MeasuredSizes:
    """Log bytes per iteration of each cross-machine send, as a running engine measured them.

    Build with :meth:`from_reports` (one report per rank) or :meth:`from_json`; every rank that
    builds it from the same reports gets the same value, so the plan it sizes is the same.
    """

    edge_bytes: tuple[tuple[int, int, int], ...]
    """``(src_rank, dst_rank, bytes)`` per measured send, sorted: what the sender wrote to its log
    (records with their headers) in the measured iteration."""
    micro_batches: int
    """Micro-batches per iteration (gradient accumulation steps)."""
    iteration: int
    """The iteration measured."""
    iteration_time_s: float | None = None
    """Its wall-clock time (the slowest rank's)."""
    num_params: int | None = None
    """Parameters of the whole model (one data-parallel replica, every stage and TP shard)."""
    state_bytes_per_param: float = 16.0
    """Model-state bytes per parameter (as :attr:`ModelShape.state_bytes_per_param`)."""
    stage_params: tuple[int, ...] = ()
    """Parameters of each pipeline stage (one data-parallel replica); empty: not measured."""
    update_bytes: tuple[int, ...] = ()
    """Update-log bytes each stage wrote in the measured iteration (every rank of it), where it
    logged its updates (ds_swift.protect.update_logger); empty or 0: not measured."""
    copy_gbps: float | None = None
    """Device-to-host copy bandwidth in GB/s measured at start-up (the slowest rank's); None on
    CPU, where a logged tensor is never copied off a device."""

    def __post_init__(self) -> None:
        positive_int("micro_batches", self.micro_batches)
        positive_float("copy_gbps", self.copy_gbps)
        positive_float("iteration_time_s", self.iteration_time_s)
        if self.num_params is not None:
            positive_int("num_params", self.num_params)
        for src, dst, nbytes in self.edge_bytes:
            if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
                raise ConfigError(f"measured bytes of send {src}->{dst}={nbytes!r} is invalid: an integer >= 0")

    @property
    def model_state_bytes(self) -> int | None:
        return None if self.num_params is None else int(self.num_params * self.state_bytes_per_param)

    def bytes_of(self, src_rank: int, dst_rank: int) -> int:
        """Bytes per iteration of the send ``src_rank -> dst_rank`` (0 if it was not measured)."""
        return self._by_pair.get((src_rank, dst_rank), 0)

    @functools.cached_property
    def _by_pair(self) -> dict[tuple[int, int], int]:
        return {(s, d): b for s, d, b in self.edge_bytes}

    @classmethod
    def from_reports(cls, reports: Iterable[Mapping[str, Any]], micro_batches: int) -> MeasuredSizes:
        """Merge one report per rank: ``{"rank", "iteration", "sends": [[dst, bytes], ...],
        "seconds", "params"}`` (``params``: its parameters where it counts toward the model,
        i.e. on data-parallel rank 0, else 0), optionally ``"stage"`` (its pipeline stage: the
        parameters and ``"update_bytes"`` add up per stage) and ``"copy_gbps"``."""
        reports = list(reports)
        iterations = {int(r["iteration"]) for r in reports}
        if len(iterations) != 1:
            raise ValueError(f"the ranks measured different iterations: {sorted(iterations)}")
        edges = sorted((int(r["rank"]), int(dst), int(b)) for r in reports for dst, b in r["sends"])
        seconds = [float(r["seconds"]) for r in reports if r.get("seconds")]
        params = sum(int(r.get("params") or 0) for r in reports)
        staged = [r for r in reports if r.get("stage") is not None]
        pp = max((int(r["stage"]) for r in staged), default=-1) + 1
        stage_params, update_bytes = [0] * pp, [0] * pp
        for r in staged:
            stage_params[int(r["stage"])] += int(r.get("params") or 0)
            update_bytes[int(r["stage"])] += int(r.get("update_bytes") or 0)
        copies = [float(r["copy_gbps"]) for r in reports if r.get("copy_gbps")]
        return cls(
            tuple(edges),
            micro_batches,
            iterations.pop(),
            max(seconds, default=None),
            params or None,
            stage_params=tuple(stage_params),
            update_bytes=tuple(update_bytes) if any(update_bytes) else (),
            copy_gbps=min(copies, default=None),
        )

    def stage_state_bytes(self, stage: int) -> int | None:
        """Model-state bytes of ``stage`` (what a checkpoint of it writes), if its parameters were measured."""
        if stage >= len(self.stage_params) or not self.stage_params[stage]:
            return None
        return int(self.stage_params[stage] * self.state_bytes_per_param)

    def stage_update_bytes(self, stage: int) -> int | None:
        """Update-log bytes per iteration of ``stage``, if it logged its updates when measured."""
        if stage >= len(self.update_bytes) or not self.update_bytes[stage]:
            return None
        return self.update_bytes[stage]

    def to_json(self) -> dict[str, Any]:
        return {
            "edge_bytes": [list(e) for e in self.edge_bytes],
            "micro_batches": self.micro_batches,
            "iteration": self.iteration,
            "iteration_time_s": self.iteration_time_s,
            "num_params": self.num_params,
            "state_bytes_per_param": self.state_bytes_per_param,
            "stage_params": list(self.stage_params),
            "update_bytes": list(self.update_bytes),
            "copy_gbps": self.copy_gbps,
        }

    @classmethod
    def from_json(cls, js: Mapping[str, Any]) -> MeasuredSizes:
        edges = tuple((int(s), int(d), int(b)) for s, d, b in js["edge_bytes"])
        return cls(
            edges,
            int(js["micro_batches"]),
            int(js["iteration"]),
            js.get("iteration_time_s"),
            js.get("num_params"),
            float(js.get("state_bytes_per_param", 16.0)),
            stage_params=tuple(int(x) for x in js.get("stage_params", ())),
            update_bytes=tuple(int(x) for x in js.get("update_bytes", ())),
            copy_gbps=js.get("copy_gbps"),
        )


@dataclass(frozen=True)
class Edge:
    """One pipeline send: activations forward (``act``) or gradients backward (``grad``)."""

    src_rank: int
    dst_rank: int
    src_stage: int
    dst_stage: int
    kind: Literal["act", "grad"]
    bytes_per_iteration: int


def pipeline_edges(
    layout: ParallelLayout, shape: ModelShape | None, measured: MeasuredSizes | None = None
) -> list[Edge]:
    """Every pipeline send that crosses a machine boundary, both directions, with its bytes
    per iteration: from the model shape, else as measured, else 0."""
    lay = layout
    msg = shape.message_bytes * shape.micro_batches if shape is not None else 0

    def size(src: int, dst: int) -> int:
        return measured.bytes_of(src, dst) if measured is not None else msg

    cross: list[Edge] = []
    for s in range(lay.pp - 1):
        for d in range(lay.dp):
            for t in range(lay.tp):
                a, b = lay.rank(tp=t, pp=s, dp=d), lay.rank(tp=t, pp=s + 1, dp=d)
                if lay.machine_of(a) != lay.machine_of(b):
                    cross.append(Edge(a, b, s, s + 1, "act", size(a, b)))
                    cross.append(Edge(b, a, s + 1, s, "grad", size(b, a)))
    return cross


def bubble_ratio(pp: int, micro_batches: int) -> float:
    """Idle fraction ``(p-1)/(m+p-1)`` of a 1F1B iteration of ``pp`` stages and ``m`` micro-batches."""
    return (pp - 1) / (micro_batches + pp - 1)


def sender_bytes(edges: Iterable[Edge]) -> dict[int, int]:
    """Bytes per iteration that each sending rank of ``edges`` copies (the sender logs what it sends)."""
    out: dict[int, int] = {}
    for e in edges:
        out[e.src_rank] = out.get(e.src_rank, 0) + e.bytes_per_iteration
    return out


def stage_times(
    pp: int, shape: Sizing | None, iteration_time_s: float | None, stage_compute_s: Any
) -> tuple[list[float], str]:
    """Compute time per iteration of each stage, and its unit, for the grouping objective.

    Given times win; else they are derived from the iteration time; else every stage counts 1
    (unit ``stage-iterations``), which still ranks groupings by how much they replay.
    ``stage_compute_s`` is one number or an iterable of one per stage (a bool is neither).
    """
    p = pp
    if stage_compute_s is not None:
        if isinstance(stage_compute_s, (int, float)) and not isinstance(stage_compute_s, bool):
            times = [float(stage_compute_s)] * p
        else:
            times = [float(t) for t in stage_compute_s]
            if len(times) != p:
                raise ConfigError(
                    f"stage_compute_s has {len(times)} values: give one per stage (pp={p}) or a single number"
                )
        for t in times:
            if not (math.isfinite(t) and t >= 0):
                raise ConfigError(f"stage_compute_s value {t!r} is invalid: a finite number of seconds >= 0")
        return times, "s"
    if iteration_time_s is not None and shape is not None:
        # A stage is busy for m of the m + p - 1 slots of a 1F1B iteration.
        m = shape.micro_batches
        return [iteration_time_s * m / (m + p - 1)] * p, "s"
    return [1.0] * p, "stage-iterations"


def worth_logging(
    p: int,
    shape: Sizing | None,
    logged: Sequence[Edge],
    iteration_time: float | None,
    pcie: float | None,
    interval: int | None,
) -> tuple[bool, str]:
    """Section 5.4: can every sender copy its logs off the device within the bubbles, and is
    a log smaller than the checkpoint it saves us from writing?

    Args:
        p: pipeline stages.
        shape: model shape or measured sizes; without either nothing is sized and logging is
            assumed worth it.
        logged: the sends that would be logged.
        iteration_time: failure-free iteration time in seconds, or None (fit not checked).
        pcie: device-to-host bandwidth in GB/s, or None (fit not checked).
        interval: iterations between global checkpoints, for the bytes held, or None.
    """
    if p == 1:
        return False, "no pipeline parallelism (pp=1): there are no pipeline sends to log"
    if not logged:
        return False, "no pipeline send crosses a logging-group boundary outside replicated stages"
    if shape is None:
        return True, "model shape unknown: log size and bubble fit not checked (assumed worth it)"
    total = sum(e.bytes_per_iteration for e in logged)
    reasons: list[str] = []
    state = shape.model_state_bytes
    if state is not None:
        held = (
            f"; logs held between checkpoints {total * interval / GB:.3g} GB (interval {interval})" if interval else ""
        )
        if total >= state:
            return False, (
                f"logs of {total / GB:.3g} GB per iteration are not smaller than the model state "
                f"({state / GB:.3g} GB): a checkpoint every iteration would write less{held}"
            )
        reasons.append(f"logs {total / GB:.3g} GB/iteration < model state {state / GB:.3g} GB{held}")
    bubble = bubble_ratio(p, shape.micro_batches)
    worst = max(sender_bytes(logged).values())
    if iteration_time is None or pcie is None:
        missing = " and ".join(
            n for n, v in (("iteration time", iteration_time), ("PCIe bandwidth", pcie)) if v is None
        )
        timed = f", iteration time {iteration_time:.3g} s" if iteration_time is not None else ""
        reasons.append(
            f"bubble fit not checked ({missing} not given; {worst / GB:.3g} GB per sending GPU per iteration{timed})"
        )
        return True, "; ".join(reasons)
    capacity = bubble * iteration_time * pcie * GB
    fits = worst <= capacity
    reasons.insert(
        0,
        f"{worst / GB:.3f} GB per sending GPU per iteration {'fits' if fits else 'does not fit'} in the bubbles: "
        f"{bubble:.3f} x {iteration_time:g} s x {pcie:g} GB/s = {capacity / GB:.3f} GB",
    )
    return fits, "; ".join(reasons)
