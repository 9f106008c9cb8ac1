"""MegatronDeepSpeed's save override (ds_swift.megatron, through ds_swift.patches.deepspeed_engine):
ds-swift's periodic saves carry Megatron's client state, and the override comes off with its handle.
Megatron-DeepSpeed's own helper is a stand-in here (the real one runs in scripts/megatron_deepspeed_cpu.sh)."""

from __future__ import annotations

import argparse
import sys
import types
from typing import Any

import pytest

from ds_swift.megatron import MegatronDeepSpeed


class Engine:
    global_steps = 6

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: Any = None, **kw: Any) -> Any:
        return client_state


@pytest.fixture
def megatron_checkpointing(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron  # megatron-core's package: Megatron-DeepSpeed's checkpointing module is absent

    fake = types.ModuleType("megatron.checkpointing")
    fake._universal_checkpoint_info = lambda models: {"models": len(models)}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megatron.checkpointing", fake)
    monkeypatch.setattr(megatron, "checkpointing", fake, raising=False)


def test_periodic_saves_carry_megatrons_state_until_the_override_is_removed(megatron_checkpointing: None) -> None:
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    swift = MegatronDeepSpeed.__new__(MegatronDeepSpeed)
    swift.samples = types.SimpleNamespace(consumed=lambda done: 4 * done)  # type: ignore[assignment]
    engine = Engine()
    args = argparse.Namespace(seq_length=8, iteration=0)
    assert swift.save_megatron_state(engine, args) is engine
    state = engine.save_checkpoint("dir", tag="global_step6")
    assert (state["iteration"], state["args"].iteration, state["args"].consumed_train_samples) == (6, 6, 24)
    assert state["tokens"] == 24 * 8 and state[UNIVERSAL_CHECKPOINT_INFO] == {"models": 1}
    assert args.iteration == 0  # Megatron's own arguments are not touched
    assert engine.save_checkpoint("dir", client_state={"own": 1}) == {"own": 1}  # Megatron's own save
    assert swift.save_override is not None
    swift.save_override.remove()
    assert "save_checkpoint" not in vars(engine) and engine.save_checkpoint("dir") is None
