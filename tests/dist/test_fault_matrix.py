"""The CI subset of ``benchmarks/fault_matrix.py`` (the full matrix is a benchmark): a bad value stops
the job naming the field; a full checkpoint disk under asynchronous saves is said, training goes on,
and a later failure still ends bitwise equal to the reference; a replacement killed in the middle of
receiving its state from a buddy copy is replaced in turn and the recovery retried, bitwise.
The phase, save, replay, corrupt-log and full-log-disk points run in CI in the recovery tests; the
torn and missing log chunks in the unit tests of the log reader and the replay feeder."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from ds_swift.testing.jobs import JobRun

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]


def matrix():  # noqa: ANN201 - the benchmark module
    spec = importlib.util.spec_from_file_location("fault_matrix", ROOT / "benchmarks" / "fault_matrix.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fault_matrix"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_bad_values_a_full_checkpoint_disk_and_a_kill_mid_transfer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bf16_baseline: JobRun
) -> None:
    fm = matrix()
    # Two of the bad values (the benchmark runs them all; every field's check is a unit test): a
    # worker-side one, and one that only the launcher's machine count shows.
    bad = ["strategy", "machines.gpus_per_node"]
    assert set(bad) <= {field for _, field in fm.BAD_VALUES}
    # The full checkpoint disk with asynchronous saves (global_checkpoint); the benchmark also runs
    # it with synchronous ones (replication).
    chosen = [
        *(f"replication/bad {field}" for field in bad),
        "replication/recv_state m1",
        "global_checkpoint/full_ckpt_disk m1",
    ]
    # The reference of both configs (one DeepSpeed config): the shared failure-free run of the bf16
    # tests (tests/dist/conftest.py; its checkpoint interval does not change the final state).
    assert bf16_baseline.iterations == fm.ITERS and bf16_baseline.config["bf16"]["enabled"]
    code = fm.main(
        [
            "--cases",
            ",".join(chosen),
            "--keep",
            str(tmp_path / "matrix"),
            "--reference",
            str(bf16_baseline.dir),
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    doc = fm.json.loads(out.strip().splitlines()[-1])
    names = {r["case"] for r in doc["cases"]}
    assert {f"replication/bad {field}" for field in bad} | {"replication/recv_state m1"} <= names
    (transfer,) = [r for r in doc["cases"] if r["case"] == "replication/recv_state m1"]
    assert transfer["passed"] and transfer["how"] == "buddy, bitwise", transfer
    disk = [r for r in doc["cases"] if r["case"].startswith("global_checkpoint/full_ckpt_disk")]
    assert len(disk) == 1
    if disk[0]["passed"] is None:
        pytest.skip(disk[0]["how"])
    assert disk[0]["ckpt_disk_full_said"], disk[0]
