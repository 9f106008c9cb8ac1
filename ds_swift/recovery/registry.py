"""The registered recovery strategies: a new strategy is one module and one line in this list.

Each strategy owns both halves: what runs while nothing fails (its
:class:`~ds_swift.recovery.services.StrategyServices`) and the restore. The config's ``strategy``
is ``auto`` or one of these names (:func:`registered_names`).

The order here does not matter (the registry asks the cheapest first, see
:meth:`~ds_swift.recovery.base.Registry.choose`); the global checkpoint is the fallback.

Each line names its strategy and the class that implements it; the classes (and with them torch and
DeepSpeed) are imported where :data:`STRATEGIES` is first used, so that checking a config's
``strategy`` (the launcher, ``ds-swift plan``, a helper whose stdout a shell reads) stays cheap.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from ds_swift.config import ConfigError, SwiftConfig
from ds_swift.config.checks import _fail
from ds_swift.recovery.base import RecoveryStrategy, Registry
from ds_swift.recovery.consensus import LoggingSetup, RankReport, RecoveryInputs, RecoveryPlan
from ds_swift.recovery.services import StrategyServices

__all__ = [
    "FALLBACK",
    "GLOBAL_CHECKPOINT",
    "REGISTERED",
    "STRATEGIES",
    "checked",
    "declared_by",
    "load_config",
    "plan_recovery",
    "registered_names",
    "services_of",
    "strategies",
    "strategy_names",
]

STRATEGIES: Registry
"""Every registered strategy and the fallback (built on first use: :func:`__getattr__`)."""

_STRATEGIES = "ds_swift.recovery.strategies"
#: the asynchronous global checkpoint: the baseline the what-if simulator compares every strategy with
#: (``ds-swift simulate``; the bench profile's row of the fallback takes this name: ds_swift.bench.profile)
GLOBAL_CHECKPOINT = "global_checkpoint"
#: (name, module:class) of every registered strategy
REGISTERED: tuple[tuple[str, str], ...] = (
    ("replication", f"{_STRATEGIES}.replication:ReplicationStrategy"),
    ("buddy", f"{_STRATEGIES}.buddy:BuddyStrategy"),
    ("logging", f"{_STRATEGIES}.message_logging:LoggingStrategy"),
    ("tranlogs", f"{_STRATEGIES}.tranlogs:TranLogsStrategy"),
    ("pipechurn", f"{_STRATEGIES}.pipechurn:PipeChurnStrategy"),
    ("scar", f"{_STRATEGIES}.scar:ScarStrategy"),
    ("immediate_rollback", f"{_STRATEGIES}.rollback:ImmediateRollbackStrategy"),
    ("lossy_forward", f"{_STRATEGIES}.lossy:LossyForwardStrategy"),
    ("elastic", f"{_STRATEGIES}.elastic:ElasticStrategy"),
    (GLOBAL_CHECKPOINT, f"{_STRATEGIES}.global_checkpoint:AsyncGlobalCheckpointStrategy"),
    ("checkfreq", f"{_STRATEGIES}.checkfreq:CheckFreqStrategy"),
)
#: the fallback: last, always able
FALLBACK = ("checkpoint", f"{_STRATEGIES}.global_checkpoint:GlobalCheckpointStrategy")


def _load(name: str, where: str) -> RecoveryStrategy:
    module, cls = where.split(":")
    strategy = getattr(importlib.import_module(module), cls)()
    if strategy.name != name:  # the line and the class must agree, or the config would name a stranger
        raise RuntimeError(f"the registry line {name!r} loads {where}, whose name is {strategy.name!r}")
    return strategy


def registered_names() -> list[str]:
    """The registered strategies' names (of :data:`STRATEGIES` where it is built, else of the lines)."""
    built = globals().get("STRATEGIES")
    if isinstance(built, Registry):
        return built.names()
    return [name for name, _ in REGISTERED] + [FALLBACK[0]]


def strategy_names() -> tuple[str, ...]:
    """The values ``strategy`` may take: ``auto`` and every registered recovery strategy's name."""
    return ("auto", *registered_names())


def strategies() -> Registry:
    """:data:`STRATEGIES` (built here on first use)."""
    built = globals().get("STRATEGIES")
    return built if isinstance(built, Registry) else __getattr__("STRATEGIES")


def declared_by(name: str, pp: int = 2) -> RecoveryStrategy | None:
    """The registered strategy named ``name``, or the one declaring a bench variant of that name
    (:meth:`~ds_swift.recovery.base.RecoveryStrategy.bench_variants`, for a job of ``pp`` stages);
    None: neither."""
    registry = strategies()
    owners = [registry.get(n) for n in registry.names()]
    return next((s for s in owners if s.name == name), None) or next(
        (s for s in owners if name in s.bench_variants(pp)), None
    )


def __getattr__(name: str) -> Any:
    """``STRATEGIES``: the registry, built on first use (PEP 562)."""
    if name != "STRATEGIES":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    registry = Registry([_load(n, w) for n, w in REGISTERED], fallback=_load(*FALLBACK))
    globals()["STRATEGIES"] = registry
    return registry


