"""A strategy owns its set-up half (issue 31 item 1): the failure-free side reads a strategy's
:class:`StrategyServices`, never its name. The services reproduce what the runtime chose by name
before (the tables below are the old ``in (...)`` tests of runtime/rebuild.py, config.py and
checkpoint set-up), the config accepts exactly the registered names, and a new strategy is one
class plus one registration: its services reach the runtime, the checkpoint set-up and the
topology analyzer with no other edit.
"""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace
from typing import Any

import pytest

import ds_swift.recovery.registry as registry_mod
from ds_swift.checkpoint.setup import checkpoint_manager
from ds_swift.config import ConfigError, SwiftConfig
from ds_swift.plan.analysis import stage_mode
from ds_swift.protect.buddy import BuddyCopier
from ds_swift.protect.digest_publisher import DigestPublisher
from ds_swift.protect.protections import Protections
from ds_swift.protect.update_logger import UpdateLogger
from ds_swift.recovery.base import RankContext, RecoveryOutcome, RecoveryStrategy
from ds_swift.recovery.consensus import RecoveryInputs, RecoveryPlan
from ds_swift.recovery.registry import services_of, strategy_names
from ds_swift.recovery.services import StrategyServices
from ds_swift.testing.configs import site, swift_config

# What the runtime chose by name before this issue (config values as they were then).
OLD_NAMES = (
    "auto",
    "replication",
    "logging",
    "checkpoint",
    "global_checkpoint",
    "checkfreq",
    "tranlogs",
    "pipechurn",
    "scar",
    "immediate_rollback",
    "lossy_forward",
)
OLD_RECOVERY = {"global_checkpoint": "checkpoint", "checkfreq": "checkpoint"}
OLD_NO_BUDDIES = ("checkpoint", "logging", "tranlogs", "pipechurn", "scar")  # of the recovery name
OLD_DIGESTS = ("auto", "replication", "logging", "tranlogs", "pipechurn", "lossy_forward")
OLD_OWN = ("tranlogs", "pipechurn", "scar", "immediate_rollback", "lossy_forward")  # analyzer: checkpoint
OLD_ASYNC = ("global_checkpoint", "checkfreq")


def old_choices(name: str, kinds: Any = "messages") -> dict[str, Any]:
    recovery = OLD_RECOVERY.get(name, name)
    mixed = recovery in ("auto", "logging") and kinds != "messages"
    return {
        "buddy": recovery not in OLD_NO_BUDDIES,
        "erasure": recovery == "pipechurn",
        "digests": recovery in OLD_DIGESTS,
        "updates": "every_rank" if recovery == "tranlogs" else "per_stage" if mixed else "off",
        "analyzer": "checkpoint" if recovery in OLD_OWN else recovery,
        "async": name in OLD_ASYNC,
        "tuner": name == "checkfreq",
        "running": name == "scar",
    }


def new_choices(cfg: SwiftConfig) -> dict[str, Any]:
    s = services_of(cfg)
    return {
        "buddy": s.buddy_copies,
        "erasure": s.erasure_chunks,
        "digests": s.digests,
        "updates": s.update_log,
        "analyzer": stage_mode(cfg),
        "async": s.async_checkpoints,
        "tuner": s.checkpoint_tuner,
        "running": s.running_checkpoint,
    }


@pytest.mark.parametrize("name", OLD_NAMES)
@pytest.mark.parametrize("kinds", ["messages", "auto"])
def test_the_services_are_what_the_names_chose(name: str, kinds: str) -> None:
    cfg = swift_config({"strategy": name, "logging": {"kinds": kinds}})
    assert new_choices(cfg) == old_choices(name, kinds)


def test_the_config_accepts_the_registered_names_only() -> None:
    names = strategy_names()
    assert names[0] == "auto" and set(names[1:]) == set(registry_mod.STRATEGIES.names())
    assert {"buddy", "elastic", "checkfreq", "global_checkpoint"} <= set(names)
    with pytest.raises(ConfigError, match=r"strategy='replicaton' is invalid: one of auto, replication, .*elastic"):
        swift_config({"strategy": "replicaton"})
    with pytest.raises(ConfigError, match=r"checkpoint.running_fraction=0.5 is read only by strategy \['scar'\]"):
        swift_config({"checkpoint": {"running_fraction": 0.5}})
    with pytest.raises(ConfigError, match=r"simulate_failure.strategy='scar' is invalid: one of .*immediate_rollback"):
        swift_config({"simulate_failure": {"iteration": 3, "strategy": "scar"}})


def test_the_old_elastic_spelling_still_works_and_says_the_new_one() -> None:
    with pytest.warns(FutureWarning, match='"strategy": "elastic"'):
        cfg = swift_config({"strategy": "lossy_forward", "elastic": {"enabled": True}})
    assert cfg.strategy == "elastic" and services_of(cfg).elastic and services_of(cfg).buddy_copies
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert services_of(swift_config({"strategy": "elastic"})).elastic


def test_checkpoint_reloads_recover_under_one_name() -> None:
    # checkfreq and global_checkpoint are strategies of their own for the set-up; the recovery is
    # the global checkpoint's reload, named so (the guard and the timelines look for that name).
    from ds_swift.recovery.consensus import RankReport

    reports = [RankReport(rank=r, survivor=r != 1, stage=0, dp=r, tp=0, machine=r, last_stepped=5) for r in range(2)]
    for name in ("checkpoint", "global_checkpoint", "checkfreq"):
        plan = registry_mod.plan_recovery(reports, forced=name)
        assert plan.strategy == registry_mod.STRATEGIES.fallback.name == "checkpoint", name


