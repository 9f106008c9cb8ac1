"""The sends and receives of an elastic resize (:mod:`ds_swift.recovery.strategies.elastic`): who
sends which old optimizer partition (or whole state) to which new rank, in one order on every
rank, and this rank's side of it: post the sends, receive, load, join the parts into its new
partition.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ds_swift import transport
from ds_swift.patches.deepspeed_engine import pipe_topology
from ds_swift.recovery.kept import KeptState
from ds_swift.recovery.state.transfer import load_state, recv_state, send_state, set_counters
from ds_swift.recovery.strategies.resize import Resize

__all__ = ["ResizeMoves", "grid_coords", "resize_transfers"]


def grid_coords(engine: Any) -> list[tuple[int, int]]:
    """(stage, tp) of every rank of ``engine``'s grid."""
    topo = pipe_topology(engine)
    has_tp = "model" in topo.get_axis_names()
    return [
        (int(topo.get_coord(r).pipe), int(topo.get_coord(r).model) if has_tp else 0) for r in range(topo.world_size())
    ]


def resize_transfers(
    resize: Resize, coords: list[tuple[int, int]], sources: Mapping[int, int], first: Mapping[int, int]
) -> list[tuple[int, int, int]]:
    """(old owner, source rank, destination rank) of every old optimizer state each new rank needs,
    in one order on every rank (the sends are posted first, then received in it): partitioned, every
    old partition of its (stage, tp); else one whole state, its own or ``first[dst]``'s (an old rank)."""
    out = []
    for dst, (stage, tp) in enumerate(coords):
        owners = (
            [resize.old_rank_at(stage, q, tp) for q in range(resize.old_dp)] if resize.partitioned else [first[dst]]
        )
        for owner in owners:
            src = resize.new_rank_of(sources[owner])
            assert src is not None  # sources are survivors
            out.append((owner, src, dst))
    return out


@dataclass
class ResizeMoves:
    """This rank's sends and receives of a resize: a new rank's module, schedule and counters from its
    donor, and every old optimizer partition (or whole state) each rank joins into its new one."""

    resize: Resize
    rank: int
    old_rank: int | None
    kept: KeptState | None
    iteration: int
    sources: Mapping[int, int]
    donors: Mapping[int, int]
    transfers: list[tuple[int, int, int]]

    def __post_init__(self) -> None:
        self.state = self.kept.state() if self.kept is not None else None  # after the undo: what it holds
        self.sending: list[tuple[Any, torch.Tensor]] = []

    def payload_of(self, owner: int) -> dict[str, Any]:
        if owner == self.old_rank and self.sources[owner] == owner:
            assert self.state is not None
            return {"optimizer": self.state["optimizer"]}
        if self.kept is None or self.kept.buddy is None:
            raise RuntimeError(f"rank {self.rank} was chosen to send rank {owner}'s buddy copy but holds none")
        return {"optimizer": self.kept.buddy.state_of(owner, self.iteration)["optimizer"]}

    def _isend(self, t: torch.Tensor, dst: int, group: Any = None) -> None:
        self.sending.append((transport.isend(t, dst, group=group), t))

    def run(self, engine: Any) -> tuple[int, dict[int, Any]]:
        """Post the sends, receive, load; returns the bytes sent and the old partitions joined here
        (old rank -> its part; None: its whole state, unpartitioned)."""
        from ds_swift.patches.deepspeed_optim_state import load_optimizer, reshard_optimizer

        rank, kept, state = self.rank, self.kept, self.state
        moved = 0
        for dst, src in sorted(self.donors.items()):
            if src == rank:
                assert kept is not None and state is not None
                rest = {k: v for k, v in state.items() if k != "optimizer"}
                moved += send_state({**rest, "counters": kept.counters or {}}, dst, send=self._isend)
        for owner, src, dst in self.transfers:
            if src == rank and dst != rank:
                moved += send_state(self.payload_of(owner), dst, send=self._isend)
        if rank in self.donors:
            rest = recv_state(self.donors[rank])
            load_state(engine, rest, self.iteration + 1)
            counters = rest.get("counters") or {}
        else:
            assert kept is not None and state is not None
            load_state(engine, {**state, "optimizer": None}, self.iteration + 1)
            counters = kept.counters or {}
        set_counters(engine, self.iteration + 1, skipped_steps=int(counters.get("skipped_steps", 0)))
        parts: dict[int, dict[str, Any]] = {}
        owners: dict[int, Any] = {}
        for owner, src, dst in self.transfers:
            if dst == rank:
                dp = self.resize.old_coords[owner][1]
                parts[dp] = self.payload_of(owner)["optimizer"] if src == rank else recv_state(src)["optimizer"]
                owners[owner] = parts[dp]
        for work, _ in self.sending:
            work.wait()
        if engine.optimizer is not None and parts:
            load_optimizer(engine.optimizer, reshard_optimizer([parts[q] for q in sorted(parts)], engine.optimizer))
        return moved, owners
