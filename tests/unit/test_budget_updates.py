"""Update logging's bytes count against ``logging.storage_budget_gb`` (ds_swift.plan.budget): a stage
that logs its updates (``logging.kinds``) stores them beside the other stages' messages."""

from __future__ import annotations

import pytest

from ds_swift.config import ConfigError, SwiftConfig
from ds_swift.plan.budget import decide
from ds_swift.plan.layout import ParallelLayout
from ds_swift.plan.sizes import MeasuredSizes

PP4_ON_4 = ParallelLayout(pp=4, gpus_per_node=1)
B = 131_568  # one send's logged bytes per iteration, as the tiny GPT measured them
KINDS = ["messages", "updates", "messages", "updates"]


def config(kinds: object, budget: float) -> SwiftConfig:
    return SwiftConfig.from_dict(
        {
            "machines": {"gpus_per_node": 1},
            "checkpoint": {"interval": 8},
            "logging": {"kinds": kinds, "storage_budget_gb": budget},
        }
    )


def measured(update_bytes: int) -> MeasuredSizes:
    reports = [
        {
            "rank": r,
            "iteration": 0,
            "sends": [[q, B] for q in (r - 1, r + 1) if 0 <= q < 4],
            "seconds": 2.0,
            "params": 10**6,
            "stage": r,
            "update_bytes": update_bytes,
            "copy_gbps": None,
        }
        for r in range(4)
    ]
    return MeasuredSizes.from_reports(reports, micro_batches=4)


def test_updates_that_overflow_the_budget_beside_the_messages_are_refused_naming_the_figures() -> None:
    # Messages alone: 6 sends of B per iteration, 6.3 MB per interval of 8: within 8 MB. Stages 1 and
    # 3 logging 10 B of updates each instead: 3 B of messages + 20 B of updates, 24 MB: over it.
    m = measured(10 * B)
    plan, _ = decide(PP4_ON_4, config("messages", 0.008), m)
    assert plan.log_bytes_per_iteration == 6 * B and not plan.update_stages
    with pytest.raises(ConfigError) as err:
        decide(PP4_ON_4, config(KINDS, 0.008), m)
    text = str(err.value)
    assert "logging.storage_budget_gb=0.008 cannot be met" in text, text
    assert f"{3 * B} bytes of messages and {20 * B} bytes of updates (stages [1, 3])" in text, text
    assert "at least 0.0242" in text, text


def test_updates_within_the_budget_pass() -> None:
    plan, _ = decide(PP4_ON_4, config(KINDS, 0.008), measured(B // 4))
    assert plan.update_stages == {1, 3}
