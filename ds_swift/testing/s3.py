"""A real S3-compatible server for tests: moto's server mode on a free loopback port, used through s3fs.

:func:`s3_server` starts it (port 0: the kernel picks a free one, so there is no race with other
tests), creates a bucket, points this process's AWS environment at it (child processes get the
same from :attr:`S3Server.env`), and stops it on exit, also on failure. Needs the dev extras
(``moto[server]``, ``s3fs``).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["S3Server", "s3_server"]


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    bucket: str
    #: the variables botocore/s3fs read: endpoint, fake credentials, region
    env: dict[str, str]

    def url(self, prefix: str | None = None) -> str:
        """``s3://bucket/prefix``, a fresh prefix when none is given."""
        return f"s3://{self.bucket}/{prefix or uuid.uuid4().hex}"


def _clear_s3fs_instances() -> None:
    import s3fs

    # fsspec caches filesystems by their arguments, not the environment: one made for another
    # server (another test module's) would keep talking to it
    s3fs.S3FileSystem.clear_instance_cache()


@contextmanager
def s3_server(bucket: str | None = None) -> Iterator[S3Server]:
    """Run moto's S3 server on 127.0.0.1 for the duration of the block (see the module docstring).

    The bucket is a fresh one unless named: moto keeps its buckets in process-wide state that
    outlives a server, so a second server in the same test process would find a fixed name taken.
    """
    bucket = bucket or f"ds-swift-test-{uuid.uuid4().hex[:12]}"
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    saved = dict(os.environ)
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            # never the developer's own profile or credentials
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }
        os.environ.update(env)
        for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            os.environ.pop(var, None)
        _clear_s3fs_instances()
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
        yield S3Server(endpoint, bucket, env)
    finally:
        _clear_s3fs_instances()
        os.environ.clear()
        os.environ.update(saved)
        server.stop()
