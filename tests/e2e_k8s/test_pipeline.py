"""The shipped pipeline (``dags/torchrun_pipeline.py``) on the real cluster, as ``make demo
BACKEND=kubernetes`` runs it: export -> shard (to S3) -> train on two nodes -> evaluate -> register ->
approve -> promote, with rank 1 failing once at step 30 so that the retry resumes from the step-20
checkpoint in S3. Its final weights must equal those of the same pipeline run without the failure."""

from __future__ import annotations

import json
from typing import Any

from cluster.layout import ROOT

from .conftest import FINAL, Airflow, DagRun, Recorder

DAG_ID = "torchrun_pipeline"


def run_pipeline(airflow: Airflow, fail_at_step: int, shards: str) -> DagRun:
    conf: dict[str, Any] = {
        "backend": "kubernetes",
        "shards_uri": shards,
        "fail_at_step": fail_at_step,
        "require_approval": False,
    }
    return airflow.dags_test(DAG_ID, conf)


def test_the_pipeline_survives_a_planned_failure_on_the_cluster_with_the_uninterrupted_weights(
    airflow: Airflow,
) -> None:
    airflow.env["AIRFLOW__CORE__DAGS_FOLDER"] = str(ROOT / "dags")
    deployment = airflow.env["AIRFLOW__TORCHRUN__DEPLOYMENT"]
    base = airflow.env["AIRFLOW__TORCHRUN__CHECKPOINT_BASE"].rstrip("/").rsplit("/", 1)[0]
    with Recorder(deployment) as seen:
        failed_once = run_pipeline(airflow, 30, f"{base}/e2e-shards/{deployment}-failing")
    out = failed_once.output
    for task in ("export_dataset", "shard", "train", "evaluate", "register", "approve", "promote"):
        assert failed_once.state(task) in ("success", "skipped"), (task, failed_once.tasks, out[-5000:])
    assert failed_once.state("train") == "success" and failed_once.tries("train") == 2, failed_once.tasks
    resumed = airflow.xcom(DAG_ID, "train", "resumed_from")
    assert resumed and resumed["step"] == 20 and str(resumed["uri"]).startswith("s3://"), resumed
    assert "Simulated failure" in out, out[-5000:]
    registered = airflow.xcom(DAG_ID, "register")
    assert registered and int(registered["version"]) >= 1, registered
    evaluation = airflow.xcom(DAG_ID, "evaluate")
    assert evaluation and evaluation["accuracy"] >= 0.9, evaluation
    # Training and evaluation ran as pods on both nodes.
    assert sorted(set(seen.nodes.values())) == ["atr-node-0", "atr-node-1"], seen.nodes

    clean = run_pipeline(airflow, 0, f"{base}/e2e-shards/{deployment}-clean")
    assert clean.state("train") == "success" and clean.tries("train") == 1, clean.tasks
    assert FINAL.findall(out), out[-5000:]
    assert FINAL.findall(out)[-1] == FINAL.findall(clean.output)[-1], json.dumps(
        {"with the failure": FINAL.findall(out), "without": FINAL.findall(clean.output)}
    )
