"""A node lost mid-run on the real cluster: its kubelet and every process of its pods killed at once
(``python -m cluster lose-node``), as a power cut would. The rank on it dies with its pod, the peer's
collective fails, the group is torn down; the node goes NotReady (the controller manager's grace
period); the task's retry launches a new group on the node that is left and resumes from S3. Nothing
hangs, and the training ends with the uninterrupted run's weights. The node is brought back
afterwards, and then nothing of the test may be left on the cluster."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import yaml

from cluster import kube, up
from cluster.layout import ROOT

from .conftest import FINAL, Airflow, Code, Recorder, training_dag, uninterrupted, wait_for_step


def node_ready(name: str) -> bool:
    node = kube.kubectl_json("get", "node", name)
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))


def test_a_lost_node_fails_the_group_and_the_retry_trains_on_the_node_left(airflow: Airflow, tmp_path: Path) -> None:
    expected = uninterrupted(airflow)
    # Half a CPU per pod, so that the retry's two pods fit on the one node left.
    base = yaml.safe_load(Path(airflow.env["AIRFLOW__TORCHRUN__RUNTIMES_FILE"]).read_text())["cpu"]
    runtimes = tmp_path / "runtimes.yaml"
    runtimes.write_text(yaml.safe_dump({"half": {**base, "resources": {"cpu": "500m", "memory": "1Gi"}}}))
    airflow.env["AIRFLOW__TORCHRUN__RUNTIMES_FILE"] = str(runtimes)
    # The retry waits until the lost node is NotReady (20 s grace here), or the scheduler could still
    # bind a new pod to it.
    airflow.write_dag(
        "node_loss",
        training_dag("node_loss", runtime="half", retries=1, retry_delay=Code("timedelta(seconds=40)")),
    )
    deployment = airflow.env["AIRFLOW__TORCHRUN__DEPLOYMENT"]
    lost = ""
    try:
        with Recorder(deployment) as seen:
            log = airflow.home / "node_loss.log"
            with log.open("w") as out:  # a file, not a pipe nobody reads while it runs
                task = subprocess.Popen(
                    [sys.executable, "-m", "airflow", "dags", "test", "node_loss"],
                    env=airflow.env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            # Past step 40: the checkpoint of step 40 is committed (a step's line comes before its save).
            pods = wait_for_step(deployment, 45)
            lost = pods["1"]["spec"]["nodeName"]
            up.lose_node(lost)
            killed_at = time.monotonic()
            not_ready_after = None
            while task.poll() is None:
                if not_ready_after is None and not node_ready(lost):
                    not_ready_after = time.monotonic() - killed_at
                assert time.monotonic() - killed_at < 900, "the task hangs after the node loss"
                time.sleep(2)
            task.wait()
            output = log.read_text()
        states = airflow.task_states("node_loss")
        print(f"node {lost} lost; NotReady after {not_ready_after}s; task states {states}; jobs {seen.jobs}")
        assert not_ready_after is not None, f"{lost} never went NotReady"
        assert states["train"] == ("success", 2), output[-5000:]
        assert "Resumed from s3://" in output, output[-5000:]
        # The retry's group ran on the node that was left; never two groups at once.
        survivor = next(n for n in ("atr-node-0", "atr-node-1") if n != lost)
        retry_pods = {p: n for p, n in seen.nodes.items() if p.startswith(seen.jobs[-1])}
        assert retry_pods and set(retry_pods.values()) == {survivor}, (seen.nodes, seen.jobs)
        assert len(seen.jobs) == 2 and seen.most_jobs_running == 1, seen.jobs
        assert FINAL.findall(output)[-1] == expected, FINAL.findall(output)
    finally:
        if lost:
            subprocess.run([sys.executable, "-m", "cluster", "restore-node", lost], cwd=ROOT, check=True)