class _Dummy(RecoveryStrategy):
    """A new strategy: buddy copies and the update log of every rank, asynchronous checkpoints."""

    name = "dummy"
    auto = False
    SERVICES = StrategyServices(
        buddy_copies=True,
        update_log="every_rank",
        async_checkpoints=True,
        checkpoint_tuner=True,
        stage_recovery=frozenset({"logging"}),
    )

    def can_restore(self, inputs: RecoveryInputs) -> str | None:
        return None

    def expected_cost(self, inputs: RecoveryInputs) -> float:
        return 0.0

    def restore(self, plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> RecoveryOutcome:
        return RecoveryOutcome(plan, plan.consensus + 1)


def test_a_new_strategy_is_one_class_and_one_registration(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="strategy='dummy' is invalid"):
        swift_config({"strategy": "dummy"})
    registry = registry_mod.STRATEGIES.copy()
    registry.register(_Dummy())  # the one line
    monkeypatch.setattr(registry_mod, "STRATEGIES", registry)
    cfg = swift_config({"strategy": "dummy", "checkpoint": {"dir": str(tmp_path)}})
    assert services_of(cfg) == _Dummy.SERVICES
    # The runtime's failure-free services, made from them.
    lines: list[str] = []
    ctx = SimpleNamespace(
        env=SimpleNamespace(rank=0, token=None), store=None, log=lines.append, op_timeout_s=1.0, generation=0
    )
    hooks = SimpleNamespace(logs=SimpleNamespace(updates=None), undo=None)
    made = Protections(site(cfg, ctx, hooks))
    buddy, updates = made.get(BuddyCopier), made.get(UpdateLogger)
    assert buddy is not None and buddy.erasure is None
    assert updates is not None and hooks.logs.updates is updates
    assert made.get(DigestPublisher) is None  # not in its services
    # The checkpoint set-up and the topology analyzer.
    manager = checkpoint_manager(cfg, ctx, rank=0, world_size=1, services=services_of(cfg))
    assert manager.writer is not None and manager.tuner is not None
    manager.writer.close(5.0)
    assert stage_mode(cfg) == "logging"
    # ...and the recovery side: the registry offers it when the config names it.
    assert registry.get("dummy").services(cfg).update_log == "every_rank"


@dataclasses.dataclass
class _Keeper:
    """A new strategy's own state, kept by the runtime while nothing fails."""

    restored_at: list[int]


@dataclasses.dataclass(frozen=True)
class _Resume:
    """What the new strategy hands the runtime for the resume."""

    iteration: int


class _Keeping(_Dummy):
    """A new strategy with state of its own: it reads it by its type, and hands one back."""

    name = "keeping"
    auto = True

    def restore(self, plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> RecoveryOutcome:
        keeper = ctx.lent.get(_Keeper)
        assert keeper is not None, ctx.lent
        keeper.restored_at.append(plan.consensus)
        outcome = RecoveryOutcome(plan, plan.consensus + 1)
        outcome.handed.put(_Resume(plan.consensus + 1))
        return outcome


#: The fields of the shared recovery classes: generic ones only (issue 31 item 2); a strategy's
#: state travels in ``RankContext.lent`` and ``RecoveryOutcome.handed``, by its type.
CONTEXT_FIELDS = {
    "store",
    "generation",
    "rank",
    "engine",
    "kept",
    "ckpt",
    "timeline",
    "gather_timeout_s",
    "verify",
    "lent",
}
OUTCOME_FIELDS = {
    "plan",
    "resume_iteration",
    "checkpoint_step",
    "bytes_moved",
    "notes",
    "summary",
    "latest_checkpoint",
    "deviation",
    "verdict",
    "back_iteration",
    "handed",
}


def test_a_new_strategys_state_needs_no_field_in_the_shared_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    from ds_swift.jobstore.membership import JobStore
    from ds_swift.recovery import coordinator
    from ds_swift.recovery.base import Registry
    from ds_swift.recovery.consensus import RankReport
    from ds_swift.recovery.handover import Handover
    from ds_swift.recovery.replay.runner import ReplayRuntime
    from ds_swift.recovery.state.inflight import FinishIteration, InflightKeeper
    from ds_swift.recovery.state.update_log import UpdateLogStore
    from ds_swift.recovery.timeline import RankTimeline

    assert {f.name for f in dataclasses.fields(RankContext)} == CONTEXT_FIELDS
    assert {f.name for f in dataclasses.fields(RecoveryOutcome)} == OUTCOME_FIELDS
    # The registered strategies' own state goes the same way (the runtime lends, a strategy reads).
    assert Handover(InflightKeeper(lambda i, m: None, seed=1), UpdateLogStore("memory://u"), None).get(
        UpdateLogStore
    ) == UpdateLogStore("memory://u")
    assert Handover().get(ReplayRuntime) is None and Handover(FinishIteration(3)).get(FinishIteration).iteration == 3  # type: ignore[union-attr]

    monkeypatch.setattr(coordinator, "STRATEGIES", Registry([_Keeping()], fallback=registry_mod.STRATEGIES.fallback))
    monkeypatch.setattr(coordinator.transport, "barrier", lambda *a, **k: None)
    keeper = _Keeper([])
    ctx = RankContext(
        JobStore.host("unit-new-strategy-state"),
        1,
        0,
        None,
        None,
        None,
        RankTimeline(rank=0, role="survivor", failed_generation=0),
        10.0,
        lent=Handover(keeper),
    )
    report = RankReport(rank=0, survivor=True, stage=0, dp=0, tp=0, machine=0, last_stepped=4)
    outcome = coordinator.run_recovery(
        ctx, world_size=1, report=report, strategy="keeping", zero_stage=1, optimizer_wrapper=None
    )
    assert outcome.plan.strategy == "keeping" and keeper.restored_at == [4]
    assert outcome.handed.get(_Resume) == _Resume(5)
