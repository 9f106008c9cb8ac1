"""patches/deepspeed_step.py on stand-in engines: hooks, overrides, idempotence, removal."""

from __future__ import annotations

from typing import Any

import pytest

from ds_swift.patches import deepspeed_step
from ds_swift.patches.deepspeed_step import PatchError, StepHooks


class FakeEngine:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.zeroed = 0

    def _take_model_step(self, lr_kwargs: Any) -> str:
        self.calls.append(f"step:{lr_kwargs}")
        self.zero_grad()
        if lr_kwargs == "boom":
            raise RuntimeError("boom")
        return "stepped"

    def zero_grad(self) -> None:
        self.zeroed += 1

    def backward(self, loss: Any) -> str:
        self.calls.append(f"backward:{loss}")
        return "bwd"


def _pipe_class() -> type:
    from deepspeed.runtime.pipe import schedule

    def exec_backward(self: Any, buffer_id: int) -> None:
        self.calls.append(f"pipe-backward:{buffer_id}")

    class FakePipe(FakeEngine):
        _INSTRUCTION_MAP = {schedule.BackwardPass: exec_backward}

    return FakePipe


@pytest.mark.parametrize("version,ok", [("0.19.8", True), ("0.19.0+cpu", True), ("0.18.9", False), ("0.20.0", False)])
def test_version_check(version: str, ok: bool) -> None:
    if ok:
        deepspeed_step.check_version(version)
    else:
        with pytest.raises(PatchError, match="0.19"):
            deepspeed_step.check_version(version)


def test_hooks_overrides_and_exact_removal() -> None:
    from deepspeed.runtime.pipe import schedule

    engine = _pipe_class()()
    before = dict(engine.__dict__)
    events: list[str] = []
    deferred = []

    hooks = StepHooks(
        on_step_begin=lambda: events.append("begin"),
        on_step_end=lambda err: events.append(f"end:{type(err).__name__ if err else None}"),
        on_backward_begin=lambda: events.append("bwd-begin"),
        step_overrides=lambda: [(engine, "zero_grad", lambda: deferred.append(1))],
    )
    patch = deepspeed_step.apply(engine, hooks, version="0.19.8")
    assert engine._take_model_step("lr") == "stepped"
    assert engine.zeroed == 0 and deferred == [1], "zero_grad replaced during the step only"
    engine.zero_grad()
    assert engine.zeroed == 1, "override removed after the step"
    with pytest.raises(RuntimeError, match="boom"):
        engine._take_model_step("boom")
    assert events[-1] == "end:RuntimeError" and "zero_grad" not in engine.__dict__
    engine.backward("loss")
    engine._INSTRUCTION_MAP[schedule.BackwardPass](engine, buffer_id=3)
    assert events == ["begin", "end:None", "begin", "end:RuntimeError", "bwd-begin", "bwd-begin"]
    assert engine.calls[-2:] == ["backward:loss", "pipe-backward:3"]

    with pytest.raises(PatchError, match="already patched"):
        deepspeed_step.apply(engine, StepHooks(), version="0.19.8")
    patch.remove()
    patch.remove()  # idempotent
    # The shared instruction-hook seam leaves its (now empty) stack behind; nothing else stays.
    assert engine.__dict__.keys() - {"_ds_swift_instruction_hooks"} == before.keys()
    assert engine.__dict__["calls"] is before["calls"]
    assert type(engine)._INSTRUCTION_MAP[schedule.BackwardPass].__name__ == "exec_backward", "class map untouched"
    assert "_INSTRUCTION_MAP" not in engine.__dict__
    with deepspeed_step.apply(engine, StepHooks(), version="0.19.8"):
        assert "_take_model_step" in engine.__dict__
    assert "_take_model_step" not in engine.__dict__


def test_set_attr_restores_previous_instance_attribute() -> None:
    engine = FakeEngine()
    engine.custom = "mine"  # type: ignore[attr-defined]
    patch = deepspeed_step.apply(engine, StepHooks(), version="0.19.8")
    patch.set_attr(engine, "custom", "patched")
    patch.set_attr(engine, "fresh", 1)
    patch.remove()
    assert engine.custom == "mine" and not hasattr(engine, "fresh")  # type: ignore[attr-defined]


def test_rejects_non_engine() -> None:
    with pytest.raises(PatchError, match="not a DeepSpeed engine"):
        deepspeed_step.apply(object(), StepHooks(), version="0.19.8")


def test_composes_with_other_instruction_hooks() -> None:
    from deepspeed.runtime.pipe import schedule

    from ds_swift.patches._base import PatchError as BasePatchError
    from ds_swift.patches.instructions import hook_instructions

    engine = _pipe_class()()
    seen: list[str] = []
    mine = deepspeed_step.apply(engine, StepHooks(on_backward_begin=lambda: seen.append("undo")), version="0.19.8")

    def other(eng: Any, call_next: Any, **kw: Any) -> Any:
        seen.append("other")
        return call_next(**kw)

    theirs = hook_instructions(engine, "test.other", {schedule.BackwardPass: other})
    engine._INSTRUCTION_MAP[schedule.BackwardPass](engine, buffer_id=0)
    assert seen == ["other", "undo"] and engine.calls == ["pipe-backward:0"]
    with pytest.raises(BasePatchError, match="out of order"):
        mine.remove()  # hooks come off last-in first-out
    theirs.remove()
    mine.remove()
    assert "_INSTRUCTION_MAP" not in engine.__dict__ and "_take_model_step" not in engine.__dict__
