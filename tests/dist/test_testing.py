"""The rank spawner and the process set of ds_swift.testing, on trivial real processes."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from ds_swift.testing.procs import ProcessSet
from ds_swift.testing.ranks import RanksFailed, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def test_run_ranks_sets_the_rank_environment(tmp_path: Path) -> None:
    code = (
        "import os, pathlib, sys; e = os.environ; "
        "pathlib.Path(sys.argv[1], e['RANK']).write_text(' '.join(e[k] for k in "
        "('WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'OMP_NUM_THREADS')))"
    )
    run_ranks(3, ["-c", code, str(tmp_path)], tmp_path / "logs", timeout_s=60)
    seen = {int(p.name): p.read_text().split() for p in tmp_path.iterdir() if p.name.isdigit()}
    assert sorted(seen) == [0, 1, 2]
    assert all(v[0] == "3" and v[1] == str(r) and v[2] == "127.0.0.1" and v[4] == "1" for r, v in seen.items())
    assert len({v[3] for v in seen.values()}) == 1  # one port for the whole job


def test_the_first_failing_rank_stops_the_job(tmp_path: Path) -> None:
    # rank 1 fails at once; rank 0 would wait in a collective forever (here: sleeps)
    code = "import os, sys, time; r = int(os.environ['RANK']); print('rank', r, 'says hi'); sys.exit(3) if r else time.sleep(600)"
    t0 = time.monotonic()
    with pytest.raises(RanksFailed, match="'rank1': 3") as err:
        run_ranks(2, ["-c", code], tmp_path / "logs", timeout_s=100)
    assert time.monotonic() - t0 < 30 and "rank 1 says hi" in str(err.value)


def test_wait_all_fail_fast_kills_the_rest(tmp_path: Path) -> None:
    with ProcessSet(tmp_path) as procs:
        slow = procs.spawn_python("slow", ["-c", "import time; time.sleep(600)"])
        procs.spawn_python("bad", ["-c", "import sys; sys.exit(5)"])
        codes = procs.wait_all(100, fail_fast=True)
        assert codes["bad"] == 5 and codes["slow"] < 0 and slow.poll() is not None
    with ProcessSet(tmp_path / "late") as procs:
        late = procs.spawn("late", [sys.executable, "-c", "import time; time.sleep(600)"])
        with pytest.raises(TimeoutError, match="late still running"):
            procs.wait_all(0.5, fail_fast=True)
    assert late.poll() is not None  # killed on leaving the set
