"""What survivors keep, donors send and buddies hold, for each DeepSpeed optimizer wrapper
(ds_swift.patches.deepspeed_optim_state): a one-rank gloo world, real DeepSpeed engines."""

from __future__ import annotations

import collections
import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ds_swift.patches.deepspeed_optim_state import (
    GeometryError,
    WrapperKind,
    capture_optimizer,
    is_partitioned,
    kind_of,
    load_optimizer,
    optimizer_payload,
    refresh_lp_params,
    reshard_optimizer,
)
from ds_swift.recovery.kept import KeptState
from ds_swift.recovery.state.transfer import decode, encode, flat_sizes, recv_state, send_state

CONFIGS = {  # by WrapperKind value
    "torch": {},
    # BF16_Optimizer: ZeRO-1 with fp32 gradient accumulation (what the pipeline engine builds)
    "bf16_optimizer": {
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "data_types": {"grad_accum_dtype": "fp32"},
    },
    "zero_stage1": {"fp16": {"enabled": True, "initial_scale_power": 8}, "zero_optimization": {"stage": 1}},
    "fp16_unfused": {"fp16": {"enabled": True, "initial_scale_power": 8}},
}
#: the DeepSpeed class each kind names
CLASSES = {
    "torch": "AdamW",
    "bf16_optimizer": "BF16_Optimizer",
    "zero_stage1": "DeepSpeedZeroOptimizer",
    "fp16_unfused": "FP16_UnfusedOptimizer",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def world() -> Iterator[None]:
    from ds_swift.patches.cpu_fp16 import allow_cpu_fp16

    saved = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"  # DeepSpeed's engine asserts it is set
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with allow_cpu_fp16():
            yield
    finally:
        dist.destroy_process_group()
        # DeepSpeed caches a clone of the world group (used without an mpu); the next module's world
        # is a new one.
        from deepspeed.utils import groups

        groups._WORLD_GROUP = None
        if saved is None:
            del os.environ["LOCAL_RANK"]
        else:
            os.environ["LOCAL_RANK"] = saved


def engine(kind: str, hidden: int = 8, steps: int = 2) -> Any:
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
        **CONFIGS[kind],
    }
    eng, *_ = deepspeed.initialize(model=model, config=config, model_parameters=list(model.parameters()))
    dtype = next(eng.module.parameters()).dtype
    for i in range(steps):
        x = torch.randn(2, hidden, generator=torch.Generator().manual_seed(i)).to(dtype)
        loss = eng(x).float().pow(2).mean()
        eng.backward(loss)
        eng.step()
    return eng


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b), (set(a), set(b))
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b, (a, b)


class Wire:
    def __init__(self) -> None:
        self.q: collections.deque[torch.Tensor] = collections.deque()

    def send(self, t: torch.Tensor, dst: int, group: Any = None) -> None:
        self.q.append(t.clone())

    def recv(self, t: torch.Tensor, src: int, group: Any = None) -> None:
        t.copy_(self.q.popleft())


