"""Logging-based replay on a real 4-rank gloo DeepSpeed pipeline: pp 4 on 2 "machines" of 2 ranks.

Phase ``train`` (failure-free): ranks 0,1 (machine 0) and 2,3 (machine 1) train ITERATIONS
iterations with the real message logger (only the stage 1 <-> stage 2 edge crosses machines; it
carries a tuple with an int64 tensor), dropout keyed by (seed, iteration, micro-batch, stage), a
global checkpoint after CKPT iterations, and save their final module and optimizer state.

Phase ``replay`` (machine 1 lost): all four ranks start again and build the engine (group creation
is collective); ranks 0,1 then only wait in a final barrier, as survivors would. Ranks 2,3 load
the checkpoint and replay CKPT..ITERATIONS-1 from the log:

1. first from a copy of the log with one flipped payload byte in iteration CORRUPT_IT: rank 2
   must raise LogUnavailable naming the chunk file and record; it then aborts rank 3 the way the
   runtime does (store flag + a poison message into its pending receive);
2. then, after reloading the checkpoint, from the intact log: the final state of ranks 2,3 must
   be bitwise equal to the failure-free run's, the losses too, and the gradients rank 2 re-logs
   for stage 1 (its machine's log died with it) must equal the original records bit for bit.

The ranks run ``tests/dist/workers/replay_pipeline_worker.py PHASE OUT_DIR`` (one per rank).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).parent / "workers" / "replay_pipeline_worker.py"


def _worker_module() -> Any:
    """The worker script as a module: the job's constants (ITERATIONS, CKPT, ...) live there."""
    spec = importlib.util.spec_from_file_location("replay_pipeline_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["replay_pipeline_worker"] = module
    spec.loader.exec_module(module)
    return module


_w = _worker_module()
ITERATIONS, CKPT, CORRUPT_IT, GAS = _w.ITERATIONS, _w.CKPT, _w.CORRUPT_IT, _w.GAS
MICRO, HIDDEN, CHUNK_ITERATIONS = _w.MICRO, _w.HIDDEN, _w.CHUNK_ITERATIONS

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def _run_phase(out: Path, phase: str) -> None:
    from ds_swift.testing.ranks import run_ranks

    run_ranks(4, [str(WORKER), phase, str(out)], out / f"proc-logs-{phase}", timeout_s=200)


def _corrupt_copy(logs: Path, dst: Path) -> tuple[str, int]:
    """Copy the log and flip one payload byte of (CORRUPT_IT, micro-batch 1, act); returns (file, record #)."""
    from ds_swift.msglog.chunk_format import ChunkName
    from ds_swift.msglog.chunk_index import load_chunk
    from ds_swift.msglog.edge import LogEdge

    shutil.copytree(logs, dst)
    cn = ChunkName.for_iteration(LogEdge("act", 1, 2, 0, 0), CORRUPT_IT, CHUNK_ITERATIONS)
    info = load_chunk(dst / cn.chunk_file)
    entry = info.entries[(CORRUPT_IT, 1, "act", 0)]
    data = bytearray((dst / cn.chunk_file).read_bytes())
    data[entry.offset + entry.length - 7] ^= 0x04
    (dst / cn.chunk_file).write_bytes(bytes(data))
    return cn.chunk_file, info.record_numbers[entry.offset]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple[str, int]]:
    out = tmp_path_factory.mktemp("replay_pipeline")
    _run_phase(out, "train")
    corrupted = _corrupt_copy(out / "logs", out / "logs_corrupt")
    _run_phase(out, "replay")
    _run_phase(out, "parallel")
    return out, corrupted


def _same(a: Any, b: Any, where: str) -> None:
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"{where} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_replayed_stages_end_bitwise_equal_to_the_failure_free_run(runs: tuple[Path, Any]) -> None:
    import torch

    out, _ = runs
    for rank in (2, 3):
        ref = torch.load(out / f"train_rank{rank}.pt", weights_only=False)
        got = torch.load(out / f"replay_rank{rank}.pt", weights_only=False)
        assert got["global_steps"] == ref["global_steps"] == ITERATIONS
        assert ref["optimizer"]["state"], "the optimizer state must be compared, not empty"
        _same(got, ref, f"rank{rank}")
    # the replay's own losses (last stage, no broadcast) are the failure-free losses, bit for bit
    train3 = json.loads((out / "train_rank3.json").read_text())
    replay3 = json.loads((out / "replay_rank3.json").read_text())
    assert replay3["stats"]["losses"] == {k: v for k, v in train3["losses"].items() if int(k) >= CKPT}


