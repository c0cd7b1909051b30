"""Small parts of the training view: the document's rank states, the checkpoint link, ``make ui``'s plan."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from airflow_torchrun.backends.handles import LocalHandle
from airflow_torchrun.contract.progress import ProgressRecord
from airflow_torchrun.links import checkpoint_url, model_version_url
from airflow_torchrun.progress import ProgressBoard
from airflow_torchrun.status import GroupStatus, NodeObservation, NodePhase, Outcome
from airflow_torchrun.ui.document import RANK_STATES, build_document


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
        ids={"dag_id": "d"}, handle=handle, status=GroupStatus(Outcome.FAILED, nodes, 0, "x"), board=board
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


@pytest.mark.slow
def test_an_ended_group_without_reports_reached_its_last_committed_checkpoint() -> None:
    """A Kubernetes group's ranks' reports go with its pods; its checkpoints still tell how far it got."""
    from airflow_torchrun.ui.document import CheckpointRow

    handle = LocalHandle(group_id="g", num_nodes=2, world_size=2, launched_at=1.0, startup_timeout=60, teardown_grace=1,
                         group_dir="/x", master_port=1)  # fmt: skip
    nodes = (NodeObservation(0, NodePhase.FAILED, exit_code=1), NodeObservation(1, NodePhase.FAILED, exit_code=1))
    rows = [
        CheckpointRow(step=20, uri="s3://b/step-20", committed=True, size=1, time=1.0, try_number=1),
        CheckpointRow(step=40, uri="s3://b/step-40", committed=False, size=1, time=2.0, try_number=1),
        CheckpointRow(step=60, uri="s3://b/step-60", committed=True, size=1, time=3.0, try_number=2),
    ]
    status = GroupStatus(Outcome.FAILED, nodes, 1, "x")
    doc = build_document(ids={"try_number": 1}, handle=handle, status=status, board=None, checkpoints=rows)
    assert doc["progress"]["reached"] == 20 and "last committed checkpoint" in doc["progress_line"]
    running = GroupStatus(Outcome.RUNNING, nodes, None, None)
    assert (
        build_document(ids={"try_number": 1}, handle=handle, status=running, board=None, checkpoints=rows)["progress"]
        is None
    )


@pytest.mark.slow  # starts `python -m airflow_torchrun.ui.serve --dry-run`
def test_make_ui_plans_both_services_on_the_demo_state(tmp_path: object) -> None:
    argv = ["--dry-run", "--airflow-port", "18080", "--mlflow-port", "15000"]
    cmd = [sys.executable, "-m", "airflow_torchrun.ui.serve", *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    assert "Airflow UI  http://localhost:18080" in out and "simple_auth_manager_passwords.json.generated" in out
    assert "MLflow UI   http://localhost:15000" in out and "mlflow ui --backend-store-uri sqlite:///" in out


def test_the_api_reads_a_failed_groups_diagnosis_and_an_earlier_tries_handle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_torchrun.backends.local.backend import LocalBackend
    from airflow_torchrun.naming import GroupIdentity
    from airflow_torchrun.ui import api

    monkeypatch.setenv("AIRFLOW__TORCHRUN__STATE_DIR", str(tmp_path))
    group_id = GroupIdentity("d", "train", "r1", try_number=1).group_id
    group = tmp_path / "groups" / group_id
    now = time.time()
    handle = LocalHandle(group_id=group_id, num_nodes=2, world_size=2, launched_at=now - 5, startup_timeout=60,
                         teardown_grace=1, group_dir=str(group), master_port=1)  # fmt: skip
    for node, code in ((0, -15), (1, 1)):
        (group / f"node-{node}").mkdir(parents=True)
        exit_info = {"returncode": code, "finished_at": now - (1 if node else 0)}
        if code < 0:
            exit_info |= {"signal": "SIGTERM", "stopped_by": "teardown"}
        (group / f"node-{node}" / "exit.json").write_text(json.dumps(exit_info))
        (group / f"node-{node}" / "node.log").write_text(
            f"[node {node} rank {node}] starting\n"
            + (
                "[node 1 rank 1] Traceback (most recent call last):\n[node 1 rank 1] ValueError: bad batch\n"
                if node
                else ""
            )
        )
    (group / "group.json").write_text(json.dumps(handle.to_dict()))
    found = LocalBackend.for_view(GroupIdentity("d", "train", "r1", try_number=1), {}, log_read_limit=1 << 20)
    assert isinstance(found, tuple) and found[0] == handle  # what ?try_number=1 shows
    assert LocalBackend.for_view(GroupIdentity("d", "train", "r1", try_number=2), {}, log_read_limit=1) is None
    entry = api.look(*found)
    assert entry.status is not None and entry.status.state is Outcome.FAILED
    assert entry.failure and "ValueError: bad batch" in entry.failure, entry.failure
    doc = build_document(ids={}, handle=handle, status=entry.status, board=entry.board, failure=entry.failure)
    assert [r["state"] for r in doc["ranks"]] == ["stopped", "failed"] and doc["failure"] == entry.failure


def test_a_group_whose_task_succeeded_is_shown_succeeded_without_looking(tmp_path) -> None:
    """A Kubernetes group's Job is deleted once done: looking would find it gone. The view takes
    the task instance's success for the group's when the summary names that group."""
    from airflow_torchrun.backends.handles import LocalHandle
    from airflow_torchrun.backends.local.backend import LocalBackend
    from airflow_torchrun.status import Outcome
    from airflow_torchrun.ui.api import look

    def handle(name: str) -> LocalHandle:
        return LocalHandle(
            group_id=name, num_nodes=2, world_size=2, launched_at=1.0, startup_timeout=600.0,
            teardown_grace=1.0, group_dir=str(tmp_path / name), master_port=1,
        )  # fmt: skip

    backend = LocalBackend(tmp_path)
    assert look(handle("gone-a"), backend, now=5.0).status.state is not Outcome.SUCCEEDED  # nothing on disk
    entry = look(handle("gone-b"), backend, now=5.0, succeeded=True)
    assert entry.status.state is Outcome.SUCCEEDED and entry.failure is None


def test_the_view_draws_the_goodput_ledger_one_bar_per_try_and_only_known_categories() -> None:
    from airflow_torchrun.ui.api import _goodput_view

    ledger = {
        "version": 1,
        "categories": ["admission", "launching", "productive"],
        "try": {"try": 2, "wall_s": 10.0, "ettr": 0.6, "outcome": "succeeded", "categories": {"productive": 6.0}},
        "tries": [
            {
                "try": 1,
                "wall_s": 8.0,
                "ettr": 0.25,
                "outcome": "failed",
                "lost_steps": 9,
                "categories": {"launching": 4.0, "productive": 2.0, "lost_work": 2.0},
            },
            {
                "try": 2,
                "wall_s": 10.0,
                "ettr": 0.6,
                "outcome": "succeeded",
                "categories": {"launching": 4.0, "productive": 6.0, "<img src=x>": 99.0, "tail": float("nan")},
            },
        ],
        "task": {"wall_s": 20.0, "ettr": 7.0, "categories": {"productive": 8.0}},
    }
    view = _goodput_view(ledger)
    assert view is not None
    assert [t["try"] for t in view["tries"]] == [1, 2]
    assert view["tries"][0]["seconds"] == {"launching": 4.0, "productive": 2.0, "lost_work": 2.0}
    assert view["tries"][0]["lost_steps"] == 9
    # A category the ledger does not know, and a value that is not a number, are not drawn.
    assert view["tries"][1]["seconds"] == {"launching": 4.0, "productive": 6.0}
    assert view["task"]["ettr"] is None  # not a share
    assert "version" not in view["categories"] and view["categories"][0] == "admission"
    assert _goodput_view({"version": 1}) is None and _goodput_view("x") is None
    assert view["resume_audit"] is None  # a fresh start: nothing audited


def test_the_view_tells_the_resume_audit_with_its_first_differing_step() -> None:
    from airflow_torchrun.ui.api import _goodput_view

    def ledger(audit: object) -> dict[str, object]:
        one = {"try": 2, "wall_s": 10.0, "ettr": 0.5, "outcome": "succeeded", "categories": {"productive": 5.0}}
        return {"version": 1, "try": one, "tries": [one], "resume_audit": audit}

    diverged = {
        "status": "diverged",
        "resumed_step": 20,
        "compared": 9,
        "steps": [21, 29],
        "ranks": [0, 1],
        "max_relative": 0.5,
        "tolerance": 1e-3,
        "first_difference": {"step": 21, "rank": 0, "before": 2.31, "after": 2.0},
        "first_divergence": {"step": 21, "rank": 0, "before": 2.31, "after": 2.0},
    }
    view = _goodput_view(ledger(diverged))
    assert view is not None and view["resume_audit"] == {
        "status": "diverged",
        "resumed_step": 20,
        "compared": 9,
        "steps": [21, 29],
        "max_relative": 0.5,
        "tolerance": 1e-3,
        "first_difference": {"step": 21, "rank": 0, "before": 2.31, "after": 2.0},
        "first_divergence": {"step": 21, "rank": 0, "before": 2.31, "after": 2.0},
    }
    # Whoever may write XCom writes this too: an unknown status is no audit, and only numbers pass.
    assert _goodput_view(ledger({**diverged, "status": "<b>exact</b>"}))["resume_audit"] is None  # type: ignore[index]
    odd = {**diverged, "steps": ["<i>", 29], "first_divergence": {"step": 21, "rank": "0", "before": "x", "after": 2.0}}
    shown = _goodput_view(ledger(odd))["resume_audit"]  # type: ignore[index]
    assert shown["steps"] is None
    assert shown["first_divergence"] == {"step": 21, "rank": None, "before": None, "after": 2.0}


class _Ti:
    """The five fields that name a try, as Airflow's task instance and its key both carry them."""

    def __init__(self, try_number: int) -> None:
        self.dag_id, self.task_id, self.run_id, self.map_index, self.try_number = "d", "train", "r", -1, try_number


