"""The identity of a logged pipeline edge, defined once for the writer, the reader and the replay.

A :class:`LogEdge` names one direction of a pipeline link by *position*: the message kind, the
sending and receiving stage, and the data- and tensor-parallel coordinates both ends share. It is
what a chunk file's name encodes and what the replay asks the log for. Global ranks are not part
of it: a replacement takes over a failed rank's position, and the log it replays is keyed by
position (the record headers still store the ranks, for inspection).

:class:`PipelinePosition` is where one engine sits in the grid; it derives the edges that engine
sends on and receives from. Pure data: no torch, no DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["KINDS", "LogEdge", "PipelinePosition", "pipeline_position"]

#: "act": activations, stage s -> s + 1; "grad": gradients, stage s -> s - 1
KINDS = ("act", "grad")


def _step(kind: str) -> int:
    if kind not in KINDS:
        raise ValueError(f"edge kind {kind!r} is not one of {KINDS}")
    return 1 if kind == "act" else -1


class LogEdge(NamedTuple):
    """One logged pipeline edge: (kind, src stage, dst stage, dp rank, tp rank).

    A tuple, so it orders, hashes and compares like the ``(kind, src, dst, dp, tp)`` tuples that
    name chunk files.
    """

    kind: str  # "act" | "grad"
    src_stage: int
    dst_stage: int
    dp_rank: int = 0
    tp_rank: int = 0

    @classmethod
    def out_of(cls, kind: str, stage: int, dp_rank: int = 0, tp_rank: int = 0) -> LogEdge:
        """The edge ``stage`` sends ``kind`` messages on."""
        return cls(kind, stage, stage + _step(kind), dp_rank, tp_rank)

    @classmethod
    def into(cls, kind: str, stage: int, dp_rank: int = 0, tp_rank: int = 0) -> LogEdge:
        """The edge ``stage`` receives ``kind`` messages from."""
        return cls(kind, stage - _step(kind), stage, dp_rank, tp_rank)

    def __str__(self) -> str:
        return f"{self.kind} s{self.src_stage}->s{self.dst_stage} dp{self.dp_rank} tp{self.tp_rank}"


@dataclass(frozen=True)
class PipelinePosition:
    """Where an engine sits in the 3D grid, and whom it sends to."""

    rank: int
    stage: int
    num_stages: int
    dp_rank: int
    tp_rank: int
    next_rank: int | None  # receives this rank's activations
    prev_rank: int | None  # receives this rank's gradients

    def out_edge(self, kind: str) -> LogEdge:
        """The edge this rank sends ``kind`` on."""
        return LogEdge.out_of(kind, self.stage, self.dp_rank, self.tp_rank)

    def in_edge(self, kind: str) -> LogEdge:
        """The edge this rank receives ``kind`` from."""
        return LogEdge.into(kind, self.stage, self.dp_rank, self.tp_rank)

    def receiver(self, kind: str) -> int | None:
        """The global rank this rank sends ``kind`` to (None at the end of the pipeline)."""
        return self.next_rank if _step(kind) > 0 else self.prev_rank

    def sender(self, kind: str) -> int | None:
        """The global rank this rank receives ``kind`` from (None at the end of the pipeline)."""
        return self.prev_rank if _step(kind) > 0 else self.next_rank


def pipeline_position(engine: Any) -> PipelinePosition:
    """The position of a DeepSpeed ``PipelineEngine`` (read from its grid; nothing is changed)."""
    grid = engine.grid
    stage = int(engine.stage_id)
    num_stages = int(engine.num_stages)
    return PipelinePosition(
        rank=int(engine.global_rank),
        stage=stage,
        num_stages=num_stages,
        dp_rank=int(grid.get_data_parallel_id()),
        tp_rank=int(grid.get_slice_parallel_rank()),
        next_rank=int(grid.stage_to_global(stage_id=stage + 1)) if stage + 1 < num_stages else None,
        prev_rank=int(grid.stage_to_global(stage_id=stage - 1)) if stage > 0 else None,
    )
