"""Failure processes on the job's compute clock, with common random numbers.

Failures are placed on the failure-free compute timeline (``total_iterations *
iteration_time_s``), as SWIFT section 7.3 does: a job of ``T`` hours sees about ``T / MTBF``
failures. Every strategy of a workload is evaluated on the same draws, so differences and
speed-ups are not blurred by sampling noise, and the draws are coupled across failure rates:

- ``uniform``: a fixed count at uniformly random positions. Repeat ``r`` always draws its
  positions from the same stream, so ``n + 1`` failures are the ``n`` failures plus one: the
  simulated time never drops when the count grows (each failure's cost is >= 0).
- ``exponential``: a Poisson process. The count is the Poisson quantile of one fixed uniform
  (monotone in the rate), the positions are the same prefix stream as ``uniform``: the
  distribution is exactly a Poisson process, and the coupling keeps the monotonicity.
- ``weibull``: a renewal process from a fresh start; gaps are ``scale * (-ln(1-u))**(1/shape)``
  of fixed uniforms, so a shorter MTBF compresses every gap (more failures, but at shifted
  positions: monotone in count, not per-sample in cost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

import numpy as np

from ds_swift.config import ConfigError

__all__ = ["FailureModel", "FailureSample", "FailureProcess", "poisson_quantile"]

FailureProcess = Literal["uniform", "exponential", "weibull"]

_HOUR = 3600.0


def _err(name: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{name}={value!r} is invalid: {allowed}")


def _positive(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _err(name, value, "a positive number")


@dataclass(frozen=True)
class FailureSample:
    """The failures of one repeat."""

    positions: np.ndarray
    """Positions as fractions of the job's compute time, in [0, 1), in draw order."""

    machine_u: np.ndarray
    """One uniform per failure choosing the machine it hits."""

    def __len__(self) -> int:
        return int(self.positions.shape[0])


