"""NCCL's semantics that ds-swift's design rests on (issue 49), on real GPUs: what the CPU stand-in
(ds_swift.testing.nccl_standin) assumes, checked where NCCL runs.

- one GPU: ds-swift's settings in effect on an eager, non-blocking world (collectives work on it),
  and an abort from another thread reaching a communicator still waiting for a peer that never
  comes (a 2-rank world of which only rank 0 exists);
- two GPUs or more: a collective whose peer died returns to the host without an error, the device
  stays stuck until the abort, the abort releases it with the buffer not reduced, and ds-swift's
  step check refuses the step (marked before the abort);
- four GPUs or more: the tiny GPT through ds-swift-launch (pp 2 x dp 2, bf16 + ZeRO-1, strict
  transport): a machine killed in the gradient reduce, and a replacement killed while generation 1
  creates its communicators, each ending bitwise equal to the failure-free run.

Every rank runs in a child process with a deadline, so a hang fails the test instead of the session.
scripts/gpu_multi_check.sh runs this file.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason="needs CUDA")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(code: str, ranks: list[int], world_size: int, timeout_s: float = 120.0) -> list[str]:
    """Run ``code`` as each of ``ranks`` of a world of ``world_size`` (rank r on GPU r); their outputs."""
    port = free_port()
    procs = []
    for r in ranks:
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1"}
        env.update(MASTER_PORT=str(port), LOCAL_RANK=str(r), PYTHONPATH=str(ROOT))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(code)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += f"\n[test] rank process {p.pid} killed after {timeout_s:g} s (a hang)"
        outs.append(f"exit {p.returncode}\n{out}")
    return outs


PRELUDE = """
import os, threading, time, datetime, torch, torch.distributed as dist
from ds_swift import transport
transport.nccl_environment(nonblocking_timeout_s=60)
transport.check_nccl_versions()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, rank == 0, wait_for_workers=False)
"""


def test_the_settings_are_in_effect_on_an_eager_non_blocking_world() -> None:
    code = (
        PRELUDE
        + """
dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=torch.device("cuda", 0))
x = torch.ones(4, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
assert x.tolist() == [1.0] * 4, x
backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
print("get_error", backend.get_error().name)
for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_RETHROW_CUDA_ERRORS", "TORCH_NCCL_ENABLE_MONITORING",
             "TORCH_NCCL_USE_COMM_NONBLOCKING", "TORCH_NCCL_NONBLOCKING_TIMEOUT"):
    print(name, os.environ[name])
print("nccl", torch.cuda.nccl.version(), "ok")
dist.distributed_c10d._abort_process_group()
"""
    )
    (out,) = run_ranks(code, [0], 1)
    assert out.startswith("exit 0") and "ok" in out and "get_error SUCCESS" in out, out
    assert "TORCH_NCCL_USE_COMM_NONBLOCKING 1" in out and "TORCH_NCCL_ENABLE_MONITORING 0" in out, out


def test_an_abort_reaches_a_communicator_still_waiting_for_its_peer() -> None:
    """A world of 2 of which rank 1 never starts: rank 0's first collective waits in the creation of
    its communicator; ds-swift's abort from another thread (the watchdog's) ends the wait."""
    code = (
        PRELUDE
        + """
t0 = time.monotonic()
def watchdog():
    while time.monotonic() - t0 < 5 or not dist.is_initialized():
        time.sleep(0.1)
    print("aborted", transport.device_communicators().abort(), flush=True)
threading.Thread(target=watchdog, daemon=True).start()
dist.init_process_group("nccl", store=store, rank=0, world_size=2, device_id=torch.device("cuda", 0))
print(f"init returned after {time.monotonic() - t0:.1f} s", flush=True)
try:
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    print("returned", x.tolist())
except Exception as exc:
    print("raised", type(exc).__name__, str(exc)[:200])
print(f"released after {time.monotonic() - t0:.1f} s")
"""
    )
    (out,) = run_ranks(code, [0], 2, timeout_s=90)
    # init must return while the peer is missing (non-blocking creation), or no abort can reach it
    init = float(re.search(r"init returned after ([\d.]+) s", out).group(1))  # type: ignore[union-attr]
    assert init < 5, out
    assert "aborted" in out and "released after" in out, out
    released = float(re.search(r"released after ([\d.]+) s", out).group(1))  # type: ignore[union-attr]
    assert released < 60, out  # by the abort, before TORCH_NCCL_NONBLOCKING_TIMEOUT


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_a_reduce_whose_peer_died_returns_and_the_step_check_refuses_it() -> None:
    code = (
        PRELUDE
        + """
from ds_swift.detect.monitor import FailureMonitor
from ds_swift.transport.core import Transport
dist.init_process_group("nccl", store=store, rank=rank, world_size=2, device_id=torch.device("cuda", rank))
warm = torch.ones(1, device="cuda"); dist.all_reduce(warm); torch.cuda.synchronize()  # both alive
store.set(f"ready{rank}", "1"); store.wait(["ready0", "ready1"])
if rank == 1:
    os._exit(0)  # dies before the reduce
time.sleep(2)
t = Transport(world=dist.distributed_c10d._get_default_group(), groups={}, world_backends=frozenset({"nccl"}))
t.generation = 0
transport._REGISTRY.transport = t
x = torch.full((1 << 20,), 2.0, device="cuda")
dist.all_reduce(x)
print("all_reduce returned to the host", flush=True)
threading.Thread(target=lambda: (time.sleep(3), transport.on_generation_failed(0, "rank 1 died")), daemon=True).start()
try:
    FailureMonitor(None, 0, 0.1).check_step(7)
    print("step applied")
except Exception as exc:
    print("step refused:", type(exc).__name__, str(exc)[:160])
print("reduced elements", int((x == 4.0).sum()), "of", x.numel())
"""
    )
    outs = run_ranks(code, [0, 1], 2, timeout_s=120)
    assert "all_reduce returned to the host" in outs[0] and "step refused: PeerFailure" in outs[0], outs[0]


@pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs: pp 2 x dp 2 on 2 simulated machines")
@pytest.mark.parametrize("fault", ["reduce", "creation"])
def test_the_tiny_gpt_recovers_bitwise_on_nccl(tmp_path: Path, fault: str) -> None:
    from ds_swift.testing.checkpoints import checkpoint_tensors, compare_tensors
    from ds_swift.testing.jobs import JobSpec, run_job

    worker = ROOT / "tests" / "gpu" / "workers" / "gpu_by_rank_worker.py"
    config = ROOT / "configs" / "gpt_tiny_pp2_dp2_bf16_zero1.json"
    env = {"SWIFT_STRICT_TRANSPORT": "1"}
    reference = run_job(tmp_path / "reference", JobSpec(worker, config, 12, (), env=env), 600)
    assert reference.code == 0, reference.output[-6000:]
    if fault == "reduce":
        args = ["--spares", "1", "--inject", "machine=1,iteration=7,phase=reduce"]
    else:
        args, env = (
            ["--spares", "2", "--inject", "machine=1,iteration=7,phase=backward"],
            {**env, "SWIFT_TEST_GPU_DIE_CREATING": "1"},
        )
    job = run_job(tmp_path / "killed", JobSpec(worker, config, 12, args, env=env), 600)
    assert job.code == 0, job.output[-6000:]
    assert "undo: last stepped iteration 7" not in job.output
    diff = compare_tensors(checkpoint_tensors(reference.final_tag), checkpoint_tensors(job.final_tag))
    assert diff.bitwise_equal, diff.describe()
