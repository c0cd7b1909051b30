"""A learning-rate sweep: one torchrun group per value (dynamic task mapping), then register the best.

``train`` is ``DistributedTrainingOperator.partial(...).expand(...)`` over the ``learning_rates``
Param: each mapped instance is a training of its own, with its own checkpoints (``train~map<i>``
under the run's checkpoint root, a lineage of its own: a retry of instance 2 resumes instance 2's
steps, never another's) and its own MLflow run. The Airflow UI names the instances by their learning
rate (``map_index_template``), and each one's Training tab lists its siblings. ``register_best``
registers the instance whose test accuracy is highest (``candidate``; ``champion`` when it beats the
current one: an unattended sweep promotes by the gate's rule).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pendulum
from airflow.sdk import DAG, Param, task

from airflow_torchrun import DistributedTrainingOperator, RegisterModelOperator, ShardDatasetOperator
from airflow_torchrun.state import state_dir

TRAINER = Path(__file__).resolve().parent.parent / "images" / "trainer"
MODEL_NAME = "digits-mlp-sweep"
METRIC = "test_accuracy"

with DAG(
    dag_id="torchrun_sweep",
    description="Train the digits MLP once per learning rate, in parallel torchrun groups; register the best",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    tags=["torchrun", "example"],
    doc_md=__doc__,
    params={
        "learning_rates": Param(
            [0.001, 0.003, 0.01],
            type="array",
            items={"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            minItems=1,
            maxItems=16,
            description="one training per value (Adam learning rate)",
        ),
        "epochs": Param(2, type="integer", minimum=1, maximum=200, description="passes over the training shard"),
        "num_nodes": Param(1, type="integer", minimum=1, maximum=8, description="torchrun agents per training"),
    },
) as dag:

    @task
    def export_dataset() -> str:
        """The digits shipped with scikit-learn, as a .npz file (as the pipeline writes it)."""
        import numpy as np
        from sklearn.datasets import load_digits

        path = state_dir() / "data" / "digits.npz"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            digits = load_digits()
            tmp = path.with_suffix(".tmp.npz")
            np.savez(tmp, x=(digits.data / 16.0).astype("float32"), y=digits.target.astype("int64"))
            tmp.replace(path)
        return f"file://{path}"

    shard = ShardDatasetOperator(
        task_id="shard",
        source_uri=export_dataset(),
        num_nodes="{{ params.num_nodes }}",
        nproc_per_node=1,
        eval_fraction=0.2,
    )

    @task
    def grid(params: dict[str, Any] | None = None) -> list[list[str]]:
        """One command line per learning rate (the value is the second argument: the instances' names)."""
        rates = (params or {})["learning_rates"]
        epochs = str((params or {})["epochs"])
        return [["--lr", str(lr), "--epochs", epochs, "--checkpoint-every", "20", "--log-every", "20"] for lr in rates]

    train = DistributedTrainingOperator.partial(
        task_id="train",
        script=str(TRAINER / "train.py"),
        num_nodes="{{ params.num_nodes }}",
        nproc_per_node=1,
        shard_manifest=shard.output,
        track=True,
        retries=1,
        map_index_template="lr={{ task.script_args[1] }}",
    ).expand(script_args=grid())

    @task
    def pick_best(summaries: list[dict[str, Any]]) -> dict[str, Any]:
        """The instance with the highest test accuracy (its MLflow run's last value), and why."""
        from airflow_torchrun.tracking import client

        mlflow = client()
        scored = []
        for index, summary in enumerate(summaries):
            run = mlflow.get_run(summary["mlflow_run_id"])
            scored.append((float(run.data.metrics[METRIC]), index, summary["mlflow_run_id"], run.data.params))
        accuracy, index, run_id, params = max(scored, key=lambda s: (s[0], -s[1]))
        print(
            f"best: map index {index} (lr={params.get('lr')}), {METRIC}={accuracy:.4f}; all: "
            + ", ".join(f"{i}: {a:.4f}" for a, i, _r, _p in scored)
        )
        return {"run_id": run_id, "map_index": index, "metrics": {"accuracy": accuracy}}

    best = pick_best(train.output)

    RegisterModelOperator(
        task_id="register_best",
        model_name=MODEL_NAME,
        run_id="{{ ti.xcom_pull(task_ids='pick_best')['run_id'] }}",
        metrics="{{ ti.xcom_pull(task_ids='pick_best')['metrics'] }}",
        gate={"accuracy": ">= 0.5"},
    ).set_upstream(best)
