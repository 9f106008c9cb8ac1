"""Property tests: step then undo restores every parameter and state tensor within 2 ulp
(of the tensor's largest magnitude), and the wrapped step is bit-identical to the plain one.

Elements where the forward step is itself (nearly) non-injective are left out of the bound
(see test_undo_helpers.ill_conditioned): Adagrad/RMSprop with L2 weight decay where lr*wd is
within 25% of the denominator sqrt(accumulator); there two different pre-step states give
the same post-step state to within rounding, and no inverse can tell them apart.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_undo_helpers import Case, run_case, tolerance

lrs = st.sampled_from([1e-4, 1e-3, 1e-2, 0.1])
wds = st.sampled_from([0.0, 0.0, 1e-4, 1e-2, 0.1])
dtypes = st.sampled_from([torch.float32, torch.float64, torch.bfloat16])


@st.composite
def sgd_kwargs(draw: Any) -> dict[str, Any]:
    momentum = draw(st.sampled_from([0.0, 0.5, 0.9, 0.99]))
    nesterov = momentum > 0 and draw(st.booleans())
    dampening = 0.0 if nesterov or momentum == 0 else draw(st.sampled_from([0.0, 0.1, 0.5]))
    return {
        "lr": draw(st.sampled_from([1e-3, 1e-2, 0.1, 0.5])),
        "momentum": momentum,
        "dampening": dampening,
        "nesterov": nesterov,
        "weight_decay": draw(wds),
        "maximize": draw(st.booleans()),
        "foreach": draw(st.sampled_from([None, True])),
    }


@st.composite
def adam_kwargs(draw: Any) -> dict[str, Any]:
    impl = draw(st.sampled_from(["single", "foreach", "fused"]))
    return {
        "lr": draw(lrs),
        "betas": (draw(st.sampled_from([0.5, 0.8, 0.9, 0.99])), draw(st.sampled_from([0.9, 0.99, 0.999, 0.9999]))),
        "eps": draw(st.sampled_from([1e-8, 1e-6])),
        "weight_decay": draw(wds),
        "maximize": draw(st.booleans()),
        "foreach": True if impl == "foreach" else None,
        "fused": True if impl == "fused" else None,
    }


@st.composite
def adagrad_kwargs(draw: Any) -> dict[str, Any]:
    return {
        "lr": draw(lrs),
        "lr_decay": draw(st.sampled_from([0.0, 1e-3])),
        "weight_decay": draw(wds),
        "initial_accumulator_value": draw(st.sampled_from([0.0, 0.1])),
        "eps": draw(st.sampled_from([1e-10, 1e-8])),
        "maximize": draw(st.booleans()),
        "foreach": draw(st.sampled_from([None, True])),
    }


@st.composite
def rmsprop_kwargs(draw: Any) -> dict[str, Any]:
    return {
        "lr": draw(st.sampled_from([1e-4, 1e-3, 1e-2])),
        "alpha": draw(st.sampled_from([0.9, 0.99, 0.999])),
        "eps": draw(st.sampled_from([1e-8, 1e-6])),
        "weight_decay": draw(wds),
        "momentum": draw(st.sampled_from([0.0, 0.5, 0.9])),
        "centered": draw(st.booleans()),
        "maximize": draw(st.booleans()),
        "foreach": draw(st.sampled_from([None, True])),
    }


@st.composite
def lamb_kwargs(draw: Any) -> dict[str, Any]:
    # lr <= 1e-2: with the trust ratio clamped at 10, lr=0.1 makes step_size*trust*wd reach 1
    # on the first step, where x1 = x0*(1 - c*wd) - c*r no longer depends on x0 at all.
    return {
        "lr": draw(st.sampled_from([1e-4, 1e-3, 1e-2])),
        "betas": (draw(st.sampled_from([0.8, 0.9, 0.99])), draw(st.sampled_from([0.99, 0.999]))),
        "eps": draw(st.sampled_from([1e-8, 1e-6])),
        "weight_decay": draw(wds),
        "bias_correction": draw(st.booleans()),
        "eps_inside_sqrt": draw(st.booleans()),
    }


FAMILIES = {
    "sgd": sgd_kwargs(),
    "adam": adam_kwargs(),
    "adamw": adam_kwargs(),
    "adagrad": adagrad_kwargs(),
    "rmsprop": rmsprop_kwargs(),
    "lamb": lamb_kwargs(),
}


@st.composite
def cases(draw: Any) -> Case:
    family = draw(st.sampled_from(sorted(FAMILIES)))
    kwargs = draw(FAMILIES[family])
    dtype = draw(dtypes)
    if kwargs.get("fused") and dtype == torch.float64:
        dtype = torch.float32
    return Case(
        family=family,
        kwargs=kwargs,
        dtype=dtype,
        steps=draw(st.integers(1, 4)),
        seed=draw(st.integers(0, 2**16)),
        grad_scale=draw(st.sampled_from([1e-3, 0.1, 1.0])),
    )


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_step_then_undo_restores_within_2_ulp(case: Case) -> None:
    out = run_case(case)
    for kind, ulps, _rel, excluded, _strict in out.rows:
        assert ulps <= tolerance(case, kind), f"{case}: {kind} restored to {ulps:.2f} ulp"
        # Only Adagrad/RMSprop with L2 weight decay have a non-injective region to set apart
        # (lr*wd near the RMS gradient: e.g. grad scale 1e-3 with lr*wd 1e-4 puts many there).
        if case.family not in ("adagrad", "rmsprop") or not case.kwargs.get("weight_decay"):
            assert excluded == 0, case


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_first_step_undo_drops_lazily_created_state(family: str) -> None:
    kwargs = {"sgd": {"lr": 0.1, "momentum": 0.9}}.get(family, {})
    out = run_case(Case(family=family, kwargs=kwargs, dtype=torch.float32, steps=1, seed=3))
    assert all(ulps <= 1.0 for _, ulps, _, _, _ in out.rows)