def test_only_cross_group_messages_come_from_the_log(runs: tuple[Path, Any]) -> None:
    out, _ = runs
    n = (ITERATIONS - CKPT) * GAS
    s2 = json.loads((out / "replay_rank2.json").read_text())["stats"]
    s3 = json.loads((out / "replay_rank3.json").read_text())["stats"]
    assert s2["iterations"] == s3["iterations"] == ITERATIONS - CKPT
    # rank 2: activations of stage 1 from the log, gradients to stage 1 dropped, the rest live
    assert (s2["messages_from_log"], s2["sends_dropped"], s2["sends_live"], s2["recvs_live"]) == (n, n, n, n)
    assert (s3["messages_from_log"], s3["sends_dropped"], s3["sends_live"], s3["recvs_live"]) == (0, 0, n, n)
    payload = (MICRO * HIDDEN * 4 * 2 + MICRO * 8) * n  # two float32 tensors + the int64 ids per message
    assert s2["log_bytes_read"] == payload and s3["log_bytes_read"] == 0
    progress = json.loads((out / "replay_rank2.json").read_text())["progress"]
    assert [p[:2] for p in progress] == [[i, ITERATIONS - CKPT] for i in range(ITERATIONS - CKPT + 1)]
    assert progress[-1][2] == payload


def test_step_collectives_leaving_the_group_come_from_a_survivors_records(runs: tuple[Path, Any]) -> None:
    import torch

    from ds_swift.recovery.replay.collectives import CollectiveRecorder

    out, _ = runs
    recs = [CollectiveRecorder.from_bytes((out / f"collectives_rank{r}.pt").read_bytes()).records for r in range(4)]
    # the clipping norm's all-reduce over the whole pipeline: the same bits on every rank
    pipeline_wide = [{k: v for k, v in r.items() if v.ranks == (0, 1, 2, 3)} for r in recs]
    assert {k[0] for k in pipeline_wide[0]} == set(range(ITERATIONS))
    for other in pipeline_wide[1:]:
        assert other.keys() == pipeline_wide[0].keys()
        for k, v in other.items():
            assert torch.equal(
                v.tensor.reshape(-1).view(torch.uint8), pipeline_wide[0][k].tensor.reshape(-1).view(torch.uint8)
            ), k
    per_step = len(pipeline_wide[0]) // ITERATIONS
    for rank in (2, 3):
        stats = json.loads((out / f"replay_rank{rank}.json").read_text())["stats"]
        assert stats["collectives_substituted"] == per_step * (ITERATIONS - CKPT)


def test_corrupt_record_raises_log_unavailable_naming_file_and_record(runs: tuple[Path, tuple[str, int]]) -> None:
    out, (chunk_file, record_no) = runs
    corrupt = json.loads((out / "replay_rank2.json").read_text())["corrupt"]
    assert corrupt["raised"] == "LogUnavailable", corrupt
    assert corrupt["iteration"] == CORRUPT_IT and corrupt["micro_batch"] == 1
    assert chunk_file in corrupt["message"] and f"record #{record_no}" in corrupt["message"], corrupt["message"]
    assert "checksum" in corrupt["message"]
    assert corrupt["file"].endswith(chunk_file)
    # rank 3 (no logged edge) was woken by the abort, not left waiting
    assert json.loads((out / "replay_rank3.json").read_text())["corrupt"]["message"] == "replay aborted by a peer"


def test_replacement_relogs_what_the_lost_machine_had_logged(runs: tuple[Path, Any]) -> None:
    import torch

    from ds_swift.msglog import LogReader

    out, _ = runs
    original, relogged = LogReader(out / "logs"), LogReader(out / "relog")
    assert {cn.edge for cn in relogged.chunk_names()} == {("grad", 2, 1, 0, 0)}
    for it in range(CKPT, ITERATIONS):
        for mb in range(GAS):
            a = original.get(it, mb, "grad", 2, 1)
            b = relogged.get(it, mb, "grad", 2, 1)
            assert isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 2
            for x, y in zip(a, b):
                assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), (it, mb)


