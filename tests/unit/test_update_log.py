"""TranLogs' update records (ds_swift.recovery.state.update_log): recorded after each step of a real
DeepSpeed engine under every optimizer wrapper, stored with their checksums, and re-applied on a
fresh engine loaded with the earlier state: bitwise the trained engine's state. A one-rank gloo world."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from test_kept_wrappers import CONFIGS, assert_same, engine, world  # noqa: F401 - world is a fixture

from ds_swift.patches.deepspeed_optim_state import (
    capture_optimizer,
    load_optimizer,
    optimizer_payload,
    refresh_lp_params,
)
from ds_swift.recovery.state.update_log import (
    UpdateLogError,
    capture_update,
    load_record,
    record_name,
    records_before,
    redo_update,
    restore_after,
    save_record,
)
from ds_swift.storage import open_store
from ds_swift.undo import attach_to_engine

pytestmark = pytest.mark.usefixtures("world")  # a one-rank gloo world (test_kept_wrappers)


def train(eng: Any, iterations: range) -> None:
    dtype = next(eng.module.parameters()).dtype
    for i in iterations:
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(100 + i)).to(dtype)
        eng.backward(eng(x).float().pow(2).mean())
        eng.step()


def state(eng: Any) -> dict[str, Any]:
    return {
        "optimizer": optimizer_payload(capture_optimizer(eng.optimizer)),
        "module": {k: v.clone() for k, v in eng.module.state_dict().items()},
        "scheduler": eng.lr_scheduler.state_dict(),
        "counters": [eng.global_steps, eng.global_samples, eng.skipped_steps],
    }


def put(store: Any, rank: int, record: Any, tmp: Path) -> None:
    path = tmp / record_name(rank, record.iteration)
    save_record(record, path)
    store.put_file(path, path.name)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_re_applied_updates_rebuild_the_trained_state_bitwise(kind: str, tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "log"))
    trained = engine(kind, steps=2)  # the "checkpoint": after iterations 0 and 1
    saved = copy.deepcopy(state(trained))  # (the payload holds the live tensors)
    undo = attach_to_engine(trained)
    for _ in range(3):  # iterations 2, 3, 4, each recorded after its step
        train(trained, range(int(trained.global_steps), int(trained.global_steps) + 1))
        put(store, 0, capture_update(trained, undo), tmp_path)
    fresh = engine(kind, steps=0)
    load_optimizer(fresh.optimizer, saved["optimizer"])
    fresh.module.load_state_dict(saved["module"])
    fresh.lr_scheduler.load_state_dict(saved["scheduler"])
    inner = getattr(fresh.optimizer, "optimizer", fresh.optimizer)
    for iteration in (2, 3, 4):
        record = load_record(store, 0, iteration)
        assert record.iteration == iteration and record.nbytes > 0
        redo_update(inner, record)
    restore_after(fresh, record)
    refresh_lp_params(fresh.optimizer)
    assert_same(state(trained), state(fresh))
    assert fresh._global_grad_norm == trained._global_grad_norm


def test_a_corrupt_or_missing_record_is_refused_naming_it(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "log"))
    eng = engine("bf16_optimizer", steps=1)
    undo = attach_to_engine(eng)
    train(eng, range(1, 2))
    put(store, 3, capture_update(eng, undo), tmp_path)
    load_record(store, 3, 1)  # intact
    with pytest.raises(UpdateLogError, match=r"upd_r00003_it0000000002\.pt"):
        load_record(store, 3, 2)  # never written (the rank died before its writer stored it)
    stored = tmp_path / "log" / store.current_object(record_name(3, 1))  # the upload's object
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stored.write_bytes(bytes(data))
    with pytest.raises(UpdateLogError, match="corrupt"):
        load_record(store, 3, 1)


def test_a_record_that_does_not_fit_the_optimizer_is_refused(tmp_path: Path) -> None:
    eng = engine("torch", steps=1)
    undo = attach_to_engine(eng)
    train(eng, range(1, 2))
    record = capture_update(eng, undo)
    other = engine("torch", hidden=6, steps=0)
    with pytest.raises(UpdateLogError, match="does not fit"):
        redo_update(other.optimizer, record)


def test_only_records_before_a_checkpoint_are_collected() -> None:
    names = [record_name(r, i) for r in (0, 1) for i in (3, 4, 5)] + [
        "act_s000-s001_dp0000_tp000_it0000000000-0000000005.swlog"
    ]
    assert sorted(records_before(names, 5)) == sorted(record_name(r, i) for r in (0, 1) for i in (3, 4))
