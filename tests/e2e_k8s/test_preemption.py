"""A pod taken away mid-run, by a plain delete and through the Eviction API, on the real cluster,
with the task watching the group itself and deferred to the trigger: the group is relaunched within
the try (``max_preemptions``), resumes from S3, and ends with the very weights of a run nobody
interrupted."""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import pytest

from cluster import kube
from cluster.layout import NAMESPACE

from .conftest import Airflow

LONG = """
import pendulum
from airflow.sdk import DAG
from airflow_torchrun import DistributedTrainingOperator

with DAG("{dag_id}", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False):
    DistributedTrainingOperator(
        task_id="train", backend="kubernetes", runtime="cpu", script="/opt/trainer/train.py",
        script_args=["--epochs", "12", "--checkpoint-every", "20", "--log-every", "20"],
        num_nodes=2, nproc_per_node=1, track=False, retries=0, max_preemptions=1, startup_timeout=300,
        deferrable={deferrable}, defer_after=0,
    )
"""
FINAL = re.compile(r"FINAL step=(\d+) weights_sha256=([0-9a-f]{64})")
# The uninterrupted run's final step and weights digest, made once per session.
_UNINTERRUPTED: dict[str, tuple[str, str]] = {}


def uninterrupted(airflow: Airflow) -> tuple[str, str]:
    if "digest" not in _UNINTERRUPTED:
        airflow.write_dag("uninterrupted", LONG.format(dag_id="uninterrupted", deferrable=False))
        run = airflow.dags_test("uninterrupted")
        assert run.state("train") == "success", run.output[-5000:]
        found = FINAL.findall(run.output)
        assert found, run.output[-5000:]
        _UNINTERRUPTED["digest"] = found[-1]
    return _UNINTERRUPTED["digest"]


def group_pods(deployment: str) -> list[dict[str, Any]]:
    items = kube.kubectl_json("get", "pods", "-n", NAMESPACE, "-l", f"airflow-torchrun/deployment={deployment}")
    return list(items["items"])


def committed_checkpoint(pod: str) -> bool:
    log = kube.kubectl("logs", "-n", NAMESPACE, pod, "-c", "trainer", check=False)
    return bool(re.search(r"step (2\d|[3-9]\d)/", log))


def take_away(deployment: str, how: str, seen: dict[str, Any]) -> None:
    """Once node 0 has logged step 20+ (a checkpoint is committed), delete or evict node 1's pod."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        pods = group_pods(deployment)
        running = [p for p in pods if p["status"].get("phase") == "Running"]
        by_index = {p["metadata"]["labels"].get("batch.kubernetes.io/job-completion-index"): p for p in running}
        if "0" in by_index and "1" in by_index and committed_checkpoint(by_index["0"]["metadata"]["name"]):
            victim = by_index["1"]["metadata"]["name"]
            seen["victim"] = victim
            seen["nodes"] = sorted(p["spec"].get("nodeName", "") for p in running)
            if how == "delete":
                kube.kubectl("delete", "pod", "-n", NAMESPACE, victim, "--wait=false")
            else:
                eviction = {
                    "apiVersion": "policy/v1",
                    "kind": "Eviction",
                    "metadata": {"name": victim, "namespace": NAMESPACE},
                }
                kube.kubectl(
                    "create",
                    "--raw",
                    f"/api/v1/namespaces/{NAMESPACE}/pods/{victim}/eviction",
                    "-f",
                    "-",
                    input=json.dumps(eviction),
                )
            # What the API server and the controllers write into the pod's status (the fake's model).
            for _ in range(40):
                try:
                    pod = kube.kubectl_json("get", "pod", "-n", NAMESPACE, victim)
                except RuntimeError:
                    break
                seen.setdefault("conditions", {}).update(
                    {c["type"]: (c["status"], c.get("reason")) for c in pod["status"].get("conditions", [])}
                )
                seen["phase"] = pod["status"].get("phase")
                time.sleep(0.5)
            return
        time.sleep(1)
    seen["error"] = "no pod reached step 20"


@pytest.mark.parametrize(
    ("how", "deferrable"), [("evict", False), ("delete", True)], ids=["evict-sync", "delete-deferrable"]
)
def test_a_pod_taken_away_mid_run_relaunches_the_group_within_the_try(
    airflow: Airflow, how: str, deferrable: bool
) -> None:
    expected = uninterrupted(airflow)
    airflow.write_dag("preempted", LONG.format(dag_id="preempted", deferrable=deferrable))
    seen: dict[str, Any] = {}
    worker = threading.Thread(
        target=take_away, args=(airflow.env["AIRFLOW__TORCHRUN__DEPLOYMENT"], how, seen), daemon=True
    )
    worker.start()
    run = airflow.dags_test("preempted")
    worker.join(timeout=30)
    assert "error" not in seen, seen
    print(f"{how}: victim {seen.get('victim')} on nodes {seen.get('nodes')}; conditions {seen.get('conditions')}")
    # The 2-node group really ran on the two nodes.
    assert seen["nodes"] == ["atr-node-0", "atr-node-1"], seen
    assert run.state("train") == "success", run.output[-5000:]
    assert run.tries("train") == 1, "the preemption spent an Airflow retry"
    assert re.search(r"[Rr]elaunch", run.output), run.output[-5000:]
    assert re.search(r"Resumed from s3://\S+ at step \d+", run.output), run.output[-5000:]
    if how == "evict":
        assert seen["conditions"].get("DisruptionTarget", ("", ""))[0] == "True", seen
    if deferrable:
        assert "Pausing task as DEFERRED" in run.output or "deferred" in run.output.lower(), run.output[-5000:]
    # Resumed, and ended exactly where the uninterrupted run did: same last step, same weights.
    assert FINAL.findall(run.output)[-1] == expected, (FINAL.findall(run.output), expected)
