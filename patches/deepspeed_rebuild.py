"""DeepSpeed/torch internals that an in-process rebuild of the pipeline engine must touch.

Measured on DeepSpeed 0.19.8 + torch 2.13 (shared/NOTES-deepspeed-cpu.md):

- ``dist.new_group(ranks)`` (DeepSpeed's grid, its data-parallel and pipe groups) takes no
  timeout and falls back to ``distributed_c10d.default_pg_timeout`` (30 min on gloo), read at
  call time. A survivor blocked on a living peer in such a group would wait 30 minutes;
  :func:`patch_default_timeout` makes every group use the watchdog's op timeout.
- ``deepspeed.runtime.pipe.p2p`` keeps ``_grid``/``_groups``/``_async`` as module globals that
  outlive an engine; :func:`reset_pipeline_globals` clears them so a rebuilt engine does not talk
  through the dead generation's grid.
- A 1-element "poison" send satisfies a peer's pending ``recv`` of any size without an error;
  :func:`patch_recv_check` makes every pipeline ``p2p.recv`` call a check afterwards, so a rank
  woken by poison raises instead of computing on a half-written buffer.
- Gloo's ``abort()`` leaves the sockets open (peers blocked on us keep waiting until our process
  exits); ``destroy_process_group()`` with every reference dropped closes them, and peers raise
  "Connection closed by peer" at once. So :func:`teardown_process_groups` destroys gloo groups,
  never aborts them (NCCL groups it aborts: ds_swift.transport.shutdown).
- "Every reference" includes the user's: a training script keeps its ``model`` (the
  ``PipelineModule``, whose ``world_group`` and ``_grid`` hold groups) and maybe the engine.
  Measured: a survivor whose pending op's peer kept its groups alive that way waited the full op
  timeout (15 s) in its own teardown. :func:`release_process_groups` cuts those references out of
  the old engine, its module, grid and optimizer wrapper, whoever else still holds them.
"""

from __future__ import annotations

import datetime
import gc
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import p2p

from ds_swift.patches._base import PatchError, PatchHandle, check_deepspeed, check_version

__all__ = [
    "drop_groups",
    "free_groups",
    "long_op_timeout",
    "patient_group_creation",
    "release_autograd_groups",
    "release_failed_engine",
    "release_pipeline_activations",
    "release_megatron_groups",
    "release_process_groups",
    "patch_default_timeout",
    "patch_recv_check",
    "reset_pipeline_globals",
    "teardown_process_groups",
]

_TORCH_RANGE = ("2.4", "2.14")


def _check_versions() -> None:
    check_deepspeed()
    check_version("torch", torch.__version__.split("+")[0], *_TORCH_RANGE)


def patch_default_timeout(timeout_s: float) -> PatchHandle:
    """Make process groups created without an explicit timeout use ``timeout_s``.

    Args:
        timeout_s: seconds; the longest a collective or p2p op may block on a living peer.
    """
    _check_versions()
    c10d = dist.distributed_c10d
    if getattr(c10d, "_ds_swift_timeout_patched", False):
        raise PatchError("the default process-group timeout is already patched by ds-swift")
    original = c10d.default_pg_timeout
    c10d.default_pg_timeout = datetime.timedelta(seconds=timeout_s)
    c10d._ds_swift_timeout_patched = True  # type: ignore[attr-defined]

    def restore() -> None:
        c10d.default_pg_timeout = original
        del c10d._ds_swift_timeout_patched  # type: ignore[attr-defined]

    return PatchHandle("default_pg_timeout", restore)


def patient_group_creation(create_timeout_s: float, op_timeout_s: float) -> PatchHandle:
    """Groups created until the handle is removed wait up to ``create_timeout_s`` for their members
    (a rebuild's groups include replacements still starting: interpreter, DeepSpeed, the model);
    on removal every live group gets ``op_timeout_s`` back for its collectives.

    Found by benchmarks/fault_matrix.py: with the op timeout (15 s) a survivor gave up on a
    replacement whose warm start took longer under load, and the generation failed again."""
    _check_versions()
    c10d = dist.distributed_c10d
    before = c10d.default_pg_timeout
    c10d.default_pg_timeout = datetime.timedelta(seconds=create_timeout_s)

    def restore() -> None:
        c10d.default_pg_timeout = before
        if dist.is_initialized():
            op = datetime.timedelta(seconds=op_timeout_s)
            for g in _live_groups():
                c10d._set_pg_timeout(op, g)

    return PatchHandle("patient_group_creation", restore)


def _live_groups() -> list[Any]:
    """Every process group this rank belongs to."""
    c10d = dist.distributed_c10d
    return [g for g in list(c10d._world.pg_map) if not c10d._rank_not_in_group(g)]


def _backends(group: Any) -> list[Any]:
    return [backend for _, backend in _device_backends(group)]


