"""The overhead benchmark's round-by-round ratios (ds_swift.testing.overhead.Interleaved)."""

from __future__ import annotations

import pytest

from ds_swift.testing.overhead import Interleaved


def test_round_ratios_pair_each_rounds_jobs_and_the_pooled_ratio_stays_the_median_one() -> None:
    runs = Interleaved()
    for name, rounds in {"on": [[1.0, 1.2, 1.1], [2.0, 2.2, 2.4]], "off": [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]}.items():
        for steps in rounds:
            runs.steps[name] += steps
            runs.job_medians[name].append(sorted(steps)[1])
    assert runs.round_ratios("on", "off") == pytest.approx([1.1, 1.1])
    assert runs.median_round_ratio("on", "off") == pytest.approx(1.1)
    runs.job_medians["on"] += [4.0, float("nan")]  # a slow round, and one with no timed step (left out)
    runs.job_medians["off"] += [2.0, 3.0]
    assert runs.median_round_ratio("on", "off") == pytest.approx(1.1)  # of 1.1, 1.1 and 2.0 (mean: 1.4)
    assert runs.ratio("on", "off") == pytest.approx(1.6 / 1.5)  # medians of the pooled steps
