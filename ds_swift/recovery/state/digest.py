"""State digests: a cheap, exact fingerprint of every tensor of a rank's training state.

Verified recovery (issue 16) checks each restored rank's state against a reference digest before
training resumes: the donor's (replication, buddy copies) or the one the lost rank published
while it was alive (logging-based replay). We promise bitwise equality with the failure-free run,
so a digest is taken over the raw bits, never over values (``-0.0`` differs from ``0.0``, every NaN
payload counts), and sees one flipped bit anywhere.

One tensor's digest: its bytes read as integer words of its element size (int16 for bf16/fp16,
int32 for fp32; two int32 lanes for 8-byte elements, each lane summed on its own), then two exact
integer sums over each lane, ``S0 = sum(w[i])`` and ``S1 = sum(i * w[i])``, hashed with the dtype
and shape into 8 bytes. A changed element changes ``S0`` by a nonzero word difference; two swapped
elements leave ``S0`` and change ``S1`` by ``(w[j] - w[k]) * (k - j)``, also nonzero. The sums run
on the tensor's device in int64, every partial result bounded below 2^62 so that no integer ever
wraps: each lane in chunks of at most 2^20 words, laid out in rows of 1024 (row sums, and
column-weighted sums): the whole chunks of a large lane (weights, masters, moments: nearly all of a
state's bytes) a few kernels per 8 chunks, short pieces (biases, norms: most tensors of a state)
packed together into batches of 1024 rows; one small transfer to the host ends the whole state's
digest (no copy of the state leaves the device). :func:`start_digest` queues that work on the
current stream and returns before it is done (on a GPU, ds_swift.protect.digest_publisher runs it on a side
stream).

Names are paths into the state: ``module/<state_dict key>``, ``optimizer/masters/<i>`` (the fp32
masters of DeepSpeed's BF16_Optimizer / FP16_Optimizer / ZeRO-1, this rank's partition),
``optimizer/inner/state/<param>/<key>`` (the inner optimizer's moments and step), ``buffers/<key>``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

__all__ = [
    "DIGEST_HEX",
    "SCALER_FIELDS",
    "PendingDigests",
    "StateDigest",
    "Verdict",
    "digest_state",
    "digest_tensors",
    "engine_state",
    "loss_scale_tensor",
    "named_tensors",
    "partition_state",
    "start_digest",
    "tensor_digest",
    "word_sums",
]

_COLS = 1024
_ROWS = 1024
_CHUNK = _COLS * _ROWS
#: hex digits of one tensor's digest (8 bytes)
DIGEST_HEX = 16
#: the parts of a captured state that are checked (the RNG is reseeded before every forward pass;
#: counters and the LR schedule are scalars, set from the agreed iteration)
_STATE_KEYS = ("module", "optimizer", "buffers")
#: what of a loss scaler (fp16's dynamic scaling) the next steps depend on
SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


# ----------------------------------------------------------------------------- one tensor
def _lanes(t: torch.Tensor) -> list[torch.Tensor]:
    """The raw bits of ``t`` as 1-D integer lanes: one per element-sized word (two for 8 bytes)."""
    flat = (torch.view_as_real(t.detach()) if t.is_complex() else t.detach()).reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    size = flat.element_size()
    if size == 1:
        return [flat.view(torch.uint8)]
    if size == 2:
        return [flat.view(torch.int16)]
    words = flat.view(torch.int32)
    if size == 4:
        return [words]
    per = size // 4
    table = words.view(-1, per)
    return [table[:, i] for i in range(per)]


Piece = tuple[int, int, torch.Tensor]
"""(lane index, chunk number, the chunk's words): a lane cut into chunks of at most 2^20 words."""

#: whole chunks summed together in one pass over a large lane (bounds the int64 temporaries to
#: 2 x 8 x 8 MB whatever the lane's size)
_GROUP = 8


def _split(lanes: list[torch.Tensor]) -> tuple[list[tuple[int, torch.Tensor]], list[Piece]]:
    """Each contiguous lane's whole chunks (``(lane index, its first n * 2^20 words)``, summed
    chunk by chunk in a few kernels: the masters, moments and weights that make up nearly all of a
    state's bytes), and every other piece (short lanes, tails, strided lanes) for :func:`_batches`."""
    whole: list[tuple[int, torch.Tensor]] = []
    pieces: list[Piece] = []
    for i, lane in enumerate(lanes):
        first = 0
        if lane.is_contiguous() and lane.numel() >= _CHUNK:
            first = lane.numel() // _CHUNK
            whole.append((i, lane[: first * _CHUNK]))
        for k in range(first, -(-lane.numel() // _CHUNK)):
            pieces.append((i, k, lane[k * _CHUNK : (k + 1) * _CHUNK]))
    return whole, pieces


def _batches(pieces: list[Piece]) -> list[list[Piece]]:
    """The pieces, packed (per device, in whole rows of ``_COLS`` words) into batches of at most
    ``_ROWS`` rows: a state holds hundreds of small tensors (biases, norms, step counters), which
    then take a few kernels together instead of a few each."""
    by_device: dict[torch.device, list[list[Piece]]] = {}
    filled: dict[torch.device, int] = {}  # rows in the device's last batch
    for i, k, piece in pieces:
        batches, rows = by_device.setdefault(piece.device, [[]]), -(-piece.numel() // _COLS)
        if filled.get(piece.device, 0) + rows > _ROWS:
            batches.append([])
            filled[piece.device] = 0
        batches[-1].append((i, k, piece))
        filled[piece.device] = filled.get(piece.device, 0) + rows
    return [b for batches in by_device.values() for b in batches if b]


def _by_col(wide: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``sum(col * w)`` of each row of ``wide`` (int64, ``_COLS`` wide)."""
    # An integer matrix-vector product is 5x faster on CPU; CUDA has none for int64.
    return torch.mv(wide, cols) if wide.device.type == "cpu" else (wide * cols).sum(dim=1)


def _chunk_sums(words: torch.Tensor) -> torch.Tensor:
    """Per whole chunk of ``words`` (a contiguous lane's first ``n * 2^20`` words): the
    ``[sum(w), sum(col * w), sum(row * w)]`` that :func:`_batch_sums` gives a piece, as an ``n x 3``
    int64 tensor on the lane's device, a few kernels per ``_GROUP`` chunks."""
    device = words.device
    cols = torch.arange(_COLS, dtype=torch.int64, device=device)
    rows = torch.arange(_ROWS, dtype=torch.int64, device=device)
    out = []
    for g in range(0, words.numel(), _GROUP * _CHUNK):
        wide = words[g : g + _GROUP * _CHUNK].to(torch.int64).view(-1, _COLS)
        row_sums = wide.sum(dim=1).view(-1, _ROWS)
        by_col = _by_col(wide, cols).view(-1, _ROWS)
        # The bounds of _batch_sums: every partial sum below 2^62.
        out.append(torch.stack([row_sums.sum(dim=1), by_col.sum(dim=1), (row_sums * rows).sum(dim=1)], dim=1))
    return torch.cat(out)


def _batch_sums(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Per piece, on its device: ``[sum(w), sum(col * w), sum(row * w)]``, the piece laid out as a
    ``rows x _COLS`` matrix (its position ``q = row * _COLS + col``)."""
    device = pieces[0].device
    rows = [-(-p.numel() // _COLS) for p in pieces]
    fill = torch.zeros(_COLS, dtype=torch.uint8, device=device)
    padded: list[torch.Tensor] = []
    for p, r in zip(pieces, rows, strict=True):
        padded += [p, fill[: r * _COLS - p.numel()]]  # zeros add nothing to either sum
    wide = torch.cat(padded).to(torch.int64).view(-1, _COLS)  # cat promotes the word types alike
    cols = torch.arange(_COLS, dtype=torch.int64, device=device)
    row_sums = wide.sum(dim=1)
    by_col = _by_col(wide, cols)
    counts = torch.tensor(rows, dtype=torch.int64, device=device)
    piece = torch.repeat_interleave(torch.arange(len(pieces), device=device), counts)
    local_row = torch.arange(wide.shape[0], device=device) - (counts.cumsum(0) - counts)[piece]
    # Each sum stays below 2^62 (words below 2^31, at most 2^20 of them, weights below 2^10): exact in
    # int64; the weighted position q = row * _COLS + col is put together in Python integers.
    terms = torch.stack([row_sums, by_col, row_sums * local_row], dim=1)
    return torch.zeros(len(pieces), 3, dtype=torch.int64, device=device).index_add_(0, piece, terms)


class PendingSums:
    """Every lane's sums, under way: the kernels are queued on each lane's device (on the caller's
    current stream) and their few bytes of results are on their way to pinned host memory;
    :meth:`result` waits for them (ds_swift.protect.digest_publisher queues them on a side stream and waits in
    its own thread). No copy of the state itself leaves the device."""

    def __init__(self, lanes: list[torch.Tensor]) -> None:
        self._count = len(lanes)
        whole, pieces = _split(lanes)
        self._whole = [(i, words.numel() // _CHUNK) for i, words in whole]
        self._batches = _batches(pieces)
        parts = [_chunk_sums(w) for _, w in whole] + [_batch_sums([p for _, _, p in b]) for b in self._batches]
        self._where: list[tuple[int, int, int]] = []  # (device slot, offset, size) of each part
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for p in parts:
            flat = by_device.setdefault(p.device, [])
            slot = list(by_device).index(p.device)
            self._where.append((slot, sum(f.numel() for f in flat), p.numel()))
            flat.append(p.reshape(-1))
        self._host: list[torch.Tensor] = []
        self._events: list[Any] = []
        for device, flat in by_device.items():
            joined = torch.cat(flat)
            if device.type == "cuda":
                host = torch.empty(joined.shape, dtype=joined.dtype, pin_memory=True)
                host.copy_(joined, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._host.append(host)
                self._events.append(event)
            else:
                self._host.append(joined)

    def result(self) -> list[tuple[int, int]]:
        """The exact ``(S0, S1)`` of every lane (waits for the devices)."""
        for event in self._events:
            event.synchronize()
        flat = [h.tolist() for h in self._host]
        host = [flat[slot][at : at + size] for slot, at, size in self._where]
        s0, s1 = [0] * self._count, [0] * self._count
        parts = iter(host)

        def add(i: int, k: int, sums: list[int]) -> None:
            c0, by_col, by_row = sums
            s0[i] += c0
            s1[i] += k * _CHUNK * c0 + by_col + _COLS * by_row

        for i, n in self._whole:
            part = next(parts)
            for k in range(n):
                add(i, k, part[3 * k : 3 * k + 3])
        for batch in self._batches:
            part = next(parts)
            for j, (i, k, _) in enumerate(batch):
                add(i, k, part[3 * j : 3 * j + 3])
        return list(zip(s0, s1, strict=True))


def _lane_sums(lanes: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The exact ``(S0, S1)`` of every lane."""
    return PendingSums(lanes).result()


def _hash(t: torch.Tensor, sums: list[tuple[int, int]]) -> str:
    text = f"{t.dtype}|{tuple(t.shape)}|{sums}"
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_HEX // 2).hexdigest()


def word_sums(t: torch.Tensor) -> list[tuple[int, int]]:
    """The exact ``(S0, S1)`` of each lane of ``t`` (what its digest hashes; see the module docstring)."""
    return _lane_sums(_lanes(t))


def tensor_digest(t: torch.Tensor) -> str:
    """One tensor's digest: 16 hex digits, equal exactly when dtype, shape and every bit are."""
    return _hash(t, word_sums(t))


def digest_tensors(named: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The digest of every tensor in ``named``, with a single transfer to the host per device."""
    return PendingDigests(named).result()


class PendingDigests:
    """:func:`digest_tensors` in two halves: the constructor queues the device work on the current
    stream (and returns at once on a GPU); :meth:`result` waits for it and hashes. The tensors must
    not change in between (ds_swift.protect.digest_publisher orders the streams)."""

    def __init__(self, named: Mapping[str, torch.Tensor]) -> None:
        self._named = dict(named)
        self._lanes = {name: _lanes(t) for name, t in self._named.items()}
        self._sums = PendingSums([lane for per in self._lanes.values() for lane in per])

    def result(self) -> dict[str, str]:
        sums = iter(self._sums.result())
        return {name: _hash(self._named[name], [next(sums) for _ in per]) for name, per in self._lanes.items()}


# ----------------------------------------------------------------------------- which tensors
def named_tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a captured state's training parts (module, optimizer, buffers), by path, and
    the loss scalers' state as tensors (``optimizer/scalers/<i>``)."""
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out[prefix] = x
        elif isinstance(x, Mapping):
            for k, v in x.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                walk(f"{prefix}/{i}", v)

    for key in _STATE_KEYS:
        if state.get(key) is not None:
            walk(key, state[key])
    # A loss scaler's state is numbers, not tensors: one float64 tensor per scaler, so that a rank
    # restored onto another loss scale (fp16: its gradients unscaled by another factor from then
    # on) fails its check as a wrong tensor would.
    optimizer = state.get("optimizer")
    if isinstance(optimizer, Mapping):
        for i, scaler in enumerate(optimizer.get("scalers") or []):
            out[f"optimizer/scalers/{i}"] = loss_scale_tensor(scaler)
    return out


def loss_scale_tensor(scaler: Mapping[str, Any]) -> torch.Tensor:
    """A loss scaler's :data:`SCALER_FIELDS` (from its ``vars``) as one float64 tensor (NaN: absent)."""
    return torch.tensor([float(scaler.get(k, math.nan)) for k in SCALER_FIELDS], dtype=torch.float64)


def engine_state(engine: Any) -> dict[str, Any]:
    """The training state of a DeepSpeed engine by reference: module state and the optimizer
    wrapper's (masters, inner optimizer), as :func:`~ds_swift.recovery.state.transfer.capture_state`
    takes it for a donor."""
    from ds_swift.patches.deepspeed_optim_state import UnsupportedWrapper, capture_optimizer, optimizer_payload

    optimizer = None
    if engine.optimizer is not None:
        try:
            optimizer = optimizer_payload(capture_optimizer(engine.optimizer))
        except UnsupportedWrapper:
            optimizer = None  # ZeRO 2/3: not restorable by these strategies; the module is still checked
    return {"module": engine.module.state_dict(), "optimizer": optimizer}


def partition_state(engine: Any) -> dict[str, Any]:
    """What a buddy copy holds of a rank (ds_swift.protect.buddy): its optimizer partition and the
    module's buffers (the parameters come from the all-gather every rank runs)."""
    module = engine.module
    params = {n for n, _ in module.named_parameters()}
    state = engine_state(engine)
    return {"optimizer": state["optimizer"], "buffers": {k: v for k, v in state["module"].items() if k not in params}}


# ----------------------------------------------------------------------------- digests and verdicts
@dataclass(frozen=True)
class StateDigest:
    """The digests of a state's tensors, in name order (names are not stored: both sides derive
    the same ones from the same engine geometry; a hash of them guards that)."""

    names: tuple[str, ...]
    values: tuple[str, ...]

    @property
    def names_hash(self) -> str:
        return hashlib.blake2b("\n".join(self.names).encode(), digest_size=8).hexdigest()

    def to_json(self, iteration: int | None = None) -> str:
        return json.dumps(
            {"iteration": iteration, "names": self.names_hash, "count": len(self.names), "values": "".join(self.values)}
        )

    def first_difference(self, reference: Mapping[str, Any]) -> str | None:
        """How this (restored) state differs from ``reference`` (a parsed :meth:`to_json`), naming
        the first differing tensor; None when every tensor is bitwise equal."""
        if reference.get("names") != self.names_hash:
            return (
                f"the restored state holds other tensors than the reference ({len(self.names)} here, "
                f"{reference.get('count')} there)"
            )
        ref = str(reference["values"])
        theirs = [ref[i : i + DIGEST_HEX] for i in range(0, len(ref), DIGEST_HEX)]
        bad = [(n, want, got) for n, want, got in zip(self.names, theirs, self.values, strict=True) if want != got]
        if not bad:
            return None
        name, want, got = bad[0]
        more = f" and {len(bad) - 1} more tensor(s)" if len(bad) > 1 else ""
        return f"tensor {name} differs (reference digest {want}, restored {got}){more}"


def digest_state(state: Mapping[str, Any]) -> StateDigest:
    """The :class:`StateDigest` of a captured state (see :func:`named_tensors`)."""
    return start_digest(state)()


def start_digest(state: Mapping[str, Any]) -> Callable[[], StateDigest]:
    """:func:`digest_state` in two halves: queues the device work now (on the current stream) and
    returns the function that waits for it and gives the digest."""
    named = named_tensors(state)
    pending = PendingDigests(named)
    names = tuple(sorted(named))

    def finish() -> StateDigest:
        digests = pending.result()
        return StateDigest(names, tuple(digests[n] for n in names))

    return finish


@dataclass(frozen=True)
class Verdict:
    """One restored rank's check of its state: ``verified`` (bitwise equal to its reference),
    ``mismatch`` (``detail`` names the tensor) or ``unverified`` (no reference: ``detail`` says why)."""

    status: Literal["verified", "mismatch", "unverified"]
    detail: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Verdict:
        return cls(**json.loads(text))
