"""An S3-compatible server on 127.0.0.1 for tests: moto's server (from PyPI) as a subprocess, port 0."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from tests.support.processes import Process, child_env

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_REGION": "us-east-1"}


@contextmanager
def moto_server_process() -> Iterator[tuple[Process, str]]:
    """moto's S3 server (requests serialised: see moto_serial) on a free port of 127.0.0.1; yields it and its URL.

    Its output has one line per request (the benchmark counts them).
    """
    proc = Process([sys.executable, "-m", "tests.support.moto_serial", "--port", "0"], child_env(**CREDENTIALS))
    try:
        port = proc.wait_for(r"Running on http://127\.0\.0\.1:(\d+)", timeout=60).group(1)
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.stop()
        proc.cleanup()


@contextmanager
def moto_server() -> Iterator[str]:
    """moto's S3 server on a free port of 127.0.0.1; yields its endpoint URL."""
    with moto_server_process() as (_, url):
        yield url


def bucket_uri(prefix: str = "memproxy") -> str:
    """A fresh bucket location (moto wants bucket names of 3+ lowercase characters)."""
    return f"s3://mp-{uuid.uuid4().hex[:12]}/{prefix}"


def s3_environ(endpoint: str) -> dict[str, str]:
    """The standard AWS variables pointing at ``endpoint``."""
    return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
