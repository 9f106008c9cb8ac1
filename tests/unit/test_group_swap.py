"""A survivor keeps its engine (issue 50): the process groups under a live DeepSpeed engine are
swapped for the next generation's in place (ds_swift.patches.group_swap), what the failed iteration
left half done is cleared (ds_swift.patches.deepspeed_fresh), and training goes on bitwise as if
nothing had failed. One rank, a gloo world of 1 re-created for each generation (as
ds_swift.runtime.context.join_generation does), megatron-core's groups built as the example's
``model_fn`` builds them; the configurations users run: bf16 + ZeRO-1 (BF16_Optimizer), fp16 +
ZeRO-1 (DeepSpeedZeroOptimizer) and fp32 ZeRO-0 (the torch optimizer itself).

The multi-rank half (a replacement's real start-up meeting the survivors' replay) is the recovery
tests' (tests/dist/test_recovery*.py, benchmarks/fault_matrix.py).
"""

from __future__ import annotations

import contextlib
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
BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "gradient_clipping": 1.0,
    "pipeline": {"stages": 1},
    "steps_per_print": 1_000_000,
}
CONFIGS = {
    "bf16_zero1": {**BASE, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}},
    "fp16_zero1": {
        **BASE,
        "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2},
        "zero_optimization": {"stage": 1},
    },
    "fp32_zero0": {**BASE, "zero_optimization": {"stage": 0}},
}
ITERATIONS = 4
FAIL_AT = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join_world() -> None:
    import deepspeed

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo")


@pytest.fixture
def one_rank() -> Iterator[None]:
    import deepspeed.comm as dscomm
    from deepspeed.utils import groups

    from ds_swift.patches.cpu_fp16 import allow_cpu_fp16

    saved = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"
    fp16 = allow_cpu_fp16()
    try:
        yield
    finally:
        fp16.remove()
        if dist.is_initialized():
            dist.destroy_process_group()
        groups._release_process_group_references(group=None)
        dscomm.cdb = None
        if saved is None:
            del os.environ["LOCAL_RANK"]
        else:
            os.environ["LOCAL_RANK"] = saved


def build(config: dict[str, Any]) -> Any:
    import deepspeed
    from megatron.core import parallel_state

    from ds_swift.patches.megatron_import import import_megatron_core

    import_megatron_core()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    model = gpt_pipeline(SHAPE, pipeline_topology("tp-dp-pp", pp=1, dp=1), seed=1)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=list(model.parameters()))
    return engine


def train(engine: Any) -> Any:
    from ds_swift.data.keyed import micro_batches

    batch_fn = gpt_batch_fn("synthetic", 1, 2, SHAPE)
    data = micro_batches(batch_fn, int(engine.global_steps), 0, engine.gradient_accumulation_steps())
    return engine.train_batch(data_iter=data)


def state_of(engine: Any) -> dict[str, torch.Tensor]:
    """Every tensor of the rank's training state, and the loss scale, by name (copies)."""
    from ds_swift.patches.deepspeed_optim_state import capture_optimizer, optimizer_payload
    from ds_swift.recovery.state.transfer import flatten

    payload = optimizer_payload(capture_optimizer(engine.optimizer))
    _, tensors = flatten(payload)
    out = {f"module.{k}": v.detach().clone() for k, v in engine.module.state_dict().items()}
    out.update({f"optimizer.{i}": t.detach().clone() for i, t in enumerate(tensors)})
    scalers = payload.get("scalers") or []
    out["loss_scale"] = torch.tensor([float(s.get("cur_scale", 1.0)) for s in scalers], dtype=torch.float64)
    return out


class Failure(RuntimeError):
    pass


def fail_during(engine: Any, phase: str) -> None:
    """Iteration FAIL_AT fails in the second micro-batch's ``phase`` (as a peer's death would make it)."""
    from deepspeed.runtime.pipe import schedule

    from ds_swift.patches.instructions import hook_instructions

    instr = {"forward": schedule.ForwardPass, "backward": schedule.BackwardPass, "reduce": schedule.ReduceGrads}
    seen = [0]

    def hook(eng: Any, call_next: Any, **kw: Any) -> Any:
        seen[0] += 1
        if seen[0] == (1 if phase == "reduce" else 2):
            raise Failure("peer gone")
        return call_next(**kw)

    handle = hook_instructions(engine, "test.fail", {instr[phase]: hook})
    try:
        with pytest.raises(Failure):
            train(engine)
    finally:
        handle.remove()