def plan_recovery(
    reports: Iterable[RankReport],
    zero_stage: int = 0,
    forced: str = "auto",
    optimizer: str | None = None,
    logging: LoggingSetup | None = None,
    checkpoint_step: int | None = None,
    registry: Registry | None = None,
    partitioned: bool = False,
) -> RecoveryPlan:
    """The plan every rank computes from every rank's report: the consensus, then the cheapest
    registered strategy able to restore the lost ranks (pure: no process group).

    Args:
        reports: one report per rank of the new generation.
        zero_stage: the ZeRO stage; above 0 each rank holds the only copy of its optimizer partition.
        forced: the config's ``strategy`` (auto, or a registered strategy's name).
        optimizer: the name of an optimizer wrapper whose state survivors cannot keep across the
            rebuild, or None.
        logging: what logging-based recovery may use (None: no message log).
        checkpoint_step: the newest complete global checkpoint (default: ``logging``'s, else -1).
        registry: the strategies to choose from (default: :data:`STRATEGIES`).
        partitioned: each data-parallel rank holds only its slice of the optimizer state.
    """
    if checkpoint_step is None:
        checkpoint_step = logging.checkpoint_step if logging is not None else -1
    inputs = RecoveryInputs.agree(
        reports,
        checkpoint_step=checkpoint_step,
        logging=logging,
        forced=forced,
        zero_stage=zero_stage,
        optimizer_wrapper=optimizer,
        partitioned=partitioned,
    )
    return (registry or strategies()).choose(inputs)[0]


def services_of(cfg: SwiftConfig) -> StrategyServices:
    """What the job runs while nothing fails under ``cfg.strategy`` (its set-up half): the one way to
    read a strategy's services (imports every strategy, torch and DeepSpeed, on first use)."""
    return strategies().services_for(cfg)


def load_config(ds_config: Mapping[str, Any] | str | os.PathLike[str]) -> SwiftConfig:
    """The ``swift`` section of a DeepSpeed config (a dict or a JSON file's path), parsed and
    :func:`checked`: what every entry point reads."""
    return checked(SwiftConfig.from_ds_config(ds_config))


def checked(cfg: SwiftConfig) -> SwiftConfig:
    """``cfg`` checked against the registered strategies (ConfigError naming the field and the fix):
    ``strategy`` and ``simulate_failure.strategy`` name one, and a field only other strategies read
    is not set. A config written before ``elastic`` was a strategy of its own comes back rewritten."""
    names = strategy_names()
    if cfg.strategy not in names:
        raise _fail("strategy", cfg.strategy, f"one of {', '.join(names)}")
    sim = cfg.simulate_failure
    # The registered names are cheap to check; which of them simulate, only once the mode is on.
    simulated = strategies().simulated_names() if sim.iteration is not None else list(registered_names())
    if sim.strategy not in simulated:
        raise _fail("simulate_failure.strategy", sim.strategy, f"one of {', '.join(simulated)}")
    cfg = _elastic_renamed(cfg)
    if cfg.checkpoint.running_fraction is not None and not services_of(cfg).running_checkpoint:
        raise ConfigError(
            f"swift config: checkpoint.running_fraction={cfg.checkpoint.running_fraction!r} is read only by "
            f"strategy {_strategies_with(cfg, 'running_checkpoint')} (prioritized running checkpoints), not "
            f'{cfg.strategy!r}: set "strategy" to one of them, or remove checkpoint.running_fraction'
        )
    if cfg.buddy.fixed_interval not in (None, 1) and services_of(cfg).erasure_chunks:
        raise ConfigError(
            f"swift config: buddy.interval={cfg.buddy.interval!r} spaces buddy copies, which strategy "
            f"{cfg.strategy!r} does not make: it keeps erasure-coded chunks of every rank's state after every "
            "step (pipechurn section): remove buddy.interval"
        )
    return cfg


def _elastic_renamed(cfg: SwiftConfig) -> SwiftConfig:
    """``elastic.enabled`` is read only by a strategy with the elastic service: the configs written
    before elastic was a strategy of its own (``lossy_forward`` + ``elastic.enabled``) are still
    served, with a warning; any other strategy beside it is refused."""
    if not cfg.elastic.enabled or services_of(cfg).elastic:
        return cfg
    elastic = _strategies_with(cfg, "elastic")
    if cfg.strategy == "lossy_forward" and elastic:
        warnings.warn(
            f'swift config: "strategy": "lossy_forward" with elastic.enabled=true is deprecated: '
            f'write "strategy": "{elastic[0]}" (elastic.enabled is then not needed)',
            FutureWarning,
            stacklevel=4,
        )
        return dataclasses.replace(cfg, strategy=elastic[0])
    raise ConfigError(
        f"swift config: elastic.enabled=true is read only by strategy {elastic} (the job goes on with fewer "
        f'data-parallel replicas when no spare is left), not {cfg.strategy!r}: set "strategy" to one of '
        "them, or remove elastic.enabled"
    )


def _strategies_with(cfg: SwiftConfig, service: str) -> list[str]:
    """The registered strategies whose services under ``cfg`` have ``service`` (for an error to name them)."""
    registry = strategies()
    return [n for n in registry.names() if getattr(registry.get(n).services(cfg), service)]
