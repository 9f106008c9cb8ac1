"""Per stage at runtime: which log (messages or updates), and whether logging pays at all.

A running engine knows no model shape, so both decisions are taken from what its first iteration
measured (:class:`~ds_swift.plan.sizes.MeasuredSizes`), the same on every rank:

- **which log** (TranLogs' per-stage mix, ``logging.kinds``): a stage recovered by logging logs
  either its inbound messages (the activations and gradients its neighbours send it across a
  logging-group boundary: a replacement recomputes each iteration, SWIFT) or its own updates (each
  step's reduced gradient: a replacement re-applies them, TranLogs). ``auto`` takes the fewer bytes
  per iteration, as measured: the first iteration logs both;
- **whether it pays** (SWIFT section 5.4, per stage): the log must be smaller than the state a
  checkpoint of the stage writes (else a checkpoint every iteration would write less), and what
  each rank copies off its device per iteration must fit in its share of the pipeline's bubbles
  (bubble ratio x the measured iteration time x the measured device-to-host bandwidth; on CPU no
  tensor is copied off a device, so there is nothing to fit). A stage where it does not pay is not
  logged (it recovers from the global checkpoint) and :func:`describe_stages` says why, with the
  numbers; ``"strategy": "logging"`` keeps it logged, and says that too.

Stages are decided together where they share a logging group (a replay re-executes a whole group
from the messages into it: its stages must all log messages, or all updates).
Pure functions: no process group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ds_swift.config import ConfigError
from ds_swift.config.checks import kinds_mismatch
from ds_swift.plan.analysis import Plan
from ds_swift.plan.sizes import MeasuredSizes, sender_bytes

__all__ = ["Kind", "StageDecision", "apply_decisions", "decide_stages", "describe_stages", "first_kinds"]

Kind = Literal["messages", "updates"]


@dataclass(frozen=True)
class StageDecision:
    """What the stages of one logging unit (stages sharing a logging group) log, and why."""

    stages: tuple[int, ...]
    kind: Kind | None
    """None: not logged (it does not pay): the stages recover from the global checkpoint."""
    message_bytes: int
    """Inbound cross-group messages per iteration (every replica), as measured."""
    update_bytes: int | None
    """Their update logs per iteration (every rank), as measured; None: not logged when measured."""
    state_bytes: int | None
    """What a checkpoint of these stages writes (measured parameters x state bytes per parameter)."""
    copy_bytes: int
    """The most bytes one rank copies off its device per iteration for the kind chosen (or asked)."""
    reason: str

    def name(self) -> str:
        return f"stage {self.stages[0]}" if len(self.stages) == 1 else f"stages {', '.join(map(str, self.stages))}"


def first_kinds(kinds: str | Sequence[str], plan: Plan) -> dict[int, set[str]]:
    """What each stage recovered by logging logs before anything is measured: ``auto`` logs both
    kinds (the first iteration's records serve a recovery whichever is chosen), a per-stage list
    its own, ``messages`` messages only."""
    _check_kinds(kinds, plan.layout.pp)
    out: dict[int, set[str]] = {}
    for s, how in plan.stage_strategy.items():
        if how != "logging":
            continue
        if kinds == "auto":
            out[s] = {"messages", "updates"}
        elif isinstance(kinds, str):
            out[s] = {"messages"}
        else:
            out[s] = {"updates" if kinds[s] == "updates" else "messages"}
    return out


def _check_kinds(kinds: str | Sequence[str], pp: int) -> None:
    if why := kinds_mismatch(kinds if isinstance(kinds, str) else tuple(kinds), pp):
        raise ConfigError(why)


def _units(plan: Plan) -> list[tuple[int, ...]]:
    """The stages recovered by logging, joined where their ranks share a logging group."""
    lay = plan.layout
    stages = sorted(s for s, how in plan.stage_strategy.items() if how == "logging")
    groups = {s: {plan.group_of_machine(lay.machine_of(r)) for r in lay.stage_ranks(s)} for s in stages}
    units: list[tuple[set[int], set[int]]] = []  # (stages, groups)
    for s in stages:
        joined = [u for u in units if u[1] & groups[s]]
        merged = ({s}.union(*(u[0] for u in joined)), groups[s].union(*(u[1] for u in joined)))
        units = [u for u in units if u not in joined] + [merged]
    return sorted(tuple(sorted(u[0])) for u in units)


def decide_stages(plan: Plan, kinds: str | Sequence[str], measured: MeasuredSizes) -> list[StageDecision]:
    """Per logging unit of ``plan`` (a plan sized by ``measured``): the log kind and whether it pays."""
    _check_kinds(kinds, plan.layout.pp)
    lay = plan.layout
    bubble_s = (
        plan.bubble_ratio * measured.iteration_time_s
        if plan.bubble_ratio is not None and measured.iteration_time_s
        else None
    )
    out = []
    for unit in _units(plan):
        edges = [e for e in plan.logged_edges if e.dst_stage in unit]
        msgs = sum(e.bytes_per_iteration for e in edges)
        ups = [measured.stage_update_bytes(s) for s in unit]
        upd = None if any(u is None for u in ups) else sum(u or 0 for u in ups)
        states = [measured.stage_state_bytes(s) for s in unit]
        state = None if any(x is None for x in states) else sum(x or 0 for x in states)
        if kinds == "auto":
            kind: Kind = "updates" if upd is not None and upd < msgs else "messages"
            why = (
                f"updates {_mb(upd)} < inbound messages {_mb(msgs)}"
                if kind == "updates"
                else f"inbound messages {_mb(msgs)} <= updates {_mb(upd)}"
            )
        elif isinstance(kinds, str):
            kind, why = "messages", f"logging.kinds=messages: inbound messages {_mb(msgs)}"
        else:
            asked = {kinds[s] for s in unit}
            if len(asked) > 1:
                raise ConfigError(
                    f"swift config: logging.kinds gives stages {list(unit)} different kinds, but they share a logging "
                    "group (a replay re-executes the whole group): give them the same kind"
                )
            kind = "updates" if asked == {"updates"} else "messages"
            why = f"logging.kinds={kind}: {'updates ' + _mb(upd) if kind == 'updates' else 'inbound messages ' + _mb(msgs)}"
        if kind == "updates":
            nbytes = upd if upd is not None else 0
            copy = max(1, len([r for s in unit for r in lay.stage_ranks(s)]))
            worst = nbytes // copy
        else:
            nbytes = msgs
            senders = {e.src_rank for e in edges}
            worst = max((b for r, b in sender_bytes(plan.logged_edges).items() if r in senders), default=0)
        pays, verdict = _pays(nbytes, state, worst, bubble_s, measured.copy_gbps)
        reason = f"{why}; {verdict}"
        if not pays and plan.mode == "logging":
            pays, reason = True, f'{reason}; "strategy": "logging" keeps it logged'
        out.append(StageDecision(unit, kind if pays else None, msgs, upd, state, worst, reason))
    return out


def _pays(
    nbytes: int, state: int | None, worst: int, bubble_s: float | None, copy_gbps: float | None
) -> tuple[bool, str]:
    """Section 5.4 for one unit: smaller than its checkpoint, and the copies fit in the bubbles."""
    parts = []
    if state is not None:
        if nbytes >= state:
            return False, (
                f"not logged: {_mb(nbytes)} per iteration is not smaller than its state {_mb(state)} "
                "(a checkpoint of it every iteration would write less)"
            )
        parts.append(f"< its state {_mb(state)}")
    else:
        parts.append("state not measured")
    if bubble_s is None:
        parts.append("bubble time not measured")
    elif copy_gbps is None:
        parts.append(f"no device-to-host copy (CPU training): nothing to fit in the {bubble_s:.3g} s of bubbles")
    else:
        capacity = bubble_s * copy_gbps * 1e9
        if worst > capacity:
            return False, (
                f"not logged: {_mb(worst)} per rank per iteration does not fit in the bubbles "
                f"({bubble_s:.3g} s x {copy_gbps:.3g} GB/s = {_mb(capacity)})"
            )
        parts.append(f"{_mb(worst)} per rank fits in the bubbles ({bubble_s:.3g} s x {copy_gbps:.3g} GB/s)")
    return True, "pays: " + ", ".join(parts)


def apply_decisions(plan: Plan, decisions: Sequence[StageDecision]) -> Plan:
    """``plan`` logging as decided: units not logged recover from the checkpoint, units logging their
    updates lose their inbound message edges, and ``stage_log_kind`` says each logged stage's kind."""
    strategy = dict(plan.stage_strategy)
    kind_of: dict[int, str] = {}
    for d in decisions:
        for s in d.stages:
            if d.kind is None:
                strategy[s] = "checkpoint"
            else:
                kind_of[s] = d.kind
    logged = [e for e in plan.logged_edges if kind_of.get(e.dst_stage) == "messages"]
    return dataclasses.replace(plan, stage_strategy=strategy, logged_edges=logged, stage_log_kind=kind_of)


def describe_stages(decisions: Sequence[StageDecision], measured: MeasuredSizes) -> str:
    """The one start-up line: per logging unit, the kind logged or why nothing is, with the numbers."""
    timed = f", iteration {measured.iteration_time_s:.3g} s" if measured.iteration_time_s else ""
    parts = [f"{d.name()}: {d.kind or 'nothing'} ({d.reason})" for d in decisions]
    head = f"per-stage logging (measured in iteration {measured.iteration}{timed})"
    return f"{head}: " + ("; ".join(parts) if parts else "no stage recovers by logging")


def _mb(nbytes: float | None) -> str:
    return "? (not measured)" if nbytes is None else f"{nbytes / 1e6:.3g} MB"
