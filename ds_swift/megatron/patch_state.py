"""Where a Megatron-DeepSpeed checkout stands with ds-swift's patch series, found without changing it.

Every probe runs on a scratch copy of the files the series touches, so ``--check`` leaves the
checkout as it was even when it is half applied (reverse-applying patches in place to find out, as
the first version did, left a half-applied checkout changed when a probe failed midway). Every
``git`` call's exit code is the answer or an error; none is ignored. ``git`` is always run with
``GIT_CEILING_DIRECTORIES`` at the folder's parent: a checkout that is a folder inside another
repository would otherwise have ``git apply`` skip every file and exit 0 ("applied", with nothing
changed).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "EXIT_CODES",
    "HunkState",
    "MegatronPatchError",
    "PatchFile",
    "SeriesState",
    "git",
    "series_state",
    "split_hunks",
    "touched_files",
]

GIT_TIMEOUT_S = 120.0
_HUNK_HEADER = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")

#: ``ds-swift megatron-patch --check``'s exit code per state (2: could not tell, e.g. not a folder)
EXIT_CODES = {"applied": 0, "applies": 1, "half applied": 3, "does not apply": 4}


@dataclass(frozen=True)
class PatchFile:
    """One patch of the series and the commit its header names."""

    path: Path
    commit: str

    @property
    def name(self) -> str:
        return self.path.name


class MegatronPatchError(RuntimeError):
    """One line that says what does not fit and what the series was made for."""


def git(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``git argv`` in ``cwd``, never in a repository that merely contains ``cwd``; the caller
    checks the exit code (for ``apply --check`` it is the answer)."""
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(cwd.resolve().parent), "LC_ALL": "C"}
    try:
        return subprocess.run(["git", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
    except FileNotFoundError:
        raise MegatronPatchError("git is not installed: the series is applied with git apply") from None
    except subprocess.TimeoutExpired:
        raise MegatronPatchError(f"git {' '.join(argv)} in {cwd} did not finish in {GIT_TIMEOUT_S:g} s") from None


def touched_files(patches: Sequence[PatchFile]) -> list[str]:
    """The paths the series reads or writes, relative to the checkout."""
    out: list[str] = []
    for patch in patches:
        for line in patch.path.read_text().splitlines():
            for prefix in ("--- a/", "+++ b/"):
                if line.startswith(prefix) and line[len(prefix) :] not in out:
                    out.append(line[len(prefix) :])
    return out


@dataclass(frozen=True)
class Hunk:
    patch: str
    file: str
    header: str
    text: str
    """a patch of this one hunk: its file's diff header and the hunk"""


def split_hunks(patch: PatchFile) -> list[Hunk]:
    """Each hunk of ``patch`` as a patch of its own (hunk bodies read by the counts in their header)."""
    lines = patch.path.read_text().splitlines(keepends=True)
    hunks: list[Hunk] = []
    i, file_header, file = 0, "", ""
    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git "):
            file_header, file = line, ""
        elif line.startswith("+++ b/"):
            file_header, file = file_header + line, line[6:].strip()
        elif not line.startswith("@@") and file_header and not file:
            file_header += line  # index, mode and '---' lines
        m = _HUNK_HEADER.match(line)
        if m and file:
            old = int(m.group(1)) if m.group(1) is not None else 1
            new = int(m.group(2)) if m.group(2) is not None else 1
            j = i + 1
            while j < len(lines) and (old > 0 or new > 0 or lines[j].startswith("\\")):
                mark = lines[j][:1]
                old -= mark in (" ", "-", "\n")
                new -= mark in (" ", "+", "\n")
                j += 1
            hunks.append(Hunk(patch.name, file, line.strip(), file_header + "".join(lines[i:j])))
            i = j
            continue
        i += 1
    return hunks


@dataclass(frozen=True)
class HunkState:
    patch: str
    file: str
    header: str
    state: str
    """``applied``, ``not applied`` (it applies) or ``conflicts`` (neither way round)"""


@dataclass(frozen=True)
class SeriesState:
    """``applies`` (nothing applied, all of it applies), ``applied``, ``half applied`` or
    ``does not apply`` (nothing applied, some hunk conflicts: another commit)."""

    state: str
    applied: tuple[str, ...] = ()
    """the patches in place, when they are the first ones of the series"""
    missing: tuple[str, ...] = ()
    failure: tuple[str, str] | None = None
    """(patch, git's error) of the first patch that does not apply in order"""
    hunks: tuple[HunkState, ...] = field(default=())
    """hunk by hunk, when the applied part is not the first patches of the series"""

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.state]


class _Scratch:
    """Fresh copies of the checkout's touched files, where patches may be applied and reversed."""

    def __init__(self, checkout: Path, files: Sequence[str], root: Path) -> None:
        self.checkout, self.files, self.root, self.count = checkout, files, root, 0

    def fresh(self) -> Path:
        self.count += 1
        copy = self.root / f"copy{self.count}"
        copy.mkdir()
        for rel in self.files:
            src = self.checkout / rel
            if src.is_file():
                (copy / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, copy / rel)
        return copy

    def in_order(self, patches: Sequence[PatchFile], *, reverse: bool = False) -> tuple[str, str] | None:
        """Apply (or reverse) ``patches`` one after the other on a fresh copy: None, or the first
        (patch, git error) that fails."""
        copy = self.fresh()
        for patch in patches:
            done = git(copy, "apply", *(["-R"] if reverse else []), str(patch.path))
            if done.returncode != 0:
                return patch.name, done.stderr
        return None


def _hunk_states(scratch: _Scratch, series: Sequence[PatchFile]) -> list[HunkState]:
    """Hunk by hunk. Later hunks change the context of earlier ones (0004 edits next to 0002), so
    on one copy: backwards, each hunk in place is taken out (the earlier ones then meet the context
    they were made against); then forwards, each is put back, or applied if it was not in place,
    so that later hunks meet what they were made on top of."""
    copy = scratch.fresh()
    with tempfile.TemporaryDirectory(prefix="hunk-") as tmp:
        hunks = [h for patch in series for h in split_hunks(patch)]
        paths = [Path(tmp) / f"{n}.patch" for n in range(len(hunks))]
        for hunk, path in zip(hunks, paths):
            path.write_text(hunk.text)
        in_place = [False] * len(hunks)
        for n in reversed(range(len(hunks))):
            in_place[n] = git(copy, "apply", "-R", str(paths[n])).returncode == 0
        states = []
        for n, (hunk, path) in enumerate(zip(hunks, paths)):
            done = git(copy, "apply", str(path))
            if in_place[n] and done.returncode != 0:
                raise MegatronPatchError(
                    f"cannot tell hunk by hunk: {hunk.patch} {hunk.file} {hunk.header} was in place, "
                    f"but does not go back after the later ones were taken out: {done.stderr.strip()}"
                )
            state = "applied" if in_place[n] else "not applied" if done.returncode == 0 else "conflicts"
            states.append(HunkState(hunk.patch, hunk.file, hunk.header, state))
    return states


def series_state(checkout: Path, series: Sequence[PatchFile]) -> SeriesState:
    """Where ``checkout`` stands with ``series``; the checkout is only read."""
    if not checkout.is_dir():
        raise MegatronPatchError(f"{checkout} is not a folder")
    names = tuple(p.name for p in series)
    with tempfile.TemporaryDirectory(prefix="ds-swift-megatron-patch-") as tmp:
        scratch = _Scratch(checkout, touched_files(series), Path(tmp))
        failure = scratch.in_order(series)
        if failure is None:
            return SeriesState("applies", missing=names)
        for k in range(len(series), 0, -1):  # the first k patches in place, the rest applying on top
            if scratch.in_order(list(reversed(series[:k])), reverse=True) is None and (
                k == len(series) or scratch.in_order(series[k:]) is None
            ):
                state = "applied" if k == len(series) else "half applied"
                return SeriesState(state, applied=names[:k], missing=names[k:])
        hunks = tuple(_hunk_states(scratch, series))
    if any(h.state == "applied" for h in hunks):
        return SeriesState("half applied", failure=failure, hunks=hunks)
    return SeriesState("does not apply", missing=names, failure=failure, hunks=hunks)
