"""What each protection costs per iteration, said once at start-up (one line each), and the
protections a benchmark switches off to measure it (:data:`ENV`).

The budget is 2 % of a step with the defaults (shared/DESIGN.md). Each line says how the figure was
obtained: the state digest is *measured* once here (one digest of the state, timed to completion
on its device); the checkpoint, buddy-copy and message-log figures are *estimated* from the state's
size and the plan, and the measured totals follow in each protection's end-of-job line and in
``job.json``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ds_swift.detect.watchdog import BEATS_PER_TIMEOUT
from ds_swift.protect.base import CostInputs
from ds_swift.recovery.state.digest import engine_state, named_tensors

__all__ = ["ENV", "SWITCHES", "mb", "protection_costs", "state_bytes", "switched_off", "switched_off_line", "timed"]

#: pinned device-to-host copy rate assumed for estimates (measured 54.8 GB/s on an H100's PCIe 5;
#: half of it leaves room for older hosts)
PCIE_BYTES_PER_S = 25e9
#: host memory copy rate assumed for a snapshot of a CPU state
HOST_COPY_BYTES_PER_S = 5e9


def state_bytes(state: Any) -> tuple[int, str]:
    """Bytes of a captured state's tensors, and the device they are on."""
    tensors = list(named_tensors(state).values())
    device = next((str(t.device) for t in tensors if t.device.type != "cpu"), "cpu")
    return sum(t.numel() * t.element_size() for t in tensors), device


def mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def protection_costs(
    engine: Any,
    cfg: Any,
    protections: Any,
    *,
    async_ckpt: bool,
    checkpoint_tuner: bool,
    machines: int | None,
    without: frozenset[str] = frozenset(),
    undo_off: str | None = None,
) -> list[str]:
    """One line per protection of this rank (what it costs per iteration: time and bytes): the global
    checkpoints, each of ``protections`` (ds_swift.protect.protections.Protections), and what the
    runtime itself adds; ``machines``: the job's machine count (None: unknown); ``without``: what a
    benchmark switched off (ds_swift.protect.costs; every rank says it first,
    :func:`switched_off_line`); ``undo_off``: why update-undo could not be attached to the engine
    (None: it is, or ``without`` says)."""
    state = engine_state(engine)
    total, device = state_bytes(state)
    lines = [f"protection costs (rank state {mb(total)} on {device}); the budget is 2% of a step:"]
    lines.append(_checkpoint_line(cfg, total, device, async_ckpt, checkpoint_tuner))
    lines += protections.cost_lines(engine, CostInputs(state, total, device, machines, without))
    lines += _runtime_lines(cfg, without, undo_off)
    return lines


def switched_off_line(without: frozenset[str]) -> str:
    """What a benchmark's :data:`~ds_swift.protect.costs.ENV` switched off, and what that leaves out."""
    return (
        f"protections SWITCHED OFF for a benchmark by {ENV} (unset it for training): "
        + "; ".join(f"{n} ({SWITCHES[n]})" for n in sorted(without))
        + "; a failure in this job is recovered without them"
    )


def _runtime_lines(cfg: Any, without: frozenset[str], undo_off: str | None = None) -> list[str]:
    """What the runtime itself adds to every iteration: failure detection, the step record, determinism
    (``undo_off``: why update-undo is not attached; None: it is)."""
    wd = cfg.watchdog
    beat = max(wd.poll_interval_s, wd.heartbeat_timeout_s / BEATS_PER_TIMEOUT)
    hang = f", hang detection after {wd.hang_timeout_s:g} s" if wd.hang_timeout_s is not None else ""
    off = f"OFF (benchmark: {ENV})"
    rng = (
        "off"
        if "rng" in without
        else (
            "on: the RNG reseeded before every forward pass (the CPU generator, and the GPUs' once CUDA is initialised)"
        )
    )
    return [
        "  failure detection: "
        + (
            off
            if "watchdog" in without
            else "a watchdog thread waits on the failure flag (under ds-swift-launch its node agent waits on it for the "
            "machine and wakes it through a FIFO, and it reads the flag itself every 10 s; else a blocking job-store "
            f"wait: about 1 request a second) and beats every {beat:g} s, in a file its node agent reads under "
            f"ds-swift-launch (else in the job store, reading its pipeline neighbours'){hang}; the training thread "
            "looks at the watchdog's event before every iteration (no store read), and reads the flag after a "
            "pipeline receive only when the buffer carries the poison mark (a look at its first 4 bytes)"
        ),
        "  update-undo: "
        + (
            off
            if "undo" in without
            else f"off ({undo_off}): a failure with a survivor one step ahead reloads the global checkpoint"
            if undo_off is not None
            else "a step record per optimizer step, on the training thread (the step's hyper-parameters and per-parameter "
            "bookkeeping: ds_swift.undo)"
        ),
        "  determinism: "
        + (
            f"deterministic algorithms {off}"
            if "determinism" in without
            else "torch's deterministic algorithms on (warn only; no NaN fill of new memory)"
        )
        + f"; RNG keying {rng}",
    ]


