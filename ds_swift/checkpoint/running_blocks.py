"""How a SCAR running checkpoint (:mod:`ds_swift.checkpoint.running`) cuts a rank's state into blocks,
and which blocks a round saves first: pure functions on tensors, no files, no threads.

A *key* tensor and its *companions* (as many elements) form a group; a tensor no group names is a
group of its own. Blocks are numbered in the state's order, group by group. A block's priority is
the squared L2 norm of its key's change since it was last saved (see the running module's docstring).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ds_swift.checkpoint.running_format import RunningCheckpointError, nblocks

__all__ = ["Group", "block_priorities", "check_groups", "lay_out", "most_changed"]

_SCRATCH_ELEMENTS = 1 << 22  # the float32 difference is computed this many elements at a time


@dataclass(frozen=True)
class Group:
    """A key tensor and its companions: the key's block decides, the companions' same range goes with it."""

    key: str
    names: tuple[str, ...]  # the key first, then its companions
    numel: int
    first: int  # its first block's number among all of the state's blocks


def check_groups(groups: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """``RunningCheckpoint(groups=...)`` checked: each tensor in one group, companions given as lists."""
    seen: dict[str, str] = {}
    for key, companions in groups.items():
        if isinstance(companions, str):
            raise ValueError(f"RunningCheckpoint groups[{key!r}] = {companions!r}: give a list of companion names")
        for name in (key, *companions):
            if name in seen:
                raise ValueError(
                    f"RunningCheckpoint groups name tensor {name!r} twice (under {seen[name]!r} and {key!r}); "
                    "a tensor belongs to one group"
                )
            seen[name] = key
    return {k: tuple(cs) for k, cs in groups.items()}


def lay_out(
    state: Mapping[str, torch.Tensor], groups_arg: Mapping[str, tuple[str, ...]], block_elements: int
) -> tuple[list[Group], int]:
    """The state's groups in its order, and the number of blocks of all of them.

    Raises:
        RunningCheckpointError: a group names a tensor the state lacks, or a companion's size differs
            from its key's.
    """
    companion_of = {c: k for k, cs in groups_arg.items() for c in cs}
    for name in [*groups_arg, *companion_of]:
        if name not in state:
            raise RunningCheckpointError(f"RunningCheckpoint groups name {name!r}, which the state lacks")
    first, groups = 0, []
    for name in state:
        if name in companion_of:
            continue
        names = (name, *groups_arg.get(name, ()))
        numel = state[name].numel()
        for c in names[1:]:
            if state[c].numel() != numel:
                raise RunningCheckpointError(
                    f"companion {c!r} has {state[c].numel()} elements, its key {name!r} {numel}: a group's "
                    "tensors must have as many elements (fix RunningCheckpoint groups)"
                )
        groups.append(Group(name, names, numel, first))
        first += nblocks(numel, block_elements)
    return groups, first


def block_priorities(
    groups: Sequence[Group],
    base: Mapping[str, torch.Tensor],
    hosts: Mapping[str, torch.Tensor],
    block: int,
    total: int,
) -> torch.Tensor:
    """Squared L2 norm of each block's change since it was last saved (float64, one per block).

    Args:
        base: key -> flat host copy as last saved.
        hosts: key -> flat host copy now.
        block: elements per block; ``total``: blocks of the whole state.
    """
    out = torch.empty(total, dtype=torch.float64)
    step = max(1, _SCRATCH_ELEMENTS // block) * block
    for g in groups:
        cur, old = hosts[g.key], base[g.key]
        for s in range(0, g.numel, step):
            e = min(g.numel, s + step)
            d = (cur[s:e].float() - old[s:e].float()).square_()
            full = (e - s) // block
            b = g.first + s // block
            out[b : b + full] = d[: full * block].view(full, block).sum(1, dtype=torch.float64)
            if full * block < e - s:  # the tensor's shorter last block
                out[b + full] = d[full * block :].sum(dtype=torch.float64)
    return out


def most_changed(priorities: torch.Tensor, last: torch.Tensor, count: int) -> np.ndarray:
    """The ``count`` most urgent blocks, in block order: never saved or NaN first, then the most
    changed, ties to the block saved longest ago (``last``: iteration last saved, -1 never), then
    to the lower block number."""
    prio = priorities.numpy().copy()
    saved_at = last.numpy()
    prio[np.isnan(prio) | (saved_at < 0)] = np.inf
    order = np.lexsort((np.arange(prio.size), saved_at, -prio))  # most changed, then saved longest ago
    return np.sort(order[:count])
