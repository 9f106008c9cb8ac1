"""Who holds whose buddy copy: ZeRO-1 / BF16_Optimizer partitions copied to a rank on another
machine (another failure domain). Pure: shared by the buddy strategy, the buddy copier of the
runtime, PipeChurn's chunk holders and the feasibility check.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["BuddyError", "Member", "assign_buddies"]


class BuddyError(ValueError):
    """Buddies cannot be placed as the config asks (too few machines outside a failure domain)."""


@dataclass(frozen=True)
class Member:
    """One rank as buddy placement sees it."""

    rank: int
    machine: int
    stage: int = 0
    dp: int = 0
    tp: int = 0


def _domain_of(failure_domains: Sequence[Sequence[int]]) -> dict[int, int]:
    return {m: i for i, domain in enumerate(failure_domains) for m in domain}


def assign_buddies(
    members: Iterable[Member], factor: int = 1, failure_domains: Sequence[Sequence[int]] = ()
) -> dict[int, tuple[int, ...]]:
    """owner rank -> the ``factor`` ranks holding copies of its partition.

    A buddy is never on the owner's machine nor in its failure domain (machines not named in
    ``failure_domains`` form one each); a rank's data-parallel peers (same stage and tensor
    coordinate) are preferred, since a replacement then often takes its module state from the same
    peer; then the least loaded; several buddies of one owner sit on distinct machines where
    possible. Deterministic: every rank computes the same map.

    Raises:
        BuddyError: fewer than ``factor`` ranks outside some rank's failure domain.
    """
    ranks = sorted(members, key=lambda m: m.rank)
    domain_ix = _domain_of(failure_domains)

    def domain(machine: int) -> tuple[str, int]:
        return ("d", domain_ix[machine]) if machine in domain_ix else ("m", machine)

    load: Counter[int] = Counter()
    out: dict[int, tuple[int, ...]] = {}
    for me in ranks:
        others = [o for o in ranks if domain(o.machine) != domain(me.machine)]
        if len(others) < factor:
            raise BuddyError(
                f"rank {me.rank} (machine {me.machine}) has {len(others)} rank(s) outside its failure domain, "
                f"fewer than buddy.replication_factor={factor}: lower it, or add machines/failure domains"
            )
        chosen: list[Member] = []
        for _ in range(factor):
            used = {c.machine for c in chosen}
            pick = min(
                (o for o in others if o not in chosen),
                key=lambda o: (
                    o.machine in used,
                    (o.stage, o.tp) != (me.stage, me.tp),
                    load[o.rank],
                    o.rank,
                ),
            )
            chosen.append(pick)
            load[pick.rank] += 1
        out[me.rank] = tuple(c.rank for c in chosen)
    return out
