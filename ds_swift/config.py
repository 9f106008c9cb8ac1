"""The ``"swift"`` section of a DeepSpeed JSON config, as typed dataclasses.

Users write::

    "swift": {
      "enabled": true,
      "machines": {"gpus_per_node": 8},
      "strategy": "auto",
      "logging": {"storage": "file:///lustre/job42/swift-logs",
                  "storage_budget_gb": 500, "chunk_iterations": 5, "bubble_only": true},
      "parallel_recovery": true,
      "checkpoint": {"dir": "/lustre/job42/ckpt", "interval": 1000}
    }

Every invalid value raises :class:`ConfigError` whose message names the field (as a dotted
path from ``swift``), the value and what is allowed. Unknown keys are errors: a typo such as
``"chunk_iteration"`` silently falling back to a default would only show months later, when a
recovery does not do what the user thought they had configured.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args
from urllib.parse import urlparse

__all__ = [
    "BuddyConfig",
    "CHECKPOINT_STRATEGIES",
    "CheckFreqConfig",
    "CheckpointConfig",
    "ConfigError",
    "ElasticConfig",
    "LoggingConfig",
    "MachinesConfig",
    "PipeChurnConfig",
    "STORAGE_SCHEMES",
    "SimulateConfig",
    "Strategy",
    "SwiftConfig",
    "VerifyConfig",
    "WatchdogConfig",
    "load_ds_config",
]

Strategy = Literal[
    "auto", "replication", "logging", "checkpoint", "global_checkpoint", "checkfreq", "tranlogs", "pipechurn", "scar",
    "immediate_rollback", "lossy_forward",
]
#: Strategies that recover by reloading the last global checkpoint on every rank.
CHECKPOINT_STRATEGIES = ("checkpoint", "global_checkpoint", "checkfreq")
ParallelRecoveryMode = Literal["exact", "fast"]

#: URL schemes the global store understands (see ds_swift.storage). "" is a plain path.
STORAGE_SCHEMES = ("", "file", "hdfs", "webhdfs", "s3", "memory")


#: What a stage recovered by logging may log (``logging.kinds``).
LOG_KINDS = ("messages", "updates")


class ConfigError(ValueError):
    """A ``swift`` config value is invalid. The message names the field and the fix."""


def _fail(path: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"swift config: {path}={value!r} is invalid: {allowed}")


def _check_type(path: str, value: Any, typ: type | tuple[type, ...], allowed: str) -> None:
    # bool is an int subclass: "interval": true must not pass as 1.
    if isinstance(value, bool) and bool not in (typ if isinstance(typ, tuple) else (typ,)):
        raise _fail(path, value, allowed)
    if not isinstance(value, typ):
        raise _fail(path, value, allowed)
    # json.loads accepts NaN and Infinity: a NaN timeout compares false with everything and
    # would silently disable the check it configures.
    if isinstance(value, float) and not math.isfinite(value):
        raise _fail(path, value, allowed)
    if isinstance(value, str) and typ is str and not value:
        raise _fail(path, value, allowed)


def _is_machine_list(value: Any) -> bool:
    return (
        isinstance(value, list | tuple)
        and bool(value)
        and all(isinstance(m, int) and not isinstance(m, bool) and m >= 0 for m in value)
    )


@dataclass(frozen=True)
class MachinesConfig:
    """How ranks map onto physical machines."""

    gpus_per_node: int = 8
    """Ranks (GPUs) per machine. Ranks ``[k*gpus_per_node, (k+1)*gpus_per_node)`` share
    machine ``k``, as the ``deepspeed`` launcher and torchrun assign them."""

    rank_order: str = "tp-dp-pp"
    """Order of the job's ranks over the 3D plan, as megatron-core's ``RankGenerator`` writes it
    (first = fastest-varying). Megatron's default ``tp-dp-pp`` puts a stage's data-parallel
    replicas next to each other, usually on one machine (-> logging); ``tp-pp-dp`` spreads them
    over machines (-> replication)."""

    failure_domains: tuple[tuple[int, ...], ...] = ()
    """Groups of machines that can fail together (a rack, a power feed), as lists of machine
    indices, e.g. ``[[0, 1], [2, 3]]``. Buddy copies never sit in their owner's domain; machines
    not named form a domain each."""

    def __post_init__(self) -> None:
        domains = self.failure_domains
        if not isinstance(domains, list | tuple) or not all(_is_machine_list(d) for d in domains):
            raise _fail("machines.failure_domains", domains, "a list of non-empty lists of machine indices")
        flat = [m for d in domains for m in d]
        if len(flat) != len(set(flat)):
            raise _fail("machines.failure_domains", domains, "each machine may appear in one domain only")
        object.__setattr__(self, "failure_domains", tuple(tuple(d) for d in domains))
        _check_type("machines.gpus_per_node", self.gpus_per_node, int, "a positive integer")
        if self.gpus_per_node < 1:
            raise _fail("machines.gpus_per_node", self.gpus_per_node, "a positive integer")
        _check_type("machines.rank_order", self.rank_order, str, "a permutation of tp, dp, pp such as tp-dp-pp")
        if sorted(self.rank_order.split("-")) != ["dp", "pp", "tp"]:
            raise _fail("machines.rank_order", self.rank_order, "a permutation of tp, dp, pp such as tp-dp-pp")


@dataclass(frozen=True)
class LoggingConfig:
    """Logging of inter-machine pipeline messages (SWIFT section 5.1)."""

    storage: str = "file://./swift-logs"
    """Global store URL for log chunks: ``file://`` (a shared filesystem such as Lustre or
    NFS), ``hdfs://``/``webhdfs://`` (through the ``hdfs`` package), ``s3://`` (needs s3fs),
    ``memory://`` (tests). A plain path means ``file://``."""

    storage_budget_gb: float | None = None
    """Upper bound on log bytes kept between two global checkpoints. When set, machines are
    grouped (selective logging, section 5.3) so that the logs fit; ``None`` logs every
    machine boundary."""

    groups: int | None = None
    """Force this many balanced machine groups instead of optimising for the budget."""

    chunk_iterations: int = 5
    """Iterations per log chunk file: the unit of upload, download and garbage collection."""

    bubble_only: bool = True
    """Copy logged tensors off the device only during pipeline bubbles (``false`` copies
    right after each send, for comparison)."""

    local_dir: str | None = None
    """Where chunks are written before upload. ``None`` writes straight into ``storage``
    when that is a ``file://`` URL, else into a temporary directory."""

    kinds: str | tuple[str, ...] = "messages"
    """What each stage recovered by logging logs (TranLogs' per-stage mix): ``messages`` (its
    inbound activations and gradients, SWIFT's log: every stage, the default); ``auto`` (per stage
    the fewer bytes per iteration, its inbound messages or its own updates, as measured in the
    first iteration, where both kinds are logged: ds_swift.plan.stage_logging); or one of
    ``messages``/``updates`` per pipeline stage (a list of pp entries; stages not recovered by
    logging ignore theirs). Read under strategy ``auto`` and ``logging``."""

    def __post_init__(self) -> None:
        _check_type("logging.storage", self.storage, str, "a URL such as file:///lustre/logs")
        scheme = urlparse(self.storage).scheme
        # A Windows-style drive letter never reaches here; single letters are not schemes we use.
        if scheme not in STORAGE_SCHEMES:
            allowed = ", ".join(f"{s}://" for s in STORAGE_SCHEMES if s)
            raise _fail("logging.storage", self.storage, f"the scheme must be one of {allowed} or a plain path")
        if self.storage_budget_gb is not None:
            _check_type("logging.storage_budget_gb", self.storage_budget_gb, (int, float), "a positive number of GB or null")
            if self.storage_budget_gb <= 0:
                raise _fail("logging.storage_budget_gb", self.storage_budget_gb, "a positive number of GB or null")
        if self.groups is not None:
            _check_type("logging.groups", self.groups, int, "a positive integer or null")
            if self.groups < 1:
                raise _fail("logging.groups", self.groups, "a positive integer or null")
            if self.storage_budget_gb is not None:
                raise ConfigError(
                    "swift config: logging.groups and logging.storage_budget_gb are both set: "
                    "give one (groups forces K balanced groups, the budget lets ds-swift choose)"
                )
        _check_type("logging.chunk_iterations", self.chunk_iterations, int, "a positive integer")
        if self.chunk_iterations < 1:
            raise _fail("logging.chunk_iterations", self.chunk_iterations, "a positive integer")
        _check_type("logging.bubble_only", self.bubble_only, bool, "true or false")
        if self.local_dir is not None:
            _check_type("logging.local_dir", self.local_dir, str, "a directory path or null")
        kinds = self.kinds
        if isinstance(kinds, list | tuple):
            if not kinds or any(k not in LOG_KINDS for k in kinds):
                raise _fail("logging.kinds", kinds, "a list of messages/updates, one per pipeline stage")
            object.__setattr__(self, "kinds", tuple(kinds))  # frozen config: hashable
        elif kinds not in ("messages", "auto"):
            raise _fail("logging.kinds", kinds, "messages, auto, or a list of messages/updates per pipeline stage")