def test_parallel_exact_mode_is_bitwise_equal_on_every_copy(runs: tuple[Path, Any]) -> None:
    import torch

    out, _ = runs
    for rank, stage_rank in ((2, 2), (3, 3), (0, 2), (1, 3)):  # replacements, then the helpers' copies
        ref = torch.load(out / f"train_rank{stage_rank}.pt", weights_only=False)
        got = torch.load(out / f"parallel_exact_rank{rank}.pt", weights_only=False)
        _same(got, ref, f"exact rank{rank} (stage of rank {stage_rank})")
    n = ITERATIONS - CKPT
    for rank, share in ((2, [0, 2]), (0, [1, 3]), (3, [0, 2]), (1, [1, 3])):
        info = json.loads((out / f"parallel_rank{rank}.json").read_text())
        assert info["exact"]["share"] == share and info["copy"] == (rank in (0, 1))
        # the stage-2 copies read half of the activations each, and dropped half of the gradients
        want = n * len(share) if rank in (2, 0) else 0
        assert info["exact"]["messages_from_log"] == info["exact"]["sends_dropped"] == want


def test_helping_leaves_the_survivors_own_state_alone(runs: tuple[Path, Any]) -> None:
    import torch

    out, _ = runs
    for rank in (0, 1):
        ref = torch.load(out / f"train_rank{rank}.pt", weights_only=False)
        got = torch.load(out / f"parallel_own_rank{rank}.pt", weights_only=False)
        _same(got["module"], ref["module"], f"own rank{rank}.module")
        _same(got["optimizer"], ref["optimizer"], f"own rank{rank}.optimizer")


def _max_ulps(a: Any, b: Any) -> int:
    import torch

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.detach().reshape(-1).view(torch.int32).to(torch.int64)
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)  # float order as integers

    return int((ordered(a) - ordered(b)).abs().max())


def test_parallel_fast_mode_is_close_and_consistent_between_copies(runs: tuple[Path, Any]) -> None:
    import torch

    out, _ = runs
    worst = 0
    for rank, stage_rank in ((2, 2), (3, 3), (0, 2), (1, 3)):
        ref = torch.load(out / f"train_rank{stage_rank}.pt", weights_only=False)["module"]
        got = torch.load(out / f"parallel_fast_rank{rank}.pt", weights_only=False)["module"]
        for k in ref:
            assert torch.allclose(got[k], ref[k], rtol=1e-4, atol=1e-6), k
            worst = max(worst, _max_ulps(got[k], ref[k]))
        # both copies of a stage applied the same combined gradient: identical to each other
        other = 0 if rank == 2 else 1 if rank == 3 else None
        if other is not None:
            _same(torch.load(out / f"parallel_fast_rank{other}.pt", weights_only=False)["module"], got, "fast copies")
    print(f"fast mode: max distance to the failure-free parameters {worst} ulp")


def test_report_replay_speed(runs: tuple[Path, Any]) -> None:
    """Not an assertion on time: prints replayed vs failure-free iteration times for the report."""
    out, _ = runs
    for rank in (2, 3):
        train = json.loads((out / f"train_rank{rank}.json").read_text())
        rep = json.loads((out / f"replay_rank{rank}.json").read_text())
        train_s, replay_s = train["iteration_s"][CKPT:], rep["stats"]["iteration_s"]
        assert len(train_s) == len(replay_s) == ITERATIONS - CKPT
        n = len(train_s)
        t, r = sum(train_s) / n, sum(replay_s) / n
        tc, rc = sum(train["cpu_s"][CKPT:]) / n, rep["cpu_s"] / n
        print(
            f"rank {rank}: failure-free {t * 1e3:.1f} ms/iteration ({tc * 1e3:.1f} ms CPU), replay {r * 1e3:.1f} "
            f"ms/iteration ({rc * 1e3:.1f} ms CPU), wall ratio {r / t:.2f}"
        )
        for mode in ("exact", "fast"):
            par = json.loads((out / f"parallel_rank{rank}.json").read_text())[mode]
            p = sum(par["iteration_s"]) / len(par["iteration_s"])
            print(
                f"rank {rank}: parallel {mode} {p * 1e3:.1f} ms/iteration (ratio {p / t:.2f}), "
                f"gradient exchange {par['exchange_s'] / len(par['iteration_s']) * 1e3:.1f} ms/iteration, "
                f"{par['exchange_bytes'] / len(par['iteration_s']) / 1e3:.0f} kB/iteration sent"
            )