def test_a_training_tasks_links_come_from_what_its_try_pushed_without_an_xcom_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Airflow's worker asks each extra link as the task ends, each an XCom read through the API
    server; the try kept what it pushed, so the links are answered from that. Another try's key, or
    a key this try never pushed, still reads XCom (through :func:`safe_link` either way)."""
    from types import SimpleNamespace

    from airflow_torchrun import links
    from airflow_torchrun.operators.contracts import TaskIO

    monkeypatch.setenv("AIRFLOW__TORCHRUN__MLFLOW_UI_URL", "http://mlflow.internal:5000")
    reads: list[str] = []
    stored = "http://mlflow.internal:5000/#/experiments/1/runs/stored"
    monkeypatch.setattr(links.XCom, "get_value", lambda *, key, ti_key: reads.append(key) or stored)
    ti = _Ti(try_number=2)
    io = TaskIO(context={"ti": ti}, where="task d.train", log=None, backend=None, preflight_budget=1.0)  # type: ignore[typeddict-item]
    operator = SimpleNamespace(_io=io)
    run = "http://mlflow.internal:5000/#/experiments/1/runs/pushed"
    io.pushed[links.MLFLOW_RUN_URL_KEY] = run
    io.pushed[links.CHECKPOINT_URL_KEY] = "javascript:alert(1)"  # pushed or read, it passes safe_link
    assert links.MlflowRunLink().get_link(operator, ti_key=ti) == run  # type: ignore[arg-type]
    assert links.MlflowRunLink().get_link(operator, ti_key=_Ti(try_number=2)) == run  # type: ignore[arg-type]
    assert links.CheckpointLink().get_link(operator, ti_key=ti) == ""  # type: ignore[arg-type]
    assert reads == []
    assert links.MlflowRunLink().get_link(operator, ti_key=_Ti(try_number=1)) == stored  # type: ignore[arg-type]
    assert links.ModelVersionLink().get_link(operator, ti_key=ti) == stored  # never pushed: read  # type: ignore[arg-type]
    assert links.MlflowRunLink().get_link(None, ti_key=ti) == stored  # type: ignore[arg-type]
    assert reads == [links.MLFLOW_RUN_URL_KEY, links.MODEL_VERSION_URL_KEY, links.MLFLOW_RUN_URL_KEY]
