"""A tracking URI's credentials (``http://user:secret@host``, ``?token=...``) reach no log line, error,
record file, link or pod spec."""

from __future__ import annotations

import json

import pytest

from airflow_torchrun.backends.kubernetes import checks
from airflow_torchrun.errors import TrackingError
from airflow_torchrun.redaction import credentials_in, redact, without_credentials
from airflow_torchrun.tracking import _remember_unfinished, check_tracking_uri, tracking_error, unfinished_runs

SECRET = "s3cr3t-Pa55"
URI = f"http://alice:{SECRET}@127.0.0.1:9/mlflow?token=tok-123"


def test_credentials_are_found_in_the_user_part_and_the_query() -> None:
    assert sorted(credentials_in(URI)) == sorted([SECRET, "tok-123"])
    assert credentials_in("http://127.0.0.1:5000") == []
    assert redact(f"could not reach {URI}", URI) == "could not reach http://alice:***@127.0.0.1:9/mlflow?token=***"
    assert without_credentials(URI) == "http://127.0.0.1:9/mlflow?token=tok-123"


def test_an_unreachable_server_is_reported_without_its_credentials() -> None:
    # Port 9 (discard) on loopback: nothing answers; the error names the server, not its password.
    with pytest.raises(TrackingError) as raised:
        check_tracking_uri(URI, timeout=2.0)
    assert SECRET not in str(raised.value) and "tok-123" not in str(raised.value)
    wrapped = tracking_error(RuntimeError(f"API request to {URI} failed"), "logging a metric", URI)
    assert SECRET not in str(wrapped) and "***" in str(wrapped)


def test_an_unfinished_run_record_keeps_no_credentials(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AIRFLOW__TORCHRUN__STATE_DIR", str(tmp_path))
    path = _remember_unfinished(URI, "run-1", "FINISHED", 1, "1")
    assert path is not None and SECRET not in path.read_text() and "tok-123" not in path.read_text()
    # ... and is still found for the server it belongs to, by digest.
    assert [r["run_id"] for r in unfinished_runs(URI)] == ["run-1"]
    assert unfinished_runs("http://127.0.0.1:9/other") == []
    assert json.loads(path.read_text())["tracking_uri"].startswith("http://alice:***@")


def test_a_kubernetes_task_with_credentials_in_its_tracking_uri_is_refused_at_parse_time() -> None:
    problems = checks.task_problems(checkpoint_uri="s3://bucket/ckpt", default_checkpoint_base=None, tracking_uri=URI)
    assert len(problems) == 1 and "carries credentials" in problems[0] and "env_from_secrets" in problems[0]
    assert SECRET not in problems[0]
    assert (
        checks.task_problems(
            checkpoint_uri="s3://bucket/ckpt", default_checkpoint_base=None, tracking_uri="http://mlflow:5000"
        )
        == []
    )