def _device_backends(group: Any) -> list[tuple[str, Any]]:
    """``(device, backend)`` of each backend of ``group`` with options, each backend once (the first
    device that names it: cpu before cuda)."""
    out: list[tuple[str, Any]] = []
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
        except (RuntimeError, ValueError):
            continue
        if hasattr(backend, "options") and all(backend is not b for _, b in out):
            out.append((device, backend))
    return out


def long_op_timeout(timeout_s: float) -> PatchHandle:
    """Give every live process group an op timeout of ``timeout_s`` until the handle is removed
    (then each gets its own back): a checkpoint save waits for its slowest writer, while the short
    op timeout keeps applying to training.

    torch sets a group's timeout through ``distributed_c10d._set_pg_timeout`` and keeps it in each
    backend's ``options._timeout`` (measured on torch 2.13, gloo).
    """
    _check_versions()
    c10d = dist.distributed_c10d
    if not dist.is_initialized():
        return PatchHandle("long_op_timeout", lambda: None)
    groups = _live_groups()
    before = [(g, [b.options._timeout for b in _backends(g)]) for g in groups]
    longer = datetime.timedelta(seconds=timeout_s)
    for g in groups:
        c10d._set_pg_timeout(longer, g)

    def restore() -> None:
        for g, timeouts in before:
            if g not in c10d._world.pg_map:
                continue  # destroyed meanwhile (a failure during the save)
            for backend, timeout in zip(_backends(g), timeouts, strict=False):
                backend._set_default_timeout(timeout)

    return PatchHandle("long_op_timeout", restore)


def patch_recv_check(check: Callable[[torch.Tensor | None], None]) -> PatchHandle:
    """Call ``check(buffer)`` after every ``deepspeed.runtime.pipe.p2p.recv`` returns (``check(None)``
    after an asynchronous one: its buffer is not filled yet, so only the failure flag can tell).

    ``check`` raises when the generation failed: the buffer may then hold a poison message.
    The pipeline engine calls ``p2p.recv`` through the module attribute, so replacing it there
    covers activations, gradients and the tensor-meta handshake of the first batch.
    """
    _check_versions()
    original = p2p.recv
    if getattr(original, "_ds_swift_recv_check", False):
        raise PatchError("p2p.recv is already wrapped by ds-swift")

    def recv(tensor: torch.Tensor, src_stage: int, async_op: bool = False) -> Any:
        result = original(tensor, src_stage, async_op=async_op)
        check(None if async_op else tensor)
        return result

    recv._ds_swift_recv_check = True  # type: ignore[attr-defined]
    recv.__wrapped__ = original  # type: ignore[attr-defined]
    p2p.recv = recv

    def restore() -> None:
        if p2p.recv is not recv:
            raise PatchError("p2p.recv was re-patched by someone else after ds-swift; cannot restore it")
        p2p.recv = original

    return PatchHandle("p2p.recv check", restore)


def reset_pipeline_globals() -> None:
    """Forget the pipeline p2p module's grid and pending ops (they belong to a dead generation)."""
    _check_versions()
    p2p._grid = None
    p2p._groups = None
    p2p._async = []


def release_process_groups(*roots: Any, max_depth: int = 3) -> int:
    """Set every process-group reference held by ``roots`` (and the DeepSpeed objects they hold,
    to ``max_depth``) to None; returns how many were cut. The objects are unusable afterwards.

    Only attributes are touched, never a module's parameters, buffers or submodules themselves;
    but a group stored *on* a parameter is cut: DeepSpeed's mixed-precision linkage (bf16 and
    ZeRO-1) sets ``param._dp_group`` on every low-precision parameter, and the user's model keeps
    its parameters alive. Measured: that reference alone kept the data-parallel group's sockets open,
    and the surviving data-parallel peer waited the full op timeout (15 s) in its gradient
    all-reduce, in 4 of 6 kills of pp 2 x dp 2 on 4 one-rank machines.
    """
    seen: set[int] = set()
    count = 0

    def is_group(v: Any) -> bool:
        return isinstance(v, dist.ProcessGroup)

    skip = ("_parameters", "_buffers", "_modules")

    def cut(container: dict[Any, Any], top: bool) -> None:
        nonlocal count
        for key, value in list(container.items()):
            if top and key in skip:
                continue
            if is_group(value):
                container[key] = None
                count += 1
            elif isinstance(value, list | tuple) and value and all(is_group(x) for x in value):
                container[key] = None
                count += 1
            elif isinstance(value, dict):
                cut(value, False)  # e.g. PipelineModule.tied_comms: {key: {"group": ..., ...}}

    def visit(obj: Any, depth: int) -> None:
        if obj is None or id(obj) in seen or depth > max_depth:
            return
        seen.add(id(obj))
        attrs = getattr(obj, "__dict__", None)
        if not isinstance(attrs, dict):
            return
        cut(attrs, True)
        for key, value in list(attrs.items()):
            # Only per-engine objects (engine, module, grid, optimizer wrappers): never process-wide
            # singletons such as deepspeed.comm's backend, which the next generation uses.
            if key not in skip and type(value).__module__.startswith("deepspeed.runtime"):
                visit(value, depth + 1)

    for root in roots:
        visit(root, 0)
        if isinstance(root, torch.nn.Module):
            # megatron-core's tensor-parallel layers keep their group (``self.tp_group``): a tp peer
            # blocked in its backward all-reduce (LinearWithGradAccumulationAndAsyncCommunication)
            # waits the op timeout while anything still holds this module.
            for sub in root.modules():
                if sub is not root and id(sub) not in seen:
                    seen.add(id(sub))
                    cut(vars(sub), True)
            for param in root.parameters():
                attrs = getattr(param, "__dict__", None)
                if isinstance(attrs, dict):
                    cut(attrs, False)
    return count


