"""The fault matrix's points: its strategy configs, and every case (config x machine x injection point).

``benchmarks/fault_matrix.py`` runs them (``fault_matrix_run.py``: one case's job and its verdict);
its docstring says what each point does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist" / "workers" / "gpt_fault_worker.py"
BF16 = ROOT / "configs" / "gpt_tiny_pp2_dp2_bf16_zero1.json"
#: fp16 + ZeRO-1 with dynamic loss scaling that overflows now and then (grows every 2 clean steps)
FP16 = ROOT / "configs" / "gpt_tiny_pp2_dp2_fp16_zero1.json"
FP32 = ROOT / "configs" / "gpt_tiny_pp2_dp2.json"  # fp32, ZeRO-0
PP4_BUDGET = ROOT / "configs" / "gpt_tiny_pp4_bf16_zero1_budget.json"
ITERS = 12
KILL_AT = 7  # after the checkpoint at 4 (interval 4), before the one at 8
#: the stall case's watchdog: its 8 s stop outlasts the op timeout, not the heartbeat or hang timeouts
#: (a stop past those is, rightly, a dead or hung machine)
STALL_WATCHDOG = {"op_timeout_s": 4.0, "heartbeat_timeout_s": 20.0, "hang_timeout_s": 25.0}

#: config -> (DeepSpeed JSON, swift overrides)
CONFIGS: dict[str, tuple[Path, dict[str, Any]]] = {
    "replication": (BF16, {"checkpoint": {"interval": 4}}),
    # The steady state of the default buddy.interval "auto" on a GPU (a round every 5th step): a
    # failure takes every rank back to the newest round and trains the iterations since again.
    "buddy_k5": (BF16, {"checkpoint": {"interval": 4}, "buddy": {"interval": 5}}),
    "logging": (PP4_BUDGET, {"checkpoint": {"interval": 4}}),
    # fp16 with dynamic loss scaling: every recovery must also carry the loss scaler (skipped steps,
    # scale changes), which bf16 has none of.
    "fp16": (FP16, {"checkpoint": {"interval": 4}}),
    "global_checkpoint": (BF16, {"strategy": "global_checkpoint", "checkpoint": {"interval": 4}}),
    "checkfreq": (BF16, {"strategy": "checkfreq", "checkfreq": {"profile_at": 3}}),
    "elastic": (BF16, {"strategy": "elastic", "checkpoint": {"interval": 4}}),
    # The elastic shrink on fp32 + ZeRO-0 (issue 30: it hung in the rendezvous once): one case.
    "elastic_fp32": (FP32, {"strategy": "elastic", "checkpoint": {"interval": 4}}),
    # The other seed systems' strategies, on the same job.
    "tranlogs": (BF16, {"strategy": "tranlogs", "checkpoint": {"interval": 4}}),
    "pipechurn": (
        BF16,
        {
            "strategy": "pipechurn",
            "pipechurn": {"data_chunks": 2, "parity_chunks": 1},
            "machines": {"gpus_per_node": 1},
            "checkpoint": {"interval": 4},
        },
    ),
    "scar": (BF16, {"strategy": "scar", "checkpoint": {"interval": 4, "running_fraction": 0.25}}),
    "immediate_rollback": (BF16, {"strategy": "immediate_rollback", "checkpoint": {"interval": 4}}),
}
#: environment of every job of a config (fp16 on DeepSpeed's CPU accelerator: ds_swift.patches.cpu_fp16)
CONFIG_ENV: dict[str, dict[str, str]] = {"fp16": {"SWIFT_TEST_CPU_FP16": "1"}}
#: configs on more machines than 2 (pipechurn's (k, r) = (2, 1) chunks need 3 other machines)
NNODES: dict[str, int] = {"pipechurn": 4}
#: configs whose recoveries are approximate by design: (largest relative distance, must shrink). A
#: case passes bitwise, or on a recovery announced approximate that ends within the distance.
APPROXIMATE: dict[str, tuple[float, bool]] = {
    "elastic": (1e-2, True),
    "elastic_fp32": (1e-2, True),
    "scar": (2e-2, False),
    "immediate_rollback": (1e-2, False),
}
#: launcher flags instead of ``--spares N``
LAUNCH: dict[str, list[str]] = {"elastic": ["--elastic"], "elastic_fp32": ["--spares", "0", "--elastic"]}
#: configs with one case only (machine 1 killed in iteration KILL_AT's backward pass), not every point
ONE_CASE = {"elastic_fp32"}
PHASES = ("forward", "backward", "step", "send", "recv")
#: one bad value per section: (swift overrides, the field the error must name)
BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"strategy": "fastest"}, "strategy"),
    ({"checkpoint": {"interval": 0}}, "checkpoint.interval"),
    ({"logging": {"storage_budget_gb": -1}}, "logging.storage_budget_gb"),
    ({"buddy": {"replication_factor": 0}}, "buddy.replication_factor"),
    ({"watchdog": {"op_timeout_s": "soon"}}, "watchdog.op_timeout_s"),
    ({"checkfreq": {"max_overhead": 2}}, "checkfreq.max_overhead"),
    ({"machines": {"gpus_per_node": 3}}, "machines.gpus_per_node"),
    ({"verify": {"digest_interval": 0}}, "verify.digest_interval"),
]


@dataclass
class Case:
    config: str
    point: str
    machine: int | None = None
    inject: str = ""
    env: dict[str, str] = field(default_factory=dict)
    swift: dict[str, Any] = field(default_factory=dict)
    nnodes: int = 0
    """Machines; 0: the config's (``NNODES``, else 2)."""
    spares: int = 1
    bad_field: str | None = None
    """A bad config value: the job must stop naming this field."""
    small_disk: str | None = None
    """"ckpt" or "log": that directory on a small tmpfs that fills up."""
    disk_size: str = "2m"
    must_say: tuple[str, ...] = ()
    """Lines the job's output must hold (the fault really happened; the fallback was announced)."""

    def __post_init__(self) -> None:
        self.nnodes = self.nnodes or NNODES.get(self.config, 2)

    @property
    def name(self) -> str:
        where = f" m{self.machine}" if self.machine is not None else ""
        return f"{self.config}/{self.point}{where}"


