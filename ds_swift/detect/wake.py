"""Waking pipeline neighbours blocked in a receive from a rank that is about to tear down."""

from __future__ import annotations

from typing import Any

from ds_swift import transport

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
    """The ranks whose heartbeats this rank watches: its pipeline neighbours and its two neighbours
    in the data-parallel ring of its stage (a stopped replica blocks the gradient all-reduce as
    surely as a stopped neighbour). At most four, whatever the job's size: every rank is watched by
    up to four others (two to agree on a verdict), where watching every data-parallel peer cost each
    rank dp reads a beat, O(N * dp) for the job (512 per rank a second at 16,384 ranks, dp 512)."""
    peers = pipeline_neighbours(engine)
    grid = engine.grid
    dp, me = int(grid.get_data_parallel_world_size()), int(grid.get_data_parallel_id())
    for other in {(me - 1) % dp, (me + 1) % dp} - {me}:
        peers.append(int(grid.stage_to_global(stage_id=engine.stage_id, data=other)))
    return sorted(set(peers) - {int(engine.global_rank)})


def poison_neighbours(peers: list[int]) -> str:
    """Wake ``peers`` blocked in a receive from us (they then see the flag and raise): a poison
    message on gloo, an abort of this rank's communicators on NCCL (ds_swift.transport.shutdown).
    Returns which it was."""
    return transport.wake_neighbours(peers)
