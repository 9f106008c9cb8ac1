"""What ``ds-swift demo`` reports: loss logs, iterations lost, the recovery timeline, the loss plot.

Pure functions on the files a job leaves (``--loss-log`` JSON lines, ``timeline-gen*.json``);
the demo (``ds_swift.bench.demo``) runs the jobs and prints these.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_swift.config import SwiftConfig
from ds_swift.recovery.registry import declared_by
from ds_swift.runtime.timeline import transfer_rate

__all__ = [
    "RECOVERY_PHASES",
    "LossPoint",
    "engine_words",
    "format_timeline",
    "iterations_lost",
    "losses_by_iteration",
    "plot_losses",
    "read_loss_log",
]

RECOVERY_PHASES = (
    ("detect", "the kill seen (node agent or a neighbour's comm error)"),
    ("teardown", "survivors dropped the dead generation's process groups"),
    ("rendezvous", "the next generation formed, replacement ranks included"),
    # The timeline's key since the first release; what its survivors did: engine_words()
    ("rebuild", "process groups re-formed under every engine (survivors' swapped in place, or rebuilt)"),
    ("consensus_undo", "agreed on the iteration to resume from (and undid steps past it)"),
    ("checkpoint_load", "lost ranks loaded the last global checkpoint"),
    ("replay", "lost ranks replayed the iterations since, from the message log"),
    ("state_restore", "lost ranks' state restored (replica broadcast, or checkpoint + replay done)"),
    ("catch_up", "back at the pre-failure iteration"),
)


# ---------------------------------------------------------------------------- loss logs
@dataclass(frozen=True)
class LossPoint:
    iteration: int
    loss: float
    generation: int = 0


def read_loss_log(path: str | os.PathLike[str]) -> list[LossPoint]:
    """Entries of a ``--loss-log`` file in the order written; a torn last line (a killed writer) is skipped."""
    points = []
    p = Path(path)
    if not p.exists():
        return []
    for line in p.read_text().splitlines():
        try:
            d = json.loads(line)
            points.append(LossPoint(int(d["iteration"]), float(d["loss"]), int(d.get("generation", 0))))
        except (ValueError, KeyError, TypeError):
            continue
    return points


def losses_by_iteration(points: Iterable[LossPoint]) -> dict[int, float]:
    """Loss per iteration; an iteration trained twice keeps its last value (the one training went on from)."""
    return {p.iteration: p.loss for p in points}


def iterations_lost(points: Iterable[LossPoint]) -> int:
    """Iterations trained more than once: finished before the failure, then trained again after it."""
    counts = Counter(p.iteration for p in points)
    return sum(1 for n in counts.values() if n > 1)


# ---------------------------------------------------------------------------- timeline
def format_timeline(tl: dict[str, Any]) -> list[str]:
    """The recovery timeline as text lines: what happened, each phase's duration, the paper's totals."""
    machine = f"machine {tl['failed_machine']}" if tl.get("failed_machine") is not None else "a machine"
    lines = [f"recovery of generation {tl['failed_generation']}: {machine} failed; recovered by {tl['strategy']}"]
    if tl.get("reason"):
        lines.append(f"  why: {tl['reason']}")
    ckpt = tl.get("checkpoint_step")
    tag = f"global_step{ckpt}" if ckpt is not None else "the initial state"
    back = f"back at iteration {tl['pre_failure_iteration']}"
    # What the strategy's recovery does, as the simulator models it (its services' sim_kind).
    strategy = declared_by(tl["strategy"])
    kind = strategy.services(SwiftConfig()).sim_kind if strategy is not None else None
    if kind == "checkpoint":
        how = f"every rank reloaded {tag} and trained iterations {ckpt or 0}..{tl['consensus']} again"
    elif kind == "logging":
        how = f"survivors kept their state; the lost ranks loaded {tag} and replayed the iterations since"
    else:
        how = "survivors kept their state in memory; replacements got theirs from replicas"
    lines.append(f"  consensus: iteration {tl['consensus']} finished everywhere; {how}; {back}")
    if tl.get("undo_ranks"):
        lines.append(f"  update-undo on ranks {tl['undo_ranks']} (they had stepped past the consensus)")
    if tl.get("donors"):
        pairs = ", ".join(f"{src}->{dst}" for dst, src in sorted(tl["donors"].items(), key=lambda kv: int(kv[0])))
        moved = sum(int(r.get("bytes_moved", 0)) for r in tl.get("ranks", []))
        lines.append(f"  state sent donor->replacement: {pairs} ({moved / 1e6:.2f} MB{transfer_words(tl)})")
    replay = tl.get("replay")
    if isinstance(replay, dict) and replay.get("iterations") is not None:
        per_rank = replay.get("per_rank") or {}
        messages = sum(int(r.get("messages_from_log", 0)) for r in per_rank.values() if isinstance(r, dict))
        lines.append(
            f"  replay: ranks {replay.get('ranks')} replayed iterations {replay.get('from')}..{replay.get('to')} "
            f"from {replay.get('source', tag)}: {messages} messages, {int(replay.get('log_bytes_read', 0)) / 1e6:.2f} MB "
            f"of log read, {float(replay.get('replay_s', 0.0)):.2f} s"
        )
    phases = tl.get("phases", {})
    known = dict(RECOVERY_PHASES)
    engines = engine_words(tl)
    if engines is not None:
        known["rebuild"] = engines[1]
    for key in [k for k, _ in RECOVERY_PHASES if k in phases] + [k for k in phases if k not in known]:
        name = engines[0] if key == "rebuild" and engines is not None else key.replace("_", " ")
        lines.append(f"  {name:<16}{float(phases[key]):7.2f} s   {known.get(key, '')}".rstrip())
    lines.append(
        f"  initialization {tl['initialization_s']:.2f} s (detection -> replacements joined), recovery "
        f"{tl['recovery_s']:.2f} s (joined -> back), total {tl['total_s']:.2f} s "
        f"({'kill' if tl.get('t_kill') is not None else 'detection'} -> back)"
    )
    return lines


def engine_words(tl: dict[str, Any]) -> tuple[str, str] | None:
    """The timeline's ``rebuild`` phase as what its survivors did: its name ("swap" where every survivor
    kept its DeepSpeed engine and swapped the process groups under it, else "rebuild") and its line;
    None where the timeline names no survivor (an older one, or a stall's)."""
    ranks = tl.get("ranks") or []
    survivors = [r for r in ranks if r.get("role") == "survivor"]
    if not survivors:
        return None
    kept = sum(1 for r in survivors if "engine_kept_s" in (r.get("extra") or {}))
    built = sum(1 for r in ranks if r.get("role") == "replacement")
    new = f"; {built} replacement{'s' if built > 1 else ''} built {'theirs' if built > 1 else 'its'}" if built else ""
    if kept == len(survivors):
        return "swap", f"{kept} of {kept} survivors kept their engine, its process groups swapped in place{new}"
    rebuilt = len(survivors) - kept
    kept_too = f"{kept} of {len(survivors)} survivors kept their engine (groups swapped in place), " if kept else ""
    return "rebuild", f"{kept_too}{rebuilt} rebuilt theirs in-process{new}"


# ---------------------------------------------------------------------------- plot
def plot_losses(
    baseline: dict[int, float],
    failed: dict[int, float],
    kill_iteration: int | None,
    path: str | os.PathLike[str],
    title: str = "tiny GPT, 2 machines x 2 ranks",
    note: str | None = None,
) -> Path:
    """PNG of both loss curves overlaid, the failure iteration marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    xs = sorted(baseline)
    ax.plot(
        xs,
        [baseline[i] for i in xs],
        color="#9ecae1",
        linewidth=6,
        solid_capstyle="round",
        label="without failure",
        zorder=1,
    )
    xf = sorted(failed)
    ax.plot(
        xf,
        [failed[i] for i in xf],
        color="#d62728",
        linewidth=1.6,
        linestyle="--",
        marker="o",
        markersize=4,
        label="machine killed, recovered",
        zorder=2,
    )
    if kill_iteration is not None:
        ax.axvline(kill_iteration, color="black", linestyle=":", linewidth=1.2, zorder=0)
        top = max([*baseline.values(), *failed.values()], default=1.0)
        ax.annotate(
            f"machine 1 killed\n(iteration {kill_iteration})",
            xy=(kill_iteration, top),
            xytext=(6, -4),
            textcoords="offset points",
            va="top",
            fontsize=9,
        )
    if note:
        ax.text(
            0.02,
            0.03,
            note,
            transform=ax.transAxes,
            fontsize=9,
            va="bottom",
            bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.8, "edgecolor": "#bbbbbb"},
        )
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def transfer_words(tl: dict[str, Any]) -> str:
    """The state transfer's achieved bandwidth (ds_swift.runtime.timeline.transfer_rate); "" where no
    rank timed one."""
    rate = transfer_rate(tl.get("ranks", []))
    if rate is None:
        return ""
    nbytes, seconds = rate
    return f", received in {seconds:.2f} s: {nbytes / 1e6 / max(seconds, 1e-9):.0f} MB/s"
