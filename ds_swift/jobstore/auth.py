"""The job secret: which store writes came from this job, and where its keys live.

Anyone who reaches the job store's port (a TCPStore has no access control) or its etcd cluster
could otherwise write ``gen<g>/failed`` and stop every rank for a recovery, or forge a heartbeat.
The job therefore holds a secret that never appears on a command line: the launcher makes one
(or takes it from ``SWIFT_JOB_SECRET`` / a mode-0600 ``--job-secret-file``) and hands it to
agents and workers through their environment.

Two uses:
- **The keys' namespace** ``swift/<token>.<tag>/``, ``tag`` an HMAC of the token: a client that
  knows the token (it is on remote agents' command lines) but not the secret cannot address the
  job's keys, counters and torch's rendezvous keys included, on a TCPStore (which cannot list).
- **Signed values**: every value ds-swift writes is ``<mac>.<value>``, the MAC over the launch id,
  the key and the value. A value without a valid MAC (an etcd client that listed the namespace and
  wrote into it), or one signed for another key or by another launch of the same job (a replay),
  is rejected: readers treat it as absent and say so once per key on stderr. Counters are signed
  values too (:mod:`ds_swift.jobstore.signed_kv` updates them by compare-and-swap).

Signing is deterministic, so ``compare_set`` works on signed values.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import stat
import tempfile

from ds_swift.logs import say

__all__ = [
    "MIN_SECRET_CHARS",
    "SECRET_ENV",
    "SecretError",
    "Sealer",
    "job_secret",
    "read_secret_file",
    "write_secret_file",
]

SECRET_ENV = "SWIFT_JOB_SECRET"
MIN_SECRET_CHARS = 16
_MAC_CHARS = 32  # 128 bits of HMAC-SHA256, hex


class SecretError(ValueError):
    """A job secret that is missing, too short or readable by others."""


class Sealer:
    """Signs and checks the job's store values; ``secret=None`` (unit tests, tools): no signing."""

    def __init__(self, secret: str | None, launch: str = "") -> None:
        if secret is not None and len(secret) < MIN_SECRET_CHARS:
            raise SecretError(
                f"the job secret has {len(secret)} characters; it needs at least {MIN_SECRET_CHARS} "
                "(e.g. python -c 'import secrets; print(secrets.token_hex(32))')"
            )
        self._key = None if secret is None else secret.encode()
        self.launch = launch
        """Bound into every MAC: a value signed by another launch of the job reads as forged."""
        self.rejected: dict[str, int] = {}
        """Key -> how many unsigned or forged values were read from it."""

    def for_launch(self, launch: str) -> Sealer:
        """The same secret, for another launch's values (reading a dead launch's record)."""
        other = Sealer(None, launch)
        other._key = self._key
        return other

    @property
    def signing(self) -> bool:
        return self._key is not None

    def namespace(self, token: str) -> str:
        if self._key is None:
            return token
        return f"{token}.{self._mac('namespace', token)[:16]}"

    def _mac(self, key: str, value: str) -> str:
        assert self._key is not None
        msg = b"\0".join((self.launch.encode(), key.encode(), value.encode()))
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()[:_MAC_CHARS]

    def seal(self, key: str, value: str) -> str:
        return value if self._key is None else f"{self._mac(key, value)}.{value}"

    def open(self, key: str, raw: bytes) -> str | None:
        """The value written at ``key``, or None (and a warning, once per key) if it is not signed by us."""
        text = raw.decode(errors="replace")
        if self._key is None:
            return text
        mac, dot, value = text.partition(".")
        if dot and len(mac) == _MAC_CHARS and hmac.compare_digest(mac, self._mac(key, value)):
            return value
        self.reject(key, len(raw))
        return None

    def reject(self, key: str, size: int, why: str = "that is not signed with this job's secret") -> None:
        """Count a rejected value at ``key``; the first one per key is said on stderr."""
        first = key not in self.rejected
        self.rejected[key] = self.rejected.get(key, 0) + 1
        if first:
            say(
                f"rejected a write to job-store key {key!r} {why} ({size} bytes); ignoring it. "
                "Something outside the job can reach the store: restrict access to its port (or use etcd "
                "with TLS and authentication).",
                level=logging.WARNING,
                name=__name__,
            )


def read_secret_file(path: str) -> str:
    """The secret in ``path``, which only its owner may read (mode 0600 or stricter)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise SecretError(
            f"--job-secret-file {path}: {exc.strerror}; put it on a filesystem every host sees, or set "
            f"{SECRET_ENV} in every host's environment instead"
        ) from exc
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(
            f"--job-secret-file {path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}): run chmod 600 {path}"
        )
    if st.st_uid != os.geteuid():
        # Whoever owns the file chose the secret (and can read it): another user's file is theirs.
        raise SecretError(
            f"--job-secret-file {path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
            "write your own (mode 0600)"
        )
    with open(path) as f:
        secret = f.read().strip()
    if len(secret) < MIN_SECRET_CHARS:
        raise SecretError(f"--job-secret-file {path} holds {len(secret)} characters; write at least {MIN_SECRET_CHARS}")
    return secret


def write_secret_file(path: str, secret: str) -> None:
    """Write ``secret`` to ``path`` with mode 0600 (replacing a file left by an earlier job).

    The bytes go to a new temporary file of an unpredictable name, created with ``O_EXCL`` (mkstemp),
    then renamed over ``path``: a temporary name anyone can guess (``<path>.<pid>.tmp``) let another
    user of a shared run directory plant a symlink there, which the open followed, writing the secret
    into a file of theirs (or truncating one of ours)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, (secret + "\n").encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def job_secret(secret_file: str | None, environ: dict[str, str], *, multi_host: bool, generate: bool) -> str:
    """The job secret a launcher or agent uses: ``--job-secret-file``, else (multi-host, where every
    host's agent must hold the same one) ``$SWIFT_JOB_SECRET``, else a new one if this process starts
    every agent itself (``generate``). On one host the variable is ignored: a launcher started from
    inside a worker must not share its parent job's secret."""
    if secret_file:
        return read_secret_file(secret_file)
    if multi_host and environ.get(SECRET_ENV):
        secret = environ[SECRET_ENV].strip()
        if len(secret) < MIN_SECRET_CHARS:
            raise SecretError(f"{SECRET_ENV} holds {len(secret)} characters; it needs at least {MIN_SECRET_CHARS}")
        return secret
    if generate:
        return secrets.token_hex(32)
    raise SecretError(
        "every agent of a multi-host job needs the same job secret, which never goes on a command line: "
        f"export {SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))') before srun (srun "
        "passes it on), or give --job-secret-file PATH (mode 0600, on a filesystem every host sees)"
    )