@dataclass(frozen=True)
class CheckpointConfig:
    """Periodic global checkpoints: the safety net every strategy keeps."""

    dir: str = "./swift-ckpt"
    """Directory (shared by all machines) for DeepSpeed-format global checkpoints. Each names the
    job that wrote it (a hash of the launcher's job token): a recovery loads only this job's own
    (and the one it started from with ``engine.load_checkpoint``), never one newer than the
    iteration the survivors agreed on, and names each other job's checkpoint it skips. Another
    job's checkpoints here do not stop a start (the same command run twice in one directory
    trains from scratch, or from what it loads): to resume, load a checkpoint at start or launch
    with the same ``--job-token``."""

    interval: int = 1000
    """Iterations between global checkpoints. Logs older than the last one are deleted,
    so this also bounds log storage."""

    save_timeout_s: float = 1800.0
    """Op timeout while a checkpoint is saved (DeepSpeed's barriers and ours wait for the slowest
    writer): a slow shared filesystem is not a failure. ``watchdog.op_timeout_s`` applies again
    once the save is done."""

    async_save: bool | None = None
    """Training waits for a host snapshot only; the files are written in the background and the
    checkpoint counts once every rank's are on storage (ds_swift.checkpoint.background). ``null``: on
    for strategies ``global_checkpoint`` and ``checkfreq``, and for every strategy where the state
    is on GPUs (the snapshot is a copy into pinned host memory at PCIe speed, ~30 ms for a 1.6 GB
    state, where a synchronous save of it stalled training 2.4 s on an H100); off for the other
    strategies on CPU (there the background writer competes with the ranks for the same cores)."""

    running_fraction: float | None = None
    """SCAR's prioritized checkpoints (strategy ``scar``; null: off): every ``running_fraction x
    interval`` iterations each rank saves the ``running_fraction`` of its optimizer state (fp32
    masters with their Adam moments, in blocks) that changed most since it was last saved, into a
    running checkpoint under ``dir``/running (as many bytes per ``interval`` as a full checkpoint);
    a lost rank's replacement loads it over the last global checkpoint (ds_swift.checkpoint.running)."""

    def __post_init__(self) -> None:
        if self.running_fraction is not None:
            _check_type("checkpoint.running_fraction", self.running_fraction, (int, float), "null or a number in (0, 1]")
            if not 0 < self.running_fraction <= 1:
                raise _fail("checkpoint.running_fraction", self.running_fraction, "null or a number in (0, 1]")
        if self.async_save is not None:
            _check_type("checkpoint.async_save", self.async_save, bool, "true, false or null")
        _check_type("checkpoint.save_timeout_s", self.save_timeout_s, (int, float), "a positive number of seconds")
        if self.save_timeout_s <= 0:
            raise _fail("checkpoint.save_timeout_s", self.save_timeout_s, "a positive number of seconds")
        _check_type("checkpoint.dir", self.dir, str, "a directory path")
        if not self.dir:
            raise _fail("checkpoint.dir", self.dir, "a non-empty directory path")
        _check_type("checkpoint.interval", self.interval, int, "a positive number of iterations")
        if self.interval < 1:
            raise _fail("checkpoint.interval", self.interval, "a positive number of iterations")


