"""Memory across an in-process rebuild (issue 29 item 4): a generation that fails in the middle of an
iteration leaves autograd graphs in flight (its micro-batches' activations, held by DeepSpeed's
pipeline buffers), and DeepSpeed's hooks in those graphs and on the parameters keep the whole
engine alive; the teardown a survivor runs (ds_swift.runtime.rebuild, through
ds_swift.patches.deepspeed_rebuild.release_failed_engine) must free them, so that the rebuilt
engine does not train beside the failed generation's activations and state. One rank, a gloo
world of 1, the tiny GPT with bf16 + ZeRO-1.
"""

from __future__ import annotations

import gc
import os
import socket
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ds_swift.models.gpt import GPTConfig, gpt_batch_fn, gpt_pipeline
from ds_swift.runtime.context import pipeline_topology

SHAPE = GPTConfig(2, 32, 2, 16, 64, 0.0)
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 1},
    "bf16": {"enabled": True},
    "gradient_clipping": 1.0,
    "pipeline": {"stages": 1},
    "steps_per_print": 1_000_000,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join_world() -> None:
    """A new generation's world (as ds_swift.runtime.context.join_generation makes it)."""
    import deepspeed

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo")


@pytest.fixture
def world() -> Iterator[None]:
    saved = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"  # DeepSpeed's engine asserts it is set
    join_world()
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        from deepspeed.utils import groups

        groups._WORLD_GROUP = None  # DeepSpeed's cached clone of the world group
        # and the pipeline engine's grid as DeepSpeed's mpu: a later module's engine (no pipeline)
        # would take its destroyed data-parallel group
        groups.mpu = None
        if saved is None:
            del os.environ["LOCAL_RANK"]
        else:
            os.environ["LOCAL_RANK"] = saved


def build() -> Any:
    import deepspeed

    model = gpt_pipeline(SHAPE, pipeline_topology("tp-dp-pp", pp=1, dp=1), seed=1)
    engine, *_ = deepspeed.initialize(model=model, config=CONFIG, model_parameters=list(model.parameters()))
    return engine


def data(engine: Any) -> Any:
    batch_fn = gpt_batch_fn("synthetic", 1, 2, SHAPE)
    from ds_swift.data.keyed import micro_batches

    return micro_batches(batch_fn, int(engine.global_steps), 0, engine.gradient_accumulation_steps())


class Failure(RuntimeError):
    pass


def fail_in_flight(engine: Any, activations: list[weakref.ref[torch.Tensor]]) -> None:
    """Train until the second micro-batch's backward pass, which fails (a peer died); every block's
    output of the generation is watched through a weak reference."""
    from deepspeed.runtime.pipe import schedule

    from ds_swift.patches.instructions import hook_instructions

    backwards = [0]

    def backward(eng: Any, call_next: Any, **kw: Any) -> Any:
        backwards[0] += 1
        if backwards[0] == 2:
            raise Failure("peer gone")
        return call_next(**kw)

    def watch(_m: Any, _i: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            activations.append(weakref.ref(out))

    hooks = [m.register_forward_hook(watch) for m in engine.module.modules()]
    handle = hook_instructions(engine, "test.fail", {schedule.BackwardPass: backward})
    try:
        engine.train_batch(data_iter=data(engine))
    except Failure:
        pass
    finally:
        handle.remove()
        for h in hooks:
            h.remove()


def tear_down(engine: Any) -> None:
    """What a survivor's teardown does to the failed generation (Rebuilder._tear_down)."""
    from ds_swift.patches.deepspeed_rebuild import release_failed_engine, release_process_groups

    assert release_failed_engine(engine) is None
    release_process_groups(engine, engine.module, engine.optimizer)


def test_a_rebuild_frees_the_failed_generations_graphs_in_flight(world: None) -> None:
    from ds_swift.patches.deepspeed_rebuild import teardown_process_groups

    engine = build()
    engine.train_batch(data_iter=data(engine))  # a whole iteration first: optimizer state exists
    activations: list[weakref.ref[torch.Tensor]] = []
    fail_in_flight(engine, activations)
    assert activations and any(a() is not None for a in activations), "nothing in flight to free"
    failed = weakref.ref(engine)
    inner = engine.optimizer.optimizer  # torch's AdamW under ZeRO-1: the fp32 masters and their moments
    state = [weakref.ref(t) for group in inner.param_groups for t in group["params"]]
    state += [weakref.ref(t) for st in inner.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    inner = None
    tear_down(engine)
    engine = None
    teardown_process_groups()
    join_world()
    rebuilt = build()
    rebuilt.train_batch(data_iter=data(rebuilt))  # trains on
    gc.collect()
    alive = [a() for a in activations if a() is not None]
    assert not alive, f"{len(alive)} activation(s) of the failed generation still alive after the rebuild"
    assert failed() is None, "the failed engine is still alive after the rebuild"
    assert all(t() is None for t in state), "the failed engine's fp32 masters or moments are still alive"