def reference(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The failure-free run's state after ITERATIONS iterations."""
    join_world()
    engine = build(config)
    for _ in range(ITERATIONS):
        train(engine)
    state = state_of(engine)
    from ds_swift.patches.deepspeed_rebuild import release_failed_engine, teardown_process_groups

    release_failed_engine(engine)
    engine = None
    teardown_process_groups()
    return state


@pytest.mark.parametrize("phase", ["forward", "backward", "reduce"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_a_kept_engine_with_swapped_groups_trains_on_bitwise(one_rank: None, config: str, phase: str) -> None:
    from ds_swift.patches.deepspeed_fresh import fresh_iteration
    from ds_swift.patches.deepspeed_rebuild import free_groups, release_pipeline_activations, teardown_process_groups
    from ds_swift.patches.group_swap import GroupSwap, StartupLedger
    from ds_swift.testing.groups import reachable_groups

    expected = reference(CONFIGS[config])

    join_world()
    ledger = StartupLedger.start()
    engine = build(CONFIGS[config])
    ledger.close()
    assert ledger.why_not is None, ledger.why_not
    for _ in range(FAIL_AT):
        train(engine)
    fail_during(engine, phase)

    # The teardown: every group reference found and cut; the failed generation's groups are freed.
    swap = GroupSwap([engine], ledger)
    old = [weakref.ref(g) for g in reachable_groups([engine])]
    assert old, "the engine holds no process group: the walk found nothing"
    release_pipeline_activations(engine)
    cut = swap.cut()
    assert len(cut) == len(old)
    teardown_process_groups(engine_kept=True)
    free_groups(cut)  # the runtime does it on a thread of its own (ds_swift.runtime.swap)
    assert not cut
    alive = [g() for g in old if g() is not None]
    assert not alive, f"{len(alive)} of the failed generation's {len(old)} groups outlived the teardown"

    # The next generation: a new world, the start-up's groups made again and put in place.
    join_world()
    made = ledger.replay()
    swap.refill(made)
    fresh_iteration(engine)
    live = {id(g) for g in dist.distributed_c10d._world.pg_map}
    held = reachable_groups([engine])
    assert held and all(id(g) in live for g in held), "the engine reaches a group outside the generation in force"
    assert len(held) == len(old)

    assert int(engine.global_steps) == FAIL_AT  # the failure came before the step: the iteration runs again
    for _ in range(ITERATIONS - FAIL_AT):
        train(engine)
    got = state_of(engine)
    assert got.keys() == expected.keys()
    different = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not different, (
        f"{len(different)} of {len(expected)} tensors differ from the failure-free run: {different[:5]}"
    )


def test_a_group_the_start_up_did_not_create_refuses_the_swap(one_rank: None) -> None:
    """A group made after the start-up (lazily, in training) cannot be replayed: the swap says so and
    the survivor rebuilds (ds_swift.runtime.swap)."""
    from ds_swift.patches.group_swap import GroupSwap, StartupLedger, SwapRefused

    join_world()
    ledger = StartupLedger.start()
    engine = build(CONFIGS["fp32_zero0"])
    ledger.close()
    engine.late_group = dist.new_group([0])
    with pytest.raises(SwapRefused, match="did not create"):
        GroupSwap([engine], ledger)
    del engine.late_group


def test_an_op_a_replay_cannot_repeat_is_named(one_rank: None) -> None:
    from ds_swift.patches.group_swap import StartupLedger, SwapRefused

    join_world()
    ledger = StartupLedger.start()
    with contextlib.suppress(Exception):  # what torch makes of an empty batch does not matter here
        dist.batch_isend_irecv([])
    ledger.close()
    assert ledger.why_not is not None and "batch_isend_irecv" in ledger.why_not
    with pytest.raises(SwapRefused, match="batch_isend_irecv"):
        ledger.replay()


def test_the_ledger_replays_small_values_and_zeros_for_large_ones(one_rank: None) -> None:
    """What a replacement's start-up reads from a survivor (a flag, a count) is what the survivor sent
    at its own start-up; a large tensor (a parameter) goes as zeros: the recovery overwrites it."""
    from ds_swift.patches import group_swap
    from ds_swift.patches.group_swap import StartupLedger

    join_world()
    ledger = StartupLedger.start()
    g = dist.new_group([0])
    dist.broadcast(torch.tensor([3, 1, 4]), src=0, group=g)
    big = torch.ones(group_swap.VALUE_LIMIT_BYTES // 4 + 1)
    dist.all_reduce(big)
    ledger.close()
    assert [c.name for c in ledger.calls] == ["new_group", "broadcast", "all_reduce"]
    flag, large = ledger.calls[1].args[0], ledger.calls[2].args[0]
    assert torch.equal(flag.fresh(), torch.tensor([3, 1, 4]))
    assert large.value is None and torch.count_nonzero(large.fresh()) == 0
    assert ledger.index_of(g) == 0
    dist.destroy_process_group()
    join_world()
    made = ledger.replay()
    assert isinstance(made[0], dist.ProcessGroup) and made[0] is not g
    assert ledger.index_of(made[0]) == 0 and ledger.index_of(g) is None


def test_the_ledger_is_a_reversible_patch(one_rank: None) -> None:
    """STYLE habit 4: the recording patch keeps the originals, refuses to record twice at once, and its
    close puts torch.distributed and DeepSpeed's _broadcast_model back exactly as they were."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from ds_swift.patches._base import PatchError
    from ds_swift.patches.group_swap import StartupLedger

    join_world()
    c10d = dist.distributed_c10d
    before = (dist.new_group, c10d.new_group, dist.broadcast, c10d.all_reduce, DeepSpeedEngine._broadcast_model)
    ledger = StartupLedger.start()
    assert dist.new_group is not before[0] and DeepSpeedEngine._broadcast_model is not before[4]
    with pytest.raises(PatchError, match="already recorded"):
        StartupLedger.start()
    ledger.close()
    ledger.close()  # idempotent
    after = (dist.new_group, c10d.new_group, dist.broadcast, c10d.all_reduce, DeepSpeedEngine._broadcast_model)
    assert all(a is b for a, b in zip(after, before, strict=True))
    assert ledger.closed_at is not None and not ledger.recording
