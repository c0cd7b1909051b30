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
    assert list(ti.xcom) == ["group", "checkpoint_uri", "resumed_from", "mlflow_run_url", "checkpoint_url"]
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


def test_an_account_that_cannot_be_sent_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A queued account (``soon``) whose push fails neither fails the push it follows (the group's,
    which must land: a group nobody can find would be torn down) nor is retried for ever."""

    class _Refusing(_TaskInstance):
        def xcom_push(self, key: str, value: Any) -> None:
            if key == "checkpoint_uri":
                raise RuntimeError("API server said 503")
            super().xcom_push(key, value)

    ti = _Refusing()
    io = TaskIO(
        context={"ti": ti}, where="task d.train", log=logging.getLogger("test"), backend=None, preflight_budget=5
    )  # type: ignore[arg-type]
    io.push("checkpoint_uri", "file:///c", soon=True)
    io.push("resumed_from", None, soon=True)
    assert ti.xcom == {}
    with caplog.at_level(logging.WARNING, logger="test"):
        io.push("group", {"group_id": "g"})
    assert ti.xcom == {"group": {"group_id": "g"}, "resumed_from": None}
    assert "Could not publish XCom checkpoint_uri: API server said 503" in caplog.text
    io.flush()  # nothing left to send
    assert io.pushed["checkpoint_uri"] == "file:///c"