@dataclass(frozen=True)
class BuddyConfig:
    """Buddy copies of each rank's optimizer partition (ZeRO-1, BF16_Optimizer), for recovery
    without the checkpoint when a partition's machine fails (ds_swift.recovery.strategies.buddy)."""

    enabled: bool = True
    """Copy each rank's partition to its buddies after every step (asynchronously, in host
    memory). Has no effect where the optimizer state is not partitioned (a replica holds it)."""

    replication_factor: int = 1
    """How many buddies, each on another machine (and failure domain), hold each partition."""

    def __post_init__(self) -> None:
        _check_type("buddy.enabled", self.enabled, bool, "true or false")
        _check_type("buddy.replication_factor", self.replication_factor, int, "a positive integer")
        if self.replication_factor < 1:
            raise _fail(
                "buddy.replication_factor", self.replication_factor, "a positive integer (disable with enabled: false)"
            )


@dataclass(frozen=True)
class PipeChurnConfig:
    """PipeChurn's erasure-coded in-memory checkpoints (strategy ``pipechurn``): after every step each
    rank's state is cut into ``data_chunks`` + ``parity_chunks`` Reed-Solomon chunks, in host memory of
    as many other machines (ds_swift.recovery.state.erasure): ``parity_chunks`` + 1 losses recovered."""

    data_chunks: int = 2
    """k: each holder keeps 1/k of the state (host memory per rank: (k + r)/k of its state, spread)."""
    parity_chunks: int = 1
    """r: each rank's chunks that may be lost. The job needs k + r machines besides each rank's own."""
    partial_recompute: bool = True
    """Only the lost ranks' passes of the iteration in flight run again, fed by kept sends (device memory:
    one iteration's sends and a gradient copy; ds_swift.recovery.state.inflight); false: all retrain it."""

    def __post_init__(self) -> None:
        for name in ("data_chunks", "parity_chunks"):
            _check_type(f"pipechurn.{name}", getattr(self, name), int, "a positive integer")
            if getattr(self, name) < 1:
                raise _fail(f"pipechurn.{name}", getattr(self, name), "a positive integer")
        _check_type("pipechurn.partial_recompute", self.partial_recompute, bool, "true or false")


