"""What parallel recovery's copy engine needs from DeepSpeed's pipeline internals.

A survivor helping with parallel recovery hosts a *copy* of a failed stage: a second DeepSpeed
``PipelineEngine`` in the same process, over a topology in which it and the stage's replacement
trade pipeline coordinates. Three DeepSpeed internals are involved:

- ``deepspeed.runtime.pipe.p2p._grid`` and ``deepspeed.utils.groups.mpu`` are module globals
  holding *the* pipeline grid of the process; building the copy repoints them at the copy's grid,
  and the copy's sends must go through its own grid while it replays. :func:`pipeline_globals`
  points them at a grid (or just keeps them) and its handle puts back what was there.
- ``PipelineModule._partition_layers`` decides which layers a stage holds; the copy must hold
  exactly the layers of the original stage, whatever the partition method would decide now.
  :func:`copy_pipeline_module` builds the copy through a subclass that overrides it (the class
  itself is not touched).
- ``ProcessTopology.mapping`` (coordinate -> rank): :func:`swapped_topology` renames ranks in it.

Pinned to ``SUPPORTED_DEEPSPEED`` (ds_swift.patches._base).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ds_swift.patches._base import SUPPORTED_DEEPSPEED, PatchError, PatchHandle, check_deepspeed

__all__ = ["SUPPORTED_DEEPSPEED", "copy_pipeline_module", "pipeline_globals", "swapped_topology"]

_MARK = "_ds_swift_pipeline_globals"


def _check() -> None:
    check_deepspeed()


def pipeline_globals(grid: Any | None = None) -> PatchHandle:
    """Point DeepSpeed's pipeline globals at ``grid`` (None: leave them); the handle restores them.

    Args:
        grid: a ``PipelineParallelGrid``, or None to only restore, on removal, whatever code run
            meanwhile (``deepspeed.initialize`` of another engine) set them to.
    """
    from deepspeed.runtime.pipe import p2p
    from deepspeed.utils import groups

    _check()
    if getattr(p2p, _MARK, False):
        raise PatchError("DeepSpeed's pipeline globals are already held by ds-swift; remove the first handle")
    # p2p._groups stays None: p2p uses send/recv on the world group here (torch >= 1.8).
    saved = (p2p._grid, groups.mpu)
    if grid is not None:
        p2p._grid, groups.mpu = grid, grid
    setattr(p2p, _MARK, True)

    def restore() -> None:
        p2p._grid, groups.mpu = saved
        delattr(p2p, _MARK)

    return PatchHandle("pipeline globals", restore)


def swapped_topology(topo: Any, swap: Mapping[int, int]) -> Any:
    """A copy of the ``ProcessTopology`` ``topo`` with rank ``r`` renamed ``swap.get(r, r)``."""
    from deepspeed.runtime.pipe.topology import ProcessTopology

    _check()
    axes = list(topo.get_axis_names())
    new = ProcessTopology(axes=axes, dims=[topo.get_dim(a) for a in axes])
    new.mapping = {coord: swap.get(rank, rank) for coord, rank in topo.mapping.items()}
    return new


def copy_pipeline_module(module: Any, topology: Any) -> Any:
    """A ``PipelineModule`` over ``topology`` built from ``module``'s layer specs and partition.

    Call it on every rank (it creates process groups), under :func:`pipeline_globals`: building a
    module repoints DeepSpeed's pipeline globals.
    """
    from deepspeed.runtime.pipe.module import PipelineModule

    _check()
    parts = list(module.parts)

    class FixedPartition(PipelineModule):  # type: ignore[misc]
        # The copy must hold exactly the layers the original stage holds.
        def _partition_layers(self, method: str = "uniform") -> None:
            self.parts = list(parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=parts[stage], stop=parts[stage + 1])

    return FixedPartition(
        layers=module._layer_specs,
        topology=topology,
        loss_fn=module.loss_fn,
        seed_layers=module.seed_layers,
        seed_fn=module.seed_fn,
        base_seed=module.base_seed,
        activation_checkpoint_interval=module.activation_checkpoint_interval,
        activation_checkpoint_func=module.activation_checkpoint_func,
        checkpointable_layers=module.checkpointable_layers,
        dynamic_shape=module.dynamic_shape,
    )
