"""``make ui`` (``python -m airflow_torchrun.ui.serve``) stops what it started, however it is stopped.

The launcher starts the MLflow UI and ``airflow standalone`` in sessions of their own, so a signal
to the launcher (``kill``, a closed terminal's SIGHUP) reaches only the launcher. Before the fix
SIGTERM and SIGHUP ended the launcher and left both services serving on their ports. Each case
starts the real services on free ports in a temporary home, waits until the MLflow UI answers and
``airflow standalone`` has started its own services, signals the launcher, and checks that every
process of both process groups is gone and both ports are closed. About 20 s each on two cores.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.standalone import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _groups_members(pgids: set[int]) -> dict[int, str]:
    """Every live process whose process group is one of ``pgids``: pid -> command line."""
    found: dict[int, str] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in pgids:
            found[int(stat.parent.name)] = cmdline
    return found


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_make_ui_stops_both_services_when_it_is_signalled(
    tmp_path: Path, reserve_port: Callable[[], int], signum: signal.Signals
) -> None:
    # Held to the test's end, past the check that nothing listens on them after the services stopped.
    airflow_port, mlflow_port, worker_log_port, trigger_log_port = (reserve_port() for _ in range(4))
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(tmp_path / "airflow"),
        "AIRFLOW__TORCHRUN__STATE_DIR": str(tmp_path / "state"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(tmp_path / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(worker_log_port),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(trigger_log_port),
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    (tmp_path / "dags").mkdir()
    out = tmp_path / "serve.out"
    with open(out, "wb") as sink:
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "airflow_torchrun.ui.serve",
                "--airflow-port",
                str(airflow_port),
                "--mlflow-port",
                str(mlflow_port),
            ],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # as a terminal's job: its own group, so the test can clean up by it
        )
    pgids: set[int] = set()
    try:
        services = wait_for("the launcher to start both services", lambda: len(_children(launcher.pid)) == 2, 60)
        assert services
        pgids = set(_children(launcher.pid))  # each service leads a session (and group) of its own
        standalone = next(p for p in pgids if "standalone" in _groups_members({p}).get(p, ""))
        (mlflow,) = pgids - {standalone}
        # Each service's own processes (MLflow's uvicorn; standalone's api-server, scheduler, ...) are
        # what used to be left running: wait until they exist.
        wait_for("MLflow's server process", lambda: len(_groups_members({mlflow})) >= 2, 120)
        wait_for("airflow standalone's services", lambda: len(_groups_members({standalone})) >= 3, 120)
        assert launcher.poll() is None, out.read_text(errors="replace")

        launcher.send_signal(signum)
        code = launcher.wait(timeout=90)
        assert code == 128 + signum, f"exit {code}\n{out.read_text(errors='replace')[-3000:]}"
        left = wait_for_gone(pgids, 15)
        assert not left, f"still running after {signum.name} to the launcher: {left}"
        assert not _listening(mlflow_port) and not _listening(airflow_port)
        assert f"{signum.name}: stopping Airflow and MLflow" in out.read_text(errors="replace")
    finally:
        for pgid in [*pgids, launcher.pid]:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        launcher.wait(timeout=10)


def wait_for_gone(pgids: set[int], seconds: float) -> dict[int, str]:
    deadline = time.monotonic() + seconds
    left = _groups_members(pgids)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _groups_members(pgids)
    return left