@dataclass(frozen=True)
class SimulateConfig:
    """Nicolae et al.'s failure-simulation mode: a failure at ``iteration`` is simulated without
    killing anything, to measure an approximate strategy's effect on the model cheaply
    (ds_swift.runtime.simulate). Off while ``iteration`` is null."""

    iteration: int | None = None
    """The iteration the simulated failure hits (null: off)."""

    strategy: str = "lossy_forward"
    """``lossy_forward``: that iteration averages only the surviving replicas' gradients (the
    ``casualties`` count as zero, from ``upto_layer`` down); ``immediate_rollback``: the ranks of
    ``stepped_stages`` keep that iteration's update, the others do not apply it (undone), and every
    rank trains it again."""

    casualties: tuple[int, ...] = ()
    """lossy_forward: the data-parallel replicas that fail (empty: the last one)."""

    upto_layer: int | None = None
    """lossy_forward: only the gradients of pipeline layers at or before this one are lost (the
    failure hit the backward pass there; later layers were reduced before it); null: every layer,
    what a real failure in DeepSpeed's pipeline loses (it reduces after the whole backward pass)."""

    stepped_stages: tuple[int, ...] = ()
    """immediate_rollback: the pipeline stages whose ranks had stepped when the failure hit."""

    def __post_init__(self) -> None:
        if self.iteration is not None:
            _check_type("simulate_failure.iteration", self.iteration, int, "null or an iteration number >= 0")
            if self.iteration < 0:
                raise _fail("simulate_failure.iteration", self.iteration, "null or an iteration number >= 0")
        if self.strategy not in ("lossy_forward", "immediate_rollback"):
            raise _fail("simulate_failure.strategy", self.strategy, '"lossy_forward" or "immediate_rollback"')
        if self.upto_layer is not None:
            _check_type("simulate_failure.upto_layer", self.upto_layer, int, "null or a pipeline layer index >= 0")
        for name in ("casualties", "stepped_stages"):
            value = getattr(self, name)
            _check_type(f"simulate_failure.{name}", value, (list, tuple), "a list of indices >= 0")
            for v in value:
                _check_type(f"simulate_failure.{name}", v, int, "a list of indices >= 0")
                if v < 0:
                    raise _fail(f"simulate_failure.{name}", value, "a list of indices >= 0")
            object.__setattr__(self, name, tuple(value))


