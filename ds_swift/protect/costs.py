"""What each protection costs per iteration, said once at start-up (one line each).

The budget is 2 % of a step with the defaults (shared/DESIGN.md). Each line says how the figure was
obtained: the state digest is *measured* once here (one digest of the state, timed to completion
on its device); the checkpoint, buddy-copy and message-log figures are *estimated* from the state's
size and the plan, and the measured totals follow in each protection's end-of-job line and in
``job.json``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ds_swift.detect.watchdog import BEATS_PER_TIMEOUT
from ds_swift.protect.buddy_interval import DECIDE_AFTER, PERIOD_S
from ds_swift.protect.switches import ENV, SWITCHES
from ds_swift.recovery.registry import services_of
from ds_swift.recovery.state.digest import digest_state, engine_state, named_tensors

__all__ = ["protection_costs", "state_bytes", "switched_off_line"]

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


def buddy_round_bytes(engine: Any) -> tuple[int, str]:
    """Bytes one buddy round stages of this rank after a step (ds_swift.protect.buddy.state_payload:
    the optimizer partition's fp32 masters and its inner optimizer's state, the LR scheduler, the
    counters, the module's buffers), and how they were counted.

    At start-up no step has run yet, and Adam creates its moments at the first one: those it will
    create are counted as it creates them (exp_avg and exp_avg_sq, each as large as the fp32 master
    partition, max_exp_avg_sq under amsgrad; torch's Adam also a float32 step per parameter), and
    so is the wrapper's gradient norm the first step keeps as a tensor: the figure is a round's
    after the first step. Another optimizer's state to come is not known here: the line says so."""
    from ds_swift.patches.deepspeed_optim_state import capture_optimizer, flag_bytes_to_come
    from ds_swift.protect.buddy import state_payload

    _, tensors = state_payload(engine)
    now = sum(t.numel() * t.element_size() for t in tensors)
    inner = capture_optimizer(engine.optimizer)["inner"]
    empty = {id(p) for g in inner.param_groups for p in g["params"] if not inner.state.get(p)}
    if not empty:
        return now, "measured from the state the copier sends"
    if "Adam" not in type(inner).__name__:
        return now, (
            f"the state the copier sends now; {type(inner).__name__}'s state of {len(empty)} parameter(s) "
            "is created at the first step and not counted"
        )
    torch_step = 4 if isinstance(inner, torch.optim.Adam | torch.optim.AdamW) else 0  # a float32 tensor each
    to_come = flag_bytes_to_come(engine.optimizer)  # the wrapper's gradient norm, a tensor from the first step
    for group in inner.param_groups:
        moments = 3 if group.get("amsgrad") else 2
        to_come += sum(moments * p.numel() * p.element_size() + torch_step for p in group["params"] if id(p) in empty)
    return now + to_come, "the state the copier sends, with the Adam moments the first step creates"


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def protection_costs(
    engine: Any,
    cfg: Any,
    *,
    digests: Any,
    buddy: Any,
    logs: Any,
    async_ckpt: bool,
    machines: int | None,
    without: frozenset[str] = frozenset(),
    undo_off: str | None = None,
) -> list[str]:
    """One line per protection of this rank (what it costs per iteration: time and bytes); ``machines``:
    the job's machine count (None: unknown); ``without``: what a benchmark switched off
    (ds_swift.protect.switches; every rank says it first, :func:`switched_off_line`);
    ``undo_off``: why update-undo could not be attached to the engine (None: it is, or ``without`` says)."""
    state = engine_state(engine)
    total, device = state_bytes(state)
    lines = [f"protection costs (rank state {_mb(total)} on {device}); the budget is 2% of a step:"]
    lines.append(_digest_line(state, total, device, digests))
    lines.append(_checkpoint_line(cfg, total, device, async_ckpt))
    if buddy is not None and machines == 1:
        lines.append("  buddy copies: none (one machine: no other machine to hold them): 0")
    elif buddy is not None:
        part, counted = buddy_round_bytes(engine)
        every = int(getattr(buddy, "interval", 1))
        per = part * buddy.factor // every
        when = "after every step" if every == 1 else f"after every {every}th step ({part * buddy.factor} bytes each)"
        if getattr(buddy, "auto", False):
            when += (
                f" for the first {DECIDE_AFTER} rounds, then every k-th (buddy.interval auto: k of 1, 2, 5, 10, ... "
                f"from the step time rank 0 measures, at least {PERIOD_S:g} s between rounds; said when chosen)"
            )
        lines.append(
            f"  buddy copies: {_mb(per)} ({per} bytes) per iteration sent to {buddy.factor} buddy rank(s) on other "
            f"machines {when} in a background thread ({counted}; the training thread waits only if the "
            "previous round is still sending; measured totals at the end)"
        )
    else:
        lines.append("  buddy copies: off (no partition to copy, or the strategy does not use them): 0")
    lines.append(_logging_line(engine, logs))
    if services_of(cfg).inflight_copy:
        lines.append(_inflight_line(engine, cfg, device))
    lines += _runtime_lines(cfg, without, undo_off)
    return lines


def switched_off_line(without: frozenset[str]) -> str:
    """What a benchmark's :data:`~ds_swift.protect.switches.ENV` switched off, and what that leaves out."""
    return (
        f"protections SWITCHED OFF for a benchmark by {ENV} (unset it for training): "
        + "; ".join(f"{n} ({SWITCHES[n]})" for n in sorted(without))
        + "; a failure in this job is recovered without them"
    )


def _logging_line(engine: Any, logs: Any) -> str:
    if logs is not None and logs.possible(engine):
        return (
            "  message logging: on: the activations and gradients this rank sends across machines, copied off the "
            "device in the pipeline's bubbles and written by a background thread (bytes per iteration measured in "
            "the logs' end-of-job line)"
        )
    if logs is not None and logs.plan_error is not None:
        return (
            f"  message logging: off (topology analysis failed: {logs.plan_error}; a failure recovers from the "
            "global checkpoint): 0"
        )
    if logs is not None and not logs.enabled:
        return f"  message logging: OFF (benchmark: {ENV}): 0"
    return "  message logging: off for this rank (no send of its crosses a machine boundary that the plan logs): 0"


def _inflight_line(engine: Any, cfg: Any, device: str) -> str:
    """PipeChurn's copy of the iteration in flight (ds_swift.recovery.state.inflight)."""
    if not cfg.pipechurn.partial_recompute:
        return "  partial recomputation: off (pipechurn.partial_recompute false: every rank retrains the iteration in flight): 0"
    from ds_swift.patches.deepspeed_grad_accum import accumulator

    try:
        hp = accumulator(engine.optimizer).where == "hp"
    except Exception:  # noqa: BLE001 - an unsupported wrapper: the keeper says so at its first copy
        hp = False
    grads = sum(p.numel() * (4 if hp else p.element_size()) for p in engine.module.parameters() if p.requires_grad)
    rate = PCIE_BYTES_PER_S * 4 if device != "cpu" else HOST_COPY_BYTES_PER_S  # a device-to-device copy
    return (
        f"  partial recomputation: a copy of the gradients before their reduction, {_mb(grads)} per iteration "
        f"(~{grads / rate * 1e3:.2f} ms, estimated at {rate / 1e9:.0f} GB/s), and references to the iteration's "
        f"sent activations/gradients, both in {device} memory until the next iteration (one iteration's worth)"
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
            else f"a watchdog thread reads the failure flag every {wd.poll_interval_s:g} s (one job-store round trip) and "
            f"writes its heartbeat, and reads its pipeline neighbours', every {beat:g} s{hang}; the training thread "
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


def _digest_line(state: Any, total: int, device: str, digests: Any) -> str:
    if digests is None:
        return "  state digests: off (verify.enabled false, or no recovery here checks against them): 0"
    seconds = _timed(lambda: digest_state(state), device)
    where, wait = (
        ("in kernels on a side CUDA stream", "the training thread does not wait for them")
        if device != "cpu"
        else ("in a background thread", "the next step waits only for one still running")
    )
    return (
        f"  state digests: every {digests.interval} iteration(s), {seconds * 1e3:.1f} ms each {where} (measured "
        f"at start-up) = {seconds * 1e3 / digests.interval:.2f} ms per iteration; reads {_mb(total)} where it lives "
        f"per digest, stores {16 * len(named_tensors(state))} bytes in the job store; {wait}"
    )


def _checkpoint_line(cfg: Any, total: int, device: str, async_ckpt: bool) -> str:
    every = cfg.checkpoint.interval
    if services_of(cfg).checkpoint_tuner:
        return (
            f"  global checkpoints: at an interval CheckFreq chooses (at most {cfg.checkfreq.max_overhead:.0%} "
            f"of training time), {_mb(total)} per save, asynchronous"
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
            f"{stall * 1e3 / every:.2f} ms per iteration; {_mb(total / every)} per iteration written in the "
            "background"
        )
    return (
        f"  global checkpoints: every {every} iterations, synchronous (training waits while DeepSpeed writes "
        f"{_mb(total)} to {cfg.checkpoint.dir}: storage speed; checkpoint.async_save true makes it wait for a "
        f"host copy only) = {_mb(total / every)} per iteration"
    )


def _timed(fn: Callable[[], Any], device: str) -> float:
    """Seconds ``fn`` takes once warm (its first run allocates and, on a GPU, loads kernels)."""
    fn()
    if device != "cpu":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device != "cpu":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0
