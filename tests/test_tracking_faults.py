"""Tracking outages against a real ``mlflow server`` (SQLite backend, 127.0.0.1): a finished group
is never failed by MLflow being down, and ranks keep training and re-send what they buffered.

The server is stopped (its port closed: connections are refused) and started again on the same
port with the same database, as when it is restarted or redeployed.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from airflow_torchrun.errors import TrackingError, retry_transient
from airflow_torchrun.tracking import (
    TAG_TRY_NUMBER,
    TrackingUnreachableError,
    _remember_unfinished,
    check_tracking_uri,
    close_unfinished,
    ensure_run,
    finish_run,
    unfinished_runs,
)
from airflow_torchrun.worker.tracking import RunLogger
from tests.mlflow_server import MlflowServer
from tests.ports import refusing_port
from tests.s3_fixtures import HungServer, http_answering

log = logging.getLogger(__name__)


@pytest.fixture
def server(mlflow_server: MlflowServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MlflowServer:
    """The session's server, running; this test's own state directory (records of unfinished runs)."""
    mlflow_server.start()
    monkeypatch.setenv("AIRFLOW__TORCHRUN__STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return mlflow_server


def _context(task_id: str, try_number: int = 1) -> dict[str, Any]:
    ti = SimpleNamespace(dag_id="faults", run_id="manual__1", task_id=task_id, map_index=-1, try_number=try_number)
    return {"ti": ti}


def _task() -> str:
    return f"train_{uuid.uuid4().hex[:8]}"


# -- the Airflow side: ensure_run and finish_run ----------------------------------------------------
@pytest.mark.slow
def test_finish_run_gives_up_within_its_budget_and_the_run_is_closed_when_the_server_is_back(
    server: MlflowServer,
) -> None:
    """Afterwards: finish_run returned False in about its budget without raising while the server
    was down; the run was recorded, and the next tracking call after the restart (a later task's
    ensure_run) closed it FINISHED with the end time of the group; no record is left."""
    from mlflow import MlflowClient

    run_id = ensure_run(_context(_task()), tracking_uri=server.uri)
    server.stop()

    ended = time.time()
    started = time.monotonic()
    assert finish_run(run_id, succeeded=True, tracking_uri=server.uri, budget=3) is False
    assert time.monotonic() - started < 10
    assert [(r["run_id"], r["status"]) for r in unfinished_runs(server.uri)] == [(run_id, "FINISHED")]

    # Meanwhile the setup of a new task says "transient", and fast: the operator retries it.
    started = time.monotonic()
    with pytest.raises(TrackingError) as info:
        retry_transient(lambda: ensure_run(_context(_task()), tracking_uri=server.uri), budget=1.5, what="setup")
    assert info.value.transient and isinstance(info.value, TrackingUnreachableError)
    assert time.monotonic() - started < 10

    server.start()
    later = ensure_run(_context(_task()), tracking_uri=server.uri)
    client = MlflowClient(server.uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert abs(run.info.end_time / 1000 - ended) < 5  # when the group ended, not when the server came back
    assert unfinished_runs(server.uri) == []
    assert client.get_run(later).info.status == "RUNNING"
    # And with the server up, finish_run records at once.
    assert finish_run(later, succeeded=False, tracking_uri=server.uri, budget=3) is True
    assert client.get_run(later).info.status == "FAILED"


def test_a_record_is_dropped_when_a_later_try_took_the_run_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mlflow_sqlite_uri: str
) -> None:
    """Afterwards: try 1's unapplied FAILED did not close the run try 2 is running; the record is gone."""
    from airflow_torchrun.tracking import client

    monkeypatch.setenv("AIRFLOW__TORCHRUN__STATE_DIR", str(tmp_path / "state"))
    uri = mlflow_sqlite_uri
    task = _task()
    run_id = ensure_run(_context(task, 1), tracking_uri=uri)
    assert ensure_run(_context(task, 2), tracking_uri=uri) == run_id  # (e.g. on another worker)
    _remember_unfinished(uri, run_id, "FAILED", int(time.time() * 1000), "1")
    mlflow_client = client(uri)
    assert close_unfinished(mlflow_client) == 0
    run = mlflow_client.get_run(run_id)
    assert run.info.status == "RUNNING" and run.data.tags[TAG_TRY_NUMBER] == "2"
    assert unfinished_runs(uri) == []
    # A record of the try that is still the run's last one is applied.
    _remember_unfinished(uri, run_id, "FAILED", int(time.time() * 1000), "2")
    assert close_unfinished(mlflow_client) == 1
    assert mlflow_client.get_run(run_id).info.status == "FAILED"


