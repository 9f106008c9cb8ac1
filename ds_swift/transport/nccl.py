"""torch's NCCL settings and the NCCL/torch versions under which ds-swift recovers in-process.

Every decision here rests on torch's ``ProcessGroupNCCL`` (torch/csrc/distributed/c10d/
ProcessGroupNCCL.cpp and .hpp, read at torch 2.13) and on what the NCCL, torch and
nvidia-resiliency-ext projects published; docs/gpu.md cites each source. What a survivor needs of
torch is that it never ends the process on its own after a failure, and that every abort reaches
the communicators, those still being created included. So, under ``ds-swift-launch`` (the
launcher sets them in every worker's environment, and :func:`nccl_environment` again before each
world is created; torch reads them when a ``ProcessGroupNCCL`` is constructed):

- ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (CleanUpOnly): on a collective's error or timeout torch's
  watchdog aborts the communicators and keeps the process (``Watchdog::runLoop``: abortComms under
  ``SHOULD_CLEAN_UP``, ``WorkNCCL::handleException`` rethrows only under ``SHOULD_TEAR_DOWN``). 1 and
  3 end the process at the first error, which after a failure is every survivor. 0 (only ds-swift
  aborts) is accepted too.
- ``TORCH_NCCL_RETHROW_CUDA_ERRORS=0``: otherwise a CUDA error met by the watchdog's own event query
  (sticky, e.g. an aborted kernel's) is rethrown on its thread, which ends the process
  (pytorch/pytorch#126544; the switch is #126587).
- ``TORCH_NCCL_ENABLE_MONITORING=0``: torch's heartbeat monitor ends the process after a dump
  signal (any rank's watchdog saw a collective fail or time out) or when its watchdog is stuck
  (``HeartbeatMonitor::runLoop`` -> ``terminateProcess``), whatever the error handling says
  (pytorch/pytorch#155916). ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` then only times a log line:
  any value is accepted.
- ``TORCH_NCCL_USE_COMM_NONBLOCKING=1``: communicators are created in NCCL's non-blocking mode,
  so an abort from the watchdog thread reaches one still being created (``ProcessGroupNCCL::
  useNonblocking``; blocking creation holds the thread in NCCL's bootstrap until every peer
  arrives). ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` (torch's default: 30 minutes) is set to the join
  timeout, the longest a rank waits for its generation's peers anyway.
- ``TORCH_NCCL_BLOCKING_WAIT`` stays as the user has it: either way no step is applied from an
  aborted collective (the step guard, ds_swift.patches.step_guard); without it the pipeline keeps
  its overlap.

Pure decisions (:func:`environment_problems`, :func:`version_problems`) are tested with plain
dicts and version tuples; the effects (:func:`nccl_environment`, :func:`check_nccl_versions`) read
``os.environ`` and the loaded torch/NCCL.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

__all__ = [
    "ASYNC_ERROR_HANDLING",
    "NCCL_FLOOR",
    "NCCL_REFUSED",
    "NONBLOCKING_TIMEOUT",
    "SETTINGS",
    "TORCH_FLOOR",
    "NcclSettingError",
    "Setting",
    "check_nccl_versions",
    "environment_problems",
    "nccl_environment",
    "nccl_version_tuple",
    "version_problems",
]

ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NONBLOCKING_TIMEOUT = "TORCH_NCCL_NONBLOCKING_TIMEOUT"
_TRUE = ("1", "true", "yes", "on", "y")
_FALSE = ("0", "false", "no", "off", "n")


class NcclSettingError(ValueError):
    """A torch NCCL setting, or the NCCL/torch version, under which survivors cannot recover."""


@dataclass(frozen=True)
class Setting:
    """One environment variable torch's ``ProcessGroupNCCL`` reads, as ds-swift needs it."""

    name: str
    value: str
    """What ds-swift sets where the user left it unset."""
    safe: tuple[str, ...]
    """The user values accepted (compared lower-cased, stripped)."""
    harm: str
    """What any other value does to the survivors of a failure (the refusal says it)."""
    aliases: tuple[str, ...] = ()
    """Older names torch reads for the same setting (checked too; ds-swift sets only ``name``)."""


SETTINGS: tuple[Setting, ...] = (
    Setting(
        ASYNC_ERROR_HANDLING,
        "2",
        ("0", "2"),
        "makes torch's watchdog end the process at the first NCCL error or timeout it sees, which after a failure is "
        "every survivor (ds-swift's own abort of the failed generation counts as one)",
        ("NCCL_ASYNC_ERROR_HANDLING",),
    ),
    Setting(
        "TORCH_NCCL_RETHROW_CUDA_ERRORS",
        "0",
        _FALSE,
        "makes torch's watchdog rethrow a CUDA error it meets on its own thread (an aborted kernel's sticky error), "
        "which ends the process (pytorch/pytorch#126544)",
    ),
    Setting(
        "TORCH_NCCL_ENABLE_MONITORING",
        "0",
        _FALSE,
        "lets torch's heartbeat monitor end the process once any rank's watchdog saw a collective fail or time out, "
        "or while its watchdog waits in an abort, whatever TORCH_NCCL_ASYNC_ERROR_HANDLING says "
        "(pytorch/pytorch#155916); ds-swift's watchdog bounds those waits itself",
    ),
    Setting(
        "TORCH_NCCL_USE_COMM_NONBLOCKING",
        "1",
        _TRUE,
        "makes NCCL create communicators in blocking mode, which no abort reaches: a peer lost while a generation "
        "creates its communicators would leave every survivor waiting in NCCL's bootstrap",
    ),
)

