"""Retraining on new data: ``torchrun_retrain``'s asset watcher under ``airflow standalone``, S3 from moto.

The repository's ``dags/`` with ``TORCHRUN_RETRAIN_URI=s3://moto_data@<bucket>/incoming/`` (the
connection ``moto_data`` points at moto's server) and a 1 s poll. ``torchrun_pipeline`` stays paused,
so the runs the retraining triggers wait queued and train nothing. What must hold:

- the object already there when the watcher first looks triggers nothing;
- one new object -> exactly one asset event and one run of ``torchrun_retrain``, which hands that
  object's URI to ``torchrun_pipeline`` (its run's conf), and nothing more over the next polls;
- the triggerer killed (kill -9, with everything under it) and a new one started: it takes the
  watcher over from the asset state store and does not report the object again; an object that
  landed while no triggerer ran is reported once (in-memory state would have lost it, a watcher
  firing on everything it finds would report both again).

About 2 minutes on two cores.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests import s3_fixtures
from tests.chaos.test_chaos_triggerer import Triggerers
from tests.conftest import ROOT
from tests.s3_fixtures import MotoS3
from tests.standalone import Standalone, start_standalone, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

moto_s3 = s3_fixtures.moto_s3
DAG_ID = "torchrun_retrain"
POLL_S = 1  # each check below waits out several polls: the shorter, the sooner done
HEALTH_THRESHOLD_S = 15


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory, moto_s3: MotoS3) -> Iterator[tuple[Standalone, str, Any]]:
    bucket = moto_s3.make_bucket("incoming")
    client = moto_s3.client()
    client.put_object(Bucket=bucket, Key="incoming/digits-0.npz", Body=b"there before the watcher")
    connection = {
        "conn_type": "aws",
        "login": s3_fixtures.ACCESS_KEY,
        "password": s3_fixtures.SECRET_KEY,
        "extra": {"endpoint_url": moto_s3.endpoint, "region_name": s3_fixtures.REGION},
    }
    extra = {
        "TORCHRUN_RETRAIN_URI": f"s3://moto_data@{bucket}/incoming/",
        "TORCHRUN_RETRAIN_POLL_S": str(POLL_S),
        "AIRFLOW_CONN_MOTO_DATA": json.dumps(connection),
        "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": str(HEALTH_THRESHOLD_S),
        # The loaded API server answered a task's first start after 33-55 s (past the worker's
        # patience): one retry, so that does not fail the run.
        "AIRFLOW__CORE__DEFAULT_TASK_RETRIES": "1",
        "AIRFLOW__CORE__DEFAULT_TASK_RETRY_DELAY": "0",
    }
    root = tmp_path_factory.mktemp("watcher")
    with start_standalone(root, ROOT / "dags", DAG_ID, "newest_data", extra_env=extra) as server:
        triggerers = Triggerers(server)
        try:
            yield server, bucket, triggerers
        finally:
            triggerers.stop()


def _get(server: Standalone, path: str) -> Any:
    """A GET that rides out a busy API server (one worker, on two cores shared with the training)."""

    def answer() -> Any:
        code, data = server.request("GET", path)
        assert code in (0, 200) or code >= 500, f"GET {path} -> {code}: {data}"
        return data if code == 200 else None

    return wait_for(f"GET {path}", answer, 120, interval=1.0)


def _runs(server: Standalone, dag_id: str = DAG_ID) -> list[dict[str, Any]]:
    return list(_get(server, f"/api/v2/dags/{dag_id}/dagRuns?limit=100&order_by=run_after")["dag_runs"])


def _events(server: Standalone) -> list[dict[str, Any]]:
    events = _get(server, "/api/v2/assets/events?limit=100&order_by=timestamp")["asset_events"]
    return [e for e in events if e.get("source_dag_id") is None and "/incoming" in e["uri"]]


def _watcher_output(server: Standalone, triggerers: Triggerers) -> str:
    outs = [server.output_text()]
    for n in range(len(triggerers.started)):
        outs.append((server.home.parent / f"triggerer-{n}.out").read_text(errors="replace"))
    return "\n".join(outs)


def _steady(server: Standalone, runs: int, events: int, seconds: float) -> None:
    """No more runs or events than expected for ``seconds`` (several polls), looking every 3 s (the
    API server's one worker also starts the tasks: a test hammering it made a task's start time out)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert len(_runs(server)) <= runs, _runs(server)
        time.sleep(3)
    assert (len(_runs(server)), len(_events(server))) == (runs, events)


def test_new_data_triggers_one_run_and_a_triggerer_restart_none_twice(
    watched: tuple[Standalone, str, Any], moto_s3: MotoS3
) -> None:
    server, bucket, triggerers = watched
    client = moto_s3.client()
    server.unpause()  # torchrun_pipeline stays paused: its triggered runs wait, queued
    uri = f"s3://moto_data@{bucket}/incoming/"
    first_look = f"{uri} holds 1 object(s) now"
    wait_for("the watcher's first look", lambda: first_look in _watcher_output(server, triggerers), 180, interval=2.0)
    _steady(server, runs=0, events=0, seconds=3 * POLL_S)  # what was there triggers nothing

    client.put_object(Bucket=bucket, Key="incoming/digits-1.npz", Body=b"new data")
    wait_for("a run of torchrun_retrain", lambda: _runs(server), 120, interval=3.0)
    _steady(server, runs=1, events=1, seconds=4 * POLL_S)
    (run,) = _runs(server)
    state = server.wait_run_state(run["dag_run_id"], {"success", "failed"})
    assert state == "success", server.task_log(run["dag_run_id"])[-6000:]
    event = _events(server)[0]
    assert event["extra"]["payload"]["new"] == [f"s3://{bucket}/incoming/digits-1.npz"], event
    (pipeline,) = _runs(server, "torchrun_pipeline")
    assert pipeline["conf"] == {"source_uri": f"s3://{bucket}/incoming/digits-1.npz"}, pipeline

    # The triggerer dies; data lands while none runs; a new triggerer takes the watcher over.
    env, _victims = triggerers.kill_current()
    client.put_object(Bucket=bucket, Key="incoming/digits-2.npz", Body=b"landed while no triggerer ran")
    triggerers.start(env, 0)
    resumed = f"Watching {uri} every {POLL_S:g}s for new data (resuming from its state)"
    wait_for(
        "the new triggerer to watch again", lambda: resumed in _watcher_output(server, triggerers), 240, interval=2.0
    )
    wait_for("the run for the data that landed meanwhile", lambda: len(_runs(server)) >= 2, 120, interval=3.0)
    _steady(server, runs=2, events=2, seconds=5 * POLL_S)
    assert _events(server)[1]["extra"]["payload"]["new"] == [f"s3://{bucket}/incoming/digits-2.npz"]

    # A new version of a known object is new data too.
    client.put_object(Bucket=bucket, Key="incoming/digits-1.npz", Body=b"new data, second version")
    wait_for("a run for the new version", lambda: len(_runs(server)) >= 3, 120, interval=3.0)
    _steady(server, runs=3, events=3, seconds=3 * POLL_S)
