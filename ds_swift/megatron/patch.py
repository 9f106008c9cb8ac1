"""`ds-swift megatron-patch PATH`: apply ds-swift's patch series to a Megatron-DeepSpeed checkout.

The series (``patches/megatron_deepspeed/*.patch``) is made against one commit of
deepspeedai/Megatron-DeepSpeed, named in every patch's ``Megatron-DeepSpeed-Commit:`` header.
The command checks the checkout's commit, finds where the checkout stands with the series on a
scratch copy (:mod:`.megatron_patch_state`), applies the whole series with one ``git apply`` (all of
it or nothing: a patch that does not apply leaves the checkout as it was, and the error names the
patch, the hunk and the commit the series was made for), checks that it is then applied, and prints
how to train a tiny GPT on CPU under ``ds-swift-launch`` with a machine killed mid-backward.
``--check`` only reports: applies, applied, half applied (which patches or hunks) or does not apply.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import ds_swift
from ds_swift.megatron.cpu import launch_command
from ds_swift.megatron.patch_state import (
    EXIT_CODES,
    MegatronPatchError,
    PatchFile,
    SeriesState,
    git,
    series_state,
    touched_files,
)

__all__ = [
    "MegatronPatchError",
    "PatchFile",
    "apply_series",
    "check_report",
    "launch_command",
    "load_series",
    "register",
]


def _series_dir() -> Path:
    # ds_swift.patches is the repository's patches/ (setup.py package_dir); found without importing it.
    spec = importlib.util.find_spec("ds_swift.patches")
    origin = spec.origin if spec is not None else None
    base = Path(origin).parent if origin else Path(ds_swift.__file__).resolve().parents[1] / "patches"
    return base / "megatron_deepspeed"


SERIES_DIR = _series_dir()
REPOSITORY = "deepspeedai/Megatron-DeepSpeed"
_COMMIT_HEADER = re.compile(r"^Megatron-DeepSpeed-Commit: ([0-9a-f]{40})$", re.MULTILINE)
_FAILED_AT = re.compile(r"patch failed: (\S+):(\d+)")
_HUNK = re.compile(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@.*$")


def load_series(series_dir: Path = SERIES_DIR) -> list[PatchFile]:
    """The series in order; every patch must name the same commit."""
    patches = []
    for path in sorted(series_dir.glob("*.patch")):
        found = _COMMIT_HEADER.findall(path.read_text())
        if len(found) != 1:
            raise MegatronPatchError(f"{path.name}: needs exactly one 'Megatron-DeepSpeed-Commit: <sha>' header line")
        patches.append(PatchFile(path, found[0]))
    if not patches:
        raise MegatronPatchError(f"no *.patch files in {series_dir}")
    commits = {p.commit for p in patches}
    if len(commits) != 1:
        raise MegatronPatchError(f"the series names several commits: {sorted(commits)}")
    return patches


def checkout_commit(checkout: Path) -> str | None:
    """The checkout's HEAD; None if ``checkout`` is not a git checkout of its own."""
    done = git(checkout, "rev-parse", "HEAD")
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


def failed_hunk(patch: Path, git_stderr: str) -> str:
    """The hunk ``git apply`` reports as failing (``patch failed: FILE:LINE``), as its header line."""
    m = _FAILED_AT.search(git_stderr)
    if m is None:
        lines = [ln.removeprefix("error: ") for ln in git_stderr.strip().splitlines()]
        return lines[-1] if lines else "git apply failed"
    target, line = m.group(1), int(m.group(2))
    current = None
    for text in patch.read_text().splitlines():
        if text.startswith("+++ b/"):
            current = text.removeprefix("+++ b/")
        hunk = _HUNK.match(text)
        if hunk and current == target and int(hunk.group(1)) == line:
            return f"hunk '{text.strip()}' of {target}"
    return f"{target} at line {line}"


def _refuse_commit(checkout: Path, head: str | None, pinned: str) -> None:
    if head is None:
        raise MegatronPatchError(
            f"{checkout} is not a git checkout of {REPOSITORY} (no .git of its own); clone it and run "
            f"'git -C {checkout} checkout {pinned}' (or pass --force to patch this folder as it is)"
        )
    raise MegatronPatchError(
        f"{checkout} is at commit {head[:12]}, the patch series is made for {REPOSITORY} commit {pinned}: "
        f"run 'git -C {checkout} checkout {pinned}' (or pass --force)"
    )


