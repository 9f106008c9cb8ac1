"""State digests (ds_swift.recovery.state.digest) and the checks built on them (ds_swift.recovery.verify,
ds_swift.protect.digest_publisher): exact over the raw bits, position-dependent, published where they outlive
the rank, and a replay checked against them."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_swift.jobstore.membership import JobStore
from ds_swift.protect.digest_publisher import DigestPublisher
from ds_swift.recovery.consensus import RecoveryPlan
from ds_swift.recovery.state.digest import (
    StateDigest,
    Verdict,
    digest_state,
    digest_tensors,
    engine_state,
    named_tensors,
    tensor_digest,
    word_sums,
)
from ds_swift.recovery.verify import (
    SLOTS,
    ReplayCheck,
    agree_verdicts,
    forget_from,
    mismatch_reason,
    publish_digest,
    published_digests,
)

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
CHUNK = 1 << 20  # words per chunk of the device-side sums


def next_up(t: torch.Tensor, i: int) -> torch.Tensor:
    """``t`` with element ``i`` moved one ulp towards +inf."""
    out = t.clone()
    flat = out.view(-1)
    flat[i] = torch.nextafter(flat[i : i + 1], torch.tensor([float("inf")], dtype=t.dtype))[0]
    return out


def reference_sums(t: torch.Tensor) -> list[tuple[int, int]]:
    """(S0, S1) per lane in plain Python integers: what the device-side chunked sums must equal."""
    flat = t.detach().reshape(-1).contiguous()
    size = flat.element_size()
    words = flat.view({1: torch.uint8, 2: torch.int16}.get(size, torch.int32)).tolist()
    lanes = [words] if size <= 4 else [words[i :: size // 4] for i in range(size // 4)]
    return [(sum(lane), sum(i * w for i, w in enumerate(lane))) for lane in lanes]


# ----------------------------------------------------------------------------- one tensor
@pytest.mark.parametrize("n", [613, 5 * 613, 10_007])  # short lanes summed together, long ones in chunks
@pytest.mark.parametrize("dtype", [*FLOATS, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool])
def test_sums_are_exact(dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(n, generator=g) * 1e4).to(dtype)
    assert word_sums(t) == reference_sums(t)
    mixed = {"a": t, "b": t[: n // 3], "c": torch.zeros(0, dtype=dtype), "d": t.flip(0)}
    assert digest_tensors(mixed) == {k: tensor_digest(v) for k, v in mixed.items()}


def test_sums_are_exact_across_chunks() -> None:
    t = torch.randn(2 * CHUNK + 12_345, generator=torch.Generator().manual_seed(2))
    words = t.view(torch.int32).to(torch.int64)
    ((s0, s1),) = word_sums(t)
    assert s0 == int(words.sum())  # no wrap: |S0| < 2^53
    positions = torch.arange(words.numel(), dtype=torch.int64)
    assert (s1 - int((words * positions).sum())) % 2**64 == 0  # torch's reference wraps; ours is exact


def test_sums_are_exact_over_many_whole_chunks() -> None:
    """A lane of more whole chunks than one pass takes (the large-lane path), with a tail, against
    per-chunk sums put together in Python integers (no rows, no columns)."""
    n = 11 * CHUNK + 777
    t = (torch.randn(n, generator=torch.Generator().manual_seed(3)) * 3e4).to(torch.bfloat16)
    words = t.view(torch.int16).to(torch.int64)
    within = torch.arange(CHUNK, dtype=torch.int64)
    s0 = s1 = 0
    for k in range(-(-n // CHUNK)):
        part = words[k * CHUNK : (k + 1) * CHUNK]
        c0 = int(part.sum())
        s0 += c0
        s1 += k * CHUNK * c0 + int((part * within[: part.numel()]).sum())  # below 2^51: no wrap
    assert word_sums(t) == [(s0, s1)]
    # A non-contiguous view of the same words: the same sums.
    assert word_sums(torch.stack([t, t], dim=1)[:, 0]) == [(s0, s1)]


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(FLOATS), n=st.integers(1, 3000), data=st.data())
def test_one_ulp_in_one_element_changes_the_digest(dtype: torch.dtype, n: int, data: st.DataObject) -> None:
    t = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    i = data.draw(st.integers(0, n - 1))
    assert tensor_digest(next_up(t, i)) != tensor_digest(t)
    assert tensor_digest(t.clone()) == tensor_digest(t)


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([*FLOATS, torch.int64]), n=st.integers(2, 3000), data=st.data())
def test_swapped_elements_change_the_digest(dtype: torch.dtype, n: int, data: st.DataObject) -> None:
    t = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 100).to(dtype)
    i, j = data.draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True))
    swapped = t.clone()
    swapped[i], swapped[j] = t[j], t[i]
    assert (tensor_digest(swapped) == tensor_digest(t)) == bool(t[i] == t[j])


def test_a_swap_across_a_chunk_boundary_and_an_ulp_in_the_last_chunk() -> None:
    t = torch.randn(CHUNK + 1000, generator=torch.Generator().manual_seed(3))
    swapped = t.clone()
    swapped[CHUNK - 1], swapped[CHUNK] = t[CHUNK], t[CHUNK - 1]
    assert tensor_digest(swapped) != tensor_digest(t)
    assert tensor_digest(next_up(t, CHUNK + 999)) != tensor_digest(t)


def test_an_8_byte_swap_that_keeps_the_word_sums() -> None:
    # Two int64 elements whose 32-bit halves add up alike: lanes are summed on their own.
    a, b = (2 << 32) + 1, (1 << 32) + 2
    t = torch.tensor([a, b, 0], dtype=torch.int64)
    assert tensor_digest(torch.tensor([b, a, 0], dtype=torch.int64)) != tensor_digest(t)


def test_bits_not_values() -> None:
    zero = torch.zeros(4)
    assert tensor_digest(-zero) != tensor_digest(zero)  # -0.0 == 0.0, but not bitwise
    nan = torch.full((4,), float("nan"))
    other_nan = nan.clone().view(torch.int32)
    other_nan[2] += 1  # another NaN payload
    assert tensor_digest(other_nan.view(torch.float32)) != tensor_digest(nan)
    # the same bits as another dtype or shape are another tensor
    t = torch.randn(6, 4)
    assert tensor_digest(t.view(torch.int32)) != tensor_digest(t)
    assert tensor_digest(t.view(4, 6)) != tensor_digest(t)
    # a strided view digests its elements in logical order
    assert tensor_digest(t.t()) == tensor_digest(t.t().contiguous())
    assert tensor_digest(torch.empty(0)) == tensor_digest(torch.empty(0))


def test_digest_tensors_is_per_tensor_with_one_transfer() -> None:
    g = torch.Generator().manual_seed(4)
    named = {"a": torch.randn(7, generator=g), "b": torch.randn(3, 3, generator=g).half(), "c": torch.arange(5)}
    assert digest_tensors(named) == {k: tensor_digest(v) for k, v in named.items()}


# ----------------------------------------------------------------------------- states
class Engine:
    """The parts of a DeepSpeed engine a digest reads: module, torch optimizer, step counter."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-2)
        self.global_steps = 0

    def step(self) -> None:
        self.module(torch.randn(5, 4)).sum().backward()
        self.optimizer.step()
        self.global_steps += 1