@dataclass(frozen=True)
class ElasticConfig:
    """Elastic shrink (strategy ``lossy_forward``, Nicolae et al. section III-B): with no spare
    machine left (``ds-swift-launch --elastic``), the job goes on without the failed machine's
    data-parallel replicas instead of stopping (ds_swift.recovery.shrink)."""

    enabled: bool = False
    """Shrink data parallelism when the launcher has no spare machine left."""

    global_batch: str = "keep"
    """``keep``: the global batch stays the same, each remaining replica accumulating more
    micro-batches (``gradient_accumulation_steps`` x dp / new dp; the same samples, the same
    update up to the summation order); ``shrink``: the accumulation stays, the global batch shrinks
    with the replicas (the casualties' samples are left out from then on)."""

    min_data_parallel: int = 1
    """Below this many data-parallel replicas the job stops instead of shrinking further."""

    def __post_init__(self) -> None:
        _check_type("elastic.enabled", self.enabled, bool, "true or false")
        if self.global_batch not in ("keep", "shrink"):
            raise _fail("elastic.global_batch", self.global_batch, '"keep" or "shrink"')
        _check_type("elastic.min_data_parallel", self.min_data_parallel, int, "an integer >= 1")
        if self.min_data_parallel < 1:
            raise _fail("elastic.min_data_parallel", self.min_data_parallel, "an integer >= 1")


@dataclass(frozen=True)
class VerifyConfig:
    """Verified recovery: every restored rank's state is checked against a reference digest before
    training resumes; a mismatch falls back to the global checkpoint, naming the tensor
    (ds_swift.recovery.verify)."""

    enabled: bool = True
    """Check restored state (parameters, fp32 masters, optimizer state) bitwise: against the donor's
    digest (replication, buddy copies), or against the digest the lost rank published while alive
    (logging-based replay)."""

    digest_interval: int = 10
    """Iterations between the state digests each rank publishes (a few bytes per tensor to the job
    store; only where a recovery may check against them: strategies ``auto``, ``replication``,
    ``logging``, ``tranlogs``, ``pipechurn``, ``lossy_forward``). A replay is checked at the newest published iteration it reaches
    (the iterations it replays after that one, fewer than ``digest_interval``, are not); a state
    rebuilt to an iteration without a digest (re-applied updates, decoded chunks, a survivor's own
    copy, a replicated or buddy copy, an elastic reshard: only the transport is checked then) is
    unverified, and said so. Set 1 to check every recovery at its exact iteration.

    Why 10: a digest reads the whole state once and moves ~34 bytes per 4-byte word through int64
    temporaries (ds_swift.recovery.state.digest), on a GPU in kernels on a side stream that the training
    thread never waits for: an estimated ~5 ms of HBM time for a 1.6 GB state (100M parameters, bf16 + fp32
    masters + Adam moments, at ~3 TB/s), i.e. 0.5 ms per iteration of a ~100 ms step at 10, a
    quarter of the 2 % budget for all protection (an H100 took 373-456 ms per digest with the old
    host-synchronising code at interval 1: 3x slower steps). On the tiny CPU GPT a digest costs a
    rank a few ms of a background thread (benchmarks/digest_overhead.py). ds-swift prints the
    estimate at start-up."""

    guard_iterations: int = 20
    """Iterations watched after every recovery (ds_swift.runtime.guard): a non-finite loss, or one
    diverging from the run's losses before the failure (see ``guard_loss_factor``), steps every rank
    back to the global checkpoint, loudly, once; a second trip ends the job with the reason instead
    of looping through restarts. 0 turns the guard off."""

    guard_loss_factor: float = 2.0
    """A loss above this many times the largest of the last 10 losses before the failure diverges
    (fp16 loss-scale skips are not judged). Must be more than 1."""

    def __post_init__(self) -> None:
        _check_type("verify.enabled", self.enabled, bool, "true or false")
        _check_type("verify.guard_iterations", self.guard_iterations, int, "a number of iterations >= 0 (0: off)")
        if self.guard_iterations < 0:
            raise _fail("verify.guard_iterations", self.guard_iterations, "a number of iterations >= 0 (0: off)")
        _check_type("verify.guard_loss_factor", self.guard_loss_factor, (int, float), "a number > 1, e.g. 2.0")
        if not self.guard_loss_factor > 1:
            raise _fail("verify.guard_loss_factor", self.guard_loss_factor, "a number > 1, e.g. 2.0")
        _check_type("verify.digest_interval", self.digest_interval, int, "a positive number of iterations")
        if self.digest_interval < 1:
            raise _fail("verify.digest_interval", self.digest_interval,
                        "a positive number of iterations (turn verification off with verify.enabled: false)")  # fmt: skip


