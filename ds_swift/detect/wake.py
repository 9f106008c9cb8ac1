"""Waking pipeline neighbours blocked in a receive from a rank that is about to tear down."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["pipeline_neighbours", "poison_neighbours", "watched_peers"]


def pipeline_neighbours(engine: Any) -> list[int]:
    """Global ranks of the previous and next pipeline stage of ``engine`` (those that exist)."""
    peers = []
    for delta in (-1, +1):
        stage = engine.stage_id + delta
        if 0 <= stage < engine.num_stages:
            peers.append(int(engine.grid.stage_to_global(stage_id=stage)))
    return peers


def watched_peers(engine: Any) -> list[int]:
    """The ranks whose heartbeats this rank watches: its pipeline neighbours and its data-parallel
    peers (a stopped replica blocks the gradient all-reduce as surely as a stopped neighbour)."""
    peers = pipeline_neighbours(engine)
    grid = engine.grid
    for dp in range(int(grid.get_data_parallel_world_size())):
        if dp != int(grid.get_data_parallel_id()):
            peers.append(int(grid.stage_to_global(stage_id=engine.stage_id, data=dp)))
    return sorted(set(peers) - {int(engine.global_rank)})


def poison_neighbours(peers: list[int]) -> None:
    """Wake ``peers`` blocked in a recv from us (they then see the flag and raise).

    Gloo completes a send only once the peer receives, so we do not wait long: a neighbour
    that is not receiving gets "connection closed" from the teardown that follows instead.
    """
    works = []
    for peer in peers:
        try:
            work = dist.isend(torch.zeros(1), peer)
            if work is not None:
                works.append(work)
        except Exception:  # noqa: BLE001, S110 - a dead peer cannot be woken and needs no waking
            pass
    deadline = time.monotonic() + 0.02
    for w in works:
        try:
            while not w.is_completed() and time.monotonic() < deadline:
                time.sleep(0.001)
        except Exception:  # noqa: BLE001, S110
            pass
