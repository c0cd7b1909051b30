"""A real ``mlflow server`` (SQLite backend) on 127.0.0.1 that tests stop and start again.

One per session (the ``mlflow_server`` fixture of ``tests/conftest.py``): each test makes its own
runs (and its own experiment where it counts them), and a test that stops the server (the fault it
injects) leaves it to the next user to start it again (:meth:`MlflowServer.start` is a no-op while
it runs). The port is kept across restarts, as when a tracking server is restarted or redeployed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.ports import ReservedPort


class MlflowServer:
    """``mlflow server`` in a session of its own, stopped by that session's process group."""

    def __init__(self, root: Path) -> None:
        self.root = root
        # Held while the object lives: the server is down between a fault test's stop and start.
        self._port = ReservedPort()
        self.port = self._port.port
        self.uri = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 180.0) -> None:
        if self._proc is not None:
            return
        command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}", "--workers", "1"]
        command += ["--default-artifact-root", str(self.root / "artifacts")]
        # Without MLflow 3's job runner (huey consumers for server-side jobs, which no test uses): it
        # cost about 23 s of CPU per start here and doubled the time to healthy (16 s -> 39 s).
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with (self.root / "server.log").open("ab") as out:
            self._proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.root, env=env
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                log = (self.root / "server.log").read_text()[-3000:]
                self.stop()
                raise RuntimeError(f"mlflow server exited: {log}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        # Not left running for the rest of the session (a loaded machine once kept one for 35 minutes).
        self.stop()
        raise RuntimeError(f"mlflow server not healthy after {timeout}s")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        try:  # uvicorn's worker may outlive the CLI: stop every member
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # uvicorn's worker may outlive the CLI for a moment
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) != 0:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"port {self.port} still open after stopping the server")

    def close(self) -> None:
        """Stopped for good: the port is let go."""
        try:
            self.stop()
        finally:
            self._port.close()
