"""Where a job's key-value store is: ``tcp://HOST:PORT`` or ``etcd://H1:P1[,H2:P2...]`` (no torch import).

``ds-swift-launch --store`` validates it before anything starts; workers find it in
``SWIFT_STORE_URL`` and open it through :meth:`ds_swift.membership.JobStore.open`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_ETCD_PORT", "StoreURL", "parse_endpoints"]

DEFAULT_ETCD_PORT = 2379


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """``h1:2379,h2:2379`` (``etcd://`` prefix optional; port defaults to 2379) -> [(host, port)]."""
    text = text.removeprefix("etcd://").strip("/")
    out: list[tuple[str, int]] = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, str(DEFAULT_ETCD_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint {item!r} is not HOST[:PORT]")
        out.append((host, int(port)))
    if not out:
        raise ValueError(f"no etcd endpoint in {text!r}: expected etcd://HOST:PORT[,HOST:PORT...]")
    return out


@dataclass(frozen=True)
class StoreURL:
    """``tcp://HOST:PORT`` (a TCPStore served by someone else) or ``etcd://H1:P1[,H2:P2...]``."""

    scheme: str
    endpoints: tuple[tuple[str, int], ...]

    @classmethod
    def parse(cls, url: str) -> StoreURL:
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in ("tcp", "etcd"):
            raise ValueError(f"store {url!r}: expected tcp://HOST:PORT or etcd://HOST:PORT[,HOST:PORT...]")
        if scheme == "etcd":
            return cls("etcd", tuple(parse_endpoints(rest)))
        host, colon, port = rest.strip("/").rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"store {url!r}: expected tcp://HOST:PORT with a port number")
        return cls("tcp", ((host, int(port)),))

    def __str__(self) -> str:
        return f"{self.scheme}://" + ",".join(f"{h}:{p}" for h, p in self.endpoints)