def apply_series(checkout: Path, series: list[PatchFile] | None = None, *, force: bool = False) -> str:
    """Apply the series to ``checkout``; returns what was done. Raises MegatronPatchError."""
    series = series if series is not None else load_series()
    pinned = series[0].commit
    head = checkout_commit(checkout)
    if head != pinned and not force:
        _refuse_commit(checkout, head, pinned)
    state = series_state(checkout, series)
    if state.state == "applied":
        return f"already applied: the {len(series)} patches of {REPOSITORY} commit {pinned[:12]}"
    if state.state == "half applied":
        raise MegatronPatchError(
            f"{checkout} is half applied ({_half_summary(state)}): nothing changed; "
            f"'ds-swift megatron-patch --check {checkout}' lists every hunk; restore the files the series "
            f"touches (git -C {checkout} checkout -- {' '.join(touched_files(series))}) and run again"
        )
    if state.failure is not None:  # does not apply
        name, stderr = state.failure
        patch = next(p for p in series if p.name == name)
        raise MegatronPatchError(
            f"{name} does not apply to {checkout}: {failed_hunk(patch.path, stderr)}; "
            f"the series is made for {REPOSITORY} commit {pinned}"
        )
    with tempfile.TemporaryDirectory(prefix="ds-swift-megatron-patch-") as tmp:
        whole = Path(tmp) / "series.patch"  # one git apply: all of the series or none of it
        whole.write_text("".join(p.path.read_text() for p in series))
        done = git(checkout, "apply", str(whole))
    if done.returncode != 0:
        raise MegatronPatchError(f"git apply of the series failed in {checkout}: {_one_line(done.stderr)}")
    after = series_state(checkout, series)
    if after.state != "applied":
        raise MegatronPatchError(
            f"git apply exited 0 but {checkout} is now {after.state}: see 'ds-swift megatron-patch --check {checkout}'"
        )
    return f"applied {len(series)} patches to {checkout} ({REPOSITORY} commit {pinned[:12]})"


def _one_line(text: str) -> str:
    return "; ".join(ln.strip() for ln in text.strip().splitlines()) or "no message"


def _half_summary(state: SeriesState) -> str:
    if state.applied:
        return f"{', '.join(state.applied)} applied; {', '.join(state.missing)} not"
    patches = dict.fromkeys(h.patch for h in state.hunks)
    parts = []
    for name in patches:
        kinds = {h.state for h in state.hunks if h.patch == name}
        parts.append(f"{name} {kinds.pop() if len(kinds) == 1 else 'partly applied'}")
    return "; ".join(parts)


def check_report(checkout: Path, series: list[PatchFile] | None = None) -> tuple[int, list[str]]:
    """``--check``: (exit code, lines) saying where ``checkout`` stands; the checkout is only read."""
    series = series if series is not None else load_series()
    pinned = series[0].commit
    state = series_state(checkout, series)
    n = len(series)
    lines = {
        "applies": [
            f"{checkout}: applies: none of the {n} patches is applied and all of them apply "
            f"(ds-swift megatron-patch {checkout} applies them)"
        ],
        "applied": [f"{checkout}: applied: all {n} patches are in place"],
        "half applied": [f"{checkout}: half applied: {_half_summary(state)}"],
        "does not apply": [
            f"{checkout}: does not apply: {state.failure[0] if state.failure else 'a patch'} "
            "conflicts with the checkout"
        ],
    }[state.state]
    if state.hunks:
        lines += [f"  {h.patch} {h.file} {h.header}: {h.state}" for h in state.hunks]
    head = checkout_commit(checkout)
    if head != pinned:
        at = f"at commit {head[:12]}" if head else "not a git checkout of its own"
        lines.append(f"  ({checkout} is {at}; the series is made for {REPOSITORY} commit {pinned})")
    return state.exit_code, lines


def _run(args: argparse.Namespace) -> int:
    checkout = Path(args.checkout).resolve()
    if args.check:
        try:
            code, lines = check_report(checkout)
        except MegatronPatchError as exc:
            print(f"ds-swift megatron-patch: error: {exc}", file=sys.stderr)
            return 2
        print("\n".join(lines))
        return code
    try:
        print(apply_series(checkout, force=args.force))
    except MegatronPatchError as exc:
        print(f"ds-swift megatron-patch: error: {exc}", file=sys.stderr)
        return 2
    work = Path(args.work).resolve()
    script = "scripts/megatron_deepspeed_cpu.sh"  # in the ds-swift repository
    print("\nA tiny GPT on CPU (gloo), a machine killed mid-backward and recovered, bitwise against the")
    print(f"failure-free run (data, config, both runs, the comparison):\n  bash {script} {checkout} {work}")
    print(f"(options: bash {script} --help: the shape, precision, ZeRO stage, strategy and the kill)")
    print("\nor by hand, once the data and config are in place (run from the checkout, LOCAL_SIZE=1):")
    print("  cd " + shlex.quote(str(checkout)) + " && LOCAL_SIZE=1 " + shlex.join(launch_command(checkout, work)))
    return 0


def register(subparsers: Any) -> None:
    codes = ", ".join(f"{code} {state}" for state, code in sorted(EXIT_CODES.items(), key=lambda kv: kv[1]))
    p = subparsers.add_parser(
        "megatron-patch",
        help="apply ds-swift's patch series to a deepspeedai/Megatron-DeepSpeed checkout",
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog=f"--check exit codes: {codes}, 2 could not tell (the error says why). Without --check: 0 applied "
        "(or already applied), 2 not applied (the checkout is left as it was).",
    )
    p.add_argument("checkout", metavar="PATH_TO_CHECKOUT", help="a git checkout of deepspeedai/Megatron-DeepSpeed")
    p.add_argument("--work", default="megatron-swift-run", help="directory for the tiny GPT's data and runs")
    p.add_argument(
        "--force",
        action="store_true",
        help="apply to a checkout of another commit (or a folder with no .git of its own) anyway",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="only report, changing nothing, whether the series applies, is applied or is half applied "
        "(which patches or hunks)",
    )
    p.set_defaults(func=_run)
