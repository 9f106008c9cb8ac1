"""An elastic resize, planned: the same on every rank, from the job's layout before and after (pure:
no process group). Protocol, state moves and strategy: :mod:`ds_swift.recovery.strategies.elastic`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ds_swift.logs import say
from ds_swift.recovery.base import MembershipRefused
from ds_swift.recovery.kept import Grid

__all__ = ["Resize", "ResizeRefused", "plan_resize", "resized_ds_config"]


class ResizeRefused(MembershipRefused):
    """The job cannot change its number of replicas (the reason says why and what to do)."""


@dataclass(frozen=True)
class Resize:
    """One change of the job's machines (a shrink or a grow), the same on every rank.

    Args:
        kind: ``shrink`` or ``grow``.
        machine: the machine that left, or came back.
        old_layout: the machines of the generation that ended, in rank order.
        new_layout: the machines of the next one, in rank order.
        per_machine: ranks per machine.
        old_coords: (stage, dp, tp) of every rank of the generation that ended, by rank.
        gas: its gradient accumulation steps.
        micro: the micro-batch size.
        policy: ``elastic.global_batch`` (``keep`` or ``shrink``).
        partitioned: each data-parallel rank of the generation that ended held only its slice of
            the optimizer state (ZeRO-1, BF16_Optimizer with dp > 1).
    """

    kind: str
    machine: int
    old_layout: tuple[int, ...]
    new_layout: tuple[int, ...]
    per_machine: int
    old_coords: tuple[tuple[int, int, int], ...]
    gas: int
    micro: int
    policy: str
    partitioned: bool

    @property
    def old_world(self) -> int:
        return len(self.old_coords)

    @property
    def new_world(self) -> int:
        return len(self.new_layout) * self.per_machine

    @property
    def old_dp(self) -> int:
        return 1 + max(c[1] for c in self.old_coords)

    @property
    def new_dp(self) -> int:
        return self.old_dp * self.new_world // self.old_world

    @property
    def new_gas(self) -> int:
        return self.gas * self.old_dp // self.new_dp if self.policy == "keep" else self.gas

    def machine_of(self, old_rank: int) -> int:
        return self.old_layout[old_rank // self.per_machine]

    def new_rank_of(self, old_rank: int) -> int | None:
        """The rank ``old_rank`` has after the change (None: its machine left)."""
        machine = self.machine_of(old_rank)
        if machine not in self.new_layout:
            return None
        return self.new_layout.index(machine) * self.per_machine + old_rank % self.per_machine

    def old_rank_at(self, stage: int, dp: int, tp: int) -> int:
        return self.old_coords.index((stage, dp, tp))

    @property
    def survivors(self) -> list[int]:
        """The old ranks that are in the new generation too."""
        return [r for r in range(self.old_world) if self.new_rank_of(r) is not None]

    @property
    def lost(self) -> list[int]:
        return [r for r in range(self.old_world) if self.new_rank_of(r) is None]

    @classmethod
    def plan(
        cls,
        *,
        kind: str,
        machine: int,
        old_layout: Sequence[int],
        new_layout: Sequence[int],
        old_coords: Sequence[tuple[int, int, int]],
        gas: int,
        micro: int,
        policy: str,
        min_dp: int,
        partitioned: bool,
    ) -> Resize:
        """Check that the change is possible; ResizeRefused (with the fix) where it is not."""
        per_machine = len(old_coords) // len(old_layout)
        resize = cls(
            kind,
            machine,
            tuple(old_layout),
            tuple(new_layout),
            per_machine,
            tuple((int(s), int(d), int(t)) for s, d, t in old_coords),
            gas,
            micro,
            policy,
            partitioned,
        )
        model_parallel = resize.old_world // resize.old_dp
        if per_machine % model_parallel:
            raise ResizeRefused(
                f"a machine holds {per_machine} rank(s), not whole data-parallel replicas of {model_parallel} "
                f"(tp x pp): adding or dropping machine {machine} would break replicas; place whole replicas per "
                "machine (swift machines.rank_order tp-pp-dp with gpus_per_node a multiple of tp x pp), or add spares"
            )
        if resize.new_dp < min_dp:
            raise ResizeRefused(
                f"dropping machine {machine} leaves {resize.new_dp} data-parallel replica(s), fewer than "
                f"elastic.min_data_parallel={min_dp}: add a spare machine (ds-swift-launch --spares) or lower it"
            )
        if policy == "keep" and (gas * resize.old_dp) % resize.new_dp:
            raise ResizeRefused(
                f"elastic.global_batch=keep: {gas * resize.old_dp} micro-batches per iteration do not split over "
                f'{resize.new_dp} replicas; set elastic.global_batch to "shrink", or choose a divisible accumulation'
            )
        return resize

    def describe(self) -> str:
        batch = (
            f"global batch kept: accumulation {self.gas} -> {self.new_gas} micro-batches per replica"
            if self.policy == "keep"
            else f"global batch {self.micro * self.gas * self.old_dp} -> {self.micro * self.gas * self.new_dp} samples"
        )
        what = (
            f"elastic shrink: machine {self.machine} left for good (no spare)"
            if self.kind == "shrink"
            else f"elastic grow: machine {self.machine} is back"
        )
        return f"{what}; data parallelism {self.old_dp} -> {self.new_dp} on machines {list(self.new_layout)}; {batch}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Resize:
        d = json.loads(text)
        d["old_layout"], d["new_layout"] = tuple(d["old_layout"]), tuple(d["new_layout"])
        d["old_coords"] = tuple(tuple(c) for c in d["old_coords"])
        return cls(**d)


def resized_ds_config(ds_config: Mapping[str, Any], resize: Resize) -> dict[str, Any]:
    """The DeepSpeed config of the resized job: the micro-batch, the new accumulation and batch."""
    out = dict(ds_config)
    out["train_micro_batch_size_per_gpu"] = resize.micro
    out["gradient_accumulation_steps"] = resize.new_gas
    out["train_batch_size"] = resize.micro * resize.new_gas * resize.new_dp
    return out


def plan_resize(
    kind: str,
    machine: int,
    old_layout: Sequence[int],
    new_layout: Sequence[int],
    old_grid: Grid,
    policy: Any,
    rank: int,
) -> Resize:
    """:meth:`Resize.plan` from the failed generation's grid (ds_swift.recovery.kept.grid_of) and the ``elastic``
    config section (``policy``); a refusal is said loudly before it is raised."""
    coords, gas, micro, partitioned = old_grid
    try:
        return Resize.plan(
            kind=kind,
            machine=machine,
            old_layout=old_layout,
            new_layout=new_layout,
            old_coords=coords,
            gas=gas,
            micro=micro,
            policy=policy.global_batch,
            min_dp=policy.min_data_parallel,
            partitioned=partitioned,
        )
    except ResizeRefused as exc:
        say(f"ELASTIC {kind.upper()} REFUSED: {exc}", rank, level=logging.WARNING, name=__name__)
        raise
