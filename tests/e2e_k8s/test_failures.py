"""Failures as the real cluster produces them: a rank's exit code under the Job controller's
podFailurePolicy, and a group the scheduler cannot place."""

from __future__ import annotations

import re
import time
from pathlib import Path

import yaml

from .conftest import Airflow, Recorder

FAILING = """
import pendulum
from airflow.sdk import DAG
from airflow_torchrun import DistributedTrainingOperator

with DAG("exit_code", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False):
    DistributedTrainingOperator(
        task_id="train", backend="kubernetes", runtime="cpu",
        command=["python", "-c", "import os, sys, time; time.sleep(3); sys.exit(3 * int(os.environ['RANK']))"],
        num_nodes=2, nproc_per_node=1, track=False, retries=2, fail_on_exit_codes=[3], startup_timeout=300,
    )
"""


def test_a_rank_exiting_with_a_fail_on_exit_code_fails_the_task_once(airflow: Airflow) -> None:
    airflow.write_dag("exit_code", FAILING)
    started = time.monotonic()
    with Recorder(airflow.env["AIRFLOW__TORCHRUN__DEPLOYMENT"]) as seen:
        run = airflow.dags_test("exit_code")
    took = time.monotonic() - started
    print("Job conditions seen:", seen.job_conditions)
    # Afterwards: the task failed in its first try (retries=2 not spent), and said why: the rank,
    # its exit code, and that Kubernetes failed the Job through the podFailurePolicy.
    assert run.state("train") == "failed", run.output[-4000:]
    assert run.tries("train") == 1, f"retried although 3 is in fail_on_exit_codes:\n{run.output[-4000:]}"
    assert re.search(r"rank 1 .*exited with code 3", run.output), run.output[-4000:]
    # The real Job controller ended the Job through our podFailurePolicy, not a backoff limit.
    (conditions,) = seen.job_conditions.values()
    # (FailureTarget comes first, Failed once the pods are gone; the teardown may delete the Job
    # in between.)
    verdicts = [c for c in conditions if c["type"] in ("FailureTarget", "Failed") and c["status"] == "True"]
    assert verdicts and all(c["reason"] == "PodFailurePolicy" for c in verdicts), conditions
    assert took < 600


def unschedulable_runtimes(airflow: Airflow, tmp_path: Path) -> Path:
    base = yaml.safe_load(Path(airflow.env["AIRFLOW__TORCHRUN__RUNTIMES_FILE"]).read_text())["cpu"]
    path = tmp_path / "runtimes.yaml"
    path.write_text(yaml.safe_dump({"huge": {**base, "resources": {"cpu": "64", "memory": "2Gi"}}}))
    return path


UNSCHEDULABLE = """
import pendulum
from airflow.sdk import DAG
from airflow_torchrun import DistributedTrainingOperator

with DAG("unschedulable", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False):
    DistributedTrainingOperator(
        task_id="train", backend="kubernetes", runtime="huge", script="/opt/trainer/train.py",
        num_nodes=2, nproc_per_node=1, track=False, retries=0, startup_timeout=45,
    )
"""


def test_a_group_no_node_can_take_fails_at_startup_timeout_with_the_schedulers_message(
    airflow: Airflow, tmp_path: Path
) -> None:
    airflow.env["AIRFLOW__TORCHRUN__RUNTIMES_FILE"] = str(unschedulable_runtimes(airflow, tmp_path))
    airflow.write_dag("unschedulable", UNSCHEDULABLE)
    started = time.monotonic()
    run = airflow.dags_test("unschedulable")
    took = time.monotonic() - started
    assert run.state("train") == "failed", run.output[-4000:]
    # The scheduler's own words, e.g. "0/2 nodes are available: 2 Insufficient cpu."
    assert re.search(r"0/2 nodes are available: .*Insufficient cpu", run.output), run.output[-4000:]
    assert took > 45, "failed before the startup timeout"