def release_pipeline_activations(engine: Any) -> int:
    """Drop the failed generation's activations in flight from ``engine``: every tensor with an
    autograd graph in its attributes (DeepSpeed's ``pipe_buffers`` of the micro-batches in flight,
    ``fwd_outputs``, ``loss``...), one container level down; returns how many were dropped. The
    engine is unusable afterwards.

    Measured (DeepSpeed 0.19.8, one rank, a failure in the second micro-batch's backward pass): the
    graphs in flight outlived the teardown and the rebuild, with the whole failed engine. DeepSpeed
    hooks its own bound methods (``_backward_prologue_per_tensor``, ``_backward_post_hook``) into
    those graphs, so the engine holds its outputs and their graphs hold the engine: a cycle through
    autograd's C++ nodes, which the garbage collector cannot see, let alone collect. Cutting the
    engine's side frees the graphs, and with them the engine. tests/unit/test_rebuild_memory.py."""
    count = 0

    def in_flight(v: Any) -> bool:
        return isinstance(v, torch.Tensor) and v.grad_fn is not None

    def clear(container: Any) -> None:
        nonlocal count
        if isinstance(container, list):
            for i, v in enumerate(container):
                if in_flight(v) or isinstance(v, tuple) and any(in_flight(x) for x in v):
                    container[i] = None
                    count += 1
        elif isinstance(container, dict):
            for k, v in list(container.items()):
                if in_flight(v) or isinstance(v, tuple) and any(in_flight(x) for x in v):
                    container[k] = None
                    count += 1
                elif isinstance(v, list | dict):
                    clear(v)  # pipe_buffers: {"outputs": [per buffer slot], ...}

    clear(vars(engine))
    return count


def release_failed_engine(engine: Any) -> str | None:
    """Free a failed generation's engine for good: its activations in flight
    (:func:`release_pipeline_activations`), then DeepSpeed's own ``engine.destroy()``, which removes
    the optimizer's gradient-accumulation hooks on the parameters and DeepSpeed's global registry of
    module and parameter names. Returns what went wrong, if anything (the rebuild goes on: the
    failed engine only stays in memory).

    Measured (DeepSpeed 0.19.8, one rank, bf16 + ZeRO-1): without ``destroy`` no engine is ever
    freed, trained or not (its parameters, fp32 masters and Adam moments stay beside the rebuilt
    engine's: twice the state after one recovery); without dropping the activations, one trained
    iteration is enough to keep it alive. tests/unit/test_rebuild_memory.py."""
    release_pipeline_activations(engine)
    try:
        engine.destroy()
    except Exception as exc:  # noqa: BLE001 - a failed engine; its memory is all that is at stake
        return f"DeepSpeed's engine.destroy() of the failed engine raised {type(exc).__name__}: {exc}"
    return None


def release_autograd_groups() -> int:
    """Cut the process groups that autograd contexts of the failed generation keep (megatron-core's
    ``LinearWithGradAccumulationAndAsyncCommunication`` saves ``ctx.tp_group`` for its backward
    all-reduce); returns how many were cut.

    Measured (tp 2 x pp 2 x dp 2, a rank leaving at the failure flag while its tensor-parallel peer
    was already inside a forward all-reduce): after the teardown, the graphs of the micro-batches in
    flight were still alive (held outside anything the garbage collector lists), and through their
    contexts' ``tp_group`` the tensor-parallel group's sockets stayed open: the peer waited its whole
    op timeout (30 s) instead of failing at once. The contexts are found by a scan of the objects the
    collector tracks (a context's attributes sit in a dict the collector does not list, so the
    scan checks the contexts themselves); their groups are cut so the peer fails within a second."""
    count = 0
    backward = torch.autograd.function.BackwardCFunction
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads obj.__class__, which some objects answer with a
        # warning (torch.distributed.reduce_op's deprecation: a FutureWarning at every rebuild).
        if issubclass(type(obj), backward):
            attrs = getattr(obj, "__dict__", None)
            if not isinstance(attrs, dict):
                continue
            for key, value in list(attrs.items()):
                if isinstance(value, dist.ProcessGroup):
                    attrs[key] = None
                    count += 1
    return count


