"""Fixtures shared by the multi-process tests."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from standin_hosts import kill_hosts, write_standins

from ds_swift.testing.jobs import FORK_SERVER_ENV, JobRun, JobSpec, build_deepspeed_shm_op, fork_zygote, run_job

# Strict transport mode in every process these tests start (they inherit the environment): a host
# tensor that ds-swift sends on a group that would be NCCL on a GPU cluster fails here, on CPU.
os.environ.setdefault("SWIFT_STRICT_TRANSPORT", "1")
# Their jobs' ranks are forked from one pre-imported interpreter (ds-swift-launch --fork-server): on
# 2 cores, 4 to 12 ranks each importing torch, DeepSpeed and megatron-core took half of a job's time.
# The ranks of tests/dist/test_launcher.py and test_multihost.py, and warm spares, start as processes
# of their own. SWIFT_TEST_FORK_SERVER=0 runs every job that way.
os.environ.setdefault(FORK_SERVER_ENV, "1")

ROOT = Path(__file__).resolve().parents[2]
#: the configuration users run, on the tiny GPT: bf16 + ZeRO-1, pp 2 x dp 2 on 2 machines of 2 ranks
BF16 = ROOT / "configs" / "gpt_tiny_pp2_dp2_bf16_zero1.json"
BF16_ITERS = 12
#: fp32 (ZeRO-0), the same GPT and plan
FP32 = ROOT / "configs" / "gpt_tiny_pp2_dp2.json"
FP32_ITERS = 15
#: fp32 pp 4 over 2 machines of 2 ranks (one replica) with the README's swift section (strategy
#: auto, a storage budget), dropout 0.1: the GPT the logging tests replay
PP4_BUDGET = ROOT / "configs" / "gpt_tiny_pp4_budget.json"
PP4_ITERS = 20
PP4_MODEL_ARGS = ("--dropout", "0.1")
#: the example with test hooks; without a fault it runs the example unchanged
FAULT_WORKER = ROOT / "tests" / "dist" / "workers" / "gpt_fault_worker.py"


@pytest.fixture(scope="session")
def warm_deepspeed(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The first DeepSpeed start on a fresh machine JIT-builds its shm comm op (~45 s): do it once,
    before any job whose ranks would each spend their start-up deadline on it."""
    build_deepspeed_shm_op(tmp_path_factory.mktemp("warm"), timeout_s=300)


@pytest.fixture(scope="session", autouse=True)
def one_zygote(tmp_path_factory: pytest.TempPathFactory, warm_deepspeed: None) -> Iterator[None]:
    """Every --fork-server job's server forked from one zygote that imported torch, DeepSpeed and
    megatron-core once for the session: ~5 CPU-s less per job, on the critical path of its start.
    SWIFT_TEST_FORK_SERVER=0 (no fork server) or SWIFT_TEST_ZYGOTE=0 starts each server on its own."""
    if os.environ.get(FORK_SERVER_ENV) != "1" or os.environ.get("SWIFT_TEST_ZYGOTE", "1") != "1":
        yield
        return
    with fork_zygote(tmp_path_factory.mktemp("zygote")):
        yield


@pytest.fixture
def small_log_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MB tmpfs for a log store: full after a few iterations (created here, removed after)."""
    mount = tmp_path / "logfs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture(scope="session")
def bf16_baseline(tmp_path_factory: pytest.TempPathFactory, warm_deepspeed: None) -> JobRun:
    """The failure-free run of :data:`BF16` (12 iterations, a checkpoint after every one, a loss log)
    that the bf16 tests of 2 machines compare with (test_checkpoint_strategies.py, test_elastic.py,
    test_recovery_bf16.py, test_hang_detection.py, ...): one run for all. Every iteration's checkpoint
    is there for the undo checks (``undo_ulp``: a resumed state against the step it stepped back to)."""
    spec = JobSpec(
        ROOT / "examples" / "pretrain_gpt.py",
        BF16,
        BF16_ITERS,
        (),
        nnodes=2,
        nproc_per_node=2,
        swift={"checkpoint": {"interval": 1}},
        loss_log=True,
    )
    run = run_job(tmp_path_factory.mktemp("bf16_baseline"), spec, 180.0)
    assert run.code == 0 and not run.timelines(), run.output[-6000:]
    return run


@pytest.fixture(scope="session")
def fp32_baseline(tmp_path_factory: pytest.TempPathFactory, warm_deepspeed: None) -> JobRun:
    """The failure-free run of :data:`FP32` (15 iterations, a checkpoint after every one) that
    test_recovery_gpt.py (its end, and every iteration for the undo checks) and test_multihost_gpt.py
    (its checkpoint after 8 iterations) compare with: one run for both."""
    spec = JobSpec(
        ROOT / "examples" / "pretrain_gpt.py",
        FP32,
        FP32_ITERS,
        (),
        nnodes=2,
        nproc_per_node=2,
        swift={"checkpoint": {"interval": 1}},
    )
    run = run_job(tmp_path_factory.mktemp("fp32_baseline"), spec, 150.0)
    assert run.code == 0 and not run.timelines(), run.output[-6000:]
    return run


@pytest.fixture(scope="session")
def pp4_baseline(tmp_path_factory: pytest.TempPathFactory, warm_deepspeed: None) -> JobRun:
    """The failure-free run of :data:`PP4_BUDGET` (20 iterations, a global checkpoint every 8) that
    test_logging_budget.py (its reference: the logging plan it prints, the logs it writes) and
    test_recovery_logging.py (``configs/gpt_tiny_pp4.json``: the same DeepSpeed config and model, a
    swift section that changes no number) compare with: one run for both. Through the fault worker,
    which says whenever DeepSpeed loads a checkpoint: no rank may here."""
    spec = JobSpec(FAULT_WORKER, PP4_BUDGET, PP4_ITERS, (), PP4_MODEL_ARGS, swift={"parallel_recovery_force": True})
    run = run_job(tmp_path_factory.mktemp("pp4_baseline"), spec, 240.0)
    assert run.code == 0 and not run.timelines(), run.output[-6000:]
    assert ": load_checkpoint " not in run.output, run.output[-6000:]
    return run


@pytest.fixture
def standins(tmp_path: Path) -> Iterator[Path]:
    """A bin/ with stand-in srun, pdsh and ssh (tests/dist/standin_hosts.py); yields the folder where
    they write pids, logs and exit codes (test_multihost.py, test_multihost_gpt.py).

    Each host's agent runs in its own session, out of reach of ProcessSet's kill: whatever happens,
    every host's session is SIGKILLed at the end (its workers follow by their parent-death signal)."""
    bin_dir, standin = tmp_path / "bin", tmp_path / "hosts"
    bin_dir.mkdir()
    standin.mkdir()
    write_standins(bin_dir)
    try:
        yield standin
    finally:
        kill_hosts(standin)
