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

``strategy`` is ``auto`` or the name of a registered recovery strategy. This package is a leaf (it
imports nothing of ds_swift but itself): what can be checked against the registered strategies (a
``strategy`` or ``simulate_failure.strategy`` that names none, a field only another strategy reads)
and what a strategy runs while nothing fails are :func:`ds_swift.recovery.registry.checked` and
:func:`ds_swift.recovery.registry.services_of`, which every entry point calls
(``ds_swift.initialize``, ``ds_swift.init_distributed``, the launcher's preflight, ``ds-swift plan``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from ds_swift.config.checks import ConfigError, _check_type, _fail
from ds_swift.config.sections import (
    LOG_KINDS,
    STORAGE_SCHEMES,
    CheckpointConfig,
    LoggingConfig,
    MachinesConfig,
    VerifyConfig,
    WatchdogConfig,
)
from ds_swift.config.strategy_sections import (
    BuddyConfig,
    CheckFreqConfig,
    ElasticConfig,
    PipeChurnConfig,
    SimulateConfig,
)

__all__ = [
    "LOG_KINDS",
    "BuddyConfig",
    "CheckFreqConfig",
    "CheckpointConfig",
    "ConfigError",
    "ElasticConfig",
    "LoggingConfig",
    "MachinesConfig",
    "PipeChurnConfig",
    "STORAGE_SCHEMES",
    "SimulateConfig",
    "SwiftConfig",
    "VerifyConfig",
    "WatchdogConfig",
    "left_off",
    "load_ds_config",
]

ParallelRecoveryMode = Literal["exact", "fast"]


@dataclass(frozen=True)
class SwiftConfig:
    """Everything ds-swift reads from ``ds_config["swift"]``."""

    enabled: bool = False
    """Turn ds-swift on. With ``false`` the engine is left exactly as DeepSpeed built it."""

    machines: MachinesConfig = field(default_factory=MachinesConfig)
    """Rank-to-machine mapping."""

    strategy: str = "auto"
    """``auto``, or the name of a registered recovery strategy (:mod:`ds_swift.recovery.registry`;
    each module's docstring says what it does). ``auto`` runs the protections of every strategy it
    may choose (replicas, buddy copies, message logging where the topology analyzer finds it worth
    it) and, after a failure, takes the cheapest that can restore the lost ranks; the global
    checkpoint is every strategy's fallback. Naming one strategy runs only what it needs:
    ``replication``, ``buddy``, ``logging``, ``tranlogs``, ``pipechurn`` are exact; ``checkpoint``,
    ``global_checkpoint`` (saved asynchronously) and ``checkfreq`` (at an interval CheckFreq chooses,
    see ``checkfreq``) reload the last global checkpoint; ``scar``, ``immediate_rollback``,
    ``lossy_forward`` and ``elastic`` (no spare left: fewer data-parallel replicas, see ``elastic``)
    are approximate and say by how much."""

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
    """Elastic shrink with no spare left (strategy ``elastic``)."""

    run_dir: str = "./swift-run"
    """Where recovery timelines and the job's own records are written."""

    def __post_init__(self) -> None:
        for name, sub in _NESTED.items():
            if not isinstance(getattr(self, name), sub):
                raise _fail(name, getattr(self, name), f"a {sub.__name__} (use SwiftConfig.from_dict for JSON)")
        _check_type("enabled", self.enabled, bool, "true or false")
        _check_type("strategy", self.strategy, str, "auto or a registered strategy's name")
        _check_type("parallel_recovery", self.parallel_recovery, bool, "true or false")
        if self.parallel_recovery_mode not in get_args(ParallelRecoveryMode):
            raise _fail("parallel_recovery_mode", self.parallel_recovery_mode, "exact or fast")
        _check_type("parallel_recovery_force", self.parallel_recovery_force, bool, "true or false")
        if self.parallel_recovery_force and not self.parallel_recovery:
            raise ConfigError(
                "swift config: parallel_recovery_force=true forces parallel recovery, which is off "
                '(parallel_recovery=false): set "parallel_recovery": true, or drop parallel_recovery_force'
            )
        _check_type("run_dir", self.run_dir, str, "a directory path")

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


def left_off(section: Any) -> str | None:
    """Why a ``swift`` section leaves ds-swift off although it configures it (None: it does not).

    A section with settings but no ``enabled`` key reads as "turn it on" to most who write it, and
    ``enabled`` is false by default: the job would train unprotected without a word. Every entry
    point (``ds_swift.init_distributed``, ``ds_swift.initialize``, the launcher's preflight) refuses
    it instead; ``"enabled": false`` keeps a section that is meant to be off."""
    if not isinstance(section, Mapping) or not section or "enabled" in section:
        return None
    keys = ", ".join(sorted(map(str, section)))
    return (
        f'swift config: the swift section sets {keys} but not "enabled", so ds-swift would be off and the job '
        'would train unprotected: add "enabled": true to turn it on (in a Megatron script: or pass --swift), '
        'or "enabled": false to train without it'
    )


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
