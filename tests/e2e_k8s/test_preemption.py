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

from .conftest import FINAL, Airflow, group_pods, last_step, pod_log, training_dag, uninterrupted


def take_away(deployment: str, how: str, seen: dict[str, Any]) -> None:
    """Once node 0 has logged step 20+ (a checkpoint is committed), delete or evict node 1's pod."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        pods = group_pods(deployment)
        running = [p for p in pods if p["status"].get("phase") == "Running"]
        by_index = {p["metadata"]["labels"].get("batch.kubernetes.io/job-completion-index"): p for p in running}
        if "0" in by_index and "1" in by_index and last_step(pod_log(by_index["0"]["metadata"]["name"])) >= 20:
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
    airflow.write_dag("preempted", training_dag("preempted", max_preemptions=1, deferrable=deferrable, defer_after=0))
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