@pytest.fixture
def http_503() -> Iterator[str]:
    """A server that answers every request 503 (a proxy in front of a dead MLflow)."""
    with http_answering(503) as url:
        yield url


def test_check_and_setup_say_transient_or_permanent(
    http_503: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Afterwards: a refused port and a 503 are transient; an unwritable SQLite location is not;
    finish_run against a dead server returns False without raising."""
    monkeypatch.setenv("AIRFLOW__TORCHRUN__STATE_DIR", str(tmp_path / "state"))
    with pytest.raises(TrackingError, match="answered HTTP 503") as info:
        check_tracking_uri(http_503)
    assert info.value.transient
    with refusing_port() as port, pytest.raises(TrackingError, match="not reachable") as info:
        ensure_run(_context(_task()), tracking_uri=f"http://127.0.0.1:{port}")
    assert info.value.transient
    (tmp_path / "file").write_text("x")
    with pytest.raises(TrackingError, match="cannot create the directory") as info:
        check_tracking_uri(f"sqlite:///{tmp_path / 'file' / 'sub' / 'mlflow.db'}")
    assert not info.value.transient
    assert finish_run("0" * 32, succeeded=True, tracking_uri=http_503, budget=1) is False


# -- inside a rank: RunLogger ------------------------------------------------------------------------
@pytest.mark.slow
def test_run_logger_rides_out_a_restart_and_logs_every_step_once(server: MlflowServer) -> None:
    """Afterwards: no exception reached the loop while the server was down, the loop was not
    stalled, and after the restart and a flush every step's loss is in the run exactly once; a
    metric first seen during the outage and params logged during it are there too."""
    from mlflow import MlflowClient

    run_id = ensure_run(_context(_task()), tracking_uri=server.uri)
    tracker = RunLogger(run_id=run_id, tracking_uri=server.uri, rank=0, flush_every=5, request_timeout=2)
    for step in range(10):
        tracker.log_step(step, loss=1.0 / (step + 1))
    assert tracker.pending == 0

    server.stop()
    started = time.monotonic()
    tracker.log_params({"lr": 0.1})
    for step in range(10, 30):
        tracker.log_step(step, loss=1.0 / (step + 1), **({"lr": 0.1} if step >= 15 else {}))
        time.sleep(0.05)
    assert time.monotonic() - started < 5  # refused connections cost milliseconds, then back-off
    assert tracker.pending == 20 + 15 and not tracker.flush()

    server.start()
    for step in range(30, 35):
        tracker.log_step(step, loss=1.0 / (step + 1), lr=0.1)
    assert tracker.flush() and tracker.pending == 0
    tracker.close()

    client = MlflowClient(server.uri)
    loss = client.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in loss) == list(range(35))  # each step once: nothing lost, nothing twice
    assert sorted(m.step for m in client.get_metric_history(run_id, "lr")) == list(range(15, 35))
    assert client.get_run(run_id).data.params == {"lr": "0.1"}
    assert tracker.metrics_dropped == 0


def test_run_logger_buffer_is_bounded_and_drops_the_oldest(caplog: pytest.LogCaptureFixture) -> None:
    """Afterwards: with nothing answering, the buffer holds the newest max_buffered values, the
    overflow is counted and named in a warning, and close() returns within its budget."""
    with refusing_port() as port:
        uri = f"http://127.0.0.1:{port}"
        tracker = RunLogger(run_id="0" * 32, tracking_uri=uri, rank=0, flush_every=1, max_buffered=10, close_budget=0.5)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="airflow_torchrun.worker.tracking"):
            for step in range(25):
                tracker.log_metrics({"loss": float(step)}, step)
            tracker.close()
    assert time.monotonic() - started < 10
    assert tracker.pending == 10 and tracker.metrics_dropped == 15
    assert [m.step for m in tracker._pending] == list(range(15, 25))
    text = caplog.text
    assert "buffer full" in text and "dropped the oldest" in text
    assert "did not take 10 buffered metric values (steps 15-24)" in text


def test_a_hung_server_does_not_stall_training(hung_server: HungServer) -> None:
    """Afterwards: 40 steps took a few request timeouts at most, not one timeout per step."""
    tracker = RunLogger(
        run_id="0" * 32,
        tracking_uri=f"http://127.0.0.1:{hung_server.port}",
        rank=0,
        flush_every=2,
        request_timeout=1,
        close_budget=0,
    )
    started = time.monotonic()
    for step in range(40):
        tracker.log_step(step, loss=1.0)
        time.sleep(0.01)
    assert time.monotonic() - started < 6
    assert tracker.pending == 40
