"""Can the strategy serve this job at all? Checked before any worker starts (``ds-swift-launch``,
``ds-swift bench``), so that a configuration no recovery can serve is refused with one line naming
the field or flag and the fix, instead of failing inside the workers once they run (a
``BuddyError`` then SIGABRT for PipeChurn on too few machines), or hanging at the first failure
(``--elastic`` without strategy ``elastic``: the launcher drops the failed machine, the survivors,
never told to shrink, wait in the rendezvous for a replacement that never comes).

One function per requirement, each ``(cfg, shape) -> str | None`` (None: met); pure, no process.
:func:`infeasible` runs them all; a requirement that needs a figure the caller does not know (the
pipeline size of a script that builds its config in code) is not checked rather than guessed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ds_swift.config import ConfigError, SwiftConfig
from ds_swift.config.checks import kinds_mismatch, machines_mismatch
from ds_swift.recovery.registry import services_of
from ds_swift.recovery.state.buddies import BuddyError, Member, assign_buddies
from ds_swift.recovery.state.erasure import assign_holders

__all__ = [
    "LAUNCH_REQUIREMENTS",
    "JobShape",
    "REQUIREMENTS",
    "check_feasible",
    "infeasible",
]


@dataclass(frozen=True)
class JobShape:
    """What the launcher knows of a job before it starts it.

    Args:
        machines: machines the job trains on (``--nnodes``).
        per_machine: ranks per machine (``--nproc-per-node``).
        elastic: ``--elastic`` (no spare left: go on without the failed machine).
        pipeline: pipeline stages (None: unknown).
        tensor: tensor-parallel size.
        partitioned_optimizer: the optimizer state is ZeRO-1 / BF16_Optimizer, partitioned over the
            data-parallel ranks when there are several (None: unknown).
    """

    machines: int
    per_machine: int
    elastic: bool = False
    pipeline: int | None = None
    tensor: int = 1
    partitioned_optimizer: bool | None = None

    @property
    def world(self) -> int:
        return self.machines * self.per_machine

    @property
    def replica(self) -> int | None:
        """Ranks of one data-parallel replica (tp x pp), None if the pipeline size is unknown."""
        return None if self.pipeline is None else self.pipeline * self.tensor

    @property
    def data_parallel(self) -> int | None:
        replica = self.replica
        return None if replica is None or self.world % replica else self.world // replica

    @property
    def partitioned(self) -> bool | None:
        """Whether each data-parallel rank holds only its slice of the optimizer state (what buddy
        copies protect), None if unknown."""
        dp = self.data_parallel
        if self.partitioned_optimizer is None or dp is None:
            return None
        return self.partitioned_optimizer and dp > 1

    def members(self) -> list[Member]:
        """Every rank with its machine (ranks fill machines in order, as the launcher places them)."""
        return [Member(rank=r, machine=r // self.per_machine) for r in range(self.world)]

    @classmethod
    def from_ds_config(
        cls,
        ds_config: Mapping[str, Any],
        machines: int,
        per_machine: int,
        elastic: bool = False,
        pipeline: int | None = None,
        tensor: int | None = None,
    ) -> JobShape:
        """The shape from the DeepSpeed config (``pipeline.stages``, ``zero_optimization.stage``,
        ``bf16``), unless ``pipeline``/``tensor`` say otherwise (Megatron's flags)."""
        if pipeline is None:
            stages = (ds_config.get("pipeline") or {}).get("stages")
            pipeline = stages if isinstance(stages, int) and stages > 0 else None
        zero = (ds_config.get("zero_optimization") or {}).get("stage", 0)
        bf16 = bool((ds_config.get("bf16") or {}).get("enabled", False))
        return cls(
            machines, per_machine, elastic, pipeline, tensor or 1, bool(bf16 or (isinstance(zero, int) and zero >= 1))
        )


Requirement = Callable[[SwiftConfig, JobShape], "str | None"]


def elastic_needs_the_config(cfg: SwiftConfig, shape: JobShape) -> str | None:
    """``--elastic`` is served only by workers that know to shrink (a strategy whose services are elastic)."""
    if not shape.elastic or (cfg.enabled and services_of(cfg).elastic):
        return None
    if not cfg.enabled:
        return (
            "--elastic: ds-swift is off in this job (swift.enabled is false): nothing would shrink the job; "
            'turn swift on with "strategy": "elastic", or drop --elastic'
        )
    return (
        f"--elastic: the swift config's strategy {cfg.strategy!r} does not shrink the job, so its workers "
        'would wait for a replacement of the failed machine that never comes; set "strategy": "elastic" '
        "in the swift section, or drop --elastic (and give --spares N)"
    )


def elastic_needs_whole_replicas(cfg: SwiftConfig, shape: JobShape) -> str | None:
    """A shrink drops whole machines: each must hold whole data-parallel replicas (tp x pp ranks)."""
    replica = shape.replica
    if not shape.elastic or not services_of(cfg).elastic or replica is None or shape.per_machine % replica == 0:
        return None
    return (
        f"--elastic: a machine must hold whole data-parallel replicas for a shrink to drop it, but "
        f"--nproc-per-node {shape.per_machine} is not a multiple of tp x pp = {replica}; use --nproc-per-node "
        f"{replica * max(1, shape.per_machine // replica)} (a multiple of {replica}), or drop --elastic"
    )


def elastic_needs_a_replica_left(cfg: SwiftConfig, shape: JobShape) -> str | None:
    """After losing one machine at least ``elastic.min_data_parallel`` replicas must remain."""
    replica, dp = shape.replica, shape.data_parallel
    if (
        not shape.elastic
        or not services_of(cfg).elastic
        or replica is None
        or dp is None
        or shape.per_machine % replica
    ):
        return None
    per = shape.per_machine // replica  # replicas per machine
    left, floor = dp - per, max(1, cfg.elastic.min_data_parallel)
    if left >= floor:
        return None
    need = -(-floor // per) + 1  # machines whose loss still leaves the floor
    return (
        f"--elastic: with --nnodes {shape.machines} the first machine lost leaves {left} data-parallel "
        f"replica(s), fewer than elastic.min_data_parallel={cfg.elastic.min_data_parallel} (and at least 1): "
        f"no shrink could ever go on; use --nnodes {need}, lower elastic.min_data_parallel, or give --spares N "
        "instead of --elastic"
    )


def pipechurn_needs_machines(cfg: SwiftConfig, shape: JobShape) -> str | None:
    """PipeChurn keeps each rank's k + r chunks on k + r machines (failure domains) besides its own."""
    if not cfg.enabled or not services_of(cfg).erasure_chunks:
        return None
    k, r = cfg.pipechurn.data_chunks, cfg.pipechurn.parity_chunks
    try:
        assign_holders(shape.members(), k, r, cfg.machines.failure_domains)
    except BuddyError:  # (its text names the buddy assignment's fields, which the user did not set)
        domains = " (grouped by machines.failure_domains)" if cfg.machines.failure_domains else ""
        return (
            f'strategy "{cfg.strategy}" needs k + r + 1 = {k + r + 1} machines in distinct failure domains '
            f"(pipechurn.data_chunks={k}, pipechurn.parity_chunks={r}, and each rank's own), the job has "
            f"--nnodes {shape.machines}{domains}: use --nnodes {k + r + 1} or more, or lower pipechurn.data_chunks / "
            "pipechurn.parity_chunks"
        )
    return None


def buddies_need_machines(cfg: SwiftConfig, shape: JobShape) -> str | None:
    """Buddy copies of a partitioned optimizer state go to ``buddy.replication_factor`` ranks outside
    the owner's machine (failure domain)."""
    uses = services_of(cfg).buddy_copies and not services_of(cfg).erasure_chunks  # else the engine makes none
    if not cfg.enabled or not cfg.buddy.enabled or not uses or not shape.partitioned:
        return None
    factor = cfg.buddy.replication_factor
    try:
        assign_buddies(shape.members(), factor, cfg.machines.failure_domains)
    except BuddyError as exc:
        need = -(-factor // shape.per_machine) + 1  # machines giving every rank ``factor`` ranks elsewhere
        return (
            f"buddy copies (buddy.enabled, strategy {cfg.strategy!r}, optimizer state partitioned by ZeRO-1 / "
            f"bf16) need buddy.replication_factor={factor} rank(s) outside each rank's machine, the job has "
            f'--nnodes {shape.machines}: use --nnodes {need} or more, or set "buddy": {{"enabled": false}} '
            f"(a lost partition then comes from the global checkpoint) ({exc})"
        )
    return None


def machines_match(cfg: SwiftConfig, shape: JobShape) -> str | None:
    """Under ds-swift-launch, ``machines.gpus_per_node`` is the launcher's ranks per machine."""
    return machines_mismatch(cfg.machines.gpus_per_node, shape.per_machine, shape.machines) if cfg.enabled else None


def kinds_fit_the_pipeline(cfg: SwiftConfig, shape: JobShape) -> str | None:
    """A per-stage ``logging.kinds`` list has one entry per pipeline stage."""
    if not cfg.enabled or shape.pipeline is None:
        return None
    return kinds_mismatch(cfg.logging.kinds, shape.pipeline)


REQUIREMENTS: tuple[Requirement, ...] = (
    elastic_needs_the_config,
    elastic_needs_whole_replicas,
    elastic_needs_a_replica_left,
    pipechurn_needs_machines,
    buddies_need_machines,
)


#: what the launcher checks (it knows the ranks per machine): the strategies' requirements and the
#: config's fit to the job (otherwise found by every worker once it runs, the job's ranks started)
LAUNCH_REQUIREMENTS: tuple[Requirement, ...] = (machines_match, kinds_fit_the_pipeline, *REQUIREMENTS)


def infeasible(cfg: SwiftConfig, shape: JobShape, requirements: tuple[Requirement, ...] = REQUIREMENTS) -> list[str]:
    """Every requirement this job does not meet, one line each (empty: the strategy can serve it)."""
    return [why for check in requirements if (why := check(cfg, shape)) is not None]


def check_feasible(cfg: SwiftConfig, shape: JobShape) -> None:
    """Raise :class:`ConfigError` naming every requirement the job does not meet."""
    whys = infeasible(cfg, shape)
    if whys:
        raise ConfigError("; ".join(whys))
