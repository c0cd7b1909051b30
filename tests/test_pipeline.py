"""The shipped pipeline DAG end to end, through Airflow's own CLI, checked with MLflow's own client.

``airflow dags test torchrun_pipeline`` runs every task for real (sharding, a 2-node torchrun group
that loses rank 1 once and resumes, evaluation, registration) in an Airflow home of its own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
DAG_ID = "torchrun_pipeline"


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("pipeline")
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(base / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__TORCHRUN__STATE_DIR": str(base / "state"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, capture_output=True)
    return env


def airflow(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "airflow", *args], env=env, capture_output=True, text=True, timeout=600, check=False
    )


def mlflow_client(env: dict[str, str]):  # type: ignore[no-untyped-def]
    from mlflow import MlflowClient

    uri = f"sqlite:///{env['AIRFLOW__TORCHRUN__STATE_DIR']}/mlflow/mlflow.db"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def last_run_id(output: str) -> str:
    for line in output.splitlines():
        if "DagRun Finished" in line and "run_id=" in line:
            return line.split("run_id=", 1)[1].split(",", 1)[0]
    raise AssertionError("no finished DAG run in the output:\n" + output[-3000:])


# What the metadata database says of a run's training task: each try's start and end, the XCom
# values of its last try, the checkpoint asset's event (read in the home's own Airflow).
FACTS = """
import json, sys
from airflow.models.asset import AssetEvent
from airflow.models.taskinstance import TaskInstance
from airflow.models.taskinstancehistory import TaskInstanceHistory
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session
from sqlalchemy import select

dag_id, run_id = sys.argv[1], sys.argv[2]
with create_session() as session:
    tries = []
    for model in (TaskInstanceHistory, TaskInstance):
        rows = session.scalars(select(model).where(model.dag_id == dag_id, model.run_id == run_id,
                                                   model.task_id == "train"))
        tries += [(r.try_number, r.start_date.timestamp(), r.end_date.timestamp()) for r in rows]
    xcom = {}
    for key in ("goodput", "resume_audit"):
        row = session.scalars(XComModel.get_many(run_id=run_id, key=key, task_ids="train", dag_ids=dag_id)).first()
        xcom[key] = None if row is None else XComModel.deserialize_value(row)
    events = session.scalars(select(AssetEvent).order_by(AssetEvent.id)).all()
    extra = [e.extra for e in events if "goodput" in (e.extra or {})]
