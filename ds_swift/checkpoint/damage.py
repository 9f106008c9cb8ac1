"""What is wrong with a checkpoint a load failed on, in one line naming the file and the way out.

DeepSpeed's ``load_checkpoint`` fails on a truncated or corrupt file with torch's
``PytorchStreamReader failed reading zip archive``: no file, no tag, no checkpoint to fall back to.
:func:`load_failure_note` reads the tag's files again as the zip archives ``torch.save`` writes
(every member's CRC: the whole checkpoint is read once, only on this error path) and names the first
that does not read whole, with the checkpoints beside it that ds-swift's marker calls complete.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ds_swift.checkpoint.trust import complete_checkpoints

__all__ = ["damaged_file", "load_failure_note", "named_on_failure"]


def damaged_file(tag_dir: str | os.PathLike[str]) -> tuple[Path, str] | None:
    """The first ``*.pt`` file of ``tag_dir`` that is not a whole zip archive, and why (None: all are)."""
    for path in sorted(Path(tag_dir).glob("*.pt")):
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            return path, f"{type(exc).__name__}: {exc}"
        if bad is not None:
            return path, f"member {bad} fails its CRC"
    return None


def load_failure_note(load_dir: str | os.PathLike[str], tag: str | None = None) -> str:
    """A note for the exception a load of ``tag`` (None: the one ``latest`` names) in ``load_dir`` raised."""
    root = Path(load_dir)
    if tag is None:
        try:
            tag = (root / "latest").read_text().strip()
        except OSError:
            return f"ds-swift: the checkpoint in {root} could not be loaded, and its 'latest' file cannot be read"
    tag_dir = root / tag
    found = damaged_file(tag_dir)
    what = (
        f"{found[0]} is truncated or corrupt ({found[1]})"
        if found is not None
        else f"every *.pt file of {tag_dir} reads as a whole archive (the error is in their contents)"
    )
    others = [t for _, t in complete_checkpoints(root) if t != tag]
    way_out = (
        f"complete checkpoints beside it: {', '.join(others)}; load one of them (its name in {root / 'latest'}, "
        "or load_checkpoint(tag=...))"
        if others
        else "no other complete checkpoint is there: start without loading, or restore the file"
    )
    return f"ds-swift: loading checkpoint {tag} from {root} failed: {what}; {way_out}"


@contextmanager
def named_on_failure(load_dir: str | os.PathLike[str], tag: str | None = None) -> Iterator[None]:
    """Around a load of ``tag`` from ``load_dir``: an exception it raises carries
    :func:`load_failure_note`."""
    try:
        yield
    except Exception as exc:
        exc.add_note(load_failure_note(load_dir, tag))
        raise
