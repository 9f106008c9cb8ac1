"""Message logging on a real 4-rank gloo DeepSpeed pipeline: pp 4 on 2 "machines" of 2 ranks.

Ranks 0,1 are machine 0 and ranks 2,3 machine 1, so the only machine-crossing edges are
stage 1 -> stage 2 (activations) and stage 2 -> stage 1 (gradients). The model sends a *tuple*
across that boundary (two float tensors and an int64 one), so multi-tensor messages and the
float-only gradient path are covered. Each receiving rank records, with a second hook on its
receive instructions, exactly what it received; the test then checks that the log holds exactly
those messages, bit for bit, found through the index, with the on-disk size within 2% of the
analytic payload size, and that ``ds-swift logs`` reports a flipped byte.

This file is also the worker: ``python test_logging_pipeline.py OUT_DIR`` (one per rank, with
RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set).
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
    import deepspeed
    import torch
    import torch.nn as nn
    from deepspeed.pipe import LayerSpec, PipelineModule

    from ds_swift.config import SwiftConfig
    from ds_swift.msglog import MachineBoundaryPlan, install_message_logging
    from ds_swift.patches.instructions import hook_instructions, schedule

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(1234)

    class Block(nn.Module):
        def __init__(self, h: int) -> None:
            super().__init__()
            self.lin = nn.Linear(h, h)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.lin(x))

    class Split(nn.Module):  # last layer of stage 1: the boundary carries a 3-tensor tuple
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            ids = torch.arange(x.shape[0], dtype=torch.long)
            return x, x * 0.5 + 1.0, ids

    class Merge(nn.Module):  # first layer of stage 2
        def forward(self, t: tuple[torch.Tensor, ...]) -> torch.Tensor:
            a, b, ids = t
            return a * b + ids.to(a.dtype).unsqueeze(1) * 1e-3

    h = HIDDEN
    layers = [LayerSpec(Block, h), LayerSpec(Block, h), LayerSpec(Block, h), LayerSpec(Split)]
    layers += [LayerSpec(Merge), LayerSpec(Block, h), LayerSpec(Block, h), LayerSpec(nn.Linear, h, h)]
    model = PipelineModule(layers=layers, num_stages=4, loss_fn=nn.MSELoss(), partition_method="uniform")
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "train_batch_size": MICRO * GAS,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)

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
            x = torch.randn(MICRO, h, generator=g)
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
        json.dumps({"records": stats.records, "bytes": stats.bytes, "logged": stats.messages_logged, "edges": sorted(handle.edges)})
    )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------- test
@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ds_swift.testing.procs import ProcessSet, free_port, worker_env

    out = tmp_path_factory.mktemp("logging_pipeline")
    port = free_port()
    with ProcessSet(out / "proc-logs") as procs:
        for rank in range(4):
            env = worker_env(
                {
                    "RANK": str(rank),
                    "WORLD_SIZE": "4",
                    "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "OMP_NUM_THREADS": "1",
                }
            )
            procs.spawn_python(f"rank{rank}", [__file__, str(out)], env=env)
        codes = procs.wait_all(200)
        assert codes == {f"rank{r}": 0 for r in range(4)}, procs.logs_tail()
    return out


def _bytes(t: Any) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())


def test_exactly_cross_machine_messages_logged_bit_for_bit(pipeline_run: Path) -> None:
    import torch

    from ds_swift.msglog import LogReader
    from ds_swift.msglog.reader import load_chunk

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
    from ds_swift.msglog.reader import load_chunk

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
