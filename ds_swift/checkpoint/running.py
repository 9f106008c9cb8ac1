"""SCAR's prioritized ("running") checkpoint of one rank's state: save a little, often, most changed first.

SCAR (shared/papers/scar-*.txt, section 4.2) replaces "all of the state every C iterations" with
"a fraction r of it every rC iterations", written into a *running checkpoint* that each partial save
updates in place, choosing what changed the most since it was last saved. Per C iterations it
writes as many bytes as a full checkpoint, but a failure finds most of the state fresher than the
last full checkpoint, and what is stale is what moved least: the perturbation ||delta|| that SCAR's
iteration-cost bound grows with is smaller (its Fig. 8: the smaller r, the less rework). With
partial recovery a replacement rank loads its running checkpoint over the last global one.

The state is one rank's ``Mapping[str, Tensor]`` (a ZeRO-1 partition's fp32 masters and Adam
moments, ...), each tensor flattened and cut into blocks of ``block_elements`` elements (a tensor's
last block may be shorter); a block is the unit of priority and of writing.

- **Groups.** A *key* tensor's block decides; the same element range of its *companions* (same
  number of elements) is saved with it: a master block goes with its ``exp_avg`` and
  ``exp_avg_sq``, so Adam resumes on moments as old as the weights. A tensor no group names is a
  group of its own. Blocks are numbered in the state's order, group by group.
- **Priority** = the L2 norm of (key block now - key block as last saved), SCAR's "changed the
  most" in the norm its bound is stated in (its section 3). Squared L2 norms add up over blocks, so
  saving the k largest minimizes the ||delta||^2 a failure right after the round would leave; a
  max-abs measure would rank one outlier element above a block that drifted everywhere. NaN counts
  as infinite. Blocks never saved are infinitely urgent; ties go to the block saved longest ago,
  then to the lower block number: the first rounds write the state in order.
- **Rounding.** A round is due every ``every = max(1, round(r * C))`` iterations (:meth:`due`).
  With B blocks, round n writes ``floor(n*B*every/C) - floor((n-1)*B*every/C)`` blocks
  (``ceil(r*B)`` or one fewer when r*C is whole): after n rounds exactly floor(n*B*every/C) blocks,
  i.e. one full checkpoint's worth per C iterations to within one block, even when ``every`` had to
  be rounded or r*B is tiny (a round may write nothing). ``save(..., full=True)`` writes all B
  blocks (right after a global checkpoint: a fresh baseline) and leaves that count alone.
- **Memory** (host): one copy of every key tensor as last saved (for ZeRO-1 with the masters as key,
  4 bytes per partition element, a third of the fp32 optimizer state); during a round a host copy
  of any key tensor not on the CPU, a float32 difference of at most 4M elements, and the chosen
  blocks' copies (r of the state's bytes), kept until written.
- **Files** in ``directory``: one ``<run>-<seq>.bin`` per round (the chosen blocks' raw bytes back
  to back, key first), and ``manifest.json``: per tensor its dtype, shape and key, per block the
  iteration, file, offset, size and crc32c of its newest copy, and a crc32c of the manifest itself.
  Both are written to a temporary name, fsynced and renamed, the directory fsynced
  (:func:`ds_swift.checkpoint.durable.write_atomic`), the manifest after the data: a crash leaves the previous
  manifest and the files it names. The manifest names the job that wrote it (:func:`running_checkpoint_job`). Round files no block points to any more are
  deleted after the manifest is replaced. No pickle: bytes plus dtype and shape in JSON.
- **Threading and errors.** :meth:`save` picks the blocks, copies them to host memory and hands the
  write to a background thread (one round in flight: the next save waits for it, so memory stays
  bounded). A failed write (disk full, storage gone) is raised, once, by the next :meth:`save`,
  :meth:`wait` or :meth:`close` as :class:`RunningCheckpointError` naming the directory and the
  blocks lost; those blocks keep their older copies on disk, and the next rounds write them first.

:func:`load_running_checkpoint` reads it back into tensors shaped like a template (the state from
the last global checkpoint): every saved block filled in, the others left as the template has them,
with each tensor's oldest and newest block iteration.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ds_swift.checkpoint.durable import write_atomic
from ds_swift.checkpoint.running_blocks import Group, block_priorities, check_groups, lay_out, most_changed
from ds_swift.checkpoint.running_format import (
    MANIFEST,
    CorruptCheckpointError,
    RunningCheckpointError,
    TensorAge,
    block_crc,
    encode_manifest,
    load_running_checkpoint,
    nblocks,
    running_checkpoint_job,
)

# The files' format and their reader live in ds_swift.checkpoint.running_format; their names stay
# importable from here.
__all__ = [
    "MANIFEST",
    "CorruptCheckpointError",
    "RunningCheckpoint",
    "RunningCheckpointError",
    "TensorAge",
    "block_elements",
    "load_running_checkpoint",
    "running_checkpoint_job",
    "running_dir",
    "running_state",
]

_ROUND_FILE = re.compile(r"[0-9a-f]{12}-\d+\.bin(\.tmp)?")


@dataclass
class _Round:
    seq: int
    iteration: int
    pieces: list[tuple[str, int, torch.Tensor]]  # (tensor, block, contiguous 1-D host copy)
    meta: dict[str, dict[str, Any]]


class RunningCheckpoint:
    """One rank's running checkpoint in ``directory`` (see the module docstring).

    Args:
        directory: where its files go (created if missing). It belongs to this object: files of an
            earlier running checkpoint there go once this one's first manifest has replaced theirs.
        fraction: SCAR's r, in (0, 1]: the share of the state a round saves.
        interval: SCAR's C, the full (global) checkpoint interval in iterations.
        groups: key tensor name -> its companions' names (as many elements as the key): the key's
            block decides, the companions' same range is saved with it. Tensors that no group names
            are groups of their own.
        block_elements: elements per block (a tensor's last block may be shorter).
        background: write on a background thread (default); False writes inside :meth:`save`.
        job: the job id stamped in every manifest (:func:`ds_swift.checkpoint.periodic.job_id_for`), which
            :func:`running_checkpoint_job` reads back: a replacement loads only its own job's blocks.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        fraction: float,
        interval: int,
        groups: Mapping[str, Sequence[str]] | None = None,
        block_elements: int = 65536,
        background: bool = True,
        job: str | None = None,
        wait_s: float | None = None,
    ) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"RunningCheckpoint fraction={fraction}: must be in (0, 1] (1 saves all every interval)")
        if interval < 1:
            raise ValueError(f"RunningCheckpoint interval={interval}: the full-checkpoint interval must be >= 1")
        if block_elements < 1:
            raise ValueError(f"RunningCheckpoint block_elements={block_elements}: must be >= 1")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fraction, self.interval, self.block_elements, self.job = fraction, interval, block_elements, job
        self.wait_s = wait_s
        """The longest a round waits for the previous round's write (None: as long as it takes);
        past it the round is skipped (RunningCheckpointError): a hung file system never holds
        the training thread."""
        self.every = max(1, round(fraction * interval))  # SCAR's rC
        self._groups_arg = check_groups(groups or {})
        self._groups: list[Group] = []  # fixed by the first save
        self._meta: dict[str, dict[str, Any]] = {}
        self._nblocks_total = 0
        self._base: dict[str, torch.Tensor] = {}  # key -> flat host copy as last saved
        self._last = torch.empty(0, dtype=torch.int64)  # block -> iteration last saved, -1 never
        self._rounds = 0  # prioritized rounds so far (full ones not counted)
        self._seq = 0
        self._run = uuid.uuid4().hex[:12]
        # Writer side: touched by the writer (background thread) only.
        self._entries: dict[str, list[list[Any] | None]] = {}
        self._bytes = 0
        self._manifest_bytes = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ds-swift-running-ckpt") if background else None
        self._pending: tuple[Future[None], _Round] | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"RunningCheckpoint({str(self.directory)!r}, fraction={self.fraction}, interval={self.interval})"

    @property
    def bytes_written(self) -> int:
        """Tensor bytes written to block files so far (manifests not included, see ``manifest_bytes_written``)."""
        return self._bytes

    @property
    def manifest_bytes_written(self) -> int:
        """Bytes of manifest written so far."""
        return self._manifest_bytes

    @property
    def full_bytes(self) -> int:
        """Bytes of the whole state, what a full checkpoint of it writes (0 before the first save)."""
        return sum(int(m["numel"]) * int(m["itemsize"]) for m in self._meta.values())

    def due(self, iteration: int) -> bool:
        """Whether a round is due after ``iteration`` (every ``every`` iterations)."""
        return iteration % self.every == 0

    def save(
        self, iteration: int, state: Mapping[str, torch.Tensor], *, full: bool = False
    ) -> dict[str, tuple[int, ...]]:
        """Save this round's blocks of ``state`` after ``iteration`` (all of them when ``full``).

        Returns once they are copied to host memory (the write goes on in the background); returns
        group key -> the block numbers (within the key tensor) saved. The state's layout (names,
        shapes, dtypes) is fixed by the first call.

        Raises:
            RunningCheckpointError: the previous round's write failed (nothing of this round was
                done; call again), or ``state`` does not fit the layout.
        """
        self._finish_pending(self.wait_s)
        if self._closed:
            raise RunningCheckpointError(f"{self!r} is closed")
        if not self._groups:
            self._layout(state)
        self._check(state)
        if full:
            count = self._nblocks_total
        else:
            self._rounds += 1
            n, total = self._rounds, self._nblocks_total
            count = (n * total * self.every) // self.interval - ((n - 1) * total * self.every) // self.interval
        chosen, pieces = self._snapshot(iteration, state, count)
        if pieces:
            self._seq += 1
            job = _Round(self._seq, iteration, pieces, self._meta)
            if self._pool is None:
                self._run_job(job)
            else:
                self._pending = (self._pool.submit(self._persist, job), job)
        return chosen

    def wait(self) -> None:
        """Wait for the round in flight; raise its write error, if any."""
        self._finish_pending()

    def close(self) -> None:
        """Finish the round in flight (raising its write error) and stop the writer thread."""
        try:
            self._finish_pending(self.wait_s)
        finally:
            self._closed = True
            if self._pool is not None:  # a write still hung is left to its thread
                self._pool.shutdown(wait=self._pending is None, cancel_futures=True)

    def __enter__(self) -> RunningCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ training thread
    def _layout(self, state: Mapping[str, torch.Tensor]) -> None:
        groups, first = lay_out(state, self._groups_arg, self.block_elements)
        self._groups, self._nblocks_total = groups, first  # only once it all checked out: a retry lays out again
        self._last = torch.full((first,), -1, dtype=torch.int64)
        for g in self._groups:
            self._base[g.key] = torch.zeros(g.numel, dtype=state[g.key].dtype)
            for n in g.names:
                t = state[n]
                self._meta[n] = {
                    "dtype": str(t.dtype),
                    "shape": list(t.shape),
                    "key": g.key,
                    "numel": t.numel(),
                    "itemsize": t.element_size(),
                }

    def _check(self, state: Mapping[str, torch.Tensor]) -> None:
        if set(state) != set(self._meta):
            raise RunningCheckpointError(
                f"the state's tensors {sorted(state)} differ from the first save's {sorted(self._meta)}; the layout "
                "is fixed by the first save: use a new RunningCheckpoint (after a full save) for a new one"
            )
        for name, t in state.items():
            m = self._meta[name]
            if list(t.shape) != m["shape"] or str(t.dtype) != m["dtype"]:
                raise RunningCheckpointError(
                    f"tensor {name!r} is {str(t.dtype)}{list(t.shape)}, the first save's was {m['dtype']}{m['shape']}; "
                    "the layout is fixed by the first save: use a new RunningCheckpoint for a new one"
                )

    def _snapshot(
        self, iteration: int, state: Mapping[str, torch.Tensor], count: int
    ) -> tuple[dict[str, tuple[int, ...]], list[tuple[str, int, torch.Tensor]]]:
        """Choose ``count`` blocks, copy them (and their companions) to host memory, move the baseline."""
        if count <= 0:
            return {g.key: () for g in self._groups}, []
        # Keys on an accelerator come over once, whole: their priorities need every element anyway.
        hosts = {g.key: state[g.key].detach().reshape(-1).to("cpu") for g in self._groups}
        if count >= self._nblocks_total:
            chosen = np.arange(self._nblocks_total)
        else:
            priorities = block_priorities(self._groups, self._base, hosts, self.block_elements, self._nblocks_total)
            chosen = most_changed(priorities, self._last, count)
        block = self.block_elements
        picked: dict[str, tuple[int, ...]] = {}
        pieces: list[tuple[str, int, torch.Tensor]] = []
        for g in self._groups:
            nb = nblocks(g.numel, block)
            local = [int(b) - g.first for b in chosen[(chosen >= g.first) & (chosen < g.first + nb)]]
            picked[g.key] = tuple(local)
            if not local:
                continue
            ranges = [(b * block, min(g.numel, (b + 1) * block)) for b in local]
            for name in g.names:
                src = hosts[name] if name == g.key else state[name].detach().reshape(-1)
                # One gather (on the tensor's device), one copy to the host: a copy training cannot touch.
                copy = torch.cat([src[s:e] for s, e in ranges]).to("cpu")
                parts = copy.split([e - s for s, e in ranges])
                pieces.extend((name, b, p) for b, p in zip(local, parts))
                if name == g.key:
                    for (s, e), p in zip(ranges, parts):
                        self._base[name][s:e].copy_(p)
            self._last[[g.first + b for b in local]] = iteration
        return picked, pieces

    def _finish_pending(self, timeout_s: float | None = None) -> None:
        if self._pending is None:
            return
        future, job = self._pending
        try:
            exc = future.exception(timeout=timeout_s)
        except FutureTimeout:
            raise RunningCheckpointError(
                f"running checkpoint {self.directory}: the round of iteration {job.iteration} is still being "
                f"written after {timeout_s:.0f} s (a slow or hung file system): this round is skipped, the next "
                "is tried at its time"
            ) from None
        self._pending = None
        if exc is not None:
            self._failed(job, exc)

    def _run_job(self, job: _Round) -> None:
        try:
            self._persist(job)
        except Exception as exc:
            self._failed(job, exc)

    def _failed(self, job: _Round, exc: BaseException) -> None:
        """Forget that ``job``'s blocks were saved (the next rounds write them first) and say so."""
        keys = {self._meta[name]["key"] for name, _, _ in job.pieces}
        lost = {(self._meta[name]["key"], b) for name, b, _ in job.pieces}
        first = {g.key: g.first for g in self._groups}
        self._last[[first[k] + b for k, b in lost]] = -1
        raise RunningCheckpointError(
            f"running checkpoint {self.directory}: writing the round of iteration {job.iteration} failed "
            f"({type(exc).__name__}: {exc}); its {len(lost)} block(s) of {sorted(keys)} are not saved: on disk they "
            f"are older than iteration {job.iteration}, or absent; the next rounds write them first"
        ) from exc

    # ------------------------------------------------------------------ writer (background thread)
    def _persist(self, job: _Round) -> None:
        name = f"{self._run}-{job.seq:06d}.bin"
        entries = {
            t: list(self._entries.get(t) or [None] * nblocks(int(m["numel"]), self.block_elements))
            for t, m in job.meta.items()
        }
        buffers, offset = [], 0
        for tensor, b, piece in job.pieces:
            data = piece.view(torch.uint8).numpy()
            entries[tensor][b] = [job.iteration, name, offset, int(data.nbytes), block_crc(data)]
            buffers.append(data)
            offset += int(data.nbytes)
        write_atomic(self.directory / name, buffers)
        self._bytes += offset
        meta = {t: {k: m[k] for k in ("dtype", "shape", "key")} for t, m in job.meta.items()}
        manifest = encode_manifest(self.block_elements, meta, entries, self.job)
        write_atomic(self.directory / MANIFEST, manifest)
        self._manifest_bytes += len(manifest)
        self._entries = entries
        self._collect(entries)

    def _collect(self, entries: Mapping[str, list[list[Any] | None]]) -> None:
        """Delete round files (and torn temporaries) the manifest no longer names."""
        live = {e[1] for es in entries.values() for e in es if e is not None}
        for path in self.directory.iterdir():
            if _ROUND_FILE.fullmatch(path.name) and path.name not in live:
                try:
                    path.unlink(missing_ok=True)
                except OSError:  # only space is lost, and the next round tries again
                    pass


