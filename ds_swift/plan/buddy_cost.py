"""What buddy copies of optimizer partitions cost (ds_swift.recovery.strategies.buddy), before the job starts.

Pure arithmetic on the DeepSpeed config and the layout. Each rank's partition payload is its share
of the fp32 master weights plus the optimizer state of that share::

    partition bytes = params per rank / dp x (4 master + 4 x moments) bytes

(params per rank = params / (pp x tp); Adam-family optimizers keep 2 moments, SGD 1). After the
step of every ``buddy.interval``-th iteration each rank sends that payload to each of its
``replication_factor`` buddies (network bytes per rank per iteration: that over the interval; under
``"auto"``, the default, the interval is chosen from the step time once the job runs, so the figure
is that of a copy after every step, the most it can be) and
holds the newest two complete copies of each partition it is buddy of (host memory per rank: 2 x
factor x partition bytes on average), plus its own copies of its last two rounds, staged before
sending (2 x partition bytes): what makes a survivor's undo bitwise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ds_swift.config import SwiftConfig
from ds_swift.plan.layout import ParallelLayout
from ds_swift.recovery.registry import services_of

__all__ = ["COPIES_NOTE", "BuddyCost", "buddy_cost", "copies_kept", "copies_stand_in"]

_MOMENTS = {"adam": 2, "adamw": 2, "lamb": 2, "onebitadam": 2, "sgd": 1, "adagrad": 1}


@dataclass(frozen=True)
class BuddyCost:
    """Buddy copies in one job: whether they run and what they cost per rank."""

    active: bool
    """Copies are made (enabled in the config and the optimizer state is partitioned)."""
    why: str
    factor: int
    interval: int | str = 1
    """Iterations between copies (``buddy.interval``; ``"auto"``: chosen from the measured step time)."""
    partition_bytes: int | None = None
    """One rank's payload: fp32 master share plus its optimizer state (None: parameters unknown)."""
    network_bytes_per_rank_per_iteration: int | None = None
    host_bytes_per_rank: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[tuple[str, str]]:
        """(label, value) rows for the plan's summary."""
        if not self.active:
            return [("buddy copies", f"off: {self.why}")]
        if self.partition_bytes is None:
            return [("buddy copies", f"on ({self.why}); bytes unknown: give --num-params")]
        net, host = self.network_bytes_per_rank_per_iteration or 0, self.host_bytes_per_rank or 0
        every = {1: "every iteration", "auto": "interval auto (bytes: a copy after every step, the most)"}.get(
            self.interval, f"every {self.interval} iterations"
        )
        return [
            ("buddy copies", f"on, {self.factor} buddy(ies) per rank, {every} ({self.why})"),
            ("buddy network / rank / iteration", f"{net / 1e9:.3f} GB ({net} bytes)"),
            (
                "buddy host memory / rank",
                f"{host / 1e9:.3f} GB (2 copies x {self.factor} buddy partition(s) + 2 own copies)",
            ),
        ]


def _partitioned_by(ds: dict[str, Any], layout: ParallelLayout) -> str | None:
    zero = ds.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0)) if isinstance(zero, dict) else 0
    bf16 = bool((ds.get("bf16") or {}).get("enabled", False)) if isinstance(ds.get("bf16"), dict) else False
    if layout.dp < 2:
        return None
    if stage >= 1:
        return f"ZeRO stage {stage} partitions the optimizer state over dp={layout.dp}"
    if bf16 and layout.pp > 1:
        return f"BF16_Optimizer partitions the fp32 masters over dp={layout.dp}"
    return None


def buddy_cost(ds: dict[str, Any], swift: SwiftConfig, layout: ParallelLayout, num_params: float | None) -> BuddyCost:
    """The buddy copies ``ds`` (a DeepSpeed config dict) asks for, and their cost per rank.

    Args:
        ds: the DeepSpeed config (``zero_optimization``, ``bf16``, ``optimizer``).
        swift: its ``swift`` section (``buddy``).
        layout: tp, pp, dp.
        num_params: parameters of the whole model (None: sizes unknown).
    """
    factor = swift.buddy.replication_factor
    if not swift.buddy.enabled:
        return BuddyCost(False, "buddy.enabled is false", factor)
    why = _partitioned_by(ds, layout)
    if why is None:
        return BuddyCost(False, "the optimizer state is not partitioned: a data-parallel replica holds it", factor)
    every = swift.buddy.interval
    if num_params is None:
        return BuddyCost(True, why, factor, every)
    opt = str((ds.get("optimizer") or {}).get("type", "adamw")).lower()
    per_param = 4 + 4 * _MOMENTS.get(opt, 2)
    part = int(num_params / (layout.pp * layout.tp) / layout.dp * per_param)
    per_iteration = part * factor // (swift.buddy.fixed_interval or 1)
    return BuddyCost(True, why, factor, every, part, per_iteration, 2 * (factor + 1) * part)


def copies_kept(swift: SwiftConfig, partitioned: bool) -> bool:
    """Whether ds-swift's copier keeps every rank's optimizer state on other machines: PipeChurn's
    erasure-coded chunks (whatever the layout), or buddy copies (``buddy.enabled``, a strategy that
    uses them) of a ``partitioned`` state. The one rule for the engine at start-up
    (ds_swift.protect.buddy.partition_copies) and ``ds-swift plan``: :func:`copies_stand_in`."""
    services = services_of(swift)
    return services.erasure_chunks or (swift.buddy.enabled and services.buddy_copies and partitioned)


#: what a plan's note says where buddy copies stand in for replicas (:func:`copies_stand_in`)
COPIES_NOTE = "the buddy copies of their optimizer partitions restore them"


def copies_stand_in(
    strategy: str, replicated: list[bool], candidates: set[int], partition_copies: bool
) -> tuple[list[bool], set[int], str | None]:
    """Buddy copies as the replicas of stages that have none (ds_swift.plan.analysis.analyze).

    With every rank's optimizer partition copied to a buddy on another machine (``partition_copies``:
    buddy copies of a ZeRO-1 / BF16_Optimizer partition, ds_swift.protect.buddy), a stage without a
    data-parallel replica on another machine is restored exactly from those copies after any one lost
    machine, as a replicated stage is. Under ``auto`` it then counts as replicated and is no logging
    candidate: a message log beside the copies would cost a write of each inbound activation and
    gradient per iteration that no single-machine failure reads. A forced ``logging`` keeps logging.

    Returns:
        the stages' replicated flags and logging candidates, and the plan's note (None: no change).
    """
    copied = sorted(candidates) if partition_copies and strategy == "auto" else []
    if not copied:
        return replicated, candidates, None
    note = (
        f"stages {copied} have no data-parallel replica on another machine; {COPIES_NOTE} instead "
        '(replication), so their inbound messages are not logged (strategy "logging" logs them and '
        "recovers them from the log instead)"
    )
    return [True] * len(replicated), set(), note