def cases() -> list[Case]:
    """Every case of the matrix, in the order it runs them."""
    return [*_phase_cases(), *_log_cases(), *_state_cases(), *_bad_value_cases()]


def _phase_cases() -> list[Case]:
    """Every config: a kill in each phase of an iteration on machine 0 and 1, and one in a save."""
    out: list[Case] = []
    for config in ONE_CASE:
        out.append(Case(config, "backward", 1, inject=f"machine=1,iteration={KILL_AT},phase=backward"))
    for config in (c for c in CONFIGS if c not in ONE_CASE):
        for machine in (0, 1):
            for phase in PHASES:
                out.append(Case(config, phase, machine, inject=f"machine={machine},iteration={KILL_AT},phase={phase}"))
        # Rank 3 (the last machine) dies as the periodic checkpoint after 8 iterations starts.
        at = 8 if config != "checkfreq" else 3
        out.append(Case(config, "save", 1, env={"SWIFT_TEST_KILL_IN_SAVE": f"rank=3,iteration={at}"}))
    return out


def _log_cases() -> list[Case]:
    """Logging's own points: a kill mid-replay, a damaged log, a torn record, a full log disk."""
    out: list[Case] = []
    out.append(
        Case(
            "logging",
            "replay",
            1,
            inject=f"machine=1,iteration={KILL_AT},phase=backward",
            env={"SWIFT_TEST_KILL_IN_REPLAY": "rank=2,iteration=5"},
            spares=2,
        )
    )
    # A damaged log: a corrupt record, a chunk cut short, a chunk lost. The replay must refuse it
    # and every rank fall back to the checkpoint, loudly.
    for point, env in (
        ("corrupt_log", "SWIFT_TEST_CORRUPT_LOG"),
        ("truncated_log", "SWIFT_TEST_TRUNCATE_LOG"),
        ("missing_log", "SWIFT_TEST_MISSING_LOG"),
    ):
        out.append(
            Case(
                "logging",
                point,
                1,
                inject=f"machine=1,iteration={KILL_AT},phase=backward",
                env={env: "rank=2,iteration=5,micro_batch=1,src=1"},
                must_say=("[test] ", "checkpoint fallback"),
            )
        )
    # A rank dies in the middle of writing a record of its log (machine 1's sender of gradients):
    # the torn tail is cut off when its replacement logs again; the recovery replays bitwise.
    out.append(
        Case(
            "logging",
            "log_write",
            1,
            env={"SWIFT_TEST_KILL_IN_LOG_WRITE": f"rank=2,iteration={KILL_AT}"},
            must_say=("in the middle of writing",),
        )
    )
    # The log's disk fills up mid-run: logging stops loudly, training goes on, and the failure
    # whose replay would need the lost messages falls back to the checkpoint.
    out.append(
        Case(
            "logging",
            "full_log_disk",
            1,
            inject=f"machine=1,iteration={KILL_AT},phase=backward",
            small_disk="log",
            disk_size="256k",  # the tiny GPT logs ~130 KB an iteration (bf16)
            must_say=("No space left on device", "checkpoint fallback"),
        )
    )
    return out