#: NCCL releases below this are refused (see :func:`version_problems`).
NCCL_FLOOR = (2, 27, 0)
#: NCCL releases refused whatever the floor: (first, last), inclusive.
NCCL_REFUSED = (((2, 28, 3), (2, 28, 8)),)
#: torch releases below this are refused on an NCCL world.
TORCH_FLOOR = (2, 8)


def _fix(s: Setting) -> str:
    return f"unset it (ds-swift then sets {s.value}) or set it to {' or '.join(s.safe[:2])}"


def environment_problems(environ: Mapping[str, str]) -> list[str]:
    """Each torch NCCL setting in ``environ`` under which a survivor cannot recover in-process: one
    line per variable, naming it, what it does to survivors and the fix (empty: none)."""
    out = []
    for s in SETTINGS:
        for name in (s.name, *s.aliases):
            value = environ.get(name)
            if value is not None and value.strip().lower() not in s.safe:
                out.append(f"{name}={value} {s.harm}; {_fix(s)}")
    return out


def nccl_environment(
    environ: MutableMapping[str, str] | None = None, nonblocking_timeout_s: float | None = None
) -> None:
    """Before a world with NCCL is created: refuse the settings that would end (or strand) survivors
    (:class:`NcclSettingError` naming every such variable), then set ds-swift's where unset.

    ``nonblocking_timeout_s``: torch's bound on waiting for a non-blocking communicator to finish its
    creation (``TORCH_NCCL_NONBLOCKING_TIMEOUT``, whole seconds; the join timeout), where unset."""
    env = os.environ if environ is None else environ
    problems = environment_problems(env)
    if problems:
        raise NcclSettingError("; ".join(problems))
    for s in SETTINGS:
        env.setdefault(s.name, s.value)
    if nonblocking_timeout_s is not None:
        env.setdefault(NONBLOCKING_TIMEOUT, str(max(1, round(nonblocking_timeout_s))))


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split("+")[0].split("."):
        digits = "".join(c for c in p if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _dotted(v: Sequence[int]) -> str:
    return ".".join(str(x) for x in v)


def version_problems(torch_version: str, nccl: Sequence[int] | None) -> list[str]:
    """Why this torch and NCCL (``torch.cuda.nccl.version()``; None: not loaded) cannot recover an
    NCCL world in-process: one line each, with the floor (empty: they can).

    - NCCL below :data:`NCCL_FLOOR`: several communicators aborted in one NCCL group call need
      NCCL >= 2.22 (torch's fix for pytorch/pytorch#119797, #150690, says 2.21 had no group
      abort), and NCCL 2.26's non-blocking mode, which ds-swift turns on, hangs at random
      (pytorch/pytorch#153960; torch 2.7.1 stopped choosing it by itself, #154055);
    - NCCL 2.28.3-2.28.8: nvidia-resiliency-ext tells its in-process restart users to avoid them
      (its README's platform table: "< 2.28.3 OR >= 2.28.9");
    - torch below :data:`TORCH_FLOOR`: torch aborts a process group's own communicators (its
      point-to-point pairs) in one group call from 2.8 on (#150690); before, one by one, which can
      hang (#119797)."""
    out = []
    t = _version(torch_version)
    if t[:2] < TORCH_FLOOR:
        out.append(
            f"torch {torch_version} aborts a process group's point-to-point NCCL communicators one by one, which can "
            f"hang (pytorch/pytorch#119797, fixed in torch {_dotted(TORCH_FLOOR)}); use torch >= {_dotted(TORCH_FLOOR)}"
        )
    if nccl is None:
        return out
    v = tuple(nccl)
    floor = (
        f"use NCCL >= {_dotted(NCCL_FLOOR)}, not {' nor '.join(f'{_dotted(a)}-{_dotted(b)}' for a, b in NCCL_REFUSED)}"
    )
    if v < NCCL_FLOOR:
        out.append(
            f"NCCL {_dotted(v)} cannot be aborted safely by ds-swift (group abort needs 2.22, and 2.26's non-blocking "
            f"communicators hang at random, pytorch/pytorch#153960); {floor}"
        )
    for first, last in NCCL_REFUSED:
        if first <= v <= last:
            out.append(
                f"NCCL {_dotted(v)} is in {_dotted(first)}-{_dotted(last)}, which nvidia-resiliency-ext tells its "
                f"in-process restart users to avoid; {floor}"
            )
    return out


def nccl_version_tuple(version: int | Sequence[int]) -> tuple[int, ...]:
    """``torch.cuda.nccl.version()`` as a tuple: recent torch returns one, older torch NCCL's
    integer code (``major * 10000 + minor * 100 + patch`` from NCCL 2.9 on)."""
    if isinstance(version, int):
        return (version // 10000, version // 100 % 100, version % 100)
    return tuple(int(x) for x in version)


def check_nccl_versions() -> None:
    """Raise :class:`NcclSettingError` where the loaded torch and NCCL cannot recover an NCCL world."""
    import torch

    nccl = nccl_version_tuple(torch.cuda.nccl.version()) if torch.cuda.is_available() else None
    problems = version_problems(torch.__version__, nccl)
    if problems:
        raise NcclSettingError("; ".join(problems))
