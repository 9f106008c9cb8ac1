"""`ds-swift plan`'s output as rich tables (without ``--json``): the stages, the logging groups,
the summary, and the buddy copies' cost.
"""

from __future__ import annotations

import sys

from ds_swift.plan.analysis import Plan
from ds_swift.plan.buddy_cost import BuddyCost
from ds_swift.plan.sizes import GB

__all__ = ["print_buddy", "print_tables"]


def print_buddy(cost: BuddyCost) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="buddy copies of optimizer partitions (per rank)")
    table.add_column("")
    table.add_column("value")
    for label, value in cost.lines():
        table.add_row(label, value)
    Console().print(table)


def _ranges(values: list[int]) -> str:
    """[0,1,2,5,7,8] -> '0-2, 5, 7-8'."""
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _gb(nbytes: int | float) -> str:
    return f"{nbytes / GB:.2f} GB"


def print_tables(plan: Plan) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 120)
    lay, js = plan.layout, plan.to_json()
    console.print(
        f"[bold]ds-swift plan[/bold]: tp={lay.tp} pp={lay.pp} dp={lay.dp} (order {js['layout']['order']}), "
        f"{lay.world_size} ranks on {lay.num_machines} machines of {lay.gpus_per_node}; strategy {plan.strategy}"
    )

    # One row per run of consecutive stages with the same strategy and logging group.
    stages = Table(title="Stages")
    for col in ("stages", "strategy", "machines", "group"):
        stages.add_column(col)
    rows: list[tuple[list[int], str, set[int], set[int]]] = []
    for s in js["stages"]:
        grp = {plan.group_of_machine(m) for m in s["machines"]}
        key = (s["strategy"], sorted(grp))
        if rows and (rows[-1][1], sorted(rows[-1][3])) == key and rows[-1][0][-1] == s["stage"] - 1:
            rows[-1][0].append(s["stage"])
            rows[-1][2].update(s["machines"])
        else:
            rows.append(([s["stage"]], s["strategy"], set(s["machines"]), grp))
    for st, strategy, machines, grp in rows:
        stages.add_row(_ranges(st), strategy, _ranges(sorted(machines)), _ranges(sorted(grp)))
    console.print(stages)

    if len(plan.groups) > 1 or plan.logged_edges:
        groups = Table(title=f"Logging groups ({plan.grouping_method})")
        for col in ("group", "machines", "logged in, per iteration", "logged out, per iteration"):
            groups.add_column(col)
        inbound = [0] * len(plan.groups)
        outbound = [0] * len(plan.groups)
        for e in plan.logged_edges:
            inbound[plan.group_of_machine(plan.machine_of(e.dst_rank))] += e.bytes_per_iteration
            outbound[plan.group_of_machine(plan.machine_of(e.src_rank))] += e.bytes_per_iteration
        for i, g in enumerate(plan.groups):
            sized = plan.sized
            groups.add_row(
                str(i), _ranges(g), _gb(inbound[i]) if sized else "unknown", _gb(outbound[i]) if sized else "unknown"
            )
        console.print(groups)

    summary = Table(show_header=False, title="Summary")
    summary.add_column("what")
    summary.add_column("value")
    if not plan.sized:
        summary.add_row("log bytes / iteration", "unknown (give --hidden, --seq-len, ...)")
    else:
        summary.add_row(
            "log bytes / iteration", f"{_gb(plan.log_bytes_per_iteration)} ({plan.log_bytes_per_iteration} bytes)"
        )
        if plan.candidate_log_bytes_per_iteration != plan.log_bytes_per_iteration:
            summary.add_row("would log if worth it", _gb(plan.candidate_log_bytes_per_iteration))
        summary.add_row("max per sending GPU", _gb(js["max_sender_bytes_per_iteration"] or 0))
    if plan.bubble_ratio is not None:
        summary.add_row("bubble ratio (p-1)/(m+p-1)", f"{plan.bubble_ratio:.3f}")
    verdict, reason = plan.worth_logging
    summary.add_row("worth logging", f"{'yes' if verdict else 'no'}: {reason}")
    summary.add_row(
        "expected recovery per replayed iteration",
        f"{plan.expected_recovery:.4g} {plan.recovery_units} ({plan.grouping_method} grouping, section 5.3 objective)",
    )
    for name, found in (("greedy grouping", plan.greedy), ("exact grouping", plan.exact)):
        if found is not None:
            summary.add_row(
                name,
                f"{len(found.groups)} groups, recovery {found.recovery_time:.4g}, "
                f"logs per interval {_gb(found.storage)}, optimal {found.optimal}",
            )
    for note in plan.notes:
        summary.add_row("note", note)
    console.print(summary)