#: A running checkpoint's blocks: at most this many elements, and at least 64 blocks per rank where
#: the state is big enough (SCAR's priorities need blocks to choose among).
BLOCK_ELEMENTS, MIN_BLOCKS = 65536, 64


def running_dir(ckpt_dir: str | Path, rank: int, job: str | None) -> Path:
    """Where ``rank`` of job ``job`` (:func:`ds_swift.checkpoint.periodic.job_id_for`) keeps its running
    checkpoint: each job its own directory, so that runs sharing ``checkpoint.dir`` never touch
    each other's (``running/rank<r>`` for a run without a job id, as before job stamps)."""
    return Path(ckpt_dir) / "running" / (job or "") / f"rank{rank}"


def running_state(optimizer: Any) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """The live tensors of a rank's optimizer state a running checkpoint keeps (fp32 masters, and the
    inner optimizer's per-parameter state tensors of the same size), and the groups: each master
    with its moments, saved block for block together."""
    from ds_swift.patches.deepspeed_optim_state import capture_optimizer, optimizer_payload

    payload = optimizer_payload(capture_optimizer(optimizer))
    tensors: dict[str, torch.Tensor] = {}
    groups: dict[str, list[str]] = {}
    inner = payload["inner"]["state"]
    for i, master in enumerate(payload["masters"]):
        key = f"masters.{i}"
        tensors[key] = master
        for name, t in sorted((inner.get(i) or {}).items()):
            if isinstance(t, torch.Tensor) and t.numel() == master.numel() and t.is_floating_point():
                tensors[f"state.{i}.{name}"] = t
                groups.setdefault(key, []).append(f"state.{i}.{name}")
    return tensors, groups


def block_elements(tensors: dict[str, torch.Tensor]) -> int:
    total = sum(t.numel() for t in tensors.values())
    return max(1, min(BLOCK_ELEMENTS, total // MIN_BLOCKS))
