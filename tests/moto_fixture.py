"""A real S3 API on localhost: moto's server, talked to through s3fs with AWS_ENDPOINT_URL.

Import the fixtures into a test module: `from moto_fixture import moto_endpoint, s3_remote`.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator

import pytest

SECRET = "spotune-test-secret-" + secrets.token_hex(6)
"""The dummy secret key every S3 test uses; tests assert it never reaches a file or a log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """http://127.0.0.1:<port> of a moto S3 server shared by the session's tests."""
    pytest.importorskip("s3fs", reason="pip install 'spotune[test]'")
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def s3_env(endpoint: str) -> dict[str, str]:
    """The environment a trainer process needs to reach the moto server (dummy credentials)."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "spotune-test-key",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        # The credential chain must not wander off to an instance metadata endpoint.
        "AWS_EC2_METADATA_DISABLED": "true",
    }


@pytest.fixture
def s3_remote(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """`s3://<fresh bucket>/run`, with this process's environment pointed at the moto server."""
    for key, value in s3_env(moto_endpoint).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    import s3fs

    bucket = f"spotune-{secrets.token_hex(4)}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    return f"s3://{bucket}/run"


def environ_with(endpoint: str) -> dict[str, str]:
    return {**os.environ, **s3_env(endpoint)}


def sparse(cond: Callable[[], bool], every: float = 0.25) -> Callable[[], bool]:
    """`cond`, asked at most once per `every` seconds (False in between): for a wait that looks at the store.
    Each look costs this process an S3 request and moto's server answering it (10-30 ms of CPU, a listing with
    its manifests more), so a wait that polls every 20 ms for a trainer's whole start-up spends seconds of CPU
    looking. Drills gate such a look on a local sign first (the run's lock file, a local checkpoint) too."""
    last = -every

    def ask() -> bool:
        nonlocal last
        now = time.monotonic()
        if now - last < every:
            return False
        last = now
        return cond()

    return ask