def test_state_names_and_the_first_difference() -> None:
    engine = Engine()
    engine.step()
    state = engine_state(engine)
    names = set(named_tensors(state))
    assert {"module/0.weight", "module/1.running_mean", "optimizer/inner/state/0/exp_avg"} <= names
    assert not any(n.startswith(("rng", "counters")) for n in named_tensors({**state, "rng": [torch.ones(1)]}))
    ref = json.loads(digest_state(state).to_json(iteration=0))
    assert digest_state(engine_state(engine)).first_difference(ref) is None
    with torch.no_grad():
        engine.module[0].bias[1] = torch.nextafter(engine.module[0].bias[1], torch.tensor(9.0))
    diff = digest_state(engine_state(engine)).first_difference(ref)
    assert diff is not None and diff.startswith("tensor module/0.bias differs (reference digest "), diff
    other = StateDigest(("x",), ("0" * 16,))
    assert "holds other tensors" in str(other.first_difference(ref))


def test_a_restored_rank_on_another_loss_scale_fails_its_check() -> None:
    """fp16: a rank whose loss scaler differs unscales every later gradient by another factor."""
    scaler = {"cur_scale": 256.0, "cur_iter": 3, "last_overflow_iter": -1, "cur_hysteresis": 2, "dynamic": True}
    state: dict[str, Any] = {
        "module": {"w": torch.ones(3)},
        "optimizer": {"masters": [torch.ones(3)], "scalers": [scaler]},
    }
    ref = json.loads(digest_state(state).to_json(iteration=3))
    assert digest_state(state).first_difference(ref) is None
    for field, value in (("cur_scale", 128.0), ("cur_iter", 2), ("last_overflow_iter", 1), ("cur_hysteresis", 1)):
        moved = {**state, "optimizer": {**state["optimizer"], "scalers": [{**scaler, field: value}]}}
        diff = digest_state(moved).first_difference(ref)
        assert diff is not None and diff.startswith("tensor optimizer/scalers/0 differs"), (field, diff)
    assert "optimizer/scalers/0" not in named_tensors(
        {"optimizer": {"masters": [torch.ones(3)], "scalers": []}}
    )  # bf16