@dataclass(frozen=True)
class CheckFreqConfig:
    """Strategy ``checkfreq``: asynchronous checkpoints at an interval chosen from measured costs
    (ds_swift.checkpoint.checkfreq); ``checkpoint.interval`` is then not used."""

    max_overhead: float = 0.05
    """The share of training time the checkpoint snapshots may take (CheckFreq's p)."""

    profile_at: int = 5
    """The first checkpoint, after this many iterations, measures the costs."""

    def __post_init__(self) -> None:
        _check_type("checkfreq.max_overhead", self.max_overhead, (int, float), "a fraction in (0, 1)")
        if not 0 < self.max_overhead < 1:
            raise _fail("checkfreq.max_overhead", self.max_overhead, "a fraction in (0, 1), e.g. 0.05")
        _check_type("checkfreq.profile_at", self.profile_at, int, "a positive number of iterations")
        if self.profile_at < 2:
            raise _fail("checkfreq.profile_at", self.profile_at, "at least 2 iterations (the first one warms up)")


@dataclass(frozen=True)
class WatchdogConfig:
    """Failure detection inside each worker."""

    poll_interval_s: float = 0.1
    """How often the watchdog thread reads the job's failure flag."""

    heartbeat_timeout_s: float = 10.0
    """A worker whose heartbeat is older than this is declared failed. Each worker writes its
    heartbeat, and reads its watched peers', every tenth of this (at least every
    ``poll_interval_s``): at 10 s, once a second."""

    op_timeout_s: float = 30.0
    """Timeout of every collective and point-to-point op: the longest a survivor blocked on
    a living peer can wait before it notices the failure by itself."""

    hang_timeout_s: float | None = 120.0
    """A training thread that starts no pipeline instruction for this long, in the middle of an
    iteration, is hung: its machine is failed and replaced (ds_swift.detect.progress). The longest
    one instruction (a forward, a backward, an optimizer step) may take; more than
    ``op_timeout_s``, so that ranks waiting on a hung one in an op time out before they look hung
    themselves; null turns it off."""

    def __post_init__(self) -> None:
        for name in ("poll_interval_s", "heartbeat_timeout_s", "op_timeout_s"):
            value = getattr(self, name)
            _check_type(f"watchdog.{name}", value, (int, float), "a positive number of seconds")
            if value <= 0:
                raise _fail(f"watchdog.{name}", value, "a positive number of seconds")
        if self.hang_timeout_s is not None:
            _check_type("watchdog.hang_timeout_s", self.hang_timeout_s, (int, float),
                        "a positive number of seconds, or null (off)")  # fmt: skip
            if self.hang_timeout_s <= self.op_timeout_s:
                # A rank waiting in an op on the hung one must time out (and stop counting) first.
                raise _fail("watchdog.hang_timeout_s", self.hang_timeout_s,
                            f"more than watchdog.op_timeout_s={self.op_timeout_s}, or null (off)")  # fmt: skip
        if self.poll_interval_s >= self.heartbeat_timeout_s:
            raise ConfigError(
                f"swift config: watchdog.poll_interval_s={self.poll_interval_s} must be smaller "
                f"than watchdog.heartbeat_timeout_s={self.heartbeat_timeout_s}"
            )


