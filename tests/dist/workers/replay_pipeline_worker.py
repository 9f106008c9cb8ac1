"""The ranks of tests/dist/test_replay_pipeline.py (see its docstring): a real 4-rank gloo DeepSpeed
pipeline, pp 4 on 2 "machines" of 2 ranks, trained, then replayed from its message log.

    python replay_pipeline_worker.py PHASE OUT_DIR      (PHASE: train, replay or parallel; one per rank)

The test imports the job's constants from here (ITERATIONS, CKPT, ...).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

ITERATIONS = 6
CKPT = 2
CORRUPT_IT = 3
GAS = 4
MICRO = 8
HIDDEN = 64
CHUNK_ITERATIONS = 2
SEED = 777
GPUS_PER_NODE = 2
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": GAS,
    "train_batch_size": MICRO * GAS,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
    "zero_optimization": {"stage": 0},
    "steps_per_print": 10**9,
}


def batch_fn(iteration: int, micro_batch: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(10_000 * iteration + micro_batch)
    x = torch.randn(MICRO, HIDDEN, generator=g)
    return x, torch.tanh(x.flip(1))


def build_engine() -> Any:
    from ds_swift.testing.pipeline_model import pipeline_engine, tuple_boundary_layers

    return pipeline_engine(tuple_boundary_layers(HIDDEN, dropout=(0.1, 0.0, 0.0, 0.2, 0.1)), CONFIG, seed=1234)


def final_state(engine: Any) -> dict[str, Any]:
    return {
        "module": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
        "optimizer": engine.optimizer.state_dict(),
        "global_steps": int(engine.global_steps),
    }


def train(out: Path, rank: int) -> None:
    import torch

    from ds_swift.config import SwiftConfig
    from ds_swift.data.keyed import micro_batches
    from ds_swift.msglog import MachineBoundaryPlan, install_message_logging
    from ds_swift.recovery.replay.collectives import CollectiveRecorder
    from ds_swift.recovery.replay.engine import keyed_rng

    engine = build_engine()
    rng = keyed_rng(engine, SEED)
    recorder = CollectiveRecorder()
    rec_handle = recorder.install(engine)
    cfg = SwiftConfig.from_dict(
        {"enabled": True, "logging": {"chunk_iterations": CHUNK_ITERATIONS, "storage": str(out / "logs")}}
    )
    log = install_message_logging(engine, MachineBoundaryPlan(GPUS_PER_NODE), cfg, native=False)
    losses, times, cpu = {}, [], []
    for it in range(ITERATIONS):
        if it == CKPT:
            engine.save_checkpoint(str(out / "ckpt"), tag=f"global_step{CKPT}")
        t0, c0 = time.perf_counter(), time.process_time()
        loss = engine.train_batch(data_iter=micro_batches(batch_fn, it, 0, GAS))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses[it] = float(loss)
    log.flush(60)
    log.remove()
    rec_handle.remove()
    rng.remove()
    (out / f"collectives_rank{rank}.pt").write_bytes(recorder.to_bytes())
    torch.save(final_state(engine), out / f"train_rank{rank}.pt")
    (out / f"train_rank{rank}.json").write_text(json.dumps({"losses": losses, "iteration_s": times, "cpu_s": cpu}))


#: the fields of the intact replay's stats that go to the test
_STATS_FIELDS = (
    "iterations",
    "wall_s",
    "iteration_s",
    "messages_from_log",
    "log_bytes_read",
    "chunks_loaded",
    "sends_dropped",
    "sends_live",
    "recvs_live",
    "losses",
    "log_wait_s",
    "collectives_substituted",
)


def _replay_corrupt(engine: Any, out: Path, rank: int, group: set[int], records: Any, store: Any) -> dict[str, Any]:
    """Ranks 2, 3 replay the corrupt log from the checkpoint: what this rank raised (``result["corrupt"]``)."""
    import torch
    import torch.distributed as dist

    from ds_swift.msglog import LogReader
    from ds_swift.patches.deepspeed_rebuild import patch_recv_check
    from ds_swift.patches.step_collectives import wrap_collectives
    from ds_swift.recovery.replay.collectives import CollectiveGuard
    from ds_swift.recovery.replay.engine import replay
    from ds_swift.recovery.replay.log import LogUnavailable

    def aborted(received: Any = None) -> None:
        if store.check(["replay/abort"]):
            raise RuntimeError("replay aborted by a peer")

    # Loading a DeepSpeed checkpoint must not need the survivors: any collective leaving {2, 3} raises here.
    with wrap_collectives("test.load", CollectiveGuard(frozenset(group), None).make):
        engine.load_checkpoint(str(out / "ckpt"), tag=f"global_step{CKPT}")
    check = patch_recv_check(aborted) if rank == 3 else None
    try:
        replay(
            engine,
            LogReader(out / "logs_corrupt"),
            group,
            CKPT,
            ITERATIONS - 1,
            batch_fn,
            seed=SEED,
            collectives=records,
        )
        return {"raised": None}
    except LogUnavailable as exc:
        raised = {
            "raised": "LogUnavailable",
            "message": str(exc),
            "iteration": exc.iteration,
            "micro_batch": exc.micro_batch,
            "file": exc.file,
        }
        store.set("replay/abort", "1")
        dist.send(torch.zeros(1), 3)  # the poison: completes rank 3's pending receive
        return raised
    except RuntimeError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    finally:
        if check is not None:
            check.remove()


def replay_phase(out: Path, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from ds_swift.config import SwiftConfig
    from ds_swift.msglog import LogReader, MachineBoundaryPlan, install_message_logging
    from ds_swift.recovery.replay.collectives import CollectiveRecorder
    from ds_swift.recovery.replay.engine import replay

    engine = build_engine()
    store = dist.distributed_c10d._get_default_store()
    result: dict[str, Any] = {}
    if rank in (2, 3):
        group = {2, 3}
        # DeepSpeed clips gradients by default: the step's norm all-reduce spans the whole pipeline.
        # Any survivor of the replica has its result; rank 2 takes rank 0's, rank 3 rank 1's.
        records = CollectiveRecorder.from_bytes((out / f"collectives_rank{rank - 2}.pt").read_bytes())
        cfg = SwiftConfig.from_dict(
            {"enabled": True, "logging": {"chunk_iterations": CHUNK_ITERATIONS, "storage": str(out / "relog")}}
        )
        relog = install_message_logging(engine, MachineBoundaryPlan(GPUS_PER_NODE), cfg, native=False)

        # 1. a corrupt record: rank 2 fails loudly, then wakes rank 3 the way the runtime does.
        result["corrupt"] = _replay_corrupt(engine, out, rank, group, records, store)

        # 2. the intact log, from the checkpoint again.
        engine.load_checkpoint(str(out / "ckpt"), tag=f"global_step{CKPT}")
        progress: list[tuple[int, int, int]] = []
        c0 = time.process_time()
        stats = replay(
            engine,
            LogReader(out / "logs"),
            group,
            CKPT,
            ITERATIONS - 1,
            batch_fn,
            progress=lambda p: progress.append((p.iterations_done, p.iterations_total, p.log_bytes_read)),
            seed=SEED,
            collectives=records,
        )
        cpu_s = time.process_time() - c0
        relog.flush(60)
        relog.remove()
        torch.save(final_state(engine), out / f"replay_rank{rank}.pt")
        result["stats"] = {k: getattr(stats, k) for k in _STATS_FIELDS}
        result["progress"] = progress
        result["cpu_s"] = cpu_s
    dist.barrier()  # ranks 0,1: the survivors, waiting for the replay to finish
    (out / f"replay_rank{rank}.json").write_text(json.dumps(result))


def parallel_phase(out: Path, rank: int) -> None:
    """Machine 1 lost again; this time machine 0 helps: sub-pipelines (2,3) and (0,1), exact then fast."""
    import torch
    import torch.distributed as dist

    from ds_swift.msglog import LogReader
    from ds_swift.recovery.replay.collectives import CollectiveRecorder
    from ds_swift.recovery.replay.parallel import (
        ParallelReplayLayout,
        build_copy_engine,
        parallel_replay,
        transfer_state,
    )

    engine = build_engine()
    layout = ParallelReplayLayout(stages=(2, 3), replacements=(2, 3), helpers=(0, 1), micro_batches=GAS)
    if rank in (0, 1):  # survivors hold their own (failure-free) state; helping must leave it alone
        own = torch.load(out / f"train_rank{rank}.pt", weights_only=False)
        engine.module.load_state_dict(own["module"])
        engine.optimizer.load_state_dict(own["optimizer"])
    records = CollectiveRecorder.from_bytes((out / "collectives_rank0.pt").read_bytes())
    copy = build_copy_engine(engine, layout, CONFIG)
    result: dict[str, Any] = {"copy": copy is not None}
    for mode in ("exact", "fast"):
        if rank in (2, 3):
            engine.load_checkpoint(str(out / "ckpt"), tag=f"global_step{CKPT}")
        transfer_state(engine, copy, layout, CKPT)
        stats = parallel_replay(
            engine,
            copy,
            layout,
            LogReader(out / "logs"),
            CKPT,
            ITERATIONS - 1,
            batch_fn,
            mode=mode,
            seed=SEED,
            collectives=records,  # type: ignore[arg-type]
        )
        assert stats is not None
        torch.save(final_state(engine if rank in (2, 3) else copy), out / f"parallel_{mode}_rank{rank}.pt")
        result[mode] = {
            "share": list(stats.share),
            "exchange_bytes": stats.exchange_bytes,
            "exchange_s": stats.exchange_s,
            "messages_from_log": stats.replay.messages_from_log,
            "iteration_s": stats.replay.iteration_s,
            "sends_dropped": stats.replay.sends_dropped,
        }
    if rank in (0, 1):
        torch.save(final_state(engine), out / f"parallel_own_rank{rank}.pt")
    dist.barrier()
    (out / f"parallel_rank{rank}.json").write_text(json.dumps(result))


def worker(phase: str, out: Path) -> None:
    from ds_swift.testing.ranks import gloo_rank

    with gloo_rank(timeout_s=120) as rank:
        {"train": train, "replay": replay_phase, "parallel": parallel_phase}[phase](out, rank)


if __name__ == "__main__":
    worker(sys.argv[1], Path(sys.argv[2]))
