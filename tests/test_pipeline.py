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

pytestmark = pytest.mark.slow
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


def test_pipeline_trains_through_a_failure_and_registers_once(home):
    conf = {"fail_at_step": 30, "epochs": 3}
    result = airflow(home, "dags", "test", DAG_ID, "-c", json.dumps(conf))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-5000:]
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


def test_a_failing_gate_skips_registration(home):
    conf = {"epochs": 1, "quality_gate": {"accuracy": ">= 0.999"}}
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
