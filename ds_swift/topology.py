"""Topology analyzer: what ds-swift does for a 3D-parallel plan, decided before the job starts.

Pure functions on data (no process group): given the tensor/pipeline/data-parallel sizes, the
rank order and the ranks per machine (:class:`ParallelLayout`), and optionally the model shape
(:class:`ModelShape`), :func:`analyze` returns a :class:`Plan`:

- the machine of every rank, and per pipeline stage a strategy (SWIFT section 3): a stage
  whose every rank has a data-parallel replica on another machine recovers by *replication*;
  else, with pipeline parallelism, by *logging* (if worth it, section 5.4); else from the
  global *checkpoint* only;
- the machine groups of selective logging (section 5.3) and the pipeline sends that cross a
  group boundary, which are logged by their sender, with their bytes per iteration;
- the "worth logging" verdict of section 5.4.

Bytes: per micro-batch, each logged stage boundary carries one activation forward and one
gradient backward of ``micro_batch_size * seq_len * hidden * dtype_bytes`` per sending TP rank
(Megatron sends the full hidden state from every TP rank) and per data-parallel replica.
GB are 1e9 bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from ds_swift import grouping
from ds_swift.config import ConfigError, SwiftConfig

__all__ = [
    "DTYPE_BYTES",
    "Coord",
    "Edge",
    "ModelShape",
    "ParallelLayout",
    "Plan",
    "analyze",
    "analyze_config",
    "infer_rank_order",
    "layout_from_deepspeed_topology",
    "layout_from_parallel_state",
]

StageStrategy = Literal["replication", "logging", "checkpoint"]
STRATEGIES = ("auto", "replication", "logging", "checkpoint")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_AXES = ("tp", "dp", "pp")
# megatron-core order tokens; cp and ep have size 1 in a layout (context parallelism is refused
# when reading parallel_state) and only need to be accepted in an order string.
_ORDER_TOKENS = ("tp", "dp", "pp", "cp", "ep")
GB = 1e9


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} is invalid: a positive integer")
    return value


def _positive_float(name: str, value: Any, *, allow_none: bool = True) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={value!r} is invalid: a positive finite number")
    return float(value)


class Coord(NamedTuple):
    """Position of a rank in the 3D plan."""

    tp: int
    pp: int
    dp: int


@dataclass(frozen=True)
class ParallelLayout:
    """Ranks over the 3D plan and over machines.

    ``order`` is megatron-core's ``RankGenerator`` order, first token fastest-varying: with
    ``"tp-dp-pp"`` (megatron's default) ``rank = tp + dp * TP + pp * TP * DP``. Rank ``r`` runs
    on machine ``r // gpus_per_node``, as the ``deepspeed`` launcher and torchrun place them.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    gpus_per_node: int = 8
    order: str = "tp-dp-pp"
    _axes: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _stride: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "gpus_per_node"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.order, str):
            raise ConfigError(f"order={self.order!r} is invalid: a rank order such as tp-dp-pp")
        tokens = self.order.lower().split("-")
        bad = [t for t in tokens if t not in _ORDER_TOKENS]
        if bad or len(set(tokens)) != len(tokens):
            raise ConfigError(
                f"order={self.order!r} is invalid: distinct tokens from {', '.join(_ORDER_TOKENS)} joined by '-', "
                "fastest-varying first (megatron-core's RankGenerator order), e.g. tp-dp-pp"
            )
        axes = [t for t in tokens if t in _AXES]
        for missing in (a for a in _AXES if a not in axes):
            # megatron appends an unnamed axis as the slowest one, but only if its size is 1
            if getattr(self, missing) != 1:
                raise ConfigError(
                    f"order={self.order!r} is invalid: it must name {missing} (size {getattr(self, missing)})"
                )
            axes.append(missing)
        stride, step = {}, 1
        for a in axes:
            stride[a] = step
            step *= getattr(self, a)
        object.__setattr__(self, "_axes", tuple(axes))
        object.__setattr__(self, "_stride", stride)
        world = self.world_size
        if world > self.gpus_per_node and world % self.gpus_per_node:
            raise ConfigError(
                f"tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = {world} ranks do not fill whole machines of "
                f"gpus_per_node={self.gpus_per_node}: make the world a multiple of gpus_per_node"
            )

    # ------------------------------------------------------------------ sizes
    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_machines(self) -> int:
        return -(-self.world_size // self.gpus_per_node)

    @property
    def axes(self) -> tuple[str, ...]:
        """``tp``/``dp``/``pp``, fastest-varying first."""
        return self._axes

    # ------------------------------------------------------------------ mapping
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")

    def machine_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.gpus_per_node

    def coords(self, rank: int) -> Coord:
        self._check_rank(rank)
        s = self._stride
        return Coord(
            tp=rank // s["tp"] % self.tp,
            pp=rank // s["pp"] % self.pp,
            dp=rank // s["dp"] % self.dp,
        )

    def rank(self, *, tp: int = 0, pp: int = 0, dp: int = 0) -> int:
        for name, value in (("tp", tp), ("pp", pp), ("dp", dp)):
            if not 0 <= value < getattr(self, name):
                raise ValueError(f"{name}={value} is outside 0..{getattr(self, name) - 1}")
        s = self._stride
        return tp * s["tp"] + pp * s["pp"] + dp * s["dp"]

    def stage_ranks(self, stage: int) -> list[int]:
        return sorted(self.rank(tp=t, pp=stage, dp=d) for t in range(self.tp) for d in range(self.dp))

    def dp_peers(self, rank: int) -> list[int]:
        """The other data-parallel replicas of ``rank`` (same stage, same TP rank)."""
        c = self.coords(rank)
        return [self.rank(tp=c.tp, pp=c.pp, dp=d) for d in range(self.dp) if d != c.dp]

    def machine_ranks(self, machine: int) -> list[int]:
        if not 0 <= machine < self.num_machines:
            raise ValueError(f"machine {machine} is outside 0..{self.num_machines - 1}")
        return list(range(machine * self.gpus_per_node, min((machine + 1) * self.gpus_per_node, self.world_size)))

    def to_json(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "order": "-".join(self._axes),
            "gpus_per_node": self.gpus_per_node,
            "world_size": self.world_size,
            "num_machines": self.num_machines,
        }


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
            _positive_int(name, getattr(self, name))
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype={self.dtype!r} is invalid: one of {', '.join(DTYPE_BYTES)}")
        if self.num_params is not None:
            _positive_int("num_params", self.num_params)
        _positive_float("state_bytes_per_param", self.state_bytes_per_param, allow_none=False)

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


@dataclass(frozen=True)
class Edge:
    """One pipeline send: activations forward (``act``) or gradients backward (``grad``)."""

    src_rank: int
    dst_rank: int
    src_stage: int
    dst_stage: int
    kind: Literal["act", "grad"]
    bytes_per_iteration: int


@dataclass(frozen=True)
class Plan:
    """What ds-swift does for one layout. Build it with :func:`analyze`."""

    layout: ParallelLayout
    shape: ModelShape | None
    strategy: str
    """The requested strategy (``auto`` or a forced one)."""
    stage_strategy: dict[int, StageStrategy]
    groups: list[list[int]]
    """Machine ids of each selective-logging group, in pipeline order."""
    logged_edges: list[Edge]
    worth_logging: tuple[bool, str]
    bubble_ratio: float | None
    grouping_method: str
    """``every-machine`` (no grouping), ``balanced`` (``groups=K``) or ``exact`` (budget)."""
    expected_recovery: float
    """The grouping objective of section 5.3, in ``recovery_units``."""
    recovery_units: str
    """``s`` when stage compute times were given or derived, else ``stage-iterations``."""
    candidate_log_bytes_per_iteration: int
    """What the grouping would log, before an ``auto`` "not worth it" verdict drops it."""
    greedy: grouping.Grouping | None = None
    exact: grouping.Grouping | None = None
    notes: tuple[str, ...] = ()
    _logged_pairs: frozenset[tuple[int, int]] = field(init=False, repr=False, compare=False)
    _group_of: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_logged_pairs", frozenset((e.src_rank, e.dst_rank) for e in self.logged_edges))
        object.__setattr__(self, "_group_of", {m: i for i, g in enumerate(self.groups) for m in g})

    def machine_of(self, rank: int) -> int:
        return self.layout.machine_of(rank)

    def group_of_machine(self, machine: int) -> int:
        try:
            return self._group_of[machine]
        except KeyError:
            raise ValueError(f"machine {machine} is outside 0..{self.layout.num_machines - 1}") from None

    def is_logged(self, src_rank: int, dst_rank: int) -> bool:
        """Whether the pipeline send ``src_rank -> dst_rank`` crosses a group boundary and is logged."""
        return (src_rank, dst_rank) in self._logged_pairs

    @property
    def log_bytes_per_iteration(self) -> int:
        return sum(e.bytes_per_iteration for e in self.logged_edges)

    def sender_bytes_per_iteration(self) -> dict[int, int]:
        """Logged bytes per iteration of each sending rank (the sender copies what it sends)."""
        out: dict[int, int] = {}
        for e in self.logged_edges:
            out[e.src_rank] = out.get(e.src_rank, 0) + e.bytes_per_iteration
        return out

    def boundaries(self) -> list[dict[str, Any]]:
        """Logged bytes per iteration across each boundary between consecutive groups."""
        out: dict[tuple[int, int], int] = {}
        for e in self.logged_edges:
            a, b = sorted(
                (self.group_of_machine(self.machine_of(e.src_rank)), self.group_of_machine(self.machine_of(e.dst_rank)))
            )
            out[(a, b)] = out.get((a, b), 0) + e.bytes_per_iteration
        return [{"groups": [a, b], "bytes_per_iteration": v} for (a, b), v in sorted(out.items())]

    def to_json(self) -> dict[str, Any]:
        lay, known = self.layout, self.shape is not None
        stages = [
            {
                "stage": s,
                "strategy": self.stage_strategy[s],
                "ranks": ranks,
                "machines": sorted({r // lay.gpus_per_node for r in ranks}),
            }
            for s, ranks in ((s, lay.stage_ranks(s)) for s in range(lay.pp))
        ]
        shape = (
            None
            if self.shape is None
            else {**dataclasses.asdict(self.shape), "message_bytes": self.shape.message_bytes}
        )
        found = {
            name: {
                "groups": len(g.groups),
                "expected_recovery": g.recovery_time,
                "log_bytes_per_interval": g.storage,
                "optimal": g.optimal,
            }
            for name, g in (("greedy", self.greedy), ("exact", self.exact))
            if g is not None
        }
        log = self.log_bytes_per_iteration
        return {
            "layout": lay.to_json(),
            "shape": shape,
            "strategy": self.strategy,
            "stages": stages,
            "groups": self.groups,
            "machine_of_rank": [r // lay.gpus_per_node for r in range(lay.world_size)],
            # bytes are unknown (None), not zero, without a model shape
            "log_bytes_per_iteration": log if known else None,
            "log_gb_per_iteration": round(log / GB, 2) if known else None,
            "candidate_log_bytes_per_iteration": self.candidate_log_bytes_per_iteration if known else None,
            "max_sender_bytes_per_iteration": max(self.sender_bytes_per_iteration().values(), default=0)
            if known
            else None,
            "logged_edges": len(self.logged_edges),
            "boundaries": self.boundaries(),
            "bubble_ratio": self.bubble_ratio,
            "worth_logging": {"value": self.worth_logging[0], "reason": self.worth_logging[1]},
            "grouping": {
                "method": self.grouping_method,
                "expected_recovery": self.expected_recovery,
                "recovery_units": self.recovery_units,
                **found,
            },
            "notes": list(self.notes),
        }


# ---------------------------------------------------------------------------- layouts from jobs
_DS_AXIS = {"pipe": "pp", "data": "dp", "model": "tp", "tensor": "tp"}


def layout_from_deepspeed_topology(topo: Any, gpus_per_node: int) -> ParallelLayout:
    """Layout of a DeepSpeed ``ProcessTopology`` (e.g. ``PipeModelDataParallelTopology``).

    DeepSpeed's axes are row-major (the *last* axis varies fastest): ``['pipe', 'data',
    'model']`` is megatron's ``tp-dp-pp``. Axes other than pipe/data/model must have size 1.
    """
    axes = list(topo.get_axis_names())
    sizes = {"tp": 1, "pp": 1, "dp": 1}
    order: list[str] = []
    for axis in axes:
        dim = int(topo.get_dim(axis))
        key = _DS_AXIS.get(axis)
        if key is None:
            if dim == 1:
                continue
            raise ConfigError(
                f"DeepSpeed topology axis {axis!r} (size {dim}) is not supported: ds-swift knows pipe, data, model"
            )
        if key in order:
            raise ConfigError(f"DeepSpeed topology has two axes for {key}: {axes}")
        sizes[key] = dim
        order.append(key)
    layout = ParallelLayout(gpus_per_node=gpus_per_node, order="-".join(reversed(order)) or "tp-dp-pp", **sizes)
    # Trust but verify: a subclass with its own mapping must agree with the order string.
    mapping = getattr(topo, "mapping", None)
    if isinstance(mapping, dict):
        for coord, rank in mapping.items():
            kw = {_DS_AXIS[a]: getattr(coord, a) for a in axes if a in _DS_AXIS}
            if layout.rank(**kw) != rank:
                raise ConfigError(
                    f"DeepSpeed topology maps {coord} to rank {rank}, not the row-major rank {layout.rank(**kw)}"
                )
    return layout


def infer_rank_order(rank: int, tp: int, pp: int, dp: int, groups: Mapping[str, Sequence[int]]) -> str:
    """The rank order (``tp-dp-pp`` etc.) under which ``rank``'s TP, PP and DP groups are ``groups``.

    megatron-core does not keep the order it was initialised with; one rank's own groups pin
    it down (axes of size 1 are interchangeable and resolved towards megatron's default).
    """
    world = tp * pp * dp
    for perm in ("tp-dp-pp", *("-".join(p) for p in itertools.permutations(_AXES) if "-".join(p) != "tp-dp-pp")):
        layout = ParallelLayout(tp=tp, pp=pp, dp=dp, gpus_per_node=world, order=perm)
        c = layout.coords(rank)
        mine = {
            "tp": [layout.rank(tp=t, pp=c.pp, dp=c.dp) for t in range(tp)],
            "pp": [layout.rank(tp=c.tp, pp=s, dp=c.dp) for s in range(pp)],
            "dp": [layout.rank(tp=c.tp, pp=c.pp, dp=d) for d in range(dp)],
        }
        if all(sorted(mine[a]) == sorted(groups[a]) for a in _AXES):
            return perm
    raise ConfigError(
        f"megatron-core groups of rank {rank} ({groups}) match no rank order of tp={tp}, pp={pp}, dp={dp}"
    )


def layout_from_parallel_state(gpus_per_node: int | None = None, parallel_state: Any = None) -> ParallelLayout:
    """Layout of the initialised megatron-core ``parallel_state`` of this process.

    ``gpus_per_node`` defaults to ``$LOCAL_WORLD_SIZE`` (set by torchrun and the launchers).
    Context parallelism is not supported (its ranks would need their own message logs).
    """
    import torch.distributed as dist

    ps = parallel_state
    if ps is None:
        import megatron.core.parallel_state

        ps = megatron.core.parallel_state
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("megatron-core parallel_state is not initialised: call initialize_model_parallel first")
    cp = int(ps.get_context_parallel_world_size()) if hasattr(ps, "get_context_parallel_world_size") else 1
    if cp != 1:
        raise ConfigError(f"context_parallel_size={cp} is not supported by ds-swift's planner (use 1)")
    tp = int(ps.get_tensor_model_parallel_world_size())
    pp = int(ps.get_pipeline_model_parallel_world_size())
    dp = int(ps.get_data_parallel_world_size())
    rank, world = dist.get_rank(), dist.get_world_size()
    if tp * pp * dp != world:
        raise ConfigError(
            f"megatron-core tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp} differs from the world size {world}"
        )
    groups = {
        "tp": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
        "pp": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
        "dp": dist.get_process_group_ranks(ps.get_data_parallel_group()),
    }
    if gpus_per_node is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            raise ConfigError("gpus_per_node is needed: pass it or set LOCAL_WORLD_SIZE")
        gpus_per_node = int(env)
    order = infer_rank_order(rank, tp, pp, dp, groups)
    return ParallelLayout(tp=tp, pp=pp, dp=dp, gpus_per_node=gpus_per_node, order=order)


# ---------------------------------------------------------------------------- analysis
def _units(layout: ParallelLayout, edges: Iterable[Edge]) -> list[list[int]]:
    """Runs of machines that selective logging treats as one (the chain of section 5.3).

    Normally every machine. When a pipeline send skips a machine (a stage's ranks span
    several machines), a group boundary may only fall where every stage lies wholly on one
    side, so that each send crosses at most one boundary and the chain's per-boundary bytes
    add up exactly.
    """
    n = layout.num_machines
    if all(abs(layout.machine_of(e.src_rank) - layout.machine_of(e.dst_rank)) <= 1 for e in edges):
        return [[m] for m in range(n)]
    lo = [min(layout.coords(r).pp for r in layout.machine_ranks(m)) for m in range(n)]
    hi = [max(layout.coords(r).pp for r in layout.machine_ranks(m)) for m in range(n)]
    units, current = [], [0]
    for m in range(1, n):
        if max(hi[:m]) < min(lo[m:]):
            units.append(current)
            current = []
        current.append(m)
    units.append(current)
    return units


def _stage_times(
    layout: ParallelLayout, shape: ModelShape | None, iteration_time_s: float | None, stage_compute_s: Any
) -> tuple[list[float], str]:
    p = layout.pp
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


def analyze(
    layout: ParallelLayout,
    shape: ModelShape | None = None,
    strategy: str = "auto",
    groups: int | None = None,
    storage_budget_gb: float | None = None,
    iteration_time_s: float | None = None,
    pcie_gbps: float | None = None,
    checkpoint_interval: int | None = None,
    stage_compute_s: float | Sequence[float] | None = None,
    *,
    network_gbps: float | None = None,
    parallel_recovery: bool = False,
) -> Plan:
    """Plan recovery for ``layout``.

    Args:
        layout: the 3D plan and its machines.
        shape: model shape; without it message sizes (and bytes) are unknown (0).
        strategy: ``auto``, or force ``replication`` / ``logging`` / ``checkpoint`` everywhere.
        groups: force this many balanced machine groups (selective logging).
        storage_budget_gb: instead of ``groups``, the log budget between two checkpoints (GB);
            the exact optimiser of :mod:`ds_swift.grouping` picks the groups.
        iteration_time_s: failure-free iteration time, for the bubble check of section 5.4.
        pcie_gbps: device-to-host bandwidth in GB/s (1e9 bytes/s), for the same check.
        checkpoint_interval: iterations between global checkpoints (needed with a budget).
        stage_compute_s: compute time per iteration of each stage (one number or one per
            stage) for the grouping objective; derived from ``iteration_time_s`` if absent.
        network_gbps: inter-machine bandwidth in GB/s for the ``M/B`` term (ignored if None).
        parallel_recovery: survivors share a failed group's replay (section 5.2).
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy={strategy!r} is invalid: one of {', '.join(STRATEGIES)}")
    if groups is not None:
        _positive_int("groups", groups)
        if storage_budget_gb is not None:
            raise ConfigError("groups and storage_budget_gb are both set: give one (groups forces K balanced groups)")
    budget = _positive_float("storage_budget_gb", storage_budget_gb)
    iteration_time = _positive_float("iteration_time_s", iteration_time_s)
    pcie = _positive_float("pcie_gbps", pcie_gbps)
    network = _positive_float("network_gbps", network_gbps)
    if checkpoint_interval is not None:
        _positive_int("checkpoint_interval", checkpoint_interval)
    lay, p = layout, layout.pp
    notes: list[str] = []

    # Replication: every rank of the stage has a data-parallel replica on another machine.
    replicated = [
        all(any(lay.machine_of(q) != lay.machine_of(r) for q in lay.dp_peers(r)) for r in lay.stage_ranks(s))
        for s in range(p)
    ]
    if strategy == "replication" and not all(replicated):
        s = replicated.index(False)
        raise ConfigError(
            f"strategy='replication' is impossible: stage {s} has no data-parallel replica on another machine"
        )
    if strategy == "logging" and p == 1:
        raise ConfigError("strategy='logging' needs pipeline parallelism (pp > 1): there are no pipeline sends to log")
    if strategy == "auto":
        candidates = {s for s in range(p) if not replicated[s]} if p > 1 else set()
    else:
        candidates = set(range(p)) if strategy == "logging" else set()

    # Cross-machine pipeline sends; a send is a logging candidate if its receiver may replay.
    msg = shape.message_bytes * shape.micro_batches if shape is not None else 0
    cross: list[Edge] = []
    for s in range(p - 1):
        for d in range(lay.dp):
            for t in range(lay.tp):
                a, b = lay.rank(tp=t, pp=s, dp=d), lay.rank(tp=t, pp=s + 1, dp=d)
                if lay.machine_of(a) != lay.machine_of(b):
                    cross.append(Edge(a, b, s, s + 1, "act", msg))
                    cross.append(Edge(b, a, s + 1, s, "grad", msg))
    candidate_edges = [e for e in cross if e.dst_stage in candidates]
    if strategy == "logging" and not candidate_edges:
        raise ConfigError("strategy='logging' is impossible: no pipeline send crosses a machine boundary")

    # The chain of section 5.3: per-unit compute time R and per-boundary bytes M.
    units = _units(lay, cross)
    unit_of = {m: i for i, u in enumerate(units) for m in u}
    times, rec_units = _stage_times(lay, shape, iteration_time, stage_compute_s)
    R = [
        math.fsum(times[s] for s in sorted({lay.coords(r).pp for m in u for r in lay.machine_ranks(m)})) for u in units
    ]
    M = [0.0] * (len(units) - 1)
    for e in candidate_edges:
        ua, ub = sorted((unit_of[lay.machine_of(e.src_rank)], unit_of[lay.machine_of(e.dst_rank)]))
        if ua != ub:
            M[ua] += e.bytes_per_iteration
    B = network * GB if network is not None else math.inf
    T = checkpoint_interval or 1
    greedy = exact = None
    if groups is not None:
        if groups > len(units):
            raise ConfigError(
                f"groups={groups} is invalid: at most {len(units)} (the machine runs that can be separated)"
            )
        chosen = grouping.evaluate(
            grouping.balanced_groups(len(units), groups), R, M, B=B, T=T, parallel_recovery=parallel_recovery
        )
        method = "balanced"
    elif budget is not None:
        if checkpoint_interval is None:
            raise ConfigError(
                "checkpoint_interval is needed with storage_budget_gb (the budget holds T iterations of logs)"
            )
        if shape is None:
            raise ConfigError(
                "storage_budget_gb needs the model shape (hidden, seq_len, micro_batch_size, micro_batches)"
            )
        greedy = grouping.greedy_merge(R, M, budget * GB, B, T, parallel_recovery)
        exact = grouping.exact_grouping(R, M, budget * GB, B, T, parallel_recovery)
        chosen, method = exact, "exact"
        if not exact.logs and any(M):
            notes.append(f"no grouping fits storage_budget_gb={budget:g}: one group, nothing logged")
        if exact.optimal is False:
            notes.append(
                "the exact optimiser stopped at its label cap: the grouping is the best found, not proven optimal"
            )
    else:
        chosen = grouping.evaluate(
            [[u] for u in range(len(units))], R, M, B=B, T=T, parallel_recovery=parallel_recovery
        )
        method = "every-machine"
    machine_groups = [sorted(m for u in g for m in units[u]) for g in chosen.groups]
    group_of = {m: i for i, g in enumerate(machine_groups) for m in g}

    def group(rank: int) -> int:
        return group_of[lay.machine_of(rank)]

    logged = [e for e in candidate_edges if group(e.src_rank) != group(e.dst_rank)]
    # A candidate stage recovers by logging if its group receives logged sends to replay from.
    receiving = {group(e.dst_rank) for e in logged}
    stage_strategy: dict[int, StageStrategy] = {}
    for s in range(p):
        if strategy == "checkpoint":
            stage_strategy[s] = "checkpoint"
        elif s in candidates and all(group(r) in receiving for r in lay.stage_ranks(s)):
            stage_strategy[s] = "logging"
        elif replicated[s] and strategy != "logging":
            stage_strategy[s] = "replication"
        else:
            stage_strategy[s] = "checkpoint"
    # Sends into a stage that ends up not replaying (part of it in a group with nothing to
    # replay from) would be logged for nobody.
    logged = [e for e in logged if stage_strategy[e.dst_stage] == "logging"]

    bubble = (p - 1) / (shape.micro_batches + p - 1) if shape is not None else None
    senders: dict[int, int] = {}
    for e in logged:
        senders[e.src_rank] = senders.get(e.src_rank, 0) + e.bytes_per_iteration
    verdict = _worth_logging(p, shape, logged, senders, bubble, iteration_time, pcie, checkpoint_interval)
    candidate_bytes = sum(e.bytes_per_iteration for e in logged)
    if strategy == "auto" and not verdict[0] and logged:
        stage_strategy = {s: ("checkpoint" if v == "logging" else v) for s, v in stage_strategy.items()}
        logged = []
    elif strategy == "logging" and not verdict[0]:
        notes.append("strategy='logging' overrides the verdict that logging is not worth it")
    return Plan(
        layout=lay,
        shape=shape,
        strategy=strategy,
        stage_strategy=stage_strategy,
        groups=machine_groups,
        logged_edges=logged,
        worth_logging=verdict,
        bubble_ratio=bubble,
        grouping_method=method,
        expected_recovery=chosen.recovery_time,
        recovery_units=rec_units,
        candidate_log_bytes_per_iteration=candidate_bytes,
        greedy=greedy,
        exact=exact,
        notes=tuple(notes),
    )


def analyze_config(layout: ParallelLayout, config: SwiftConfig, shape: ModelShape | None = None, **kwargs: Any) -> Plan:
    """:func:`analyze` with the strategy, groups / storage budget, checkpoint interval and
    parallel recovery of a ``swift`` config section; ``kwargs`` (timings) pass through."""
    return analyze(
        layout,
        shape,
        strategy=config.strategy,
        groups=config.logging.groups,
        storage_budget_gb=config.logging.storage_budget_gb,
        checkpoint_interval=config.checkpoint.interval,
        parallel_recovery=config.parallel_recovery,
        **kwargs,
    )


def _worth_logging(
    p: int,
    shape: ModelShape | None,
    logged: list[Edge],
    senders: dict[int, int],
    bubble: float | None,
    iteration_time: float | None,
    pcie: float | None,
    interval: int | None,
) -> tuple[bool, str]:
    """Section 5.4: can every sender copy its logs off the device within the bubbles, and is
    a log smaller than the checkpoint it saves us from writing?"""
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
            f"; logs held between checkpoints {total * interval / GB:.2f} GB (interval {interval})" if interval else ""
        )
        if total >= state:
            return False, (
                f"logs of {total / GB:.2f} GB per iteration are not smaller than the model state "
                f"({state / GB:.2f} GB): a checkpoint every iteration would write less{held}"
            )
        reasons.append(f"logs {total / GB:.2f} GB/iteration < model state {state / GB:.2f} GB{held}")
    assert bubble is not None  # set whenever shape is
    worst = max(senders.values())
    if iteration_time is None or pcie is None:
        missing = " and ".join(
            n for n, v in (("iteration time", iteration_time), ("PCIe bandwidth", pcie)) if v is None
        )
        reasons.append(
            f"bubble fit not checked ({missing} not given; {worst / GB:.3f} GB per sending GPU per iteration)"
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