def _checkpoint_line(cfg: Any, total: int, device: str, async_ckpt: bool, tuner: bool) -> str:
    every = cfg.checkpoint.interval
    if tuner:
        return (
            f"  global checkpoints: at an interval CheckFreq chooses (at most {cfg.checkfreq.max_overhead:.0%} "
            f"of training time), {mb(total)} per save, asynchronous"
        )
    if async_ckpt:
        rate, how = (
            (PCIE_BYTES_PER_S, "a pinned copy at PCIe speed")
            if device != "cpu"
            else (HOST_COPY_BYTES_PER_S, "a host memory copy")
        )
        stall = total / rate
        return (
            f"  global checkpoints: every {every} iterations, asynchronous: the training thread waits for "
            f"{how}, ~{stall * 1e3:.0f} ms per save (estimated at {rate / 1e9:.0f} GB/s) = "
            f"{stall * 1e3 / every:.2f} ms per iteration; {mb(total / every)} per iteration written in the "
            "background"
        )
    return (
        f"  global checkpoints: every {every} iterations, synchronous (training waits while DeepSpeed writes "
        f"{mb(total)} to {cfg.checkpoint.dir}: storage speed; checkpoint.async_save true makes it wait for a "
        f"host copy only) = {mb(total / every)} per iteration"
    )


def timed(fn: Callable[[], Any], device: str) -> float:
    """Seconds ``fn`` takes once warm (its first run allocates and, on a GPU, loads kernels)."""
    fn()
    if device != "cpu":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device != "cpu":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


# ---------------------------------------------------------------- protections a benchmark switched off
# ``benchmarks/gpu_overhead.py --breakdown`` runs the same job with every protection on, then with
# one of them off at a time. The protections with a config field of their own are switched off
# through it (``verify.enabled``, ``buddy.enabled``, ``checkpoint.interval``); the others have
# none, because a user must not be able to lose them by accident, and are switched off here, by
# the environment variable :data:`ENV` (comma-separated names of :data:`SWITCHES`), which only that
# benchmark sets. Every worker that reads it says so at start-up in a warning (the variable may have
# leaked from a benchmark's shell), and a recovery in such a job is not what the defaults would have
# done: never set it for training.


ENV = "SWIFT_BENCH_WITHOUT"

#: name -> what switching it off leaves out
SWITCHES: Mapping[str, str] = {
    "logging": "message logging and the step-collective records (logging-based recovery)",
    "undo": "update-undo's step records (a survivor ahead then reloads the checkpoint)",
    "determinism": "torch's deterministic algorithms (replays may differ from the first run)",
    "rng": "RNG keying per forward pass (replayed dropout may differ)",
    "wakeup": "SCHED_BATCH for ds-swift's background threads and its transport's gloo threads (they preempt "
    "the training thread when they wake, as before; ds_swift.threadname)",
    "watchdog": "the watchdog thread (heartbeats, failure-flag polls, hang detection) and the failure-flag "
    "checks after every receive and before every iteration",
}


def switched_off(env: Mapping[str, str] | None = None) -> frozenset[str]:
    """The protections :data:`ENV` names (empty when unset). Raises ValueError on an unknown name."""
    raw = (os.environ if env is None else env).get(ENV, "")
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    unknown = sorted(names - set(SWITCHES))
    if unknown:
        raise ValueError(
            f"{ENV}={raw!r}: unknown protection(s) {unknown}; known: {', '.join(SWITCHES)} "
            "(unset it to keep every protection on)"
        )
    return names
