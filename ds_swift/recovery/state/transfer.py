"""A rank's training state as bytes and tensors, and its transfer between ranks: what every
state-moving strategy shares (replication, buddy copies, PipeChurn's chunks, elastic resharding,
parallel recovery), apart from any one strategy.

The state of a pipeline rank is its stage's module parameters and buffers, everything its
optimizer wrapper holds (fp32 masters, optimizer state, loss scaler, flags; see
ds_swift.patches.deepspeed_optim_state), the LR scheduler, the step counters and the RNG state
(:func:`capture_state`): a nested structure of tensors.

Wire format, over ds-swift's transport (ds_swift.transport: a gloo group of its own, host tensors),
point-to-point, tensors only (no pickle of a peer's bytes, so a peer can never make this rank run
code): one int64 length, a UTF-8 JSON manifest (the state with every tensor replaced by
``{"__t__": index}``, plus each tensor's shape and dtype: :func:`encode`), then one flat buffer
per dtype holding every tensor of that dtype (:func:`send_state`); :func:`load_state` puts it
back into an engine. A few large sends instead of hundreds of small ones.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from ds_swift import transport
from ds_swift.patches.deepspeed_engine import counters_of, set_counters
from ds_swift.patches.deepspeed_optim_state import (
    capture_optimizer,
    load_optimizer,
    optimizer_payload,
    refresh_lp_params,
)

if TYPE_CHECKING:
    from ds_swift.recovery.timeline import RankTimeline

__all__ = [
    "capture_state",
    "counters_of",
    "decode",
    "decode_dtype",
    "encode",
    "finish_restore",
    "flat_sizes",
    "flat_views",
    "flatten",
    "hand_over",
    "load_received",
    "load_state",
    "recv_state",
    "send_state",
    "set_counters",
    "unflatten",
]

_DTYPES = {
    str(d): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def flatten(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """Split ``obj`` (nested dicts/lists/tuples of tensors and JSON scalars) into a JSON-able
    skeleton and its tensors. Dicts with non-string keys and tuples are tagged so that they come
    back as they were (optimizer state is keyed by int, Adam's betas are a tuple)."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return {"__t__": len(tensors) - 1}
        if isinstance(x, dict):
            # OrderedDicts (state dicts) become plain dicts: load_state_dict accepts either.
            if all(isinstance(k, str) and not k.startswith("__") for k in x):
                return {k: walk(v) for k, v in x.items()}
            return {"__items__": [[walk(k), walk(v)] for k, v in x.items()]}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            return {"__tuple__": [walk(v) for v in x]}
        if isinstance(x, torch.dtype):
            return {"__dtype__": str(x)}
        if x is None or isinstance(x, bool | int | float | str):
            return x
        raise TypeError(f"state transfer sends tensors and JSON scalars only, not {type(x).__name__}")

    return walk(obj), tensors


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if "__t__" in x:
                return tensors[int(x["__t__"])]
            if "__items__" in x:
                return {walk(k): walk(v) for k, v in x["__items__"]}
            if "__tuple__" in x:
                return tuple(walk(v) for v in x["__tuple__"])
            if "__dtype__" in x:
                return _DTYPES[x["__dtype__"]]
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(skeleton)


def encode(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """``state`` as a JSON manifest (skeleton + each tensor's shape and dtype) and its tensors."""
    skeleton, tensors = flatten(state)
    metas = [[list(t.shape), str(t.dtype)] for t in tensors]
    return json.dumps({"skeleton": skeleton, "tensors": metas}).encode(), tensors


@functools.lru_cache(maxsize=16)
def _tensor_metas(manifest: bytes) -> tuple[tuple[torch.dtype, int], ...]:
    """(dtype, elements) of each tensor ``manifest`` lists. A buddy round reads its manifest's list
    several times on each end (buffers, views, wire order): parsed once."""
    return tuple((_DTYPES[name], int(torch.Size(shape).numel())) for shape, name in json.loads(manifest)["tensors"])


def flat_views(manifest: bytes, flats: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor of ``manifest``, in order, as a 1-D view of its dtype's flat buffer in ``flats``."""
    offsets = dict.fromkeys(flats, 0)
    views = []
    for dtype, n in _tensor_metas(manifest):
        views.append(flats[dtype][offsets[dtype] : offsets[dtype] + n])
        offsets[dtype] += n
    return views


def decode(manifest: bytes, flats: dict[torch.dtype, torch.Tensor]) -> Any:
    """The state :func:`encode` described, its tensors cut out of one flat buffer per dtype (views)."""
    doc = json.loads(manifest.decode())
    views = flat_views(manifest, flats)
    return unflatten(doc["skeleton"], [v.view(shape) for v, (shape, _) in zip(views, doc["tensors"], strict=True)])


def decode_dtype(name: str) -> torch.dtype:
    """The dtype a manifest names (``"torch.float32"``)."""
    return _DTYPES[name]


def flat_sizes(manifest: bytes) -> dict[torch.dtype, int]:
    """Elements per dtype of the flat buffers that go with ``manifest`` (in sending order)."""
    sizes: dict[torch.dtype, int] = {}
    for d, n in _tensor_metas(manifest):
        sizes[d] = sizes.get(d, 0) + n
    return sizes


def send_state(state: Any, dst: int, group: Any = None, send: Callable[..., Any] | None = None) -> int:
    """Send ``state`` to rank ``dst``; returns the payload bytes sent.

    The manifest goes first, then every tensor as it lies in memory, one message each, in the
    manifest's order: no flat copy of the state is made (a host tensor that is
    contiguous goes as it is), and with the transport's own send every message is posted at once
    (``isend``) and waited for at the end, so the link never waits for the next copy.

    Args:
        state: nested dicts/lists/tuples of tensors and JSON scalars.
        dst: the receiving rank.
        group: the process group (default: the one ds-swift's transport picks for host tensors).
        send: ``send(tensor, dst, group=...)``, blocking or returning something with ``wait()``; the
            transport's ``isend`` by default (tests pass a queue, or a send that dies midway).
    """
    post = send or transport.isend
    manifest, tensors = encode(state)
    blob = torch.frombuffer(bytearray(manifest), dtype=torch.uint8)
    pending = [post(torch.tensor([blob.numel()], dtype=torch.int64), dst, group=group), post(blob, dst, group=group)]
    sent = blob.numel()
    for t in _wire_order(tensors):
        flat = t.detach().reshape(-1).cpu()  # a view of a contiguous host tensor: no copy
        pending.append(post(flat, dst, group=group))
        sent += flat.numel() * flat.element_size()
    for work in pending:
        if work is not None and hasattr(work, "wait"):
            work.wait()
    return sent


def _wire_order(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in the order they travel: the manifest's (:func:`flat_views`' on the receiving
    end), empty ones left out (a message of no bytes is no message on every transport)."""
    return [t for t in tensors if t.numel()]


def recv_state(src: int, group: Any = None, recv: Callable[..., Any] | None = None) -> Any:
    """Receive a state sent by :func:`send_state` from rank ``src`` (tensors land on the CPU, in one
    flat buffer per dtype, each received in place: every receive posted at once, ``irecv``, unless
    ``recv`` is given)."""
    post = recv or transport.irecv
    length = torch.zeros(1, dtype=torch.int64)
    _wait(post(length, src, group=group))
    blob = torch.empty(int(length.item()), dtype=torch.uint8)
    _wait(post(blob, src, group=group))
    manifest = blob.numpy().tobytes()
    flats = {dtype: torch.empty(n, dtype=dtype) for dtype, n in flat_sizes(manifest).items()}
    pending = [post(view, src, group=group) for view in flat_views(manifest, flats) if view.numel()]
    for work in pending:
        _wait(work)
    return decode(manifest, flats)


def _wait(work: Any) -> None:
    if work is not None and hasattr(work, "wait"):
        work.wait()


def hand_over(
    recipients: Iterable[int],
    state_for: Callable[[int], Any],
    donor: int | None,
    *,
    posted: bool = False,
    on_sent: Callable[[int, int], None] | None = None,
    timeline: RankTimeline | None = None,
) -> tuple[Any, int]:
    """This rank's part of a state transfer: send ``state_for(dst)`` to each of ``recipients`` (in
    their order), then receive this rank's own state from ``donor``. Every byte goes through
    ds-swift's transport (:func:`send_state`, :func:`recv_state`).

    Args:
        recipients: the ranks this rank sends to (the plan's ``recipients_of(rank)``).
        state_for: the state to send to one of them (captured just before its send).
        donor: the rank this rank receives its state from (``donor_of(rank)``); None: none.
        posted: post every send (``isend``) first and wait for them last, after the receive: a rank
            holding several copies then serves its receivers in any order, and a rank that both
            sends and receives never waits for a peer that waits for it. Else each send completes
            before the next one starts (one flat copy of the state in flight at a time).
        on_sent: ``on_sent(dst, nbytes)`` after each send is handed over (the strategy's log line).
        timeline: where the transfer's bytes and seconds go (``extra["transfer"]``: the achieved
            bandwidth, in the recovery's summary).

    Returns:
        The state received (None without a donor) and the payload bytes sent.
    """
    posting: list[tuple[Any, torch.Tensor]] = []

    def isend(t: torch.Tensor, dst: int, group: Any = None) -> None:
        posting.append((transport.isend(t, dst, group=group), t))  # t stays alive until its wait

    sent = 0
    t0 = time.perf_counter()
    for dst in recipients:
        n = send_state(state_for(dst), dst, send=isend if posted else None)
        sent += n
        if on_sent is not None:
            on_sent(dst, n)
    received = recv_state(donor) if donor is not None else None
    for work, _ in posting:
        work.wait()
    if timeline is not None and (sent or received is not None):
        got = sum(t.numel() * t.element_size() for t in flatten(received)[1]) if received is not None else 0
        timeline.extra["transfer"] = {"sent_bytes": sent, "received_bytes": got, "s": time.perf_counter() - t0}
    return received, sent


def capture_state(engine: Any, optimizer: bool = True) -> dict[str, Any]:
    """A rank's whole training state, by reference (no copies): what a donor sends. The optimizer
    entry is everything the rank's optimizer wrapper holds (fp32 masters, the inner optimizer's
    state, loss scaler, flags: see ds_swift.patches.deepspeed_optim_state)."""
    opt = engine.optimizer if optimizer else None
    state: dict[str, Any] = {
        "module": engine.module.state_dict(),
        "optimizer": optimizer_payload(capture_optimizer(opt)) if opt is not None else None,
        "lr_scheduler": engine.lr_scheduler.state_dict() if getattr(engine, "lr_scheduler", None) else None,
        "counters": counters_of(engine),
        "rng": {"torch": torch.get_rng_state()},
    }
    if torch.cuda.is_available():
        state["rng"]["cuda"] = torch.cuda.get_rng_state_all()
    return state


def load_state(engine: Any, state: dict[str, Any], iteration: int) -> None:
    """Load a captured state into a (rebuilt or fresh) engine that resumes at ``iteration``.

    The low-precision parameters of a partitioned wrapper are rebuilt from the masters by
    :func:`finish_restore`, a collective every rank calls once all have loaded.
    """
    if state.get("module") is not None:
        engine.module.load_state_dict(state["module"], strict=True)
    if state.get("optimizer") is not None and engine.optimizer is not None:
        load_optimizer(engine.optimizer, state["optimizer"])
    if state.get("lr_scheduler") is not None and getattr(engine, "lr_scheduler", None) is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    counters = state.get("counters") or {}
    set_counters(engine, iteration, skipped_steps=int(counters.get("skipped_steps", 0)))
    rng = state.get("rng") or {}
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def load_received(engine: Any, state: dict[str, Any], iteration: int) -> None:
    """:func:`load_state` of a state received from a peer: a replica's whole state, or a partition
    copy (a buddy copy, decoded chunks), which has no module parameters (the low-precision ones come
    from the masters in :func:`finish_restore`) but carries the module's buffers under ``buffers``."""
    buffers = state.pop("buffers", None) or {}
    load_state(engine, state, iteration)
    if buffers:
        engine.module.load_state_dict(buffers, strict=False)


def finish_restore(engine: Any) -> None:
    """Every rank, after every rank loaded its state: the low-precision parameters from the fp32
    masters (an all-gather over data-parallel groups for ZeRO-1/bf16; the same call the step ends
    with, so bitwise what the failure-free run has)."""
    refresh_lp_params(engine.optimizer)
