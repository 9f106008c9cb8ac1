"""A torch.distributed ``Store`` on an etcd v3 cluster: the job store that outlives every training machine.

The in-process ``TCPStore`` lives in the agent of machine 0, so losing that machine loses the
store and the job with it. An etcd cluster runs on its own hosts (three of them survive one
loss), and every client (agents, workers, gloo's rendezvous through ``PrefixStore``) talks to it
over etcd's v3 JSON gateway through ``etcd3gw``, a maintained pure-HTTP client.

Why not torch's ``torch.distributed.elastic.rendezvous.etcd_store.EtcdStore``: it needs
``python-etcd``, a client of etcd's v2 API (unmaintained since 2018; etcd 3.4 turns v2 off by
default and 3.6 removed it), and it lacks ``compare_set``, which the job store's generation
counter relies on.

Values live at ``<prefix><key>``; counters (``add``) are decimal strings, as in ``TCPStore``.
Atomic updates are etcd transactions that compare the key's ``mod_revision``. A transaction holds
at most :data:`MAX_TXN_OPS` operations (etcd's default ``--max-txn-ops``): reads and checks of more
keys are split. A blocking ``wait`` watches the missing keys (one streamed request), never polls.

Security (:class:`ds_swift.jobstore.url.StoreCredentials`): ``https`` with a CA file checks the
servers' certificates; a client certificate answers ``--client-cert-auth``; a user and password
log in through ``/v3/auth/authenticate`` and every request carries the token, renewed when etcd
says it expired (simple tokens live ``--auth-token-ttl``, 300 s by default).
"""

from __future__ import annotations

import base64
import builtins
import datetime
import json
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from ds_swift.jobstore.contention import CasBudget
from ds_swift.jobstore.url import StoreCredentials

__all__ = ["EtcdStore"]

#: etcd's default --max-txn-ops: a transaction with more operations is refused
MAX_TXN_OPS = 128
#: per-request HTTP timeout: a member that does not answer within it counts as down
_REQUEST_TIMEOUT_S = 5.0
#: a login token older than this is renewed (etcd's simple tokens live 300 s unused by default)
_TOKEN_RENEW_S = 60.0