# ----------------------------------------------------------------------------- the job store
@pytest.fixture
def store() -> JobStore:
    return JobStore(dist.HashStore(), "unit-digest")


def test_published_digests_keep_the_last_slots_and_forget_what_is_trained_again(store: JobStore) -> None:
    d = StateDigest(("a",), ("0" * 16,))
    for it in range(10):
        publish_digest(store, 3, it, 1, d)
    assert sorted(published_digests(store, 3)) == list(range(10 - SLOTS, 10))
    forget_from(store, 3, 8)
    assert sorted(published_digests(store, 3)) == [6, 7]
    for it in range(0, 20, 5):  # every 5th iteration: the ring spans 20
        publish_digest(store, 4, it, 5, d)
    assert sorted(published_digests(store, 4)) == [0, 5, 10, 15]


def plan(first: int, last: int) -> RecoveryPlan:
    return RecoveryPlan("logging", "", last, (0,), (1,), replay_ranks=(1,), replay_from=first)


def trained(steps: int, store: JobStore | None = None) -> Engine:
    engine = Engine()
    for it in range(steps):
        engine.step()
        if store is not None:
            publish_digest(store, 1, it, 1, digest_state(engine_state(engine)))
    return engine


def test_a_replay_is_checked_at_the_newest_published_iteration(store: JobStore) -> None:
    trained(6, store)  # the rank published iterations 2..5 (4 slots), then died
    replayed = trained(4)  # loaded "iteration 4" and replays 4..5
    check = ReplayCheck(store, 1, plan(4, 5), replayed)
    assert check.target == 5
    replayed.step()  # iteration 4
    check.before_iteration(5)
    replayed.step()  # iteration 5
    verdict = check.finish()
    assert verdict.status == "verified" and "iteration 5 bitwise equal" in verdict.detail, verdict


def test_a_perturbed_replay_is_a_mismatch_naming_the_tensor(store: JobStore) -> None:
    trained(6, store)
    replayed = trained(6)
    with torch.no_grad():
        replayed.module[0].weight.view(-1)[3] += 1e-3  # one element
    verdict = ReplayCheck(store, 1, plan(4, 5), replayed).finish()
    assert verdict.status == "mismatch", verdict
    assert (
        "state replayed to iteration 5 differs from the digest rank 1 published then: tensor module/0.weight "
        "differs (reference digest " in verdict.detail
    ), verdict.detail
    # a step from a perturbed state (as a perturbed message leaves it) spreads to more tensors
    replayed = trained(5)
    with torch.no_grad():
        replayed.module[0].weight.view(-1)[3] += 1e-3
    check = ReplayCheck(store, 1, plan(4, 5), replayed)
    replayed.step()
    verdict = check.finish()
    assert verdict.status == "mismatch" and "more tensor(s)" in verdict.detail, verdict


