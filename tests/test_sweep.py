"""The sweep example end to end: ``airflow dags test torchrun_sweep`` (``dag.test()`` underneath).

Two learning rates, one epoch each, one node: two mapped training instances, each with its own
checkpoint lineage (``train~map<i>``) and MLflow run, named ``lr=<value>`` by the
``map_index_template``; ``pick_best`` takes the higher test accuracy and ``register_best`` registers
that run's model. The training view of each instance lists both (one row per map index). The same
DAG under ``airflow standalone`` is in ``tests/pipeline_ui/test_pipeline_ui.py``. About 3 minutes on two cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
DAG_ID = "torchrun_sweep"
RATES = [0.001, 0.01]


def _env(base: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(base / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__TORCHRUN__STATE_DIR": str(base / "state"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def _query(env: dict[str, str], code: str) -> Any:
    """Run ``code`` (which prints one JSON document) against that Airflow home, in a process of its own."""
    cmd = [sys.executable, "-c", code]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


READ = """
import json
from airflow.models.taskinstance import TaskInstance
from airflow.utils.session import create_session
from sqlalchemy import select
from airflow_torchrun.ui.api import collect
with create_session() as s:
    tis = s.scalars(select(TaskInstance).where(TaskInstance.dag_id == "torchrun_sweep")).all()
    run_id = tis[0].run_id
    rows = sorted((t.task_id, t.map_index, str(getattr(t.state, "value", t.state)), t.rendered_map_index) for t in tis)
    view = collect(s, "torchrun_sweep", run_id, "train", 0, None)
print(json.dumps({"run_id": run_id, "tis": rows, "view": view}, default=str))
"""


def test_the_sweep_trains_each_rate_in_its_own_lineage_and_registers_the_best(tmp_path: Path) -> None:
    env = _env(tmp_path)
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, capture_output=True)
    conf = {"learning_rates": RATES, "epochs": 1}
    run = subprocess.run(
        [sys.executable, "-m", "airflow", "dags", "test", DAG_ID, "-c", json.dumps(conf)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1100,
        check=False,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-5000:]
    found = _query(env, READ)
    tis = {(t[0], t[1]): (t[2], t[3]) for t in found["tis"]}
    assert tis[("train", 0)] == ("success", "lr=0.001") and tis[("train", 1)] == ("success", "lr=0.01"), tis
    assert tis[("register_best", -1)][0] == "success", tis

    # One checkpoint lineage per instance, each with its own committed steps.
    run_dirs = list((tmp_path / "state" / "checkpoints" / DAG_ID).iterdir())
    assert len(run_dirs) == 1, run_dirs
    lineages = {}
    for index in (0, 1):
        root = run_dirs[0] / f"train~map{index}"
        lineages[index] = json.loads((root / "LINEAGE").read_text())
        assert any((d / "COMMITTED").exists() for d in root.glob("step-*")), f"no committed step in {root}"
    assert [lineages[i]["map_index"] for i in (0, 1)] == [0, 1], lineages

    # One MLflow run per instance; the registered version is the better one's.
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'state' / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(uri, registry_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name(DAG_ID).experiment_id])
    by_index = {int(r.data.tags["airflow.map_index"]): r for r in runs}
    assert sorted(by_index) == [0, 1] and by_index[0].info.run_id != by_index[1].info.run_id
    accuracy = {i: r.data.metrics["test_accuracy"] for i, r in by_index.items()}
    best = max(accuracy, key=lambda i: accuracy[i])
    (version,) = client.search_model_versions("name = 'digits-mlp-sweep'")
    assert version.run_id == by_index[best].info.run_id, (accuracy, version.run_id)
    assert f"best: map index {best} (lr={RATES[best]})" in out

    # The training view of instance 0: one row per map index, named as the UI names them.
    view = found["view"]
    assert view["map_name"] == "lr=0.001" and view["state"] == "succeeded", view
    assert [(m["map_index"], m["name"], m["state"]) for m in view["map_instances"]] == [
        (0, "lr=0.001", "success"),
        (1, "lr=0.01", "success"),
    ]
    assert view["checkpoint_uri"].endswith("/train~map0"), view["checkpoint_uri"]
