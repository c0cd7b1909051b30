"""Every object the Kubernetes backend renders is accepted by the real API server's dry run
(``dryRun=All``: admission, defaulting, validation, immutable fields: what no schema can check),
sent with the identity of the Airflow connection (so the documented Role allows creating them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.build import binary
from cluster.layout import NAMESPACE, state
from cluster.up import home_env

VARIANTS = {
    "plain": "",
    "deadline": "execution_timeout=timedelta(minutes=30),",
    "env": 'env={"NCCL_DEBUG": "WARN", "A_DOLLAR": "$HOME and $(NOT_EXPANDED)"},',
}
RUNTIMES = {
    "cpu": {},
    "queued": {"queue": "training"},
    "placed": {
        "node_selector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "example.com/dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        "priority_class": "",
        "labels": {"team": "ml"},
        "annotations": {"example.com/owner": "ml"},
        "writable_paths": ["/home/trainer/.cache"],
        "ttl_seconds_after_finished": 600,
    },
}


@pytest.fixture(scope="module")
def render_env(cluster_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], Path]:
    """What ``airflow-torchrun render`` needs: the cluster's settings, a DAGs folder, and no metadata
    database (it reads none); the runtimes file with every runtime of :data:`RUNTIMES`."""
    root = tmp_path_factory.mktemp("dry-run")
    base = yaml.safe_load(Path(cluster_env["AIRFLOW__TORCHRUN__RUNTIMES_FILE"]).read_text())["cpu"]
    runtimes = {name: {**base, **extra} for name, extra in RUNTIMES.items()}
    if not runtimes["placed"]["priority_class"]:
        del runtimes["placed"]["priority_class"]
    (root / "runtimes.yaml").write_text(yaml.safe_dump(runtimes))
    (root / "dags").mkdir()
    env = home_env(cluster_env, root, "e2e-dry-run")
    env["AIRFLOW__TORCHRUN__RUNTIMES_FILE"] = str(root / "runtimes.yaml")
    return env, root / "dags"


def dag_source(runtime: str, extra: str) -> str:
    return f"""
from datetime import timedelta
import pendulum
from airflow.sdk import DAG
from airflow_torchrun import DistributedTrainingOperator

with DAG("dry_run", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False):
    DistributedTrainingOperator(
        task_id="train", backend="kubernetes", runtime={runtime!r}, script="/opt/trainer/train.py",
        script_args=["--epochs", "1"], num_nodes=2, nproc_per_node=1, track=False, {extra}
    )
"""


def _render_and_dry_run(env: dict[str, str], dag: Path, task_id: str, *extra: str) -> dict[str, Any]:
    """``airflow-torchrun render`` of ``task_id``, piped into ``kubectl apply --dry-run=server``: the
    objects as the API server answered them, by kind."""
    rendered = subprocess.run(
        [
            sys.executable,
            "-m",
            "airflow_torchrun.cli",
            "render",
            "--dag-file",
            str(dag),
            "--task-id",
            task_id,
            "--namespace",
            NAMESPACE,
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert rendered.returncode == 0, rendered.stderr[-3000:]
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    assert sorted(d["kind"] for d in docs) == ["Job", "NetworkPolicy", "Service"]
    checked = subprocess.run(
        [
            str(binary("kubectl")),
            f"--kubeconfig={state().pki / 'airflow.kubeconfig'}",
            "apply",
            "--dry-run=server",
            "-o",
            "yaml",
            "-f",
            "-",
        ],
        input=rendered.stdout,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert checked.returncode == 0, f"the API server refused the rendered objects:\n{checked.stderr}"
    out = [d for d in yaml.safe_load_all(checked.stdout) if d]
    return {i["kind"]: i for d in out for i in (d["items"] if d["kind"] == "List" else [d])}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_the_api_server_accepts_what_we_render(
    render_env: tuple[dict[str, str], Path], runtime: str, variant: str
) -> None:
    env, dags = render_env
    dag = dags / f"dry_run_{runtime}_{variant}.py"
    dag.write_text(dag_source(runtime, VARIANTS[variant]))
    answered = _render_and_dry_run(env, dag, "train")
    job = answered["Job"]
    # What the server defaulted or would have refused to change later is what we sent.
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["suspend"] is (runtime == "queued")
    assert job["spec"]["podFailurePolicy"]["rules"], job["spec"]


@pytest.mark.parametrize("task_id", ["train", "evaluate"])
def test_the_api_server_accepts_the_shipped_pipelines_jobs(
    render_env: tuple[dict[str, str], Path], task_id: str
) -> None:
    """docs/kubernetes.md, "The dry run": the shipped pipeline's Jobs, for a run triggered with
    backend=kubernetes, with what upstream tasks push shown as placeholders."""
    env, _ = render_env
    pipeline = Path(__file__).resolve().parents[2] / "dags" / "torchrun_pipeline.py"
    conf = '{"backend": "kubernetes", "shards_uri": "s3://data/shards"}'
    job = _render_and_dry_run(env, pipeline, task_id, "--conf", conf)["Job"]
    variables = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert variables["TRAIN_SHARD_MANIFEST"] == "<XCom 'return_value' of task shard, resolved at run time>"
