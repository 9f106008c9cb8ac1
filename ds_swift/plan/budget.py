"""The logging plan at runtime: the one an engine starts with, and the one it switches to once measured.

A DeepSpeed config says nothing of the hidden size or the sequence length, so under a
``logging.storage_budget_gb`` a running engine cannot size its pipeline messages before it has
sent some. It starts with :func:`conservative_plan` (every machine its own logging group: every
cross-machine send into a stage recovered by logging is logged, as without a budget), measures in
its first iteration what each logged send wrote and how long the iteration took
(:class:`~ds_swift.plan.sizes.MeasuredSizes`), and then every rank computes the same
:func:`budget_plan` from the same figures and logs by it from the next iteration on.

Every plan that logs is measured so (also without a budget): from the same figures each stage's
log kind and whether logging pays there are decided (ds_swift.plan.stage_logging), and the plan
logs accordingly. Grouping and those decisions only remove cuts, so whatever the measured plan logs
the conservative one logged too: the first iteration's log serves a recovery under either plan. A budget that no grouping that
logs can meet is an error naming the field and the smallest budget that works (:func:`budget_error`),
never a plan that silently logs nothing. Pure functions: no process group.
"""

from __future__ import annotations

from ds_swift.config import ConfigError, SwiftConfig
from ds_swift.plan.analysis import Plan, analyze, analyze_config, stage_mode
from ds_swift.plan.layout import ParallelLayout
from ds_swift.plan.sizes import GB, MeasuredSizes
from ds_swift.plan.stage_logging import StageDecision, apply_decisions, decide_stages, describe_stages

__all__ = ["budget_error", "budget_plan", "conservative_plan", "decide", "describe", "needs_measuring"]


def conservative_plan(layout: ParallelLayout, cfg: SwiftConfig, partition_copies: bool = False) -> Plan:
    """The plan before any message was measured: the config's, with its storage budget not yet applied
    (``partition_copies``: see :func:`ds_swift.plan.analysis.analyze`)."""
    budget = cfg.logging.storage_budget_gb
    plan = analyze(
        layout,
        None,
        strategy=cfg.strategy,
        mode=stage_mode(cfg),
        groups=cfg.logging.groups,
        checkpoint_interval=cfg.checkpoint.interval,
        parallel_recovery=cfg.parallel_recovery,
        partition_copies=partition_copies,
    )
    if not plan.logged_edges:
        return plan
    checks = "the per-stage log kinds and worth-logging checks"
    when = "once the first iteration's messages are measured"
    if budget is not None:
        note = f"logging.storage_budget_gb={budget:g} is applied {when}, as are {checks}"
    else:
        note = f"{checks} are applied {when}"
    note += "; until then every machine boundary is logged"
    return _with_note(plan, note)


def needs_measuring(cfg: SwiftConfig, plan: Plan) -> bool:
    """The engine must measure its first iteration before it settles its plan: wherever the plan
    logs (the storage budget, the log kind of each stage and whether logging pays need the figures)."""
    return bool(plan.logged_edges)


def decide(
    layout: ParallelLayout, cfg: SwiftConfig, measured: MeasuredSizes, partition_copies: bool = False
) -> tuple[Plan, list[StageDecision]]:
    """The config's plan sized by ``measured``, with each logging stage's kind and worth-logging
    decision applied, and those decisions; raises :func:`budget_error` if the budget cannot be met."""
    plan = analyze_config(
        layout, cfg, measured=measured, iteration_time_s=measured.iteration_time_s, partition_copies=partition_copies
    )
    if plan.min_budget_gb is not None:
        raise budget_error(cfg, plan)
    decisions = decide_stages(plan, cfg.logging.kinds, measured)
    plan = apply_decisions(plan, decisions)
    _check_updates_fit(cfg, plan, measured)
    return plan, decisions


def _check_updates_fit(cfg: SwiftConfig, plan: Plan, measured: MeasuredSizes) -> None:
    """The stages that log their updates (``logging.kinds``) store them beside the messages: both
    count against ``logging.storage_budget_gb``. Raises ConfigError (naming the figures) when they
    do not fit together."""
    budget, interval = cfg.logging.storage_budget_gb, cfg.checkpoint.interval
    if budget is None or not plan.update_stages:
        return
    updates = sum(measured.stage_update_bytes(s) or 0 for s in plan.update_stages)
    held = (plan.log_bytes_per_iteration + updates) * interval / GB
    if held > budget:
        raise ConfigError(
            f"swift config: logging.storage_budget_gb={budget:g} cannot be met: the plan logs "
            f"{plan.log_bytes_per_iteration} bytes of messages and {updates} bytes of updates (stages "
            f"{sorted(plan.update_stages)}) per iteration, {held:.3g} GB per checkpoint.interval={interval} "
            f"(measured in iteration {measured.iteration}); set logging.storage_budget_gb to at least {held:.3g}, "
            'shorten checkpoint.interval, or set logging.kinds to "messages"'
        )


def budget_plan(
    layout: ParallelLayout, cfg: SwiftConfig, measured: MeasuredSizes, partition_copies: bool = False
) -> Plan:
    """The plan of :func:`decide`."""
    return decide(layout, cfg, measured, partition_copies)[0]


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


def describe(plan: Plan, cfg: SwiftConfig, decisions: list[StageDecision] | None = None) -> list[str]:
    """The plan, in the few lines the engine prints once when it has measured its first iteration
    (with ``decisions``: one more, each logging stage's kind or why it is not logged)."""
    m = plan.measured
    budget, interval = cfg.logging.storage_budget_gb, cfg.checkpoint.interval
    per_iteration = plan.log_bytes_per_iteration
    timed = f", iteration time {m.iteration_time_s:.3g} s" if m is not None and m.iteration_time_s else ""
    where = f"measured in iteration {m.iteration}{timed}" if m is not None else "from the model shape"
    held = per_iteration * interval / GB
    updates = sum(m.stage_update_bytes(s) or 0 for s in plan.update_stages) if m is not None else 0
    also = (
        f" of messages and {updates} bytes of updates (stages {sorted(plan.update_stages)})"
        if plan.update_stages
        else ""
    )
    title = f"logging.storage_budget_gb={budget:g}" if budget is not None else "no storage budget"
    lines = [
        f"logging plan for {title} ({where}): {len(plan.groups)} group(s) of "
        f"machines {plan.groups} ({plan.grouping_method}); {per_iteration} bytes{also} logged per "
        f"iteration, {(per_iteration + updates) * interval / GB if updates else held:.3g} GB per checkpoint interval "
        f"of {interval} iterations",
        f"recovery per pipeline stage: {plan.stage_strategy}",
        f"worth logging: {'yes' if plan.worth_logging[0] else 'no'}: {plan.worth_logging[1]}",
    ]
    if decisions is not None and m is not None:
        lines.append(describe_stages(decisions, m))
    return lines + [f"note: {n}" for n in plan.notes]


def _with_note(plan: Plan, note: str) -> Plan:
    import dataclasses

    return dataclasses.replace(plan, notes=(*plan.notes, note))