@dataclass(frozen=True)
class FailureModel:
    """When failures happen. Give exactly one of ``count``/``mtbf_hours``/``median_hours``."""

    model: FailureProcess = "uniform"
    """``uniform`` (a count at uniformly random times), ``exponential`` or ``weibull``."""

    count: int | None = None
    """``uniform`` only: the number of failures."""

    mtbf_hours: float | None = None
    """Mean time between failures of the job (any machine), hours. For ``uniform`` the count
    is ``round(failure-free compute hours / mtbf_hours)``, as in SWIFT section 7.3."""

    median_hours: float | None = None
    """``exponential``/``weibull``: median time between failures instead of the mean."""

    shape: float | None = None
    """``weibull`` only (required): shape k; k < 1 means failures cluster (infant mortality)."""

    def __post_init__(self) -> None:
        if self.model not in get_args(FailureProcess):
            raise _err("model", self.model, f"one of {', '.join(get_args(FailureProcess))}")
        given = [n for n in ("count", "mtbf_hours", "median_hours") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ConfigError(
                f"failures: give exactly one of count, mtbf_hours, median_hours (got {', '.join(given) or 'none'})"
            )
        if self.count is not None:
            if self.model != "uniform":
                raise _err("count", self.count, "only for model uniform; use mtbf_hours or median_hours")
            if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 0:
                raise _err("count", self.count, "an integer >= 0")
        if self.median_hours is not None and self.model == "uniform":
            raise _err(
                "median_hours", self.median_hours, "only for exponential/weibull; uniform takes count or mtbf_hours"
            )
        _positive("mtbf_hours", self.mtbf_hours)
        _positive("median_hours", self.median_hours)
        if self.model == "weibull":
            if self.shape is None:
                raise _err("shape", None, "required for model weibull: a positive number")
            _positive("shape", self.shape)
        elif self.shape is not None:
            raise _err("shape", self.shape, "only for model weibull")

    # ------------------------------------------------------------------ derived
    @property
    def mean_gap_hours(self) -> float | None:
        """Mean time between failures, hours (``None`` for a bare count)."""
        if self.mtbf_hours is not None:
            return float(self.mtbf_hours)
        if self.median_hours is None:
            return None
        if self.model == "exponential":
            return self.median_hours / math.log(2.0)
        assert self.shape is not None
        scale = self.median_hours / math.log(2.0) ** (1.0 / self.shape)
        return scale * math.gamma(1.0 + 1.0 / self.shape)

    def expected_count(self, compute_hours: float) -> float:
        """Expected number of failures in a job of ``compute_hours`` (renewal: first order)."""
        if self.count is not None:
            return float(self.count)
        if self.model == "uniform":
            return float(self._uniform_count(compute_hours))
        gap = self.mean_gap_hours
        assert gap is not None
        return compute_hours / gap

    @property
    def uniform_positions(self) -> bool:
        """Whether positions are i.i.d. uniform given the count (closed forms apply)."""
        return self.model in ("uniform", "exponential")

    def with_mtbf(self, mtbf_hours: float) -> FailureModel:
        """The same process at another mean time between failures (for sweeps)."""
        return replace(self, count=None, median_hours=None, mtbf_hours=float(mtbf_hours))

    def _uniform_count(self, compute_hours: float) -> int:
        if self.count is not None:
            return self.count
        assert self.mtbf_hours is not None
        return int(round(compute_hours / self.mtbf_hours))

    # ------------------------------------------------------------------ sampling
    def sample(self, compute_s: float, repeats: int, seed: int) -> list[FailureSample]:
        """Draw ``repeats`` failure sets for a job of ``compute_s`` seconds of compute."""
        return [self.sample_one(compute_s, seed, r) for r in range(repeats)]

    def sample_one(self, compute_s: float, seed: int, repeat: int) -> FailureSample:
        # Separate streams for positions, machines and counts: changing the count never
        # shifts the positions of the failures that were already there.
        pos_rng = np.random.default_rng([seed, repeat, 0])
        machine_rng = np.random.default_rng([seed, repeat, 1])
        hours = compute_s / _HOUR
        if self.model == "weibull":
            positions = self._weibull_positions(pos_rng, hours)
        else:
            if self.model == "uniform":
                n = self._uniform_count(hours)
            else:
                u = float(np.random.default_rng([seed, repeat, 2]).random())
                gap = self.mean_gap_hours
                assert gap is not None
                n = poisson_quantile(u, hours / gap)
            positions = pos_rng.random(n)
        return FailureSample(positions, np.asarray(machine_rng.random(positions.shape[0]), dtype=np.float64))

    def _weibull_positions(self, rng: np.random.Generator, hours: float) -> np.ndarray:
        assert self.shape is not None
        gap = self.mean_gap_hours
        assert gap is not None
        scale = gap / math.gamma(1.0 + 1.0 / self.shape)
        arrivals: list[np.ndarray] = []
        now = 0.0
        chunk = max(16, int(2 * hours / gap) + 1)
        while True:
            u = rng.random(chunk)
            times = now + np.cumsum(scale * (-np.log1p(-u)) ** (1.0 / self.shape))
            inside = times[times < hours]
            arrivals.append(inside)
            if inside.shape[0] < chunk:
                break
            now = float(times[-1])
        return np.concatenate(arrivals) / hours


def poisson_quantile(u: float, mean: float) -> int:
    """Smallest k with P(N <= k) >= u for N ~ Poisson(mean): monotone in both arguments."""
    if mean <= 0.0:
        return 0
    k = 0
    log_pmf = -mean
    cdf = math.exp(log_pmf)
    # The cap only guards against u rounding to 1: P(N > mean + 40 sqrt(mean) + 50) is nil.
    cap = int(mean + 40.0 * math.sqrt(mean) + 50.0)
    while cdf < u and k < cap:
        k += 1
        log_pmf += math.log(mean) - math.log(k)
        cdf += math.exp(log_pmf)
    return k
