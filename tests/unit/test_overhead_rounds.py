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
    assert runs.ratio("on", "off") == pytest.approx(1.6 / 1.5)  # medians of the pooled steps
