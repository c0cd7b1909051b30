"""A relaunch within a try repeats none of the try's preflight: the rank contract's storage, lineage
and tracking checks ran for its first launch; a relaunch only reads the resume point again (what
the group before committed, up to its last process). Real storage (``file://``), a hand-built task
instance at Airflow's boundary (XCom kept in a dict)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from airflow_torchrun import contract
from airflow_torchrun.backends.local.backend import LocalBackend
from airflow_torchrun.operators.contracts import TaskIO
from airflow_torchrun.operators.training_contract import TrainingContract, TrainingSettings
from airflow_torchrun.storage.checkpoints import CheckpointStore


@dataclass
class _TaskInstance:
    dag_id: str = "d"
    task_id: str = "train"
    run_id: str = "manual__2026-01-01"
    try_number: int = 1
    map_index: int = -1
    start_date: Any = None
    xcom: dict[str, Any] = field(default_factory=dict)

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcom[key] = value


@dataclass
class _RecordingIO(TaskIO):
    """The task's I/O, noting every call made under the preflight policy."""

    calls: list[str] = field(default_factory=list)

    def preflight(self, what: str, call: Any) -> Any:
        self.calls.append(what)
        return super().preflight(what, call)


def test_a_relaunch_reads_the_resume_point_again_and_checks_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW__TORCHRUN__DEPLOYMENT", "tests")
    ti = _TaskInstance()
    io = _RecordingIO(
        context={"ti": ti},  # type: ignore[arg-type]
        where="task d.train",
        log=logging.getLogger("test"),
        backend=LocalBackend(tmp_path / "state"),
        preflight_budget=5,
    )
    uri = f"file://{tmp_path}/ckpt"
    training = TrainingContract(
        io,
        TrainingSettings(track=False),
        dag_id="d",
        task_id="train",
        checkpoint_uri=uri,
        resume="auto",
        shard_manifest=None,
        mlflow_experiment=None,
    )
    first = training.env()
    assert io.calls == [
        "checking checkpoint storage",
        "checking who owns the checkpoints",
        "finding the checkpoint to resume from",
    ]
    # The preflight's accounts wait for the next push (the engine's, after the launch): none of
    # them holds the launch up by a round trip to the API server.
    assert first[contract.RESUME_FROM] == "" and io.pushed["resumed_from"] is None
    assert ti.xcom == {}
    io.push("group", {"group_id": "g"})
    assert list(ti.xcom) == ["checkpoint_uri", "resumed_from", "mlflow_run_url", "checkpoint_url", "group"]
    assert ti.xcom["resumed_from"] is None and ti.xcom["checkpoint_uri"] == uri
    # The first launch committed step 7 on its way out (its save on SIGTERM, say).
    store = CheckpointStore(uri)
    Path(store.step_path(7)).mkdir(parents=True)
    store.fs.pipe_file(f"{store.step_path(7)}/state.pt", b"s" * 10)
    store.commit(7, {"world_size": 2})
    io.calls.clear()
    again = training.relaunch_env()
    assert io.calls == ["finding the checkpoint to resume from"]
    io.flush()
    assert again[contract.RESUME_FROM] == store.step_uri(7) and ti.xcom["resumed_from"]["step"] == 7
    assert {k: v for k, v in again.items() if k != contract.RESUME_FROM} == {
        k: v for k, v in first.items() if k != contract.RESUME_FROM
    }
