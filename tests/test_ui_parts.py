"""Small parts of the training view: the document's rank states, the checkpoint link, ``make ui``'s plan."""

from __future__ import annotations

import subprocess
import sys

import pytest

from airflow_torchrun.backends.handles import LocalHandle
from airflow_torchrun.links import checkpoint_url, model_version_url
from airflow_torchrun.progress import ProgressBoard
from airflow_torchrun.status import GroupState, GroupStatus, NodeObservation, NodePhase
from airflow_torchrun.ui.document import RANK_STATES, build_document
from airflow_torchrun.worker.progress import ProgressRecord


@pytest.mark.parametrize(
    ("uri", "template", "url"),
    [
        (
            "s3://bucket/a/b/step-00000040",
            None,
            "https://s3.console.aws.amazon.com/s3/buckets/bucket?prefix=a/b/step-00000040/",
        ),
        ("s3://b/k", "http://minio:9001/browser/{bucket}/{key}", "http://minio:9001/browser/b/k"),
        ("file:///tmp/ck/step-1", None, "file:///tmp/ck/step-1"),
        ("file:///tmp/ck", "http://files.local{path}", "http://files.local/tmp/ck"),
    ],
)
def test_checkpoint_url(uri: str, template: str | None, url: str) -> None:
    assert checkpoint_url(uri, template) == url


def test_model_version_url() -> None:
    assert model_version_url("http://m:5000/", "digits mlp", 3) == "http://m:5000/#/models/digits%20mlp/versions/3"


def test_document_gives_every_rank_its_node_state_and_progress() -> None:
    handle = LocalHandle(group_id="g", num_nodes=2, world_size=4, launched_at=1.0, startup_timeout=60, teardown_grace=1,
                         group_dir="/x", master_port=1)  # fmt: skip
    nodes = (
        NodeObservation(0, NodePhase.FAILED, exit_code=1),
        NodeObservation(1, NodePhase.FAILED, exit_code=-15, signal="SIGTERM", stopped_by="teardown"),
    )
    board = ProgressBoard(nproc_per_node=2)
    board.add([ProgressRecord(rank=3, step=7, time=2.0, total_steps=10, samples_per_s=50.0, data_wait=0.1)])
    doc = build_document(
        ids={"dag_id": "d"}, handle=handle, status=GroupStatus(GroupState.FAILED, nodes, 0, "x"), board=board
    )
    assert [(r["rank"], r["node_rank"], r["local_rank"], r["state"]) for r in doc["ranks"]] == [
        (0, 0, 0, "failed"),
        (1, 0, 1, "failed"),
        (2, 1, 0, "stopped"),
        (3, 1, 1, "stopped"),
    ]
    assert doc["ranks"][3]["step"] == 7 and doc["ranks"][2]["signal"] == "SIGTERM"
    assert {r["state"] for r in doc["ranks"]} <= set(RANK_STATES)
    assert doc["progress"]["step"] == 7 and doc["nproc_per_node"] == 2 and doc["state"] == "failed"
    empty = build_document(ids={}, handle=None, status=None, board=None)
    assert empty["state"] == "pending" and empty["ranks"] == []


def test_make_ui_plans_both_services_on_the_demo_state(tmp_path: object) -> None:
    argv = ["--dry-run", "--airflow-port", "18080", "--mlflow-port", "15000"]
    cmd = [sys.executable, "-m", "airflow_torchrun.ui.serve", *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    assert "Airflow UI  http://localhost:18080" in out and "simple_auth_manager_passwords.json.generated" in out
    assert "MLflow UI   http://localhost:15000" in out and "mlflow ui --backend-store-uri sqlite:///" in out
