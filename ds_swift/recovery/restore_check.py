"""A strategy's check round: every rank says whether its part of the restore worked, and any
failure makes every rank fall back to the global checkpoint together (an agreement round of
ds_swift.jobstore.agreement, on the store: not a collective a failed rank might skip)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ds_swift.jobstore.agreement import agree, round_prefix
from ds_swift.recovery.base import RankContext, RestoreFailed, checkpoint_source, loud
from ds_swift.recovery.consensus import RecoveryInputs

__all__ = ["check_round"]


def check_round(
    ctx: RankContext,
    inputs: RecoveryInputs,
    key: str,
    why: str | None,
    mine: dict[str, object],
    what: str,
    keep: Callable[[Mapping[int, dict[str, Any]]], Iterable[int]] | None = None,
) -> dict[int, dict[str, Any]]:
    """Every rank says whether its part of the restore worked (on the store, not in a collective a
    failed rank might skip); any failure makes every rank fall back to the global checkpoint, loudly,
    naming the rank and why. An agreement round (ds_swift.jobstore.agreement): returns the answers
    of the ranks that said why not, and of those ``keep`` picks from every rank's answer (None: every
    answer with more than its ``why``) — what every rank needs, not N answers for each of N ranks."""
    world = sorted(r.rank for r in inputs.reports)

    def decide(values: Mapping[int, str]) -> str:
        answers = {r: json.loads(v) for r, v in values.items()}
        kept = set(keep(answers)) if keep is not None else {r for r, a in answers.items() if set(a) - {"why"}}
        return json.dumps({r: a for r, a in answers.items() if a["why"] or r in kept})

    said = agree(
        ctx.store,
        round_prefix(ctx.generation, key),
        ctx.rank,
        json.dumps({"why": why, **mine}),
        world,
        decide,
        timeout_s=ctx.gather_timeout_s,
        generation=ctx.generation,
    )
    answers = {int(r): a for r, a in json.loads(said).items()}
    problems = [str(a["why"]) for _, a in sorted(answers.items()) if a["why"]]
    if problems:
        reason = f"{what}: " + "; ".join(problems)
        if ctx.rank == world[0]:  # the same on every rank: said once (each rank's fallback line repeats it)
            loud(
                ctx.rank,
                f"{reason}: ALL RANKS FALL BACK TO THE GLOBAL CHECKPOINT ({checkpoint_source(inputs.checkpoint_step)})",
            )
        raise RestoreFailed(reason)
    return answers