@dataclass(frozen=True)
class SwiftConfig:
    """Everything ds-swift reads from ``ds_config["swift"]``."""

    enabled: bool = False
    """Turn ds-swift on. With ``false`` the engine is left exactly as DeepSpeed built it."""

    machines: MachinesConfig = field(default_factory=MachinesConfig)
    """Rank-to-machine mapping."""

    strategy: Strategy = "auto"
    """``auto`` lets the topology analyzer choose per stage (replication where a replica
    lives on another machine, else logging where it is worth it, else checkpoint);
    ``replication``/``logging``/``checkpoint`` force one for every stage. ``global_checkpoint``:
    every rank reloads the last global checkpoint, saved asynchronously; ``checkfreq``: the same,
    at an interval CheckFreq's rule chooses (see ``checkfreq``); ``tranlogs``: every rank logs its
    optimizer update after each step to ``logging.storage``, and a lost rank's replacement loads the
    last global checkpoint and re-applies its updates (no recompute, survivors keep their state);
    ``pipechurn``: every rank's state after each step, erasure-coded into the host memory of other
    machines (see ``pipechurn``), is rebuilt from the surviving chunks. ``scar``: SCAR's partial
    recovery, approximate: the lost ranks' replacements load the last global checkpoint, the
    survivors keep their state, and training goes on from that mixed state without a replay.
    ``immediate_rollback``: Nicolae et al.'s, approximate: no undo; the survivors' state as it is
    (a rank that stepped the failed iteration keeps that update) goes to the replacements (from a
    data-parallel replica, or the newest buddy copy of a ZeRO-1 partition) and the failed
    mini-batch is replayed. ``lossy_forward``: Nicolae et al.'s, approximate: the state is restored
    as by ``auto`` (replica or buddy copies), then the failed iteration averages only the gradients
    of the data-parallel replicas that lost no rank."""

    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Message logging for logging-based recovery."""

    parallel_recovery: bool = False
    """Let survivors share the replay of a failed machine's micro-batches (section 5.2)."""

    parallel_recovery_mode: ParallelRecoveryMode = "exact"
    """``exact`` combines micro-batch gradients in the original order (bitwise equal to
    sequential replay); ``fast`` uses a plain all-reduce."""

    parallel_recovery_force: bool = False
    """Use parallel recovery even where the recovery plan finds it cannot help (the replayers would
    share one host's CPU cores: a CPU job with fewer cores than replaying ranks on a host). Off: the
    plan says why and replays sequentially."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Global checkpoints."""

    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """Failure detection."""

    buddy: BuddyConfig = field(default_factory=BuddyConfig)
    """Buddy copies of ZeRO-1 / BF16_Optimizer partitions."""

    checkfreq: CheckFreqConfig = field(default_factory=CheckFreqConfig)
    """CheckFreq's interval choice (strategy ``checkfreq``)."""

    verify: VerifyConfig = field(default_factory=VerifyConfig)
    """Verified recovery: restored state checked against reference digests."""

    pipechurn: PipeChurnConfig = field(default_factory=PipeChurnConfig)
    """PipeChurn's erasure coding (strategy ``pipechurn``)."""

    simulate_failure: SimulateConfig = field(default_factory=SimulateConfig)
    """Nicolae et al.'s failure-simulation mode (off unless its ``iteration`` is set)."""

    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    """Elastic shrink with no spare left (strategy ``lossy_forward``)."""

    run_dir: str = "./swift-run"
    """Where recovery timelines and the job's own records are written."""

    def __post_init__(self) -> None:
        for name, sub in _NESTED.items():
            if not isinstance(getattr(self, name), sub):
                raise _fail(name, getattr(self, name), f"a {sub.__name__} (use SwiftConfig.from_dict for JSON)")
        _check_type("enabled", self.enabled, bool, "true or false")
        if self.strategy not in get_args(Strategy):
            raise _fail("strategy", self.strategy, f"one of {', '.join(get_args(Strategy))}")
        _check_type("parallel_recovery", self.parallel_recovery, bool, "true or false")
        if self.parallel_recovery_mode not in get_args(ParallelRecoveryMode):
            raise _fail("parallel_recovery_mode", self.parallel_recovery_mode, "exact or fast")
        _check_type("parallel_recovery_force", self.parallel_recovery_force, bool, "true or false")
        if self.parallel_recovery_force and not self.parallel_recovery:
            raise ConfigError("swift config: parallel_recovery_force=true forces parallel recovery, which is off "
                              "(parallel_recovery=false): set \"parallel_recovery\": true, or drop parallel_recovery_force")
        _check_type("run_dir", self.run_dir, str, "a directory path")
        if self.checkpoint.running_fraction is not None and self.strategy != "scar":
            raise ConfigError(
                f"swift config: checkpoint.running_fraction={self.checkpoint.running_fraction!r} is read only by "
                f'strategy "scar" (SCAR\'s partial recovery), not {self.strategy!r}: set "strategy": "scar", or '
                "remove checkpoint.running_fraction"
            )
        if self.elastic.enabled and self.strategy != "lossy_forward":
            raise ConfigError(
                f"swift config: elastic.enabled=true needs \"strategy\": \"lossy_forward\" (the survivors go on "
                f"without the lost replicas' samples of the failed iteration), not {self.strategy!r}: set the "
                "strategy, or remove elastic.enabled"
            )

    # ----------------------------------------------------------------- constructors
    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> SwiftConfig:
        """Build from the ``swift`` section itself (``None`` or ``{}`` gives the defaults)."""
        return _build(cls, {} if section is None else section, "")

    @classmethod
    def from_ds_config(cls, ds_config: Mapping[str, Any] | str | os.PathLike[str]) -> SwiftConfig:
        """Build from a whole DeepSpeed config: a dict, or the path of its JSON file."""
        cfg = load_ds_config(ds_config)
        return cls.from_dict(cfg.get("swift"))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def recovery_strategy(self) -> str:
        """The strategy recovery forces (``checkpoint`` for every checkpoint-reload scheme)."""
        return "checkpoint" if self.strategy in CHECKPOINT_STRATEGIES else self.strategy

    @property
    def analyzer_strategy(self) -> str:
        """What the topology analyzer is asked to plan per stage: ``tranlogs``, ``pipechurn`` and
        ``scar`` (and ``immediate_rollback``, ``lossy_forward``) log no pipeline message, so there no stage recovers by message logging (each
        restores its lost ranks from the checkpoint, or from chunks, its own way: ``checkpoint``)."""
        own = ("tranlogs", "pipechurn", "scar", "immediate_rollback", "lossy_forward")
        return "checkpoint" if self.recovery_strategy in own else self.recovery_strategy

    @property
    def async_checkpoints(self) -> bool:
        """Whether periodic checkpoints are asynchronous for a state on CPU (see ``checkpoint.async_save``)."""
        return self.async_checkpoints_for(gpu=False)

    def async_checkpoints_for(self, gpu: bool) -> bool:
        """Whether periodic checkpoints are asynchronous for a state on GPUs (``gpu``) or on CPU."""
        if self.checkpoint.async_save is not None:
            return self.checkpoint.async_save
        return gpu or self.strategy in ("global_checkpoint", "checkfreq")


