"""What ``ds-swift bench`` prints and draws: its table (one row a strategy) and the loss-over-time plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ds_swift.bench.measure import loss_series
from ds_swift.testing.jobs import JobRun

__all__ = ["fmt_mb", "fmt_value", "format_table", "plot_loss_vs_time"]


def fmt_value(value: float | None, fmt: str, none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def format_table(rows: list[dict[str, Any]]) -> list[str]:
    name_w = max([12, *(len(r["strategy"]) for r in rows)])
    how = {id(r): ",".join(r["recovered_by"]) or "no recovery" for r in rows}
    how_w = max([14, *(len(h) for h in how.values())])
    head = (
        f"{'strategy':{name_w}s} {'recovered by':{how_w}s} {'throughput':>10s} {'total':>7s} {'init':>6s} "
        f"{'recov':>6s} {'lost':>4s} {'loss delta':>10s} {'exact':>10s} {'bytes/it':>9s} {'rss/rank':>9s} "
        f"{'buddy':>7s} {'recomputed':>10s}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        exact = (
            "bitwise"
            if r["bitwise"]
            else (f"{r['param_distance']:.1e} rel" if r["param_distance"] is not None else f"{r['max_ulp']:.0f} ulp")
        )
        lines.append(
            f"{r['strategy']:{name_w}s} {how[id(r)]:{how_w}s} "
            f"{fmt_value(r['throughput_ratio'], '.3f'):>10s} {fmt_value(r['total_s'], '.2f'):>6s}s "
            f"{fmt_value(r['initialization_s'], '.2f'):>5s}s {fmt_value(r['recovery_s'], '.2f'):>5s}s {r['iterations_lost']:4d} "
            f"{fmt_value(r['final_loss_delta'], '+.2e'):>10s} {exact:>10s} {fmt_mb(r['bytes_per_iteration']):>9s} "
            f"{fmt_mb(r['max_rss_bytes']):>9s} {fmt_mb(r['buddy_host_bytes']):>7s} {_passes(r):>10s}"
        )
    return lines


def _passes(r: dict[str, Any]) -> str:
    """micro-batch passes recomputed: all replayers / the busiest one's (the critical path)."""
    total, busiest = r.get("recomputed_passes"), r.get("recomputed_passes_busiest")
    return "-" if total is None else f"{total:.0f}/{busiest:.0f}"


def fmt_mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}MB"


def plot_loss_vs_time(reference: JobRun, runs: dict[str, tuple[JobRun, JobRun]], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ref = loss_series(reference)
    ax.plot([t for t, _, _ in ref], [v for _, _, v in ref], color="#bbbbbb", linewidth=5, label="no failure (none)")
    for name, (_, failed) in runs.items():
        series = loss_series(failed)
        ax.plot(
            [t for t, _, _ in series],
            [v for _, _, v in series],
            marker="o",
            markersize=3,
            linewidth=1.4,
            label=f"{name}, machine killed",
        )
    ax.set_xlabel("wall-clock seconds since iteration 0")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- the sub-command
