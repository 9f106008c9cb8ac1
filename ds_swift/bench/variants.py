"""What ``ds-swift bench --strategies`` may name: the config's ``strategy`` values, the variants the
registered strategies declare (:meth:`ds_swift.recovery.base.RecoveryStrategy.bench_variants`: PipeChurn
without and with partial recomputation, logging with and without parallel recovery, ...), and the
reference ``none`` (ds-swift off). A new strategy, or a new variant of one, needs no edit here.
"""

from __future__ import annotations

from typing import Any

from ds_swift.bench.jobs import BenchError
from ds_swift.recovery.base import BenchVariant
from ds_swift.recovery.registry import strategies, strategy_names

__all__ = ["REFERENCE", "bench_strategies", "bench_variants", "has_spare", "strategy_overrides"]

#: the job every row is compared with: ds-swift off, no fault tolerance at all
REFERENCE = "none"


def bench_variants(pp: int = 2) -> dict[str, tuple[str, BenchVariant]]:
    """variant name -> (the strategy that declares it, the variant), for a job of ``pp`` pipeline stages."""
    registry = strategies()
    out: dict[str, tuple[str, BenchVariant]] = {}
    for name in registry.names():
        for variant, how in registry.get(name).bench_variants(pp).items():
            out[variant] = (name, how)
    return out


def bench_strategies() -> tuple[str, ...]:
    """Every name ``--strategies`` takes besides the reference: the config's, then the variants."""
    return (*strategy_names(), *bench_variants())


def has_spare(name: str) -> bool:
    """Whether the failure job of ``name`` has a spare machine (a variant may run without: a shrink)."""
    variant = bench_variants().get(name)
    return variant is None or variant[1].spare


def strategy_overrides(name: str, interval: int, pp: int = 2) -> dict[str, Any]:
    """The ``swift`` section overrides one strategy's jobs run with (``pp``: the job's pipeline stages)."""
    if name == REFERENCE:
        return {"enabled": False}
    variants = bench_variants(pp)
    if name in variants:
        strategy, variant = variants[name]
        return {"strategy": strategy, **variant.swift, "checkpoint": {"interval": interval}}
    if name not in strategy_names():
        raise BenchError(f"--strategies: unknown strategy {name!r}; choose from {', '.join(bench_strategies())}")
    return {"strategy": name, "checkpoint": {"interval": interval}}
