"""The storage budget at runtime: the logging plan an engine starts with, and the one it switches to.

A DeepSpeed config says nothing of the hidden size or the sequence length, so under a
``logging.storage_budget_gb`` a running engine cannot size its pipeline messages before it has
sent some. It starts with :func:`conservative_plan` (every machine its own logging group: every
cross-machine send into a stage recovered by logging is logged, as without a budget), measures in
its first iteration what each logged send wrote and how long the iteration took
(:class:`~ds_swift.plan.sizes.MeasuredSizes`), and then every rank computes the same
:func:`budget_plan` from the same figures and logs by it from the next iteration on.

Grouping only removes cuts, so whatever the budgeted plan logs the conservative one logged too:
the first iteration's log serves a recovery under either plan. A budget that no grouping that
logs can meet is an error naming the field and the smallest budget that works (:func:`budget_error`),
never a plan that silently logs nothing. Pure functions: no process group.
"""

from __future__ import annotations

from ds_swift.config import ConfigError, SwiftConfig
from ds_swift.plan.analysis import Plan, analyze, analyze_config
from ds_swift.plan.layout import ParallelLayout
from ds_swift.plan.sizes import GB, MeasuredSizes

__all__ = ["budget_error", "budget_plan", "conservative_plan", "describe", "needs_measuring"]


def conservative_plan(layout: ParallelLayout, cfg: SwiftConfig) -> Plan:
    """The plan before any message was measured: the config's, with its storage budget not yet applied."""
    budget = cfg.logging.storage_budget_gb
    plan = analyze(
        layout,
        None,
        strategy=cfg.analyzer_strategy,
        groups=cfg.logging.groups,
        checkpoint_interval=cfg.checkpoint.interval,
        parallel_recovery=cfg.parallel_recovery,
    )
    if budget is None or not plan.logged_edges:
        return plan
    note = (
        f"logging.storage_budget_gb={budget:g} is applied once the first iteration's messages are measured; "
        "until then every machine boundary is logged"
    )
    return _with_note(plan, note)


def needs_measuring(cfg: SwiftConfig, plan: Plan) -> bool:
    """The engine must measure its messages before it can plan: a budget, and a plan that logs."""
    return cfg.logging.storage_budget_gb is not None and bool(plan.logged_edges)


def budget_plan(layout: ParallelLayout, cfg: SwiftConfig, measured: MeasuredSizes) -> Plan:
    """The config's plan sized by ``measured``; raises :func:`budget_error` if the budget cannot be met."""
    plan = analyze_config(layout, cfg, measured=measured, iteration_time_s=measured.iteration_time_s)
    if plan.min_budget_gb is not None:
        raise budget_error(cfg, plan)
    return plan


def budget_error(cfg: SwiftConfig, plan: Plan) -> ConfigError:
    """The one-line error for a budget that no grouping that logs fits."""
    assert plan.min_budget_gb is not None and plan.measured is not None
    interval = cfg.checkpoint.interval
    return ConfigError(
        f"swift config: logging.storage_budget_gb={cfg.logging.storage_budget_gb:g} cannot be met: the cheapest "
        f"grouping that logs keeps {plan.min_budget_gb:.3g} GB of logs between two global checkpoints "
        f"(checkpoint.interval={interval}; message sizes measured in iteration {plan.measured.iteration}); "
        f"set logging.storage_budget_gb to at least {plan.min_budget_gb:.3g}, shorten checkpoint.interval, "
        'or set "strategy": "checkpoint" to recover from global checkpoints only'
    )


def describe(plan: Plan, cfg: SwiftConfig) -> list[str]:
    """The plan, in the few lines the engine prints once when it has measured its messages."""
    m = plan.measured
    budget, interval = cfg.logging.storage_budget_gb, cfg.checkpoint.interval
    per_iteration = plan.log_bytes_per_iteration
    timed = f", iteration time {m.iteration_time_s:.3g} s" if m is not None and m.iteration_time_s else ""
    where = f"measured in iteration {m.iteration}{timed}" if m is not None else "from the model shape"
    held = per_iteration * interval / GB
    lines = [
        f"logging plan for logging.storage_budget_gb={budget:g} ({where}): {len(plan.groups)} group(s) of "
        f"machines {plan.groups} ({plan.grouping_method}); {per_iteration} bytes logged per iteration, "
        f"{held:.3g} GB per checkpoint interval of {interval} iterations",
        f"recovery per pipeline stage: {plan.stage_strategy}",
        f"worth logging: {'yes' if plan.worth_logging[0] else 'no'}: {plan.worth_logging[1]}",
    ]
    return lines + [f"note: {n}" for n in plan.notes]


def _with_note(plan: Plan, note: str) -> Plan:
    import dataclasses

    return dataclasses.replace(plan, notes=(*plan.notes, note))
