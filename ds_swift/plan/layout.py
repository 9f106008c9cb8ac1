"""Parallel layouts: where every rank sits in the 3D plan and on which machine.

:class:`ParallelLayout` is plain data (tensor/pipeline/data-parallel sizes, megatron-core's rank
order, ranks per machine). The converters read one from a running job: DeepSpeed's
``ProcessTopology`` (:func:`layout_from_deepspeed_topology`) or megatron-core's
``parallel_state`` (:func:`layout_from_parallel_state`, which recovers the rank order from one
rank's groups with :func:`infer_rank_order`); comparing the two cross-checks that DeepSpeed's
pipeline and megatron-core's model agree on who is who.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ds_swift.config import ConfigError

__all__ = [
    "Coord",
    "ParallelLayout",
    "infer_rank_order",
    "layout_from_deepspeed_topology",
    "layout_from_parallel_state",
    "positive_float",
    "positive_int",
]

_AXES = ("tp", "dp", "pp")
# megatron-core order tokens; cp and ep have size 1 in a layout (context parallelism is refused
# when reading parallel_state) and only need to be accepted in an order string.
_ORDER_TOKENS = ("tp", "dp", "pp", "cp", "ep")


def positive_int(name: str, value: Any) -> int:
    """``value`` if it is a positive int (not a bool), else a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} is invalid: a positive integer")
    return value


def positive_float(name: str, value: Any, *, allow_none: bool = True) -> float | None:
    """``value`` as a float if it is positive and finite (None passes if ``allow_none``)."""
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
            positive_int(name, getattr(self, name))
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
