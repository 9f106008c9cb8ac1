"""The job-wide ``swift`` config sections: machines, message logging, global checkpoints, failure
detection and verification (the strategies' own sub-sections: :mod:`ds_swift.config.strategy_sections`)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

from ds_swift.config.checks import ConfigError, _check_type, _fail, _is_machine_list

__all__ = [
    "LOG_KINDS",
    "STORAGE_SCHEMES",
    "CheckpointConfig",
    "LoggingConfig",
    "MachinesConfig",
    "VerifyConfig",
    "WatchdogConfig",
]

#: URL schemes the global store understands (see ds_swift.storage). "" is a plain path.
STORAGE_SCHEMES = ("", "file", "hdfs", "webhdfs", "s3", "memory")

#: What a stage recovered by logging may log (``logging.kinds``).
LOG_KINDS = ("messages", "updates")


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
            _check_type(
                "logging.storage_budget_gb", self.storage_budget_gb, (int, float), "a positive number of GB or null"
            )
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
            _check_type(
                "checkpoint.running_fraction", self.running_fraction, (int, float), "null or a number in (0, 1]"
            )
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
    store; only where a recovery may check against them: the strategies whose services have
    ``digests``, ds_swift.recovery.services, e.g. ``auto``, ``replication``, ``logging``). A replay is checked at the newest published iteration it reaches
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
            raise _fail(
                "verify.digest_interval",
                self.digest_interval,
                "a positive number of iterations (turn verification off with verify.enabled: false)",
            )


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
            _check_type(
                "watchdog.hang_timeout_s",
                self.hang_timeout_s,
                (int, float),
                "a positive number of seconds, or null (off)",
            )
            if self.hang_timeout_s <= self.op_timeout_s:
                # A rank waiting in an op on the hung one must time out (and stop counting) first.
                raise _fail(
                    "watchdog.hang_timeout_s",
                    self.hang_timeout_s,
                    f"more than watchdog.op_timeout_s={self.op_timeout_s}, or null (off)",
                )
        if self.poll_interval_s >= self.heartbeat_timeout_s:
            raise ConfigError(
                f"swift config: watchdog.poll_interval_s={self.poll_interval_s} must be smaller "
                f"than watchdog.heartbeat_timeout_s={self.heartbeat_timeout_s}"
            )
