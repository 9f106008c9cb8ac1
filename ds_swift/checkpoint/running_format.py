"""The files of a SCAR running checkpoint (:mod:`ds_swift.checkpoint.running`) and reading them back.

``manifest.json`` names, per tensor, its dtype, shape and group key, and per block the iteration,
round file, offset, size and crc32c of its newest copy, with a crc32c of the manifest itself and
the job that wrote it; round files hold the blocks' raw bytes. :func:`load_running_checkpoint`
fills a template's tensors from them, checking every block it reads.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c as _crc32c
import torch

__all__ = [
    "MANIFEST",
    "CorruptCheckpointError",
    "RunningCheckpointError",
    "TensorAge",
    "block_crc",
    "encode_manifest",
    "load_running_checkpoint",
    "nblocks",
    "running_checkpoint_job",
]

MANIFEST = "manifest.json"
_FORMAT = "ds-swift-running-checkpoint/1"


class RunningCheckpointError(RuntimeError):
    """A running checkpoint could not be written, or does not fit the state or template given."""


class CorruptCheckpointError(RunningCheckpointError):
    """A running checkpoint's manifest or block file is missing, truncated or fails its crc32c."""


@dataclass(frozen=True)
class TensorAge:
    """How stale one loaded tensor is."""

    oldest: int | None
    """Iteration of its least recently saved block; None when no block was ever saved."""
    newest: int | None
    """Iteration of its most recently saved block; None when no block was ever saved."""
    saved_blocks: int
    """Blocks filled from the running checkpoint (the others are the template's)."""
    blocks: int


def nblocks(numel: int, block: int) -> int:
    """Blocks of ``block`` elements a tensor of ``numel`` elements is cut into (its last may be shorter)."""
    return -(-numel // block)


def block_crc(data: Any) -> int:
    """crc32c of a buffer (a block's bytes, or the manifest's canonical JSON)."""
    return int(_crc32c.crc32c(memoryview(data)))


def encode_manifest(block_elements: int, meta: Mapping[str, Any], blocks: Mapping[str, Any], job: str | None) -> bytes:
    """The manifest's bytes, its crc32c over the canonical JSON of the rest included."""
    body = {"format": _FORMAT, "block_elements": block_elements, "tensors": meta, "blocks": blocks, "job": job}
    crc = block_crc(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    return json.dumps({**body, "crc32c": crc}, separators=(",", ":")).encode()


def _read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing: {directory} holds no running checkpoint") from None
    except ValueError as exc:
        raise CorruptCheckpointError(f"{path} is corrupt or truncated (not JSON: {exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise CorruptCheckpointError(f"{path} is not a running-checkpoint manifest ({_FORMAT})")
    crc = doc.pop("crc32c", None)
    if crc != block_crc(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()):
        raise CorruptCheckpointError(f"{path} is corrupt: its crc32c does not match its content")
    return doc


def running_checkpoint_job(directory: str | os.PathLike[str]) -> str | None:
    """The job id the running checkpoint in ``directory`` is stamped with (None: written without one).

    Raises:
        CorruptCheckpointError: no manifest there, or a corrupt one (names it).
    """
    job = _read_manifest(Path(directory)).get("job")
    return job if isinstance(job, str) else None


def load_running_checkpoint(
    directory: str | os.PathLike[str], template: Mapping[str, torch.Tensor], newer_than: int = -1
) -> tuple[dict[str, torch.Tensor], dict[str, TensorAge]]:
    """The template's tensors with every block the running checkpoint in ``directory`` holds filled in.

    Blocks never saved keep the template's values (load the last global checkpoint into it first),
    and so do blocks saved at an iteration ``newer_than`` or older (the global checkpoint loaded into
    the template is as new as they are, or newer).
    Tensors of the checkpoint that the template lacks are not read. Returns new tensors (on the
    template's devices) and each one's :class:`TensorAge`.

    Raises:
        CorruptCheckpointError: the manifest or a block file is missing, truncated or corrupt (names it).
        RunningCheckpointError: a template tensor is absent from the checkpoint or of another size/dtype.
    """
    directory = Path(directory)
    doc = _read_manifest(directory)
    block = int(doc["block_elements"])
    flats: dict[str, torch.Tensor] = {}
    ages: dict[str, TensorAge] = {}
    reads: dict[str, list[tuple[int, int, int, str, int]]] = {}  # file -> (offset, size, crc, tensor, block)
    for name, t in template.items():
        meta = doc["tensors"].get(name)
        if meta is None:
            raise RunningCheckpointError(
                f"template tensor {name!r} is not in the running checkpoint {directory / MANIFEST} "
                f"(it holds {sorted(doc['tensors'])})"
            )
        numel = math.prod(meta["shape"])
        if t.numel() != numel or str(t.dtype) != meta["dtype"]:
            raise RunningCheckpointError(
                f"template tensor {name!r} is {str(t.dtype)} with {t.numel()} elements; the running checkpoint "
                f"{directory / MANIFEST} saved it as {meta['dtype']} with {numel}: load the matching state first"
            )
        flats[name] = t.detach().to("cpu").clone(memory_format=torch.contiguous_format).view(-1)
        entries = doc["blocks"][name]
        if len(entries) != nblocks(numel, block):
            raise CorruptCheckpointError(
                f"{directory / MANIFEST} is corrupt: {len(entries)} block entries for {name!r}"
            )
        saved = [(b, e) for b, e in enumerate(entries) if e is not None and e[0] > newer_than]
        for b, (_, file, offset, size, crc) in saved:
            if Path(file).name != file or size != (min(numel, (b + 1) * block) - b * block) * t.element_size():
                raise CorruptCheckpointError(f"{directory / MANIFEST} is corrupt: {name!r} block {b} entry {file!r}")
            reads.setdefault(file, []).append((offset, size, crc, name, b))
        its = [e[0] for _, e in saved]
        ages[name] = TensorAge(min(its, default=None), max(its, default=None), len(saved), nblocks(numel, block))
    for file, items in reads.items():
        _read_blocks(directory / file, sorted(items), flats, block)
    out = {name: flats[name].view(t.shape).to(t.device) for name, t in template.items()}
    return out, ages


def _read_blocks(
    path: Path, items: Sequence[tuple[int, int, int, str, int]], flats: Mapping[str, torch.Tensor], block: int
) -> None:
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        _, _, _, name, b = items[0]
        raise CorruptCheckpointError(
            f"{path} is missing; the manifest names it for {len(items)} block(s) ({name!r} block {b}, ...)"
        ) from None
    with f:
        for offset, size, crc, name, b in items:
            f.seek(offset)
            data = bytearray(f.read(size))
            if len(data) != size:
                raise CorruptCheckpointError(
                    f"{path} is truncated: {name!r} block {b} needs bytes [{offset}, {offset + size}), "
                    f"the file has {path.stat().st_size}"
                )
            if block_crc(data) != crc:
                raise CorruptCheckpointError(f"{path} is corrupt: {name!r} block {b} fails its crc32c")
            flat = flats[name]
            start = b * block
            dest = flat[start : start + size // flat.element_size()]
            dest.view(torch.uint8).copy_(torch.frombuffer(data, dtype=torch.uint8))
