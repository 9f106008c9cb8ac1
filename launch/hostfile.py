"""Which hosts run agents: the DeepSpeed hostfile, ``--include``/``--exclude``, local or remote.

Same formats as the ``deepspeed`` launcher: ``hostname slots=N`` lines, and filters such as
``worker-0@worker-1:0,2`` (hosts joined by ``@``, optional ``:slot,slot`` GPU indices).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["HostEntry", "HostfileError", "check_host", "filter_resources", "is_local", "read_hostfile"]

#: a host name or IPv4 address: what ssh and pdsh take as a host and nothing else. A leading '-' would
#: be an ssh option (``-oProxyCommand=...`` runs a command here); '[', ',', '@', '^' mean host lists,
#: users or files to pdsh; shell characters would break out of the commands the hosts run.
_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}\Z")


class HostfileError(ValueError):
    """A bad hostfile or host filter; the message names the file and line or the flag."""


@dataclass(frozen=True)
class HostEntry:
    """One line of a DeepSpeed hostfile: ``hostname slots=N``."""

    host: str
    slots: int


def check_host(host: str, where: str) -> str:
    """``host`` if it is a plain host name or IPv4 address; else HostfileError naming ``where``."""
    if _HOST_NAME.match(host):
        return host
    if host.startswith("-"):
        why = "starts with '-', which ssh and pdsh would read as an option"
    elif ":" in host.strip("[]"):
        why = (
            "looks like an IPv6 address, which is not supported (':' separates GPU slots in --include); "
            "give the host a name in /etc/hosts or use its IPv4 address"
        )
    else:
        why = "is not a host name: only letters, digits, '.', '-' and '_' (not first) may appear in one"
    raise HostfileError(f"{where}: host {host!r} {why}")


def read_hostfile(path: str) -> tuple[HostEntry, ...]:
    """Read a DeepSpeed hostfile; blank lines and ``#`` comments are skipped."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as exc:
        raise HostfileError(f"--hostfile {path}: cannot read it: {exc.strerror}") from None
    hosts: list[HostEntry] = []
    for n, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots="):
            raise HostfileError(f"--hostfile {path}:{n}: {raw.strip()!r} is not 'hostname slots=N'")
        try:
            slots = int(parts[1].removeprefix("slots="))
        except ValueError:
            slots = -1
        if slots < 1:
            raise HostfileError(f"--hostfile {path}:{n}: slots must be a positive integer in {raw.strip()!r}")
        check_host(parts[0], f"--hostfile {path}:{n}")
        if any(h.host == parts[0] for h in hosts):
            raise HostfileError(f"--hostfile {path}:{n}: host {parts[0]} is listed twice")
        hosts.append(HostEntry(parts[0], slots))
    if not hosts:
        raise HostfileError(f"--hostfile {path}: no hosts in it")
    return tuple(hosts)


def is_local(host: str) -> bool:
    if host in ("localhost", "127.0.0.1", "::1") or host.startswith("127."):
        return True
    names = {socket.gethostname(), socket.getfqdn()}
    return host in names or host.split(".")[0] in {n.split(".")[0] for n in names}


def _parse_filter(text: str, flag: str) -> dict[str, list[int] | None]:
    out: dict[str, list[int] | None] = {}
    for part in filter(None, text.split("@")):
        host, colon, slots = part.partition(":")
        if not host:
            raise HostfileError(f"{flag} {text!r}: empty host name")
        if colon:
            try:
                out[host] = sorted({int(s) for s in slots.split(",")})
            except ValueError:
                raise HostfileError(f"{flag} {text!r}: slots of {host} must be integers, as in {host}:0,2") from None
        else:
            out[host] = None
    return out


def filter_resources(
    hosts: Sequence[HostEntry], include: str | None, exclude: str | None
) -> list[tuple[str, list[int]]]:
    """The (host, GPU slots) that ``--include``/``--exclude`` leave, in hostfile order (deepspeed's rules)."""
    if include and exclude:
        raise HostfileError("--include and --exclude exclude each other")
    available = {h.host: list(range(h.slots)) for h in hosts}
    if include:
        chosen = _parse_filter(include, "--include")
        for host, slots in chosen.items():
            if host not in available:
                raise HostfileError(f"--include: host {host} is not in the hostfile")
            if slots is not None and not set(slots) <= set(available[host]):
                raise HostfileError(f"--include: {host} has slots 0..{len(available[host]) - 1}, not {slots}")
        result = [
            (h.host, available[h.host] if chosen[h.host] is None else list(chosen[h.host] or []))
            for h in hosts
            if h.host in chosen
        ]
    else:
        dropped = _parse_filter(exclude, "--exclude") if exclude else {}
        for host in dropped:
            if host not in available:
                raise HostfileError(f"--exclude: host {host} is not in the hostfile")
        result = []
        for h in hosts:
            slots = dropped.get(h.host, [])
            if h.host in dropped and slots is None:
                continue
            left = [s for s in available[h.host] if s not in (slots or [])]
            if left:
                result.append((h.host, left))
    if not result:
        raise HostfileError("--include/--exclude leave no host")
    return result
