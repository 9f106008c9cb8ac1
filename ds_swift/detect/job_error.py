"""Whose error is it: the job's own, or its machine's? (issue 52)

A Python exception a rank raises that is not a communication error is, as a rule, the job's own:
a bug, a configuration the job cannot run, data it cannot read. Replacing the machine would only
meet it again, on a spare, with the job's spares spent and the real error buried under "no
replacement". Such an error ends the job at once, with that exception as its last line. The one
exception to the rule is told apart like this:

- **the machine's fault**: an error of the device itself (:func:`is_device_error`: a CUDA error
  other than a device-side assert or an out-of-memory, an uncorrectable ECC error), raised after the
  generation's first step (the job has run on this machine, so neither its code nor its config
  is at fault), on one machine alone. Its node agent fails the machine (a spare takes over, counted
  against ``--max-failures``), and the peers recover as from a crash;
- **the job's own**: every other error, and a device error raised before the generation's first
  step (a job that never stepped here cannot tell a bad device from a setting every machine
  shares), or on ranks of more than one machine (two machines do not break alike: their agents
  compare the errors' signatures in the store, :func:`signature`, so a replacement that meets the
  error its predecessor raised ends the job too).

Each rank records its error in the job store before it exits (:func:`record_job_error`: by the
runtime's classification, or, for an error raised outside ds-swift's calls, by the interpreter's
last hook, :func:`ds_swift.detect.classify.record_uncaught`); its node agent reads it when the rank
exits (``launch/agent_failures.py``). The first error of the job's own in a generation also goes in
:func:`job_error_key`: a peer failing on the connection it closes raises it too, and the peer's
agent, finding it there, takes that rank's exit for the same error rather than a machine failure.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ds_swift.jobstore.membership import JobStore

__all__ = [
    "JobErrorRecord",
    "is_device_error",
    "job_error",
    "job_error_key",
    "rank_error_key",
    "record_job_error",
    "signature",
]

#: The device's own failures (its memory, its driver), not the program's: a device-side assert is an
#: index out of range in the job's code, and an out-of-memory its batch size.
_DEVICE = re.compile(
    r"CUDA error: (?!device-side assert triggered|out of memory)|uncorrectable ECC error|"
    r"CUBLAS_STATUS_EXECUTION_FAILED|CUDNN_STATUS_EXECUTION_FAILED"
)


def job_error_key(generation: int) -> str:
    """Job-store key a rank sets to ``"rank <r>: <error>"`` before raising the job's own error in
    ``generation``: its peers, failing on the connection it closes, raise rather than recover."""
    return f"gen{generation}/job_error"


def rank_error_key(rank: int) -> str:
    """Job-store key of the error ``rank`` raised (any generation; a :class:`JobErrorRecord`): its
    node agent reads it when the rank exits."""
    return f"job_error/rank{rank}"


def job_error(store: JobStore, generation: int) -> str | None:
    """The job's own error a rank of ``generation`` raised (see :func:`job_error_key`), or None."""
    return store.get(job_error_key(generation))


def is_device_error(exc: BaseException) -> bool:
    """An error of the device itself (see :data:`_DEVICE`), which a sound machine would not raise."""
    return isinstance(exc, RuntimeError) and _DEVICE.search(str(exc)) is not None


def signature(exc: BaseException) -> str:
    """What makes two ranks' errors the same one: its type and the first line of its message with
    numbers and addresses left out (ranks, devices and pointers differ between machines)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {re.sub(r'0x[0-9a-fA-F]+|[0-9]+', '#', first)[:300]}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class JobErrorRecord:
    """What a rank recorded of the error it raised (the value of :func:`rank_error_key`)."""

    what: str
    """``rank <r> raised <type>: <message>``: the line the job ends with."""
    sig: str = ""
    """:func:`signature` of the error."""
    device: bool = False
    """:func:`is_device_error`."""
    early: bool = True
    """Raised before this rank finished a step in its generation."""

    @property
    def machines_fault(self) -> bool:
        """A candidate for the machine's fault (still the job's if another machine raised the same)."""
        return self.device and not self.early

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def parse(cls, text: str) -> JobErrorRecord:
        """A stored record (a bare line, as written before records had fields: the job's own)."""
        try:
            doc: Any = json.loads(text)
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or not isinstance(doc.get("what"), str):
            return cls(text)
        return cls(doc["what"], str(doc.get("sig", "")), bool(doc.get("device")), bool(doc.get("early", True)))


def record_job_error(
    store: JobStore, generation: int, rank: int | None, exc: BaseException, *, early: bool = False
) -> JobErrorRecord:
    """Say in the store what error ``rank`` raised (see the module docstring); ``early``: before
    its first step in ``generation``. A device error after the first step is not the generation's
    job error: its peers recover from it as from the machine's crash, unless the agents find it on
    another machine too."""
    who = f"rank {rank}" if rank is not None else "a rank"
    record = JobErrorRecord(
        f"{who} raised {type(exc).__name__}: {str(exc)[:200]}", signature(exc), is_device_error(exc), early
    )
    try:
        if not record.machines_fault and store.get(job_error_key(generation)) is None:
            store.set(job_error_key(generation), record.what)  # the first one says what ended the generation
        if rank is not None:
            store.set(rank_error_key(rank), record.to_json())
    except Exception:  # noqa: BLE001 - the error itself is what the job must see, not the store's
        pass
    return record
