"""A replacement's newest update record, probed (ds_swift.recovery.state.update_log.newest_in_run):
records run without a gap from the newest complete checkpoint, so a few existence checks find the
newest one, where a listing would read every rank's records since that checkpoint."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from ds_swift.recovery.state.update_log import newest_in_run


@given(since=st.integers(0, 10_000), count=st.integers(0, 5_000))
def test_the_newest_of_a_run_is_found_in_logarithmic_probes(since: int, count: int) -> None:
    newest = since + count - 1  # records since .. newest stored (none when count is 0)
    probes: list[int] = []

    def stored(it: int) -> bool:
        probes.append(it)
        return since <= it <= newest

    assert newest_in_run(stored, since) == newest
    assert len(probes) <= 2 * math.log2(count + 1) + 3, (count, len(probes))
