"""Storage and tracking trouble around a real local group, through ``dag.test()``.

What must hold: an S3 endpoint that is down before launch is waited for within
``preflight_budget`` (then the try fails *retryably*, with nothing launched); a tracking server
that is down when training ends never fails the finished task. Real parts: moto's S3 server
stopped and restarted on its port, a real ``mlflow server`` process stopped mid-run.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import s3_fixtures
from tests.conftest import group_processes
from tests.mlflow_server import MlflowServer

pytestmark = pytest.mark.slow


def once_training(action: Callable[[], None]) -> threading.Thread:
    """Run ``action`` from a thread once a group launched from now on has its rank 0 training."""
    state_dir = Path(os.environ["AIRFLOW__TORCHRUN__STATE_DIR"])
    # Only groups launched from now on: an earlier test's group may still be writing its log.
    earlier = set((state_dir / "groups").glob("*"))

    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for group in set((state_dir / "groups").glob("*")) - earlier:
                node_log = group / "node-0" / "node.log"
                if node_log.exists() and "rank=0" in node_log.read_text(errors="replace"):
                    action()
                    return
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _connection(monkeypatch: pytest.MonkeyPatch, s3: s3_fixtures.RestartableS3) -> None:
    conn = {
        "conn_type": "aws",
        "login": s3_fixtures.ACCESS_KEY,
        "password": s3_fixtures.SECRET_KEY,
        "extra": {"endpoint_url": s3.s3.endpoint, "region_name": s3_fixtures.REGION},
    }
    monkeypatch.setenv("AIRFLOW_CONN_FLAKY_S3", json.dumps(conn))


def _task(tiny_script: Path, bucket: str, **extra: object) -> str:
    args = "".join(f" {k}={v!r}," for k, v in extra.items())
    return f"""
        DistributedTrainingOperator(
            task_id="train", script={str(tiny_script)!r}, num_nodes=2, track=False, aws_conn_id="flaky_s3",
            checkpoint_uri="s3://{bucket}/ckpt",{args}
        )
        """


def test_a_storage_outage_before_launch_is_waited_for(run_dag, tiny_script, restartable_s3, monkeypatch):
    bucket = restartable_s3.s3.make_bucket()
    _connection(monkeypatch, restartable_s3)
    restartable_s3.stop()
    # Down long enough to be seen down even when starting the DAG run takes 15 s (a loaded machine).
    restartable_s3.start_after(25.0)
    result = run_dag(_task(tiny_script, bucket, preflight_budget=90, retries=0))
    assert result.state == "success", result.log[-4000:]
    assert result.try_number("train") == 1
    assert "checking checkpoint storage failed (transient" in result.log


def test_a_storage_outage_past_the_budget_fails_retryably_and_launches_nothing(
    run_dag, tiny_script, restartable_s3, monkeypatch
):
    bucket = restartable_s3.s3.make_bucket()
    _connection(monkeypatch, restartable_s3)
    restartable_s3.stop()
    result = run_dag(
        _task(tiny_script, bucket, preflight_budget=2, retries=1, retry_delay=0),
        imports="from datetime import timedelta",
    )
    assert result.state == "failed"
    # Retryable: Airflow tried again (a permanent error would have stopped at try 1).
    assert result.try_number("train") == 2, result.log[-3000:]
    assert "A retry may succeed" in result.log
    assert result.xcom("train", key="group") is None, "nothing may be launched against a store that is down"


def test_a_missing_bucket_fails_at_once_without_retry(run_dag, tiny_script, restartable_s3, monkeypatch):
    _connection(monkeypatch, restartable_s3)
    started = time.monotonic()
    result = run_dag(_task(tiny_script, "no-such-bucket-here", preflight_budget=60, retries=1, retry_delay=0))
    assert result.state == "failed"
    assert result.try_number("train") == 1
    assert "does not exist" in result.log and "A retry cannot fix this" in result.log
    assert time.monotonic() - started < 50, "a permanent error must not wait out the budget"
    # What the preflight pushed before it failed is published all the same (the view lists the root).
    assert result.xcom("train", key="checkpoint_uri") == "s3://no-such-bucket-here/ckpt"  # sent on the way out


def test_tracking_down_when_training_ends_does_not_fail_the_task(
    run_dag, tiny_script, mlflow_server: MlflowServer, caplog
):
    server = mlflow_server
    server.start()
    stopper = once_training(server.stop)
    try:
        result = run_dag(
            f"""
            DistributedTrainingOperator(
                task_id="train", script={str(tiny_script)!r}, num_nodes=2, retries=0, preflight_budget=3,
                mlflow_tracking_uri={server.uri!r}, env={{"STEPS": "60", "STEP_SECONDS": "0.1"}},
            )
            """
        )
    finally:
        stopper.join(5)
        server.stop()
    assert result.state == "success", result.log[-4000:]
    xcom = result.xcom("train")
    assert xcom["mlflow_run_id"] and xcom["node_exit_codes"] == [0, 0]
    said = result.log + caplog.text  # the tracking module logs through its own logger
    assert f"MLflow run {xcom['mlflow_run_id']} could not be marked FINISHED" in said
    assert group_processes(xcom["group_id"]) == []


def test_a_storage_outage_while_training_is_ridden_out_at_the_end(run_dag, tiny_script, restartable_s3, monkeypatch):
    bucket = restartable_s3.s3.make_bucket()
    _connection(monkeypatch, restartable_s3)

    def outage() -> None:  # down while the ranks train and when the group ends
        restartable_s3.stop()
        restartable_s3.start_after(30.0)

    stopper = once_training(outage)
    result = run_dag(_task(tiny_script, bucket, preflight_budget=60, retries=0, env={"STEPS": "20"}))
    stopper.join(5)
    assert result.state == "success", result.log[-4000:]
    assert "reading the final checkpoint failed (transient" in result.log
    assert result.xcom("train")["final_checkpoint"] is None  # the tiny script saves none


def test_a_kill_while_waiting_for_storage_launches_nothing(run_dag, tiny_script, restartable_s3, monkeypatch):
    bucket = restartable_s3.s3.make_bucket()
    _connection(monkeypatch, restartable_s3)
    restartable_s3.stop()
    restartable_s3.start_after(14.0)
    # What Airflow's task runner receives when the task is marked failed in the UI, mid-preflight.
    killer = threading.Timer(8.0, lambda: os.kill(os.getpid(), signal.SIGTERM))
    killer.start()
    result = run_dag(_task(tiny_script, bucket, preflight_budget=60, retries=0))
    killer.join()
    assert result.state == "failed"
    assert "was not launched: the task was killed (on_kill)" in result.log, result.log[-3000:]
    assert result.xcom("train", key="group") is None