def release_megatron_groups() -> int:
    """megatron-core's ``parallel_state`` keeps this generation's groups in module globals until the
    script's next ``initialize_model_parallel``; ``destroy_model_parallel`` misses some of them
    (``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP``, measured on megatron-core 0.16.1). Cut them all now,
    so peers blocked on this rank in one of them fail at once. Returns how many were cut (0 where
    megatron-core is not imported)."""
    import sys

    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None:
        return 0
    # Unconditionally: it only sets its globals to None, among them the global memory buffer that the
    # next initialize_model_parallel asserts is unset (after a kept engine's groups were cut out of
    # these globals, model_parallel_is_initialized() says False while the buffer is still there).
    ps.destroy_model_parallel()
    count = 0
    for name, value in list(vars(ps).items()):
        groups = value if isinstance(value, list | tuple) else [value]
        if name.startswith("_") and groups and all(isinstance(g, dist.ProcessGroup) for g in groups):
            setattr(ps, name, None)
            count += 1
    return count


def teardown_process_groups(engine_kept: bool = False) -> list[Any]:
    """End every process group of this generation so peers blocked on us fail fast: destroyed on
    gloo, aborted where they have NCCL (ds_swift.transport.shutdown says why), then DeepSpeed's
    references to them released (what ``deepspeed.comm.destroy_process_group`` does after torch's
    destroy, which on NCCL could wait on a dead peer). ``engine_kept``: a survivor keeps its engine
    (ds_swift.patches.group_swap cut its groups, DeepSpeed's and Megatron's module globals included,
    and puts their successors back): those globals and Megatron's other state stay as they are.

    The caller must have dropped its references to the engine (and to any exception traceback
    that holds its frames) first: a process group still referenced is not freed and keeps its
    sockets open, and peers blocked on it then wait for the op timeout.

    Returns (``engine_kept`` only; else nothing) the groups torch's registry let go of, still
    referenced: the caller frees them on a thread of its own (:func:`free_groups`), as it does the
    groups cut out of the kept engine; freeing them here, on the training thread, was ~18 ms a group
    (0.2 s of the demo's teardown, before the next generation could form).
    """
    from deepspeed.utils import groups

    from ds_swift import transport

    _check_versions()
    if not engine_kept:
        release_megatron_groups()
        release_autograd_groups()
        held = transport.teardown_world()
        groups._release_process_group_references(group=None)
        reset_pipeline_globals()
        drop_groups(held)
        gc.collect()
        return []
    # A kept engine's groups were cut out of it (ds_swift.patches.group_swap.GroupSwap.cut), and its
    # caller frees them (free_groups) with those torch's registry lets go of here.
    return transport.teardown_world()


#: threads that let go of a failed generation's groups side by side (see :func:`drop_groups`)
FREE_THREADS = 16


def drop_groups(groups: list[Any]) -> None:
    """Drop ``groups`` (emptied here), side by side on up to :data:`FREE_THREADS` threads.

    Measured (torch 2.13, gloo, 2 ranks): a group's release is ~17 ms, nearly all of it waiting, not
    computing, and without the GIL: 40 groups freed one after another took 0.68 s, on 16 threads
    0.06 s, and the next generation's groups were created meanwhile in half the time they took beside
    a sequential release (sockets of the failed generation still closing under them)."""
    parts = [groups[i::FREE_THREADS] for i in range(min(FREE_THREADS, len(groups)))]
    groups.clear()
    if len(parts) <= 1:
        parts.clear()
        return
    threads = [threading.Thread(target=part.clear, name="ds-swift-group-free", daemon=True) for part in parts]
    parts.clear()  # each thread's list now holds its groups' last references
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def free_groups(groups: list[Any]) -> float:
    """Let go of ``groups`` (the last references to a failed generation's groups, emptied here):
    their sockets close and their threads end (:func:`drop_groups`). A group still held somewhere
    else after that (an autograd graph of the failed iteration, a cycle) is cut out of autograd's
    contexts and collected, the collector's scans a few tenths of a second on a loaded heap; the
    rest of the failed generation's garbage is the collector's to free on its own schedule. Returns
    the seconds it took.

    The training thread need not wait for it: a gloo group's release runs without the GIL."""
    t0 = time.perf_counter()
    refs = [weakref.ref(g) for g in groups]
    drop_groups(groups)
    if any(r() is not None for r in refs):
        release_autograd_groups()
        gc.collect()
    return time.perf_counter() - t0