def test_without_the_last_digest_the_replay_is_checked_before_it(store: JobStore) -> None:
    trained(5, store)  # the digest of iteration 5 never left the rank
    replayed = trained(3)
    check = ReplayCheck(store, 1, plan(3, 5), replayed)
    assert check.target == 4
    for it in (3, 4, 5):
        check.before_iteration(it)
        replayed.step()
    verdict = check.finish()
    assert verdict.status == "verified" and "iterations 5..5 after it unchecked" in verdict.detail, verdict
    none = ReplayCheck(store, 7, plan(3, 5), replayed).finish()
    assert none.status == "unverified" and "published no digest" in none.detail
    assert ReplayCheck(store, 1, plan(3, 5), replayed).finish(approximate=True).status == "unverified"


def test_every_rank_agrees_on_the_verdicts(store: JobStore) -> None:
    bad = Verdict("mismatch", "tensor module/w differs")
    assert agree_verdicts(store, 1, 0, 1, bad, timeout_s=5) == {0: bad}
    assert agree_verdicts(store, 2, 0, 1, None, timeout_s=5) == {}
    assert mismatch_reason({0: Verdict("verified", "ok")}) is None
    reason = mismatch_reason({2: bad, 0: Verdict("verified", "ok"), 1: bad})
    assert reason == (
        "restored state failed verification: rank 1: tensor module/w differs; rank 2: tensor module/w differs"
    )


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the digest publisher said on ds-swift's logging channel."""
    return [r.getMessage() for r in caplog.records if r.name == "ds_swift.protect.digest_publisher"]


def test_the_publisher_digests_every_interval_in_the_background(
    store: JobStore, caplog: pytest.LogCaptureFixture
) -> None:
    pub = DigestPublisher(1, 2, lambda: store)
    engine = Engine()
    try:
        for _ in range(5):
            pub.wait()
            engine.step()
            pub.after_step(engine)
        assert pub.wait(timeout_s=30)
    finally:
        pub.stop()
    assert pub.published == 3  # iterations 0, 2, 4
    logged = _said(caplog)
    assert len(logged) == 1 and logged[0].startswith("state digests: 3 published, "), logged  # at the end: the cost
    got = published_digests(store, 1)
    assert sorted(got) == [0, 2, 4]
    assert digest_state(engine_state(engine)).first_difference(got[4]) is None


def test_a_publisher_that_cannot_reach_the_store_says_so_once(
    store: JobStore, caplog: pytest.LogCaptureFixture
) -> None:

    def broken() -> Any:
        raise ConnectionError("store down")

    pub = DigestPublisher(1, 1, broken)
    engine = SimpleNamespace(module=torch.nn.Linear(2, 2), optimizer=None, global_steps=1)
    try:
        for _ in range(3):
            pub.after_step(engine)
            assert pub.wait(timeout_s=30)
    finally:
        pub.stop()
    (warned,) = [r for r in caplog.records if r.name == "ds_swift.protect.digest_publisher"]
    assert warned.levelno == logging.WARNING
    assert warned.getMessage().startswith(
        "state digests are not being published: a recovery's restored state will be unverified: "
    ) and warned.getMessage().endswith("not published (ConnectionError: store down)")


def test_a_second_store_outage_is_said_again(store: JobStore, caplog: pytest.LogCaptureFixture) -> None:
    down = [False]

    class Flaky:
        def set(self, key: str, value: str) -> None:
            if down[0]:
                raise ConnectionError("store down")
            store.set(key, value)

    flaky: Any = Flaky()
    pub = DigestPublisher(1, 1, lambda: flaky)
    engine = SimpleNamespace(module=torch.nn.Linear(2, 2), optimizer=None, global_steps=1)
    try:
        for outage in (True, True, False, False, True, True):  # two outages, the store back between them
            down[0] = outage
            pub.after_step(engine)
            assert pub.wait(timeout_s=30)
            engine.global_steps += 1
    finally:
        pub.stop()
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "ds_swift.protect.digest_publisher"]
    assert [level for level, _ in said[:3]] == [logging.WARNING, logging.INFO, logging.WARNING], said
    assert "iteration 0 not published" in said[0][1] and said[1][1] == "state digests are published again (iteration 2)"
    assert "iteration 4 not published" in said[2][1]
    assert len(said) == 4 and said[3][1].startswith("state digests: 2 published, ")  # the cost, at the end
