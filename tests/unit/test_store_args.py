"""``ds-swift-launch`` store flags: TLS/auth credentials (never on argv) and the launch id."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds_swift.jobstore.url import StoreCredentials, StoreURL
from ds_swift.jobstore.worker_env import WorkerEnv
from launch.args import LaunchUsageError, parse_args

SECRET_ENV = {"SWIFT_JOB_SECRET": "s" * 32, "SWIFT_JOB_TOKEN": "tok"}


def _pem(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    path.write_text("-----BEGIN CERTIFICATE-----\n")
    return str(path)


def test_store_urls_with_tls() -> None:
    where = StoreURL.parse("etcd+https://e1:2379,e2")
    assert where.tls and where.is_etcd and where.endpoints == (("e1", 2379), ("e2", 2379))
    assert str(where) == "etcd+https://e1:2379,e2:2379" and not StoreURL.parse("etcd://e1").tls
    with pytest.raises(ValueError, match="etcd\\+https://"):
        StoreURL.parse("etcds://e1")


def test_credentials_come_from_flags_or_the_environment_and_only_for_tls(tmp_path: Path) -> None:
    ca, cert, key = _pem(tmp_path, "ca.pem"), _pem(tmp_path, "c.pem"), _pem(tmp_path, "c.key")
    password = tmp_path / "pw"
    password.write_text("hunter2-but-longer\n")
    password.chmod(0o600)
    argv = [
        "--store",
        "etcd+https://e1:2379",
        "--store-ca",
        ca,
        "--store-cert",
        cert,
        "--store-key",
        key,
        "--store-user",
        "swift",
        "--store-password-file",
        str(password),
        "t.py",
    ]
    args = parse_args(argv, environ={})
    assert args.store_credentials == StoreCredentials(
        ca=ca, cert=cert, key=key, user="swift", password="hunter2-but-longer"
    )
    assert "hunter2" not in repr(args)
    # The same from the environment (srun passes it on); workers get it the same way, never by argv.
    env = {"SWIFT_STORE_CA": ca, "SWIFT_STORE_USER": "swift", "SWIFT_STORE_PASSWORD": "pw-from-env"}
    from_env = parse_args(["--store", "etcd+https://e1", "t.py"], environ=env).store_credentials
    assert from_env == StoreCredentials(ca=ca, user="swift", password="pw-from-env")
    wenv = WorkerEnv(
        rank=0,
        local_rank=0,
        world_size=1,
        machine=0,
        num_machines=1,
        generation=0,
        replacement=False,
        store_addr="e1",
        store_port=2379,
        token="t",
        run_dir=".",
        inject="",
        store_credentials=from_env,
    )
    assert WorkerEnv.from_env(wenv.to_env()).store_credentials == from_env
    for bad, msg in [
        (["--store", "etcd://e1", "--store-ca", ca], "are for an etcd\\+https:// store"),
        (["--store-user", "swift", "--store-password-file", str(password)], "are for an etcd\\+https:// store"),
        (["--store", "etcd+https://e1", "--store-cert", cert], "both --store-cert and --store-key"),
        (["--store", "etcd+https://e1", "--store-user", "swift"], "needs a password"),
        (["--store", "etcd+https://e1", "--store-ca", str(tmp_path / "nope")], "is not a file"),
    ]:
        with pytest.raises(LaunchUsageError, match=msg):
            parse_args([*bad, "t.py"], environ={})
    password.chmod(0o644)
    with pytest.raises(LaunchUsageError, match="chmod 600"):
        parse_args(argv, environ={})


def test_every_agent_of_a_launch_derives_the_same_launch_id() -> None:
    slurm = {
        **SECRET_ENV,
        "SLURM_JOB_ID": "77",
        "SLURM_NODEID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_NNODES": "2",
    }
    argv = ["--store", "etcd://e1:2379", "t.py"]
    assert parse_args(argv, environ=slurm).launch_id == "slurm-77.0.r0"
    # A requeued job keeps its job and step ids; the restart count makes it a new launch.
    assert parse_args(argv, environ={**slurm, "SLURM_RESTART_COUNT": "2"}).launch_id == "slurm-77.0.r2"
    manual = ["--node-rank", "1", "--nnodes", "2", "--store", "etcd://e1:2379", "t.py"]
    with pytest.raises(LaunchUsageError, match="needs --launch-id"):
        parse_args(manual, environ=SECRET_ENV)
    assert parse_args(["--launch-id", "run-7", *manual], environ=SECRET_ENV).launch_id == "run-7"
    assert parse_args(manual, environ={**SECRET_ENV, "SWIFT_LAUNCH_ID": "run-8"}).launch_id == "run-8"
    with pytest.raises(LaunchUsageError, match="--launch-id"):
        parse_args(["--launch-id", "a b", *manual], environ=SECRET_ENV)
    # One host: a new launch each time (the launcher makes the id); agent 0's own TCPStore: the same.
    assert parse_args(["t.py"], environ={}).launch_id is None
    assert parse_args(["--node-rank", "0", "--nnodes", "2", "t.py"], environ=SECRET_ENV).launch_id is None