def _why(exc: Exception) -> str:
    """etcd's own error message (the gateway's JSON body), else the HTTP reason."""
    detail = getattr(exc, "detail_text", None) or ""
    try:
        return str(json.loads(detail).get("error") or detail)[:300]
    except (ValueError, AttributeError):
        return (detail or str(exc))[:300]


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else bytes(data)
    return base64.b64encode(raw).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end for a prefix)."""
    return prefix[:-1] + bytes([prefix[-1] + 1]) if prefix and prefix[-1] < 0xFF else b"\0"


class EtcdStore(dist.Store):
    """``torch.distributed.Store`` over an etcd v3 cluster (any member may answer).

    Args:
        endpoints: ``[(host, port), ...]`` of the cluster's client URLs; a member that cannot be
            reached is skipped for the next one (etcd serves linearizable reads and writes from
            any member, so the choice does not change what a client sees).
        prefix: every key of this store lives under it.
        timeout: how long ``get``/``wait`` block for a key that does not exist yet.
        tls: talk ``https`` (``etcd+https://`` URLs).
        credentials: CA, client certificate, user and password (see the module docstring).
    """

    #: a Store written in Python: torch's PrefixStore cannot route delete_key to it (ds_swift.jobstore.signed_kv)
    python_store = True

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        prefix: str = "",
        timeout: datetime.timedelta | None = None,
        tls: bool = False,
        credentials: StoreCredentials | None = None,
    ) -> None:
        super().__init__()  # the pybind trampoline needs it
        import etcd3gw  # lazily: only jobs that use etcd need the client installed

        self.endpoints = list(endpoints)
        self.prefix = prefix.encode()
        self.tls = tls
        self.credentials = credentials or StoreCredentials()
        cred = self.credentials
        if (cred.ca or cred.cert) and not tls:
            raise ValueError("a CA or client certificate needs an etcd+https:// store URL (TLS); got etcd://")
        self._clients = [
            etcd3gw.Etcd3Client(
                host=h,
                port=p,
                timeout=_REQUEST_TIMEOUT_S,
                api_path="/v3/",
                protocol="https" if tls else "http",
                ca_cert=cred.ca or None,
                cert_cert=cred.cert or None,
                cert_key=cred.key or None,
            )
            for h, p in self.endpoints
        ]
        # Per request, not on the session: requests lets $REQUESTS_CA_BUNDLE override a session's CA.
        self._tls_args: dict[str, Any] = {"verify": cred.ca} if cred.ca else {}
        self._token: str | None = None
        self._token_at = 0.0
        self._current = 0
        self._lock = threading.Lock()  # one requests.Session per client: one request at a time
        self._watcher: Any = None  # the session blocking waits stream their watches on
        self.set_timeout(timeout or datetime.timedelta(seconds=300))

    def __reduce__(self) -> Any:  # workers get the URL, not the object; but multiprocessing may pickle it
        return (EtcdStore, (self.endpoints, self.prefix.decode(), self._timeout(), self.tls, self.credentials))

    def _timeout(self) -> datetime.timedelta:
        # Store.timeout is the C++ property that set_timeout (torch's own callers included) changes.
        value: datetime.timedelta = self.timeout  # type: ignore[attr-defined]
        return value

    # ------------------------------------------------------------------ transport
    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        from etcd3gw.exceptions import Etcd3Exception

        with self._lock:
            if self._token is not None and time.monotonic() - self._token_at > _TOKEN_RENEW_S:
                self._token = None  # log in again before etcd forgets it (its TTL, or a JWT's expiry)
            try:
                try:
                    return self._post_any(path, payload)
                except RuntimeError:
                    # etcd's gateway answers a token it no longer knows (a restarted member) by
                    # timing out: with a user, log in again once before calling the cluster gone.
                    if self._token is None:
                        raise
                self._token = None
                return self._post_any(path, payload)
            except Etcd3Exception as exc:
                raise RuntimeError(f"etcd refused {path}: {_why(exc)}") from exc

    def _post_any(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """One request, to the first member that answers (logging in first if a user is set)."""
        from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError

        errors: list[str] = []
        for _ in range(len(self._clients)):
            client = self._clients[self._current]
            try:
                if self.credentials.user and self._token is None:
                    self._token = self._authenticate(client)
                    self._token_at = time.monotonic()
                headers = {"Authorization": self._token} if self._token else None
                result: dict[str, Any] = client.post(
                    client.get_url(path), json=payload, headers=headers, **self._tls_args
                )
                return result
            except (ConnectionFailedError, ConnectionTimeoutError) as exc:
                host, port = self.endpoints[self._current]
                errors.append(f"{host}:{port}: {str(exc)[:200]}")
                self._current = (self._current + 1) % len(self._clients)
        raise RuntimeError(f"no etcd member answers ({'; '.join(errors)})")

    def _authenticate(self, client: Any) -> str:
        from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception

        body = {"name": self.credentials.user, "password": self.credentials.password}
        try:
            result = client.post(client.get_url("/auth/authenticate"), json=body, **self._tls_args)
        except (ConnectionFailedError, ConnectionTimeoutError):
            raise  # the next member may answer
        except Etcd3Exception as exc:
            raise RuntimeError(
                f"etcd refused user {self.credentials.user!r}: {_why(exc)} (check --store-user and the "
                "password; etcd must have authentication enabled: etcdctl auth enable)"
            ) from exc
        return str(result["token"])

    def _key(self, key: str | bytes) -> bytes:
        return self.prefix + (key.encode() if isinstance(key, str) else bytes(key))

    def _range(self, key: str | bytes) -> dict[str, Any] | None:
        kvs = self._post("/kv/range", {"key": _b64(self._key(key))}).get("kvs")
        return kvs[0] if kvs else None

    def _txn(
        self, compare: list[dict[str, Any]], success: list[dict[str, Any]], failure: list[dict[str, Any]]
    ) -> dict[str, Any]:
        return self._post("/kv/txn", {"compare": compare, "success": success, "failure": failure})

    # ------------------------------------------------------------------ torch.distributed.Store
    def set(self, key: str, value: str | bytes) -> None:
        self._post("/kv/put", {"key": _b64(self._key(key)), "value": _b64(value)})

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store's timeout for someone to set it."""
        self.wait([key])
        kv = self._range(key)
        if kv is None:  # deleted between wait and range
            raise LookupError(f"etcd store: key {key!r} vanished")
        return _unb64(kv.get("value"))

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the decimal counter at ``key`` (created at 0); returns the new value."""
        bkey = _b64(self._key(key))
        budget = CasBudget(key)
        while True:
            kv = self._range(key)
            current = int(_unb64(kv.get("value"))) if kv is not None else 0
            if kv is None:
                cmp = {"key": bkey, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            else:
                cmp = {"key": bkey, "target": "MOD", "result": "EQUAL", "mod_revision": kv["mod_revision"]}
            new = current + int(amount)
            if amount == 0 and kv is not None:
                return current  # a read: no write, no new revision
            result = self._txn([cmp], [{"request_put": {"key": bkey, "value": _b64(str(new))}}], [])
            if result.get("succeeded"):
                return new
            # Another client updated it between our read and our write: read again, within the budget.
            budget.lost()

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """``TCPStore`` semantics: set ``desired`` if the value is ``expected`` (or the key is absent and
        ``expected`` is empty); returns the value the key holds afterwards (or ``expected`` if absent)."""
        bkey = _b64(self._key(key))
        expected = expected_value.encode() if isinstance(expected_value, str) else bytes(expected_value)
        desired = desired_value.encode() if isinstance(desired_value, str) else bytes(desired_value)
        if expected:
            cmp = {"key": bkey, "target": "VALUE", "result": "EQUAL", "value": _b64(expected)}
        else:
            cmp = {"key": bkey, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        result = self._txn(
            [cmp], [{"request_put": {"key": bkey, "value": _b64(desired)}}], [{"request_range": {"key": bkey}}]
        )
        if result.get("succeeded"):
            return desired
        kvs = result.get("responses", [{}])[0].get("response_range", {}).get("kvs")
        return _unb64(kvs[0].get("value")) if kvs else expected

    def _chunks(self, keys: Sequence[str]) -> list[Sequence[str]]:
        """``keys`` in runs of at most :data:`MAX_TXN_OPS`: etcd refuses a longer transaction."""
        return [keys[i : i + MAX_TXN_OPS] for i in range(0, len(keys), MAX_TXN_OPS)]

    def _present(self, keys: Sequence[str]) -> tuple[list[bool], int]:
        """Which of ``keys`` exist, and the store's revision when the first batch was read."""
        present: list[bool] = []
        revision = -1
        for chunk in self._chunks(keys):
            ops = [{"request_range": {"key": _b64(self._key(k)), "count_only": True}} for k in chunk]
            result = self._txn([], ops, [])
            if revision < 0:
                revision = int(result.get("header", {}).get("revision", 0))
            present += [int(r.get("response_range", {}).get("count", 0)) > 0 for r in result.get("responses", [])]
        return present, revision

    def check(self, keys: list[str]) -> bool:
        """True if every key exists (one read-only transaction per 128 keys)."""
        return all(self._present(keys)[0]) if keys else True

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Block until every key exists: one check, then one watch of the missing keys' range that
        counts them off as they are written (no polling). LookupError after ``timeout``."""
        limit = (timeout or self._timeout()).total_seconds()
        deadline = time.monotonic() + limit
        while True:
            present, revision = self._present(keys)
            missing = {self._key(k) for k, p in zip(keys, present, strict=True) if not p}
            if not missing:
                return
            if not self._watch_until(missing, revision + 1, deadline):
                raise LookupError(f"etcd store: keys {sorted(keys)[:4]}... not set within {limit:.0f} s")

    def _watch_until(self, missing: builtins.set[bytes], start_revision: int, deadline: float) -> bool:
        """Watch the range of ``missing`` from ``start_revision`` until every one of them was put
        (True), or until ``deadline`` (False); False too when the watch ends early (the caller checks again)."""
        import requests

        lo, hi = min(missing), max(missing)
        body = {"create_request": {"key": _b64(lo), "range_end": _b64(hi + b"\0"), "start_revision": start_revision}}
        client = self._clients[self._current]
        headers = {"Authorization": self._token} if self._token else None
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            with self._watch_session(client).post(
                client.get_url("/watch"),
                json=body,
                headers=headers,
                stream=True,
                timeout=(_REQUEST_TIMEOUT_S, max(0.05, left)),
                **self._tls_args,
            ) as resp:
                for line in resp.iter_lines():
                    if line:
                        result = json.loads(line).get("result", {})
                        if result.get("canceled") or result.get("compact_revision"):
                            return False  # the caller checks again from the revision now
                        for event in result.get("events", ()):
                            if event.get("type", "PUT") == "PUT":
                                missing.discard(_unb64(event["kv"]["key"]))
                        if not missing:
                            return True
                    if time.monotonic() >= deadline:
                        return False
        except requests.exceptions.RequestException:
            pass  # the read timed out (nothing written in time), or the member went: check again
        return not missing

    def _watch_session(self, client: Any) -> Any:
        """A session of its own for watches (a watch streams; the client's session serves requests)."""
        import requests

        with self._lock:
            if self._watcher is None:
                self._watcher = requests.Session()
                self._watcher.verify = client.session.verify
                self._watcher.cert = client.session.cert
            return self._watcher

    def delete_key(self, key: str) -> bool:
        result = self._post("/kv/deleterange", {"key": _b64(self._key(key))})
        return int(result.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        start = self.prefix or b"\0"
        result = self._post(
            "/kv/range", {"key": _b64(start), "range_end": _b64(_prefix_end(self.prefix)), "count_only": True}
        )
        return int(result.get("count", 0))

    def try_get(self, key: str) -> bytes | None:
        """The value of ``key`` now, or None: one request (``check`` then ``get`` would take three)."""
        kv = self._range(key)
        return None if kv is None else _unb64(kv.get("value"))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        values = self.get_many(keys)
        if any(v is None for v in values):
            raise LookupError("etcd store: a key of multi_get vanished")
        return [v for v in values if v is not None]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of ``keys`` now (None where absent): one transaction per 128 keys."""
        out: list[bytes | None] = []
        for chunk in self._chunks(keys):
            result = self._txn([], [{"request_range": {"key": _b64(self._key(k))}} for k in chunk], [])
            for r in result.get("responses", []):
                kvs = r.get("response_range", {}).get("kvs")
                out.append(_unb64(kvs[0].get("value")) if kvs else None)
        return out

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        pairs = list(zip(keys, values, strict=True))
        for i in range(0, len(pairs), MAX_TXN_OPS):
            ops = [
                {"request_put": {"key": _b64(self._key(k)), "value": _b64(v)}} for k, v in pairs[i : i + MAX_TXN_OPS]
            ]
            self._txn([], ops, [])

    # ------------------------------------------------------------------ beyond the Store API
    def delete_prefix(self, sub_prefix: str = "") -> int:
        """Delete every key under ``prefix + sub_prefix`` (a finished job's keys); returns how many."""
        start = self._key(sub_prefix)
        result = self._post("/kv/deleterange", {"key": _b64(start), "range_end": _b64(_prefix_end(start))})
        return int(result.get("deleted", 0))

    def count(self, sub_prefix: str = "") -> int:
        """How many keys are under ``prefix + sub_prefix``: one request (a counter without a writer's
        compare-and-swap: many writers at once would retry each other's)."""
        start = self._key(sub_prefix)
        result = self._post(
            "/kv/range", {"key": _b64(start), "range_end": _b64(_prefix_end(start)), "count_only": True}
        )
        return int(result.get("count", 0))

    def keys(self, sub_prefix: str = "") -> list[str]:
        """Every key under ``prefix + sub_prefix``, without the store's prefix (names only, no values)."""
        start = self._key(sub_prefix)
        result = self._post("/kv/range", {"key": _b64(start), "range_end": _b64(_prefix_end(start)), "keys_only": True})
        return [_unb64(kv["key"])[len(self.prefix) :].decode(errors="replace") for kv in result.get("kvs", [])]
