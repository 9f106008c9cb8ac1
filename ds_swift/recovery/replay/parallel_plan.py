"""Whether and how parallel recovery replays a failed group (pure, from the plan and the ranks' reports).

:func:`parallel_layout` says which survivors host copies of which failed stages, or why none can;
:func:`parallel_helps` says whether those copies would make the replay faster on this hardware, or
why not (the recovery then replays sequentially unless ``parallel_recovery_force``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ds_swift.recovery.consensus import RankReport, RecoveryPlan
from ds_swift.recovery.replay.parallel import ParallelReplayLayout

__all__ = ["compute_of_this_rank", "parallel_helps", "parallel_layout"]


def parallel_layout(plan: RecoveryPlan, reports: list[RankReport], micro_batches: int) -> ParallelReplayLayout | str:
    """Who replays what with parallel recovery, or why it cannot be used for this plan.

    The replacements host the failed stages (sub-pipeline 0); as many survivors outside the
    replayed group, lowest ranks first, host a copy each (sub-pipeline 1).
    """
    by_rank = {r.rank: r for r in reports}
    group = list(plan.replay_ranks)
    if micro_batches < 2:
        return "parallel recovery needs at least two micro-batches per iteration"
    if len({(by_rank[r].dp, by_rank[r].tp) for r in group}) != 1:
        return "the replayed group spans several data- or tensor-parallel ranks (two sub-pipelines of one replica only)"
    ordered = sorted(group, key=lambda r: by_rank[r].stage)
    stages = [by_rank[r].stage for r in ordered]
    if stages != list(range(stages[0], stages[0] + len(stages))):
        return f"the replayed stages {stages} are not contiguous"
    helpers = [r for r in plan.survivors if r not in group][: len(group)]
    if len(helpers) < len(group):
        return f"{len(helpers)} survivors outside the replayed group cannot host copies of {len(group)} stages"
    return ParallelReplayLayout(tuple(stages), tuple(ordered), tuple(helpers), micro_batches)


def compute_of_this_rank() -> dict[str, Any]:
    """What :func:`parallel_helps` needs of a rank: its host, the CPU cores it may use, the threads
    it computes with, and whether it computes on an accelerator of its own."""
    import os
    import socket

    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {
        "host": socket.gethostname(),
        "cores": cores,
        "threads": torch.get_num_threads(),
        "accelerator": bool(torch.cuda.is_available()),
    }


def parallel_helps(layout: ParallelReplayLayout, compute: Mapping[int, Mapping[str, Any]]) -> str | None:
    """Why parallel recovery cannot make this replay faster (None: it can), from every replayer's
    :func:`compute_of_this_rank`. A helper speeds the replay up only with compute of its own: a
    rank on an accelerator has it; ranks computing on one host's CPU cores share them, so where a
    host's replayers (replacements and helpers) want more threads than the host has cores, the
    copies only take turns and the state transfer and gradient exchange are pure cost."""
    ranks = list(layout.replacements) + list(layout.helpers)
    if all(compute[r].get("accelerator") for r in ranks):
        return None
    by_host: dict[str, list[int]] = {}
    for r in ranks:
        by_host.setdefault(str(compute[r]["host"]), []).append(r)
    for host, on in sorted(by_host.items()):
        cores = min(int(compute[r]["cores"]) for r in on)
        want = sum(max(1, int(compute[r]["threads"])) for r in on)
        if want > cores:
            return (
                f"replacements {sorted(set(on) & set(layout.replacements))} and helpers "
                f"{sorted(set(on) & set(layout.helpers))} would compute on host {host}'s {cores} CPU core(s) "
                f"with {want} thread(s): the copies would share the cores, not add any"
            )
    return None