@pytest.mark.parametrize("kind", list(CONFIGS))  # ZeRO-1 bf16 without fp32 accumulation is "zero_stage1" too
def test_a_wrappers_state_moves_into_a_fresh_engine_bitwise(world: None, kind: str) -> None:
    trained, fresh = engine(kind), engine(kind, steps=0)
    assert kind_of(trained.optimizer) is WrapperKind(kind) and not is_partitioned(trained.optimizer)  # dp = 1
    wire = Wire()
    send_state(optimizer_payload(capture_optimizer(trained.optimizer)), 1, send=wire.send)  # tensor-only
    load_optimizer(fresh.optimizer, recv_state(0, recv=wire.recv))
    refresh_lp_params(fresh.optimizer)
    assert_same(
        optimizer_payload(capture_optimizer(trained.optimizer)), optimizer_payload(capture_optimizer(fresh.optimizer))
    )
    for p, q in zip(trained.module.parameters(), fresh.module.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_one_classifier_names_the_deepspeed_class_for_kept_state_and_undo(world: None, kind: str) -> None:
    from ds_swift.undo.engine import attach_to_engine

    eng = engine(kind, steps=0)
    assert type(eng.optimizer).__name__ == CLASSES[kind]
    assert kind_of(eng.optimizer) is WrapperKind(kind)
    with attach_to_engine(eng) as undo:  # update-undo branches on the same kind
        assert undo.kind.kind is WrapperKind(kind)


def test_another_geometry_is_refused_loudly(world: None) -> None:
    payload = optimizer_payload(capture_optimizer(engine("bf16_optimizer").optimizer))
    with pytest.raises(GeometryError, match="masters"):
        load_optimizer(engine("bf16_optimizer", hidden=6, steps=0).optimizer, payload)
    with pytest.raises(GeometryError, match="kind"):
        load_optimizer(engine("zero_stage1", steps=0).optimizer, payload)


def split_like_dp(payload: dict[str, Any], dp: int, lp_numels: list[int]) -> list[dict[str, Any]]:
    """The payloads ``dp`` data-parallel ranks would hold of ``payload`` (one rank's whole state):
    each flat group padded at its end to a multiple of 2 x dp (DeepSpeed's alignment), cut in dp."""
    import copy

    parts = []
    for q in range(dp):
        part = copy.deepcopy(payload)
        for i, full in enumerate(lp_numels):
            size = -(-full // (2 * dp)) * 2

            def cut(t: torch.Tensor, size: int = size, full: int = full, q: int = q) -> torch.Tensor:
                padded = torch.zeros(size * dp, dtype=t.dtype)
                padded[:full] = t.reshape(-1)[:full]
                return padded[q * size : (q + 1) * size].clone()

            part["masters"][i] = cut(payload["masters"][i])
            part["geometry"]["masters"][i] = size
            part["geometry"]["partitions"][i] = [q, dp]
            for key, value in payload["inner"]["state"][i].items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    part["inner"]["state"][i][key] = cut(value)
        parts.append(part)
    return parts


@pytest.mark.parametrize("kind", ["bf16_optimizer", "zero_stage1"])
def test_partitions_of_another_data_parallel_size_reshard_bitwise(world: None, kind: str) -> None:
    """An elastic shrink (ds_swift.recovery.shrink): the partitions of 2 or 3 replicas, joined and cut
    again for this engine's single one, are its own state bit for bit; a misplaced or missing
    partition, or moments that disagree on the step, are refused."""
    eng = engine(kind, hidden=7)  # 7 * 7 + 7 + 7 + 1 = 64 parameters: padding for dp 3 (and not for 2)
    opt = eng.optimizer
    payload = optimizer_payload(capture_optimizer(opt))
    groups = opt.bf16_groups if kind == "bf16_optimizer" else opt.bit16_groups
    numels = [sum(p.numel() for p in g) for g in groups]
    for dp in (2, 3):
        parts = split_like_dp(payload, dp, numels)
        assert_same(reshard_optimizer(parts, opt), payload)
        with pytest.raises(GeometryError, match="not one whole set"):
            reshard_optimizer(parts[::-1], opt)
        with pytest.raises(GeometryError, match="not one whole set"):
            reshard_optimizer(parts[:-1], opt)
    parts = split_like_dp(payload, 2, numels)
    parts[1]["inner"]["state"][0]["step"] = parts[1]["inner"]["state"][0]["step"] + 1
    with pytest.raises(GeometryError, match="'step' differs"):
        reshard_optimizer(parts, opt)


def test_a_survivor_keeps_the_loss_scaler_and_undoes_through_the_wrapper(world: None) -> None:
    from ds_swift.undo import attach_to_engine

    eng = engine("zero_stage1", steps=1)
    handle = attach_to_engine(eng)
    before = optimizer_payload(capture_optimizer(eng.optimizer))
    before = decode(*_copy(before))
    scale_before = eng.optimizer.loss_scaler.cur_scale
    x = torch.randn(2, 8).half()
    eng.backward(eng(x).float().pow(2).mean())
    eng.step()
    kept = KeptState.capture(eng, handle)
    assert kept.last_stepped == 1 and kept.can_undo, kept.undo_blocker()
    kept.undo_to(0)
    after = optimizer_payload(kept.optimizer)
    assert kept.optimizer["scalers"][0]["cur_scale"] == scale_before
    for a, b in zip(after["masters"], before["masters"], strict=True):
        assert float((a - b).detach().abs().max()) <= 1e-6 * max(1.0, float(b.detach().abs().max()))
    fresh = engine("zero_stage1", steps=0)
    kept.restore(fresh, 0, undo=False, timeline=_Timeline())
    assert fresh.global_steps == 1 and fresh.optimizer.loss_scaler.cur_scale == scale_before


def test_an_undo_after_a_checkpoint_load_restores_the_loaded_loss_scaler(world: None, tmp_path: Any) -> None:
    """DeepSpeed's ZeRO load replaces the loss scaler object: the step record must read the new one
    (it read the object of before the load, and an undo put that stale scaler's state back)."""
    from ds_swift.undo import attach_to_engine

    eng = engine("zero_stage1", steps=1)
    handle = attach_to_engine(eng)
    eng.save_checkpoint(str(tmp_path), tag="t1")

    def step(i: int) -> None:
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(10 + i)).half()
        eng.backward(eng(x).float().pow(2).mean())
        eng.step()

    step(0)  # the scaler of before the load moves on to cur_iter 2
    stale = eng.optimizer.loss_scaler
    eng.load_checkpoint(str(tmp_path), tag="t1")
    assert eng.optimizer.loss_scaler is not stale and eng.optimizer.loss_scaler.cur_iter == 1
    step(1)
    kept = KeptState.capture(eng, handle)
    assert kept.last_stepped == 1 and kept.can_undo, kept.undo_blocker()
    kept.undo_to(0)
    assert kept.optimizer["scalers"][0]["cur_iter"] == 1  # the loaded scaler's, not the stale one's 2


def _copy(payload: Any) -> tuple[bytes, dict[torch.dtype, torch.Tensor]]:
    manifest, tensors = encode(payload)
    flats = {d: torch.cat([t.reshape(-1) for t in tensors if t.dtype == d]).clone() for d in flat_sizes(manifest)}
    return manifest, flats


class _Timeline:
    def __init__(self) -> None:
        self.undone_from: int | None = None
        self.t_undone: float | None = None
        self.extra: dict[str, Any] = {}


def _detached(payload: Any) -> Any:
    manifest, flats = _copy(payload)
    return decode(manifest, flats)


@pytest.mark.parametrize("kind", ["bf16_optimizer", "zero_stage1"])
def test_an_undo_from_the_own_copy_is_bitwise(world: None, kind: str) -> None:
    """A survivor whose step's buddy round had not landed takes back its own copy of the iteration
    before (ds_swift.protect.buddy.stage_own): its masters, moments, loss scaler, LR scheduler and
    (rebuilt from the masters) low-precision parameters are bitwise those of the failure-free run at
    that iteration. Update-undo's inverse update on the same step is measured alongside: on this
    4k-parameter model it leaves elements off by an ulp, which is why the own copy exists."""
    from ds_swift.protect.buddy_holdings import BuddyHoldings, stage_own
    from ds_swift.protect.buddy_payload import state_payload
    from ds_swift.undo import attach_to_engine

    def stepped_once_more(holdings: BuddyHoldings | None) -> KeptState:
        eng = engine(kind, hidden=64, steps=3)
        handle = attach_to_engine(eng)
        if holdings is not None:
            stage_own(holdings, int(eng.global_steps) - 1, *state_payload(eng))
        x = torch.randn(2, 64, generator=torch.Generator().manual_seed(9)).to(next(eng.module.parameters()).dtype)
        eng.backward(eng(x).float().pow(2).mean())
        eng.step()
        kept = KeptState.capture(eng, handle)
        kept.buddy = holdings
        return kept

    reference = engine(kind, hidden=64, steps=3)  # the failure-free run at iteration 2
    want = _detached(optimizer_payload(capture_optimizer(reference.optimizer)))
    holdings = BuddyHoldings()
    kept = stepped_once_more(holdings)
    assert holdings.own_versions() == (2,) and kept.undo_exact and kept.can_undo
    assert kept.undo_to(2) == "own copy" and kept.last_stepped == 2
    fresh = engine(kind, hidden=64, steps=0)
    kept.restore(fresh, 2, undo=False, timeline=_Timeline())
    refresh_lp_params(fresh.optimizer)  # what the strategies' finish_restore does
    assert_same(optimizer_payload(capture_optimizer(fresh.optimizer)), want)
    assert fresh.lr_scheduler.state_dict() == reference.lr_scheduler.state_dict() and fresh.global_steps == 3
    for p, q in zip(fresh.module.parameters(), reference.module.parameters(), strict=True):
        assert torch.equal(p, q)
    # What was taken back is the survivor's own: the next rounds, refilling the held buffers, leave it be.
    other = engine(kind, hidden=64, steps=1)
    for version in (3, 4):
        stage_own(holdings, version, *state_payload(other))
    assert holdings.own_versions() == (3, 4)
    assert_same(optimizer_payload(capture_optimizer(fresh.optimizer)), want)

    inverse = stepped_once_more(None)
    assert not inverse.undo_exact and inverse.undo_to(2) == "inverse update"
    got = optimizer_payload(inverse.optimizer)
    off = sum(int((a != b).sum()) for a, b in zip(got["masters"], want["masters"], strict=True))
    print(f"{kind}: the inverse update leaves {off} of {sum(t.numel() for t in want['masters'])} masters off")


def test_the_wire_format_carries_no_pickle() -> None:
    manifest, _ = encode({"a": (1, 2.5, None), 3: torch.zeros(2), "dt": torch.bfloat16})
    assert manifest.startswith(b"{")  # JSON
    with pytest.raises(TypeError, match="tensors and JSON scalars only"):
        encode({"obj": object()})


@pytest.mark.parametrize("kind", ["bf16_optimizer", "torch"])
def test_the_buddy_cost_line_counts_what_the_copier_stages_after_a_step(world: None, kind: str) -> None:
    """The start-up line's buddy bytes (before any step: Adam's moments do not exist yet) are the
    bytes a round stages once the job trains (the fp32 masters, both moments, the step counters)."""
    from ds_swift.protect.base import CostInputs
    from ds_swift.protect.buddy import BuddyCopier
    from ds_swift.protect.buddy_holdings import BuddyHoldings, stage_own
    from ds_swift.protect.buddy_payload import round_bytes, state_payload

    eng = engine(kind, steps=0)
    estimate, how = round_bytes(eng)
    assert "Adam moments" in how, how
    line = BuddyCopier(2, ()).cost_line(eng, CostInputs(None, 0, "cpu", machines=2, without=frozenset()))
    assert f"({2 * estimate} bytes) per iteration sent to 2 buddy rank(s)" in line, line
    _, before = state_payload(eng)
    dtype = next(eng.module.parameters()).dtype
    loss = eng(torch.randn(2, 8, generator=torch.Generator().manual_seed(0)).to(dtype)).float().pow(2).mean()
    eng.backward(loss)
    eng.step()
    manifest, live = state_payload(eng)
    staged = sum(t.numel() * t.element_size() for t in stage_own(BuddyHoldings(), 0, manifest, live))
    assert staged == estimate > sum(t.numel() * t.element_size() for t in before)
    assert round_bytes(eng) == (staged, "measured from the state the copier sends")
