"""Where a job's key-value store is, and how to log in to it (no torch import).

``tcp://HOST:PORT``, ``etcd://H1:P1[,H2:P2...]`` (plain HTTP) or ``etcd+https://H1:P1[,...]`` (TLS:
the server's certificate checked against a CA, optionally a client certificate, and etcd's
user/password authentication). ``ds-swift-launch --store`` validates it before anything starts;
workers find it in ``SWIFT_STORE_URL`` and open it through :meth:`ds_swift.jobstore.membership.JobStore.open`.

Credentials never go on a command line: files are named by path (``--store-ca``, ``--store-cert``,
``--store-key``, ``--store-password-file``) or the ``SWIFT_STORE_*`` variables below, and the
password travels to agents and workers in the environment only (:class:`StoreCredentials`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["CREDENTIAL_ENV", "DEFAULT_ETCD_PORT", "StoreCredentials", "StoreURL", "parse_endpoints"]

DEFAULT_ETCD_PORT = 2379
_SCHEMES = ("tcp", "etcd", "etcd+https")

#: field of StoreCredentials -> the environment variable that carries it to agents and workers
CREDENTIAL_ENV = {
    "ca": "SWIFT_STORE_CA",
    "cert": "SWIFT_STORE_CERT",
    "key": "SWIFT_STORE_KEY",
    "user": "SWIFT_STORE_USER",
    "password": "SWIFT_STORE_PASSWORD",
}
PASSWORD_FILE_ENV = "SWIFT_STORE_PASSWORD_FILE"


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
    """``tcp://HOST:PORT`` (a TCPStore served by someone else), ``etcd://H1:P1[,H2:P2...]`` or
    ``etcd+https://H1:P1[,...]``."""

    scheme: str
    endpoints: tuple[tuple[str, int], ...]

    @classmethod
    def parse(cls, url: str) -> StoreURL:
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in _SCHEMES:
            raise ValueError(
                f"store {url!r}: expected tcp://HOST:PORT, etcd://HOST:PORT[,HOST:PORT...] or etcd+https://HOST:PORT[,...]"
            )
        if scheme.startswith("etcd"):
            return cls(scheme, tuple(parse_endpoints(rest)))
        host, colon, port = rest.strip("/").rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"store {url!r}: expected tcp://HOST:PORT with a port number")
        return cls("tcp", ((host, int(port)),))

    @property
    def is_etcd(self) -> bool:
        return self.scheme.startswith("etcd")

    @property
    def tls(self) -> bool:
        return self.scheme == "etcd+https"

    def __str__(self) -> str:
        return f"{self.scheme}://" + ",".join(f"{h}:{p}" for h, p in self.endpoints)


def _read_private(path: str, what: str) -> str:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror}") from exc
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"{what} {path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}): run chmod 600 {path}"
        )
    with open(path) as f:
        return f.read().strip()


@dataclass(frozen=True)
class StoreCredentials:
    """How a client proves itself to an etcd store with TLS and authentication (all optional).

    ``ca``: the CA file that signed the etcd servers' certificates (default: the system's CAs);
    ``cert``/``key``: a client certificate and its key, for a server started with
    ``--client-cert-auth`` (etcd's HTTP gateway, which ds-swift talks to, refuses a client
    certificate with a Common Name: issue it with subjectAltName only); ``user``/``password``:
    an etcd user (``etcdctl user add``) whose role grants read-write on the ``swift/`` prefix."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password: str = field(default="", repr=False)

    @property
    def empty(self) -> bool:
        return not (self.ca or self.cert or self.key or self.user)

    @classmethod
    def from_env(cls, environ: Mapping[str, str], password_file: str | None = None) -> StoreCredentials:
        """From ``SWIFT_STORE_*`` (and a mode-0600 password file, flag or ``SWIFT_STORE_PASSWORD_FILE``)."""
        values = {name: environ.get(var, "") for name, var in CREDENTIAL_ENV.items()}
        password_file = password_file or environ.get(PASSWORD_FILE_ENV) or None
        if password_file:
            values["password"] = _read_private(password_file, "--store-password-file")
        return cls(**values).checked()

    def checked(self) -> StoreCredentials:
        """Refuse half a client certificate, a missing file, or a user without a password."""
        if bool(self.cert) != bool(self.key):
            raise ValueError(
                f"store credentials: a client certificate needs both --store-cert and --store-key "
                f"({CREDENTIAL_ENV['cert']}/{CREDENTIAL_ENV['key']}); got only one"
            )
        for name in ("ca", "cert", "key"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ValueError(f"store credentials: --store-{name} {path} is not a file ({CREDENTIAL_ENV[name]})")
        if self.user and not self.password:
            raise ValueError(
                f"store credentials: user {self.user!r} needs a password: --store-password-file PATH (mode 0600) "
                f"or {CREDENTIAL_ENV['password']} in the environment"
            )
        return self

    def to_env(self) -> dict[str, str]:
        """The variables that hand these credentials to a child process (environment only, never argv)."""
        return {var: getattr(self, name) for name, var in CREDENTIAL_ENV.items() if getattr(self, name)}
