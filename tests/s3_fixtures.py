"""S3 over HTTP for tests: moto's server on 127.0.0.1, reached through s3fs like a real endpoint.

Bind the fixtures in a test module with ``moto_s3 = s3_fixtures.moto_s3`` (and ``s3_env``,
``restartable_s3``). For outages: :class:`RestartableS3` stops and restarts a server on the same
port (moto keeps its buckets in this process, like a real store keeps its data), and
:func:`s3_error_server` answers every request with one S3 error (a 503 ``SlowDown``, say);
``hung_server`` accepts connections, counts them and never answers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.request import Request, urlopen

import pytest

from tests.ports import ReservedPort

if TYPE_CHECKING:
    from airflow_torchrun.storage.checkpoints import CheckpointStore

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"
# The IAM policy a checkpoint writer needs, for the credential tests.
S3_ALL = json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]})


@dataclass
class MotoS3:
    """A running moto server and how to reach it."""

    endpoint: str
    _iam_users: dict[str, dict[str, str]] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """The AWS_* variables that point botocore/s3fs (and subprocesses) at this server."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
        }

    def storage_options(self, **overrides: Any) -> dict[str, Any]:
        """Explicit s3fs options for this server (no environment needed)."""
        options: dict[str, Any] = {
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "endpoint_url": self.endpoint,
            "client_kwargs": {"region_name": REGION},
        }
        options.update(overrides)
        return options

    def client(self, service: str = "s3", **kwargs: Any) -> Any:
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            aws_access_key_id=kwargs.pop("key", ACCESS_KEY),
            aws_secret_access_key=kwargs.pop("secret", SECRET_KEY),
            region_name=REGION,
            **kwargs,
        )

    def make_bucket(self, prefix: str = "ckpt") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def iam_user(self, name: str, *, allow_s3: bool) -> dict[str, str]:
        """An IAM user with an access key (created once), with or without S3 permissions."""
        if name not in self._iam_users:
            iam = self.client("iam")
            iam.create_user(UserName=name)
            key = iam.create_access_key(UserName=name)["AccessKey"]
            if allow_s3:
                iam.put_user_policy(UserName=name, PolicyName="s3-all", PolicyDocument=S3_ALL)
            self._iam_users[name] = {"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
        return self._iam_users[name]

    @contextlib.contextmanager
    def enforce_auth(self) -> Iterator[None]:
        """Make the server check signatures and IAM policies (moto accepts anything otherwise)."""
        self._post("/moto-api/reset-auth", b"0")
        try:
            yield
        finally:
            self._post("/moto-api/reset-auth", b"inf")

    def _post(self, path: str, data: bytes) -> None:
        # Not form-encoded: moto reads the raw body.
        request = Request(self.endpoint + path, data=data, method="POST", headers={"Content-Type": "text/plain"})
        with urlopen(request, timeout=10) as response:
            response.read()


def reachable(store: CheckpointStore, budget: float = 60.0) -> None:
    """``store.check_access()`` where a test needs the store usable, called as the operator's preflight
    calls it: a transient failure is retried within ``budget``, a permanent one raised at once. The
    check's own 2 s connect timeout is the product's; on a loaded machine the in-process moto server
    missed it once (a rehearsal's ``test_a_root_belongs_to_its_first_lineage[s3]``), which the
    preflight rides out."""
    from airflow_torchrun.errors import retry_transient

    retry_transient(store.check_access, budget=budget, what="checking checkpoint storage")


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    """moto's S3 (and IAM) server on a free localhost port, for the whole session."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = MotoS3(endpoint=f"http://{host}:{port}")
    try:
        # moto builds a service's app on its first request, seconds on a loaded machine: built here,
        # not in the first test's check with its short timeouts.
        s3.client().list_buckets()
        yield s3
    finally:
        server.stop()


@pytest.fixture
def s3_env(moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch) -> MotoS3:
    """The AWS_* variables set for this test (and the processes it starts)."""
    for key, value in moto_s3.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return moto_s3


class RestartableS3:
    """moto's S3 server on a fixed localhost port that a test can stop and start again.

    Stopped means the port is closed (connections are refused), as when the store's process is down.
    """

    def __init__(self) -> None:
        # Held while the object lives: the server is down between a fault test's stop and start.
        self._port = ReservedPort()
        self.port = self._port.port
        self.s3 = MotoS3(endpoint=f"http://127.0.0.1:{self.port}")
        self._server: Any = None

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        if self._server is None:
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
            server.start()
            self._server = server

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop()
            # ThreadedMotoServer.stop() leaves the listening socket open (connections would hang).
            server._server.server_close()

    def close(self) -> None:
        """Stopped for good: the port is let go."""
        self.stop()
        self._port.close()

    def start_after(self, seconds: float) -> threading.Timer:
        """Start the server again in ``seconds``, from another thread."""
        timer = threading.Timer(seconds, self.start)
        timer.daemon = True
        timer.start()
        return timer


@pytest.fixture
def restartable_s3() -> Iterator[RestartableS3]:
    """A running :class:`RestartableS3`, stopped at the end of the test."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = RestartableS3()
    server.start()
    try:
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def http_answering(status: int, body: bytes = b"", content_type: str = "application/xml") -> Iterator[str]:
    """An HTTP server on localhost answering every request with ``status`` and ``body``; yields its URL."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _answer

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def s3_error_server(
    status: int, code: str, message: str = "injected by the test"
) -> contextlib.AbstractContextManager[str]:
    """An endpoint answering every request with the S3 error ``code`` and ``status``."""
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
        "<RequestId>test</RequestId></Error>"
    ).encode()
    return http_answering(status, body)


@dataclass
class HungServer:
    """A localhost port that accepts connections and never answers (a hung server); ``connections``
    counts what it accepted."""

    port: int
    connections: int = 0


@pytest.fixture
def hung_server() -> Iterator[HungServer]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = HungServer(int(sock.getsockname()[1]))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:  # closed: the test is over
                return
            held.append(conn)  # open and silent until the test ends
            server.connections += 1

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        thread.join(timeout=5)
        for conn in held:
            conn.close()
