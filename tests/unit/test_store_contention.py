"""Compare-and-swap loops end: a counter update that keeps losing raises, naming the key
(ds_swift.jobstore.contention), where it spun for good before."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from conftest import Ends

from ds_swift.jobstore import contention
from ds_swift.jobstore.contention import StoreContention
from ds_swift.jobstore.signed_kv import SignedKV

SECRET = "contention-test-secret-" + "3" * 10


SPINNING = "the compare-and-swap loop is still spinning"


@pytest.fixture(autouse=True)
def small_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(contention, "CAS_ATTEMPTS", 25)
    monkeypatch.setattr(contention, "_MAX_BACKOFF_S", 0.01)


def test_a_signed_counter_that_always_loses_its_swap_gives_up_naming_the_key(ends: Ends) -> None:
    kv = SignedKV(dist.HashStore(), "tok", SECRET)
    kv.add("gen0/joined", 1)
    lost = {"n": 0}

    def always_beaten(key: str, raw: bytes | None, desired: bytes) -> bool:
        lost["n"] += 1  # another writer changed the key between our read and our write, every time
        return False

    kv._swap = always_beaten  # type: ignore[method-assign]
    err = ends(lambda: kv.add("gen0/joined", 1), 20.0, SPINNING)
    assert isinstance(err, StoreContention) and "'gen0/joined'" in str(err) and lost["n"] == 25, (err, lost)
    err = ends(lambda: kv.advance("generation", 7), 20.0, SPINNING)
    assert isinstance(err, StoreContention) and "'generation'" in str(err), err


def test_an_etcd_counter_that_always_loses_its_transaction_gives_up(ends: Ends) -> None:
    pytest.importorskip("etcd3gw")
    from ds_swift.jobstore.etcd import EtcdStore

    store = EtcdStore([("127.0.0.1", 9)])  # never reached: its requests are replaced below
    store._range = lambda key: {"value": "NA==", "mod_revision": "1"}  # "4"  # type: ignore[method-assign]
    store._txn = lambda compare, success, failure: {"succeeded": False}  # type: ignore[method-assign]
    err = ends(lambda: store.add("launch/lost_agents", 1), 20.0, SPINNING)
    assert isinstance(err, StoreContention) and "'launch/lost_agents'" in str(err), err


def test_a_few_lost_rounds_are_retried() -> None:
    kv = SignedKV(dist.HashStore(), "tok", SECRET)
    swap = kv._swap
    losses = iter([False, False, False, False, False])

    def beaten_five_times(key: str, raw: bytes | None, desired: bytes) -> bool:
        return next(losses, True) and swap(key, raw, desired)

    kv._swap = beaten_five_times  # type: ignore[method-assign]
    assert kv.add("c", 2) == 2 and kv.add("c", 3) == 5