print(json.dumps({"tries": sorted(tries), "xcom": xcom, "asset_extra": extra[-1] if extra else None}))
"""


def training_facts(env: dict[str, str], run_id: str) -> dict:  # type: ignore[type-arg]
    result = subprocess.run(
        [sys.executable, "-c", FACTS, DAG_ID, run_id], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def failed_once(home: dict[str, str]) -> tuple[str, str]:
    """The pipeline with its planned failure (rank 1 killed at step 30, the retry resumes from 20)."""
    conf = {"fail_at_step": 30, "epochs": 3, "require_approval": False}
    result = airflow(home, "dags", "test", DAG_ID, "-c", json.dumps(conf))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-5000:]
    return out, last_run_id(out)


def test_pipeline_trains_through_a_failure_and_registers_once(home, failed_once):
    out, _ = failed_once
    assert "was killed by signal SIGKILL" in out  # the planned failure of try 1
    assert "resuming from file://" in out and "(step 20)" in out
    run_id = last_run_id(out)

    client = mlflow_client(home)
    experiment = client.get_experiment_by_name(DAG_ID)
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "one MLflow run per DAG run and task, reused by the retry"
    run = runs[0]
    assert run.data.tags["airflow.dag_id"] == DAG_ID and run.data.tags["airflow.run_id"] == run_id
    assert run.data.tags["airflow.try_number"] == "2"
    # One loss value per step, logged by rank 0 only, across both tries: steps 1..N exactly once.
    total = int(re.search(r"FINAL step=(\d+)", out).group(1))  # type: ignore[union-attr]
    history = client.get_metric_history(run.info.run_id, "loss")
    steps = sorted(m.step for m in history)
    assert steps == list(range(1, total + 1))
    assert {"throughput_samples_per_s", "data_wait_fraction", "eval_accuracy"} <= set(run.data.metrics)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "loss_curve.png" in artifacts

    (version,) = client.search_model_versions("name = 'digits-mlp'")
    assert version.run_id == run.info.run_id
    model = client.get_registered_model("digits-mlp")
    assert model.aliases == {"candidate": version.version, "champion": version.version}

    # Running the registration again for the same DAG run registers nothing new.
    again = airflow(home, "tasks", "test", DAG_ID, "register", run_id)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert len(client.search_model_versions("name = 'digits-mlp'")) == 1


def test_the_pipeline_reports_where_its_time_went_and_that_its_resume_was_exact(home, failed_once):
    out, run_id = failed_once
    facts = training_facts(home, run_id)
    (one, first_start, _first_end), (two, second_start, second_end) = facts["tries"]
    assert (one, two) == (1, 2)
    goodput = facts["xcom"]["goodput"]
    this, task = goodput["try"], goodput["task"]
    # Try 2's categories add up to its wall time as Airflow measured it (start to end of the try).
    airflow_wall = second_end - second_start
    assert abs(sum(this["categories"].values()) - airflow_wall) <= 0.02 * airflow_wall, (this, airflow_wall)
    # The task's: from try 1's start to try 2's end, the gap between the tries a restart gap.
    task_wall = second_end - first_start
    assert abs(sum(task["categories"].values()) - task_wall) <= 0.02 * task_wall, (task, task_wall)
    assert [t["try"] for t in goodput["tries"]] == [1, 2] and task["tries"] == 2
    # Lost work: resumed from step 20, rank 1 died on reaching step 30: steps 21-29 were done twice.
    ledger = [line for line in out.splitlines() if "Goodput of try" in line or "Resume audit" in line]
    assert this["lost_steps"] == 9 and task["lost_steps"] == 9, (this, task, ledger)
    assert this["categories"]["lost_work"] > 0 and task["categories"]["restart_gap"] > 0
    # ETTR is productive time over wall time, the task's summing its tries (which of the two is the
    # larger depends on the job: with this tiny model a step takes milliseconds, startup seconds).
    assert 0 < this["ettr"] < 1 and 0 < task["ettr"] < 1, (this, task)
    assert this["ettr"] == pytest.approx(this["categories"]["productive"] / this["wall_s"], abs=2e-3), this
    productive = sum(t["categories"]["productive"] for t in goodput["tries"])
    assert task["categories"]["productive"] == pytest.approx(productive, abs=0.01), (task, goodput["tries"])
    assert goodput["tries"][0]["outcome"] == "failed" and this["outcome"] == "succeeded"
    assert "Goodput of try 2: ETTR" in out and "the task (2 tries)" in out
    # The recomputed steps' losses were the ones try 1 reported, bit for bit.
    audit = facts["xcom"]["resume_audit"]
    assert audit["status"] == "exact" and audit["resumed_step"] == 20 and audit["steps"] == [21, 29], audit
    assert "Resume audit (resumed from step 20): exact" in out
    assert facts["asset_extra"]["goodput"]["tries"] == 2 and facts["asset_extra"]["resume_audit"] == "exact"
    run = mlflow_client(home).search_runs([mlflow_client(home).get_experiment_by_name(DAG_ID).experiment_id])[0]
    assert run.data.tags["torchrun.resume_audit"] == "exact"
    assert run.data.metrics["goodput_lost_steps"] == 9 and 0 < run.data.metrics["goodput_ettr"] < 1


def test_a_failing_gate_skips_registration(home):
    # One node: the gate judges the evaluation's metrics, however many nodes trained.
    conf = {"num_nodes": 1, "epochs": 1, "quality_gate": {"accuracy": ">= 0.999"}, "require_approval": False}
    result = airflow(home, "dags", "test", DAG_ID, "-c", json.dumps(conf))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-5000:]
    assert "quality gate" in out.lower() and "skip" in out.lower()
    client = mlflow_client(home)
    versions = client.search_model_versions("name = 'digits-mlp'")
    assert all(v.tags.get("airflow.run_id") != last_run_id(out) for v in versions)


@pytest.mark.parametrize(
    ("conf", "expected"),
    [
        ({"num_nodes": 0}, "num_nodes"),
        ({"learning_rate": -1}, "learning_rate"),
        ({"backend": "slurm"}, "backend"),
        ({"quality_gate": {"accuracy": "about 0.9"}}, "quality_gate"),
        ({"quality_gate": {}}, "quality_gate"),
    ],
)
def test_params_out_of_bounds_are_refused_before_work_starts(home, conf, expected):
    result = airflow(home, "dags", "test", DAG_ID, "-c", json.dumps(conf))
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert "Invalid input for param" in out and expected in out
    assert "Launched group" not in out


def test_the_pipeline_dag_imports_cleanly(home):
    result = airflow(home, "dags", "list-import-errors", "-o", "json")
    assert result.returncode == 0, result.stderr[-2000:]
    # the JSON document is the last line (Airflow logs warnings before it)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
    assert Path(ROOT / "dags" / "torchrun_pipeline.py").is_file()
