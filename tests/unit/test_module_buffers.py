"""ds_swift.protect.buddy_payload: a module's non-parameter state, as state_dict gives it, found once."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch

from ds_swift.models.gpt import GPTConfig, gpt_layer_specs
from ds_swift.protect.buddy_payload import persistent_buffers


def from_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the buddy payload took before: state_dict less named_parameters (a shared one named once)."""
    params = {n for n, _ in module.named_parameters()}
    return {k: v for k, v in module.state_dict().items() if k not in params}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)  # keys and order
    for k in a:  # the same tensors, detached
        assert a[k].data_ptr() == b[k].data_ptr() and a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        assert not a[k].requires_grad


class WithBuffers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)  # running stats: persistent buffers
        self.register_buffer("mask", torch.ones(4, dtype=torch.bool))
        self.register_buffer("cache", torch.zeros(3), persistent=False)  # not in state_dict
        self.register_buffer("unset", None)
        self.shared = self.lin  # the same submodule under two names: state_dict lists it twice
        self.tied = torch.nn.Linear(4, 4, bias=False)
        self.tied.weight = self.lin.weight  # a tied parameter: named once by named_parameters


def test_the_same_entries_as_state_dict_less_its_parameters() -> None:
    gpt = torch.nn.Sequential(*[spec.build() for spec in gpt_layer_specs(GPTConfig(num_layers=2, hidden_size=16))])
    for module in (WithBuffers(), gpt, torch.nn.Linear(2, 2)):
        assert_same(persistent_buffers(module), from_state_dict(module))
        assert_same(persistent_buffers(module), from_state_dict(module))  # from the layout found the first time


def test_it_follows_a_buffer_replaced_registered_or_set_to_none_after_the_first_call() -> None:
    m = WithBuffers()
    persistent_buffers(m)
    m.mask = torch.zeros(4, dtype=torch.bool)  # assigned anew: the next payload must carry the new one
    m.norm.register_buffer("late", torch.full((2,), 7.0))  # registered after the first call
    m.add_module("extra", torch.nn.BatchNorm1d(2))
    assert_same(persistent_buffers(m), from_state_dict(m))
    assert "norm.late" in persistent_buffers(m) and "extra.running_mean" in persistent_buffers(m)
    m.mask = None  # type: ignore[assignment]
    assert_same(persistent_buffers(m), from_state_dict(m))


class ExtraState(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.scale = torch.tensor([3.0])

    def get_extra_state(self) -> Any:
        return self.scale

    def set_extra_state(self, state: Any) -> None:
        self.scale = state


def test_a_module_that_changes_what_state_dict_says_is_read_through_state_dict() -> None:
    """Extra state (TransformerEngine's fp8 layers keep theirs there) and state-dict hooks."""
    m = torch.nn.Sequential(ExtraState(), torch.nn.BatchNorm1d(2))
    got = persistent_buffers(m)
    assert "0._extra_state" in got and torch.equal(got["0._extra_state"], torch.tensor([3.0]))
    assert list(got) == list(from_state_dict(m))
    hooked = torch.nn.Sequential(torch.nn.BatchNorm1d(2))

    def rename(module: Any, state: dict[str, Any], prefix: str, local: Any) -> None:
        state[prefix + "hooked"] = torch.ones(1)

    hooked[0]._register_state_dict_hook(rename)
    assert "0.hooked" in persistent_buffers(hooked)


def test_the_cache_does_not_keep_a_dropped_module_alive() -> None:
    """An engine rebuilt after a failure drops its module; the layout must not hold it."""
    m = WithBuffers()
    persistent_buffers(m)
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None
