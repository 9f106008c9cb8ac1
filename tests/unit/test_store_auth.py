"""The job secret: signed store values, the secret namespace, and where the secret comes from."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch.distributed as dist

from ds_swift.jobstore.auth import Sealer, SecretError, job_secret, read_secret_file, write_secret_file
from ds_swift.jobstore.membership import JobStore, MembershipError

SECRET = "0123456789abcdef" * 2


def test_a_value_reads_back_only_if_signed_with_the_secret(capsys: pytest.CaptureFixture[str]) -> None:
    ours, theirs = Sealer(SECRET), Sealer("another-secret-of-enough-length")
    sealed = ours.seal("gen0/failed", "machine 1 died")
    assert ours.open("gen0/failed", sealed.encode()) == "machine 1 died"
    # Unsigned, signed with another secret, or moved to another key: rejected, and said once per key.
    assert ours.open("gen0/failed", b"machine 1 died") is None
    assert ours.open("gen0/failed", theirs.seal("gen0/failed", "x").encode()) is None
    assert ours.open("gen1/failed", sealed.encode()) is None
    assert ours.rejected == {"gen0/failed": 2, "gen1/failed": 1}
    err = capsys.readouterr().err
    assert err.count("rejected a write to job-store key 'gen0/failed'") == 1 and "gen1/failed" in err
    assert ours.namespace("tok") != theirs.namespace("tok") and ours.namespace("tok").startswith("tok.")
    assert Sealer(None).open("k", b"plain") == "plain" and Sealer(None).namespace("tok") == "tok"
    with pytest.raises(SecretError, match="at least 16"):
        Sealer("short")


def test_the_secret_file_must_be_private(tmp_path: Path) -> None:
    path = tmp_path / "job.secret"
    write_secret_file(str(path), SECRET)
    assert path.stat().st_mode & 0o777 == 0o600 and read_secret_file(str(path)) == SECRET
    path.chmod(0o644)
    with pytest.raises(SecretError, match=f"chmod 600 {path}"):
        read_secret_file(str(path))
    with pytest.raises(SecretError, match="every host sees"):
        read_secret_file(str(tmp_path / "absent"))


def test_where_the_secret_comes_from(tmp_path: Path) -> None:
    env = {"SWIFT_JOB_SECRET": SECRET}
    # One host: a fresh secret, whatever a parent job left in the environment.
    made = job_secret(None, env, multi_host=False, generate=True)
    assert made != SECRET and len(made) == 64
    assert job_secret(None, env, multi_host=True, generate=False) == SECRET
    with pytest.raises(SecretError, match="SWIFT_JOB_SECRET holds 3"):
        job_secret(None, {"SWIFT_JOB_SECRET": "abc"}, multi_host=True, generate=False)
    with pytest.raises(SecretError, match="--job-secret-file"):
        job_secret(None, {}, multi_host=True, generate=False)
    path = tmp_path / "s"
    write_secret_file(str(path), "f" * 20)
    assert job_secret(str(path), env, multi_host=True, generate=False) == "f" * 20


@pytest.fixture
def job() -> JobStore:
    return JobStore.host("tok", secret=SECRET)


def _intruder(job: JobStore, prefix: str) -> dist.PrefixStore:
    raw = dist.TCPStore("127.0.0.1", job.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    return dist.PrefixStore(prefix.rstrip("/"), raw)  # PrefixStore adds the "/"


def test_a_forged_failure_flag_is_rejected_and_a_real_one_still_lands(job: JobStore) -> None:
    # Knowing the token only, a client writes where the keys would be without a secret: nobody reads there.
    _intruder(job, "swift/tok/").set("gen0/failed", "forged")
    assert job.failure(0) is None
    # Knowing the namespace too (an etcd client can list it), an unsigned flag is still rejected.
    inside = _intruder(job, job.prefix)
    inside.set("gen0/failed", "forged")
    inside.set("hb/0", "1e12 step")
    assert job.failure(0) is None and job.heartbeat_of(0) is None and job.generation() == 0
    assert job.sealer.rejected["gen0/failed"] >= 1
    # The job's own declaration overwrites the forged value and moves the generation.
    job.declare_failure(0, "machine 1 died")
    assert job.failure(0) == "machine 1 died" and job.generation() == 1
    inside.set("gen1/topic/3", "forged")
    job.publish(1, "topic", 2, "real")
    with pytest.raises(TimeoutError, match=r"ranks \[3\]"):
        job.gather(1, "topic", [2, 3], timeout_s=0.3)


def test_a_client_with_another_secret_is_refused(job: JobStore) -> None:
    with pytest.raises(MembershipError, match="secret differs"):
        JobStore.connect("127.0.0.1", job.port, "tok", timeout_s=10, secret="x" * 32)
    peer = JobStore.connect("127.0.0.1", job.port, "tok", timeout_s=10, secret=SECRET)
    peer.heartbeat(0, "step")
    assert job.heartbeat_of(0) is not None and job.heartbeat_of(0)[1] == "step"


def test_the_secret_never_goes_through_a_file_someone_else_planted(tmp_path: Path) -> None:
    import os

    path = tmp_path / "job.secret"
    victim = tmp_path / "victim"
    victim.write_text("theirs\n")
    # The temporary name an earlier version used (<path>.<pid>.tmp): anyone could guess it and put a
    # symlink there, which the open followed (O_TRUNC without O_EXCL).
    (tmp_path / f"job.secret.{os.getpid()}.tmp").symlink_to(victim)
    write_secret_file(str(path), SECRET)
    assert victim.read_text() == "theirs\n" and read_secret_file(str(path)) == SECRET
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["job.secret", f"job.secret.{os.getpid()}.tmp", "victim"]
    )


def test_a_secret_file_of_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    path = tmp_path / "job.secret"
    write_secret_file(str(path), SECRET)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(path).st_uid + 1)
    with pytest.raises(SecretError, match="not to this user"):
        read_secret_file(str(path))
