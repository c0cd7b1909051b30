"""Kueue on the real cluster: a queued group is admitted as a whole; a second one waits, with
Kueue's own reason in its task log, and is admitted when the first ends."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cluster import kube
from cluster.layout import NAMESPACE

from .conftest import Airflow, Recorder

QUEUED = """
import pendulum
from airflow.sdk import DAG
from airflow_torchrun import DistributedTrainingOperator

with DAG("{dag_id}", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False):
    DistributedTrainingOperator(
        task_id="train", backend="kubernetes", runtime="queued", script="/opt/trainer/train.py",
        script_args=["--epochs", "{epochs}", "--checkpoint-every", "0"],
        num_nodes=2, nproc_per_node=1, track=False, retries=0, startup_timeout=600,
    )
"""


def kueue_running() -> bool:
    try:
        kube.kubectl("get", "localqueues.kueue.x-k8s.io", "-n", NAMESPACE, "training", timeout=15)
    except (RuntimeError, subprocess.TimeoutExpired):
        return False
    return True


def test_a_second_queued_group_waits_for_quota_with_kueues_reason(airflow: Airflow, tmp_path: Path) -> None:
    if not kueue_running():
        pytest.fail("Kueue is not running on the cluster (make cluster starts it; see .state/cluster/logs/kueue.log)")
    base = yaml.safe_load(Path(airflow.env["AIRFLOW__TORCHRUN__RUNTIMES_FILE"]).read_text())["cpu"]
    runtimes = tmp_path / "runtimes.yaml"
    runtimes.write_text(yaml.safe_dump({"queued": {**base, "queue": "training"}}))
    airflow.env["AIRFLOW__TORCHRUN__RUNTIMES_FILE"] = str(runtimes)
    # The first group must still hold the quota when the second one's task (tens of seconds of
    # `airflow dags test` start-up) asks: 8 epochs (about 1 s of training) were over by then once.
    airflow.write_dag("queued_first", QUEUED.format(dag_id="queued_first", epochs=400))
    airflow.write_dag("queued_second", QUEUED.format(dag_id="queued_second", epochs=2))
    with Recorder(airflow.env["AIRFLOW__TORCHRUN__DEPLOYMENT"]) as seen:
        first = subprocess.Popen(
            [sys.executable, "-m", "airflow", "dags", "test", "queued_first"],
            env=airflow.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        # Start the second once the first is admitted (its Job unsuspended) and running.
        deadline = time.monotonic() + 300
        while not any(p.startswith("queued-first") for p in seen.nodes):
            assert first.poll() is None, first.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "the first queued group never got its pods"
            time.sleep(1)
        second = airflow.dags_test("queued_second")
        first_out = first.communicate(timeout=900)[0]
    assert first.returncode == 0, first_out[-4000:]
    assert airflow.task_states("queued_first")["train"][0] == "success", first_out[-4000:]
    assert second.state("train") == "success", second.output[-4000:]
    # Kueue's reason for keeping the second group out, in that task's log.
    assert re.search(r"insufficient unused quota|couldn't assign flavors", second.output), second.output[-5000:]
    # Admitted as a whole: both pods of a group ran on the two nodes together.
    second_nodes = sorted(n for p, n in seen.nodes.items() if p.startswith("queued-second"))
    assert second_nodes == ["atr-node-0", "atr-node-1"], seen.nodes