def _state_cases() -> list[Case]:
    """Replication's own points (a transfer cut, two machines, damaged checkpoints, a stall) and a
    full checkpoint disk under synchronous and asynchronous saves."""
    out: list[Case] = []
    # A peer vanishing mid-transfer during a replication recovery: the replacement receiving its
    # state (a second spare takes its place; the recovery is retried) or the survivor sending it
    # (both machines lost now: the checkpoint, announced).
    for config in ("replication", "buddy_k5"):  # the newest copy, or one k iterations older
        out.append(
            Case(
                config,
                "recv_state",
                1,
                inject=f"machine=1,iteration={KILL_AT},phase=backward",
                spares=2,
                env={"SWIFT_TEST_KILL_IN_RECV_STATE": "rank=2"},
                must_say=("in the middle of receiving",),
            )
        )
        out.append(
            Case(
                config,
                "send_state",
                1,
                inject=f"machine=1,iteration={KILL_AT},phase=backward",
                spares=2,
                env={"SWIFT_TEST_KILL_IN_SEND_STATE": "rank=0"},
                must_say=("in the middle of sending", "checkpoint fallback"),
            )
        )
    out.append(
        Case(
            "replication",
            "two_machines",
            None,
            nnodes=4,
            spares=2,
            inject=f"machine=0+2,iteration={KILL_AT},phase=forward",  # both at one instant
            swift={"machines": {"gpus_per_node": 1, "rank_order": "tp-pp-dp"}, "watchdog": {"op_timeout_s": 60.0}},
        )
    )
    for config in ("replication", "global_checkpoint"):  # synchronous and asynchronous saves
        out.append(
            Case(config, "full_ckpt_disk", 1, inject=f"machine=1,iteration={KILL_AT},phase=backward", small_disk="ckpt")
        )
    # A checkpoint fallback (forced, synchronous saves) meets a corrupt / a missing file of rank 0 in
    # the newest checkpoint (8): every rank must step back to 4 together, loudly, and end bitwise.
    for point, env in (("corrupt_ckpt", "SWIFT_TEST_CORRUPT_CKPT"), ("missing_ckpt", "SWIFT_TEST_MISSING_CKPT")):
        out.append(
            Case(
                "replication",
                point,
                1,
                inject="machine=1,iteration=10,phase=backward",
                env={env: "rank=0,iteration=8"},
                swift={"strategy": "checkpoint"},
            )
        )
    # A stall, not a death (issue 30): rank 0 stops (SIGSTOP) past the op timeout, then resumes; its
    # peers' ops time out with every rank alive: one agreed verdict (a stall), the same ranks re-form
    # the next generation with their state, and the job ends bitwise, no machine replaced.
    out.append(
        Case(
            "replication",
            "stall",
            0,
            env={"SWIFT_TEST_PAUSE": f"rank=0,iteration={KILL_AT},seconds=8"},
            swift={"watchdog": STALL_WATCHDOG},
            must_say=("resumed (SIGCONT)", "(a stall: no rank died, none replaced)"),
        )
    )
    return out


def _bad_value_cases() -> list[Case]:
    """One bad value per config section: the job must stop naming the field. No spare: the job stops
    before training, and a spare's warm workers would only import torch for nothing (nor would a
    replacement, failing the same way, change the verdict)."""
    out: list[Case] = []
    for swift, name in BAD_VALUES:
        out.append(Case("replication", f"bad {name}", None, swift=swift, spares=0, bad_field=name))
    return out
