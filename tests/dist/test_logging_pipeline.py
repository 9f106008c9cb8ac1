"""Message logging on a real 4-rank gloo DeepSpeed pipeline: pp 4 on 2 "machines" of 2 ranks.

Ranks 0,1 are machine 0 and ranks 2,3 machine 1, so the only machine-crossing edges are
stage 1 -> stage 2 (activations) and stage 2 -> stage 1 (gradients). The model sends a *tuple*
across that boundary (two float tensors and an int64 one), so multi-tensor messages and the
float-only gradient path are covered. Each receiving rank records, with a second hook on its
receive instructions, exactly what it received; the test then checks that the log holds exactly
those messages, bit for bit, found through the index, with the on-disk size within 2% of the
analytic payload size, and that ``ds-swift logs`` reports a flipped byte.

This file is also the worker: ``python test_logging_pipeline.py OUT_DIR`` (one per rank, started
by ``ds_swift.testing.ranks.run_ranks``). The model is ``ds_swift.testing.pipeline_model``'s.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ITERATIONS = 5
GAS = 4
MICRO = 16
HIDDEN = 256
CHUNK_ITERATIONS = 2
GPUS_PER_NODE = 2

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]


# --------------------------------------------------------------------------- worker
def worker(out: Path) -> None:
    from ds_swift.testing.ranks import gloo_rank

    with gloo_rank() as rank:
        log_and_record(out, rank)


def log_and_record(out: Path, rank: int) -> None:
    import torch

    from ds_swift.config import SwiftConfig
    from ds_swift.msglog import MachineBoundaryPlan, install_message_logging
    from ds_swift.patches.instructions import hook_instructions, schedule
    from ds_swift.testing.pipeline_model import pipeline_config, pipeline_engine, tuple_boundary_layers

    optimizer = {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}
    engine = pipeline_engine(tuple_boundary_layers(HIDDEN), pipeline_config(MICRO, GAS, optimizer), seed=1234)
    received: dict[str, list[Any]] = {"act": [], "grad": []}

    def record(kind: str, get: Any) -> Any:
        def hook(eng: Any, call_next: Any, **kw: Any) -> Any:
            result = call_next(**kw)
            got = get(eng, kw["buffer_id"])
            got = got if isinstance(got, list | tuple) else [got]
            # grad_layer is reused across micro-batches: copy now
            received[kind].append((int(eng.global_steps), [t.detach().clone() for t in got]))
            return result

        return hook

    recv_hooks = hook_instructions(
        engine,
        "test.recv",
        {
            schedule.RecvActivation: record("act", lambda e, b: e.pipe_buffers["inputs"][b]),
            schedule.RecvGrad: record("grad", lambda e, b: e.grad_layer),
        },
    )
    cfg = SwiftConfig.from_dict(
        {"enabled": True, "logging": {"chunk_iterations": CHUNK_ITERATIONS, "storage": str(out / "logs")}}
    )
    handle = install_message_logging(engine, MachineBoundaryPlan(GPUS_PER_NODE), cfg, native=False)

    g = torch.Generator().manual_seed(42)

    def data() -> Any:
        while True:
            x = torch.randn(MICRO, HIDDEN, generator=g)
            yield x, torch.tanh(x)

    it = data()
    for _ in range(ITERATIONS):
        engine.train_batch(data_iter=it)
    handle.flush(60)
    stats = handle.stats
    handle.remove()
    recv_hooks.remove()
    torch.save(received, out / f"received_rank{rank}.pt")
    (out / f"stats_rank{rank}.json").write_text(
        json.dumps(
            {
                "records": stats.records,
                "bytes": stats.bytes,
                "logged": stats.messages_logged,
                "edges": sorted(handle.edges),
            }
        )
    )


# --------------------------------------------------------------------------- test
@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ds_swift.testing.ranks import run_ranks

    out = tmp_path_factory.mktemp("logging_pipeline")
    run_ranks(4, [__file__, str(out)], out / "proc-logs", timeout_s=200)
    return out


def _bytes(t: Any) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())


def test_exactly_cross_machine_messages_logged_bit_for_bit(pipeline_run: Path) -> None:
    import torch

    from ds_swift.msglog import LogReader
    from ds_swift.msglog.chunk_index import load_chunk

    stats = {r: json.loads((pipeline_run / f"stats_rank{r}.json").read_text()) for r in range(4)}
    assert [stats[r]["edges"] for r in range(4)] == [[], ["act"], ["grad"], []]
    assert stats[0]["records"] == stats[3]["records"] == 0

    reader = LogReader(pipeline_run / "logs")
    edges = {cn.edge for cn in reader.chunk_names()}
    assert edges == {("act", 1, 2, 0, 0), ("grad", 2, 1, 0, 0)}
    assert len(reader.chunk_names()) == 2 * -(-ITERATIONS // CHUNK_ITERATIONS)

    # rank 2 received stage 1's activations, rank 1 received stage 2's gradients
    checked = 0
    for kind, receiver, src, dst in (("act", 2, 1, 2), ("grad", 1, 2, 1)):
        got = torch.load(pipeline_run / f"received_rank{receiver}.pt")[kind]
        assert len(got) == ITERATIONS * GAS
        for n, (iteration, tensors) in enumerate(got):
            assert iteration == n // GAS
            logged = reader.get(iteration, n % GAS, kind, src, dst, dp_rank=0)
            logged = logged if isinstance(logged, tuple) else (logged,)
            # activations: 2 floats + the int64 ids; gradients: the 2 float tensors only
            assert len(logged) == (3 if kind == "act" else 2)
            assert len(logged) == len(tensors)
            for a, b in zip(logged, tensors):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert _bytes(a) == _bytes(b), (kind, iteration, n % GAS)
                checked += 1
    assert checked == ITERATIONS * GAS * 5

    # nothing else is in the log, and the index (not a scan) found every record
    records = list(reader.iter_records())
    assert len(records) == ITERATIONS * GAS * 5
    assert stats[1]["records"] + stats[2]["records"] == len(records)
    for cn in reader.chunk_names():
        info = load_chunk(reader.directory / cn.chunk_file)
        assert info.problems == []
        idx_size = (reader.directory / cn.index_file).stat().st_size
        assert idx_size == 16 + 40 * len(info.order)
    assert reader.verify().ok


def test_log_bytes_match_the_analytic_figure(pipeline_run: Path) -> None:
    logs = pipeline_run / "logs"
    on_disk = sum(p.stat().st_size for p in logs.iterdir())
    per_iter_disk = on_disk / ITERATIONS
    act = MICRO * HIDDEN * 4 * 2 + MICRO * 8  # two float32 activations + int64 ids
    grad = MICRO * HIDDEN * 4 * 2
    # The analytic figure: payload bytes of every cross-machine message, from the shapes sent.
    payload = GAS * (act + grad)
    ratio = per_iter_disk / payload
    print(f"log bytes/iteration on disk {per_iter_disk:.0f}, analytic payload {payload}, ratio {ratio:.4f}")
    assert 1.0 <= ratio <= 1.02


def test_cli_reports_a_flipped_byte(pipeline_run: Path, tmp_path: Path) -> None:
    from ds_swift.msglog.chunk_index import load_chunk

    logs = tmp_path / "logs"
    shutil.copytree(pipeline_run / "logs", logs)
    ok = subprocess.run([sys.executable, "-m", "ds_swift.cli", "logs", str(logs)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "grad s2->s1 dp0 tp0" in ok.stdout and "act s1->s2 dp0 tp0" in ok.stdout

    chunk = sorted(logs.glob("act_*.swlog"))[1]
    info = load_chunk(chunk)
    victim = info.order[4]  # a record in the middle; flip a payload byte
    data = bytearray(chunk.read_bytes())
    data[victim.offset + victim.length - 100] ^= 0x10
    chunk.write_bytes(bytes(data))
    bad = subprocess.run([sys.executable, "-m", "ds_swift.cli", "logs", str(logs)], capture_output=True, text=True)
    assert bad.returncode == 1
    assert "checksum error" in bad.stderr
    assert chunk.name in bad.stderr and f"record #4 at offset {victim.offset}" in bad.stderr, bad.stderr


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
