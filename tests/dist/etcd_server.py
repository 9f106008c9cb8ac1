"""The tests' etcd server (ds_swift.testing.etcd): a test that needs one is skipped where none can start."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds_swift.testing import etcd
from ds_swift.testing.etcd import PASSWORD, USER, EtcdUnavailable, etcd_binary

__all__ = ["PASSWORD", "USER", "Etcd", "etcd_binary"]


def Etcd(root: Path, tls: bool = False) -> etcd.Etcd:  # noqa: N802 - the class it stands in for
    """ds_swift.testing.etcd.Etcd, or the test skipped (no etcd binary, no openssl CLI)."""
    try:
        return etcd.Etcd(root, tls=tls)
    except EtcdUnavailable as exc:
        pytest.skip(str(exc))
