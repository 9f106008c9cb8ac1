"""How a recovery's time grows with the job: a cost model per phase, fitted from measurements.

``benchmarks/scale.py`` counts the job-store requests and bytes of each phase of one recovery for
simulated jobs of a few sizes (the real control-plane code, an in-process store) and measures what
one store server answers per second; this module fits each phase's counts with a polynomial in the
number of ranks N (non-negative coefficients of 1, N, N^2, N^3: a phase that is O(N) fits as one)
and turns them into time:

    phase time = fixed + cpu + max(requests / S + bytes / B, round trips x RTT)

``S`` (requests per second) and ``B`` (bytes per second) are the one server's measured capacity:
every rank's requests queue at it. ``fixed`` is what does not touch the store (a warm spare taking
over, the state moving over the network, NCCL's own communicator set-up): measured end to end at
small N, or an assumption the model names; ``cpu`` what every rank computes at once (the consensus
over N reports). A recovery's time is the sum of its phases.

``ds-swift simulate`` uses :meth:`ScaleModel.initialization_s` as a strategy's ``restart_s`` for a
workload that gives its ``ranks`` (ds_swift.sim.schema: ``scale_model``), instead of one constant.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Phase", "Poly", "ScaleModel", "load_scale_model"]


@dataclass(frozen=True)
class Poly:
    """``c0 + c1 N + c2 N^2 + c3 N^3`` with non-negative coefficients."""

    coef: tuple[float, ...] = (0.0,)

    def __call__(self, n: float) -> float:
        return float(sum(c * n**i for i, c in enumerate(self.coef)))

    @property
    def order(self) -> int:
        """The highest power of N with a coefficient (0: constant)."""
        return max((i for i, c in enumerate(self.coef) if c > 0), default=0)

    @classmethod
    def fit(cls, points: Mapping[int, float], degree: int = 2, tolerance: float = 1e-3) -> Poly:
        """The least-squares fit of ``points`` (N -> value) with non-negative coefficients of powers
        up to ``degree``, over every subset of powers (at most 16): the lowest order whose relative
        squared error is within ``tolerance`` of the best (three points of a line stay a line)."""
        ns = np.array(sorted(points), dtype=float)
        ys = np.array([points[int(n)] for n in ns], dtype=float)
        scale = max(1.0, float(np.sum(ys**2)))
        found: list[tuple[float, int, tuple[float, ...]]] = []
        for k in range(1, min(len(ns), degree + 1) + 1):
            for subset in itertools.combinations(range(degree + 1), k):
                a = np.stack([ns**p for p in subset], axis=1)
                sol, *_ = np.linalg.lstsq(a, ys, rcond=None)
                if (sol < 0).any():
                    continue
                coef = [0.0] * (degree + 1)
                for p, c in zip(subset, sol, strict=True):
                    coef[p] = float(c)
                found.append((float(np.sum((a @ sol - ys) ** 2)) / scale, max(subset), tuple(coef)))
        if not found:
            return cls((0.0,))
        best = min(err for err, _, _ in found)
        return cls(min((order, err, coef) for err, order, coef in found if err <= best + tolerance)[2])


@dataclass(frozen=True)
class Phase:
    """One phase of a recovery: its store traffic as a function of N, and what it costs besides."""

    name: str
    requests: Poly = field(default_factory=Poly)
    bytes: Poly = field(default_factory=Poly)
    round_trips: int = 0
    """Store round trips one after the other on the phase's critical path."""
    fixed_s: float = 0.0
    """Time that does not depend on the store (measured at small N, or an assumption)."""
    cpu_s: Poly = field(default_factory=Poly)
    """Computation on every rank at once (the consensus over N reports), seconds."""
    note: str = ""


@dataclass(frozen=True)
class ScaleModel:
    """The phases of one recovery and the store server they queue at."""

    phases: tuple[Phase, ...]
    server_requests_per_s: float
    server_bytes_per_s: float
    rtt_s: float = 2e-4
    initialization: tuple[str, ...] = ()
    """The phases a strategy's ``restart_s`` stands for: all but moving the lost state and redoing
    the iteration in flight, which ``ds-swift simulate`` prices itself (``broadcast_s``, ``load_s``,
    the in-flight redo)."""
    source: str = ""

    def phase_s(self, phase: Phase, n: int) -> float:
        queue = phase.requests(n) / self.server_requests_per_s + phase.bytes(n) / self.server_bytes_per_s
        return phase.fixed_s + phase.cpu_s(n) + max(queue, phase.round_trips * self.rtt_s)

    def breakdown(self, n: int) -> dict[str, float]:
        return {p.name: self.phase_s(p, n) for p in self.phases}

    def recovery_s(self, n: int) -> float:
        """Kill -> every rank back, for a job of ``n`` ranks."""
        return sum(self.breakdown(n).values())

    def initialization_s(self, n: int) -> float:
        """The phases of :attr:`initialization` at ``n`` ranks (a strategy's ``restart_s``)."""
        return sum(self.phase_s(p, n) for p in self.phases if p.name in self.initialization)

    def requests(self, n: int) -> float:
        return sum(p.requests(n) for p in self.phases)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> ScaleModel:
        phases = tuple(
            Phase(
                name=str(p["name"]),
                requests=Poly(tuple(p["requests"]["coef"])),
                bytes=Poly(tuple(p["bytes"]["coef"])),
                round_trips=int(p.get("round_trips", 0)),
                fixed_s=float(p.get("fixed_s", 0.0)),
                cpu_s=Poly(tuple(p.get("cpu_s", {}).get("coef", (0.0,)))),
                note=str(p.get("note", "")),
            )
            for p in doc["phases"]
        )
        return cls(
            phases,
            float(doc["server_requests_per_s"]),
            float(doc["server_bytes_per_s"]),
            float(doc.get("rtt_s", 2e-4)),
            tuple(doc.get("initialization", ())),
            str(doc.get("source", "")),
        )


def load_scale_model(path: str | Path) -> ScaleModel:
    """A model ``benchmarks/scale.py --model-out`` wrote (configs/sim/scale_model.json ships one)."""
    from ds_swift.config import ConfigError

    try:
        doc = json.loads(Path(path).read_text())
        return ScaleModel.from_dict(doc)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"scale_model {path}: {exc} (write one with benchmarks/scale.py --model-out)") from exc


def fit_phase(
    name: str,
    requests: Mapping[int, float],
    nbytes: Mapping[int, float],
    *,
    degree: int = 2,
    round_trips: int = 0,
    fixed_s: float = 0.0,
    note: str = "",
) -> Phase:
    """A phase from its measured requests and bytes per N."""
    return Phase(name, Poly.fit(requests, degree), Poly.fit(nbytes, degree + 1), round_trips, fixed_s, note=note)


def relative_error(model: Poly, points: Sequence[tuple[int, float]]) -> float:
    """The largest relative error of ``model`` over ``points``."""
    return max(abs(model(n) - y) / max(1.0, abs(y)) for n, y in points)
