"""PNG figures of the sweeps: end-to-end time vs checkpoint interval (SWIFT Figure 13) and vs
mean time between failures (Figure 14). matplotlib is imported inside the functions, on the
Agg backend, so the CLI stays fast and works without a display."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ds_swift.sim.runner import SweepPoint

__all__ = ["plot_interval_sweep", "plot_mtbf_sweep"]

# One sweep per workload: strategy name -> points.
Sweeps = Mapping[str, Mapping[str, list[SweepPoint]]]


def _figure(n: int) -> tuple[Any, list[Any]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, n, figsize=(5.0 * n, 3.8), squeeze=False)
    return fig, list(axes[0])


def _band(ax: Any, points: list[SweepPoint], label: str, marker: str) -> None:
    xs = [p.x for p in points]
    ax.plot(xs, [p.mean_hours for p in points], marker=marker, markersize=3, label=label)
    lo = [p.ci_low_hours for p in points]
    hi = [p.ci_high_hours for p in points]
    if not any(math.isnan(v) for v in lo + hi):
        ax.fill_between(xs, lo, hi, alpha=0.15)


def plot_interval_sweep(sweeps: Sweeps, optima: Mapping[str, Mapping[str, int | None]], path: str | Path) -> Path:
    """Figure 13: one panel per workload, a curve per strategy, its optimum marked."""
    fig, axes = _figure(len(sweeps))
    markers = "osD^vx*"
    for ax, (workload, curves) in zip(axes, sweeps.items()):
        for i, (strategy, points) in enumerate(curves.items()):
            _band(ax, points, strategy, markers[i % len(markers)])
            best = optima.get(workload, {}).get(strategy)
            if best is not None:
                ax.axvline(best, linestyle=":", linewidth=0.8, color=ax.lines[-1].get_color())
        ax.set_xscale("log")
        ax.set_xlabel("checkpoint / snapshot interval (iterations)")
        ax.set_ylabel("end-to-end training time (h)")
        ax.set_title(workload)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_mtbf_sweep(sweeps: Sweeps, path: str | Path) -> Path:
    """Figure 14: one panel per workload, end-to-end time vs MTBF at the optimal intervals."""
    fig, axes = _figure(len(sweeps))
    markers = "osD^vx*"
    for ax, (workload, curves) in zip(axes, sweeps.items()):
        for i, (strategy, points) in enumerate(curves.items()):
            _band(ax, points, strategy, markers[i % len(markers)])
        ax.set_xscale("log")
        xs = sorted({p.x for points in curves.values() for p in points})
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.minorticks_off()
        ax.set_xlabel("mean time between failures (h)")
        ax.set_ylabel("end-to-end training time (h)")
        ax.set_title(workload)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig: Any, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
