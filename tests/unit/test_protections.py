"""ds_swift.protect: a new protection is one class and one line in PROTECTIONS, and reaches the
recovery report, the strategies' lent objects, the start-up cost lines and the usage record."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist

from ds_swift.config import SwiftConfig
from ds_swift.protect import protections as registry
from ds_swift.protect.base import CostInputs, Protection, Site
from ds_swift.protect.buddy import BuddyCopier
from ds_swift.protect.costs import protection_costs
from ds_swift.protect.message_logging import MessageLogging
from ds_swift.protect.protections import Protections
from ds_swift.recovery.consensus import RankReport
from ds_swift.recovery.coordinator import rank_report
from ds_swift.recovery.holdings import Held
from ds_swift.recovery.kept import KeptState
from ds_swift.testing.configs import site, swift_config


@dataclass(frozen=True)
class DummyHeld(Held):
    NAME: ClassVar[str] = "dummy"
    iterations: tuple[int, ...] = ()


class DummyLoan:
    """What the dummy protection lends a strategy."""


class Dummy(Protection):
    """A new protection: holds iterations 3 and 4, lends a DummyLoan, costs one line."""

    name = "dummy"
    label = "dummy copies"

    @classmethod
    def build(cls, site: Site) -> Dummy:
        return cls()

    def held(self, kept: KeptState | None) -> DummyHeld:
        return DummyHeld(iterations=(3, 4))

    def lent(self, kept: KeptState | None) -> DummyLoan:
        return DummyLoan()

    def cost_line(self, engine: Any, costs: CostInputs) -> str:
        return f"  dummy copies: {costs.total_bytes} bytes per iteration"

    def usage(self) -> dict[str, Any]:
        return {"dummy_bytes": 7, "log_bytes": 5}


class Off(Protection):
    """A protection the config leaves off: its cost line says why."""

    name = "off"
    label = "off copies"

    @classmethod
    def build(cls, site: Site) -> str:
        return "never wanted"


@pytest.fixture
def world() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _protections(cfg: SwiftConfig) -> Protections:
    ctx = SimpleNamespace(env=None, store=None, log=lambda *a, **k: None, op_timeout_s=1.0)
    logs = SimpleNamespace(
        updates=None,
        coverage_lost=None,
        possible=lambda engine: False,
        plan_error=None,
        enabled=True,
        bytes_logged=lambda: 9,
    )
    return Protections(site(cfg, ctx, SimpleNamespace(logs=logs, inflight=None, undo=None)))


def test_a_new_protection_is_one_class_and_one_line(monkeypatch: pytest.MonkeyPatch, world: None) -> None:
    monkeypatch.setattr(registry, "PROTECTIONS", (*registry.PROTECTIONS, Dummy, Off))  # the one line
    made = _protections(swift_config({"strategy": "checkpoint"}))
    assert isinstance(made.get(Dummy), Dummy) and made.get(BuddyCopier) is None
    # The report: its holdings under its name, read back through its view after the JSON round trip.
    engine = SimpleNamespace(grid=SimpleNamespace(get_data_parallel_id=lambda: 0), stage_id=0)
    report = RankReport.from_json(rank_report(engine, None, 0, made.holdings(None)).to_json())
    assert DummyHeld.of(report) == DummyHeld(iterations=(3, 4)) and set(report.holdings) == {"dummy"}
    # What a strategy may use: kept by its type.
    assert isinstance(made.lend(None).get(DummyLoan), DummyLoan)
    # The usage record: its figures, summed with another protection's of the same name.
    assert made.usage()["dummy_bytes"] == 7 and made.usage()["log_bytes"] == 5 + 9
    # The start-up cost lines: its own, and the one that is off with why, in PROTECTIONS order.
    module = torch.nn.Linear(4, 4)
    eng = SimpleNamespace(module=module, optimizer=None, lr_scheduler=None, global_steps=0, skipped_steps=0)
    lines = protection_costs(eng, made.site.cfg, made, async_ckpt=False, checkpoint_tuner=False, machines=2)
    dummy = [i for i, line in enumerate(lines) if line.startswith("  dummy copies: ")]
    off = [i for i, line in enumerate(lines) if line == "  off copies: off (never wanted): 0"]
    assert len(dummy) == 1 and len(off) == 1 and dummy[0] < off[0], lines
    assert any(line.startswith("  message logging: off for this rank") for line in lines), lines
    assert any(line.startswith("  buddy copies: off (strategy 'checkpoint' does not use them)") for line in lines)


def test_a_protection_that_fails_to_close_is_said_and_the_others_still_close(monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[str] = []

    class Breaks(Dummy):
        name = "breaks"

        def close(self, timeout_s: float) -> None:
            raise OSError("disk gone")

    class Last(Dummy):
        name = "last"

        def close(self, timeout_s: float) -> None:
            closed.append(self.name)

    monkeypatch.setattr(registry, "PROTECTIONS", (Breaks, Last))
    said: list[tuple[str, int]] = []
    ctx = SimpleNamespace(
        env=None, store=None, op_timeout_s=1.0, log=lambda m, level=logging.INFO: said.append((m, level))
    )
    made = Protections(site(SwiftConfig(), ctx, SimpleNamespace()))
    made.close()
    assert closed == ["last"] and said == [("dummy copies: not closed cleanly: OSError: disk gone", logging.WARNING)]


def test_the_message_log_is_always_built_and_says_why_it_logs_nothing(world: None) -> None:
    made = _protections(swift_config({}))
    assert isinstance(made.get(MessageLogging), MessageLogging)
    assert made.holdings(None) == {}  # nothing lost, no copies: the report carries nothing