def load_ds_config(ds_config: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """Return a DeepSpeed config as a dict, reading it if given a path."""
    if isinstance(ds_config, Mapping):
        return dict(ds_config)
    path = Path(ds_config)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"DeepSpeed config {str(path)!r} cannot be read: {exc.strerror}") from exc
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"DeepSpeed config {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ConfigError(f"DeepSpeed config {str(path)!r} must hold a JSON object at its top level")
    return cfg


_NESTED: dict[str, type] = {
    "machines": MachinesConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
    "watchdog": WatchdogConfig,
    "buddy": BuddyConfig,
    "checkfreq": CheckFreqConfig,
    "verify": VerifyConfig,
    "pipechurn": PipeChurnConfig,
    "simulate_failure": SimulateConfig,
    "elastic": ElasticConfig,
}


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        where = prefix.rstrip(".") or "swift"
        raise ConfigError(f"swift config: {where} must be a JSON object, got {data!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"swift config: unknown key {', '.join(repr(prefix + u) for u in unknown)}; "
            f"allowed keys under {prefix.rstrip('.') or 'swift'}: {', '.join(sorted(names))}"
        )
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        sub = _NESTED.get(key) if cls is SwiftConfig else None
        kwargs[key] = _build(sub, value, f"{prefix}{key}.") if sub is not None else value
    return cls(**kwargs)
