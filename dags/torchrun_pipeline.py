"""The pipeline users trigger: shard -> train -> evaluate -> register -> approve -> promote, tracked in MLflow.

Trigger it from the Airflow UI ("Trigger DAG" shows a form for the Params below) or the REST API.
It runs on the embedded local backend by default; ``backend=kubernetes`` runs the training group
as an Indexed Job with the ``cpu`` runtime (the trainer image holds the scripts under /workspace).

Registration gives the new version the alias ``candidate`` and proposes it as ``champion`` when it
beats the current champion on the quality gate's first metric. A person then approves or rejects the
promotion on Airflow's Required Actions page (the request shows the candidate's metrics beside the
champion's); only an approval moves ``champion``. ``require_approval=false`` promotes unattended.

Assets: the training task updates ``digits-mlp-checkpoint``, the registration task
``digits-mlp-model`` (a new version), the promotion ``digits-mlp-champion``, so downstream DAGs can
be scheduled on a new checkpoint, model version or champion.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pendulum
from airflow.sdk import DAG, Asset, Param, task

from airflow_torchrun import (
    DistributedTrainingOperator,
    EvaluateModelOperator,
    ModelApprovalOperator,
    PromoteModelOperator,
    RegisterModelOperator,
    ShardDatasetOperator,
)
from airflow_torchrun.state import state_dir

TRAINER = Path(__file__).resolve().parent.parent / "images" / "trainer"
# Locally the scripts are read from this repository; on Kubernetes from the trainer image.
SCRIPTS = "{{ '/opt/trainer' if params.backend == 'kubernetes' else '" + str(TRAINER) + "' }}"
MODEL_NAME = "digits-mlp"
GATE_CONDITION = r"^\s*(>=|>|<=|<)\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$"
CHECKPOINT_ASSET = Asset(name="digits-mlp-checkpoint", uri="torchrun://checkpoints/torchrun_pipeline/train")
MODEL_ASSET = Asset(name="digits-mlp-model", uri=f"mlflow://models/{MODEL_NAME}")
CHAMPION_ASSET = Asset(name="digits-mlp-champion", uri=f"mlflow://models/{MODEL_NAME}/champion")

with DAG(
    dag_id="torchrun_pipeline",
    description="Shard the digits, train an MLP on a torchrun group, evaluate it, register it in MLflow",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    tags=["torchrun", "example"],
    doc_md=__doc__,
    params={
        "num_nodes": Param(2, type="integer", minimum=1, maximum=8, description="torchrun agents (nodes)"),
        "nproc_per_node": Param(1, type="integer", minimum=1, maximum=8, description="ranks per node"),
        "epochs": Param(5, type="integer", minimum=1, maximum=200, description="passes over the training shards"),
        "learning_rate": Param(0.003, type="number", exclusiveMinimum=0, maximum=1, description="Adam learning rate"),
        "backend": Param(
            "local", type="string", enum=["local", "kubernetes"], description="where the training group runs"
        ),
        "quality_gate": Param(
            {"accuracy": ">= 0.9"},
            type="object",
            minProperties=1,
            # Checked when the run is triggered, not after the training: "<op> <number>" per metric.
            additionalProperties={"type": "string", "pattern": GATE_CONDITION},
            description='metric -> condition to pass for the model to be registered, e.g. {"accuracy": ">= 0.9"}',
        ),
        # None, not "": the trigger form turns an emptied text field into null, which a plain
        # "string" Param refuses (the Trigger button stays disabled).
        "shards_uri": Param(
            None,
            type=["null", "string"],
            description="where the shards go (empty: the local state dir); with backend=kubernetes an s3:// URI "
            "every pod can read",
        ),
        "require_approval": Param(
            True,
            type="boolean",
            description="ask a person (Required actions) before the champion alias moves; off: promote unattended",
        ),
        "source_uri": Param(
            None,
            type=["null", "string"],
            description="the dataset to train on (digits-shaped .npz/.parquet/.csv URI, s3://[conn_id@]...); "
            "empty: scikit-learn's digits",
        ),
        "fail_at_step": Param(
            0,
            type="integer",
            minimum=0,
            description="make rank 1 fail once at this step, to see a retry resume (0: never)",
        ),
    },
) as dag:

    @task
    def export_dataset(params: dict[str, object] | None = None) -> str:
        """``source_uri`` when given (torchrun_retrain passes the data that landed), else the digits
        shipped with scikit-learn, as a .npz file (x: 64 pixels in [0, 1], y: label)."""
        given = str((params or {}).get("source_uri") or "").strip()
        if given:
            return given
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
        output_uri="{{ params.shards_uri or '' }}",
        num_nodes="{{ params.num_nodes }}",
        nproc_per_node="{{ params.nproc_per_node }}",
        eval_fraction=0.2,
    )

    train = DistributedTrainingOperator(
        task_id="train",
        script=SCRIPTS + "/train.py",
        script_args=[
            "--epochs",
            "{{ params.epochs }}",
            "--lr",
            "{{ params.learning_rate }}",
            "--checkpoint-every",
            "20",
            "--log-every",
            "20",
            "--fail-at-step",
            "{{ params.fail_at_step }}",
            "--fail-rank",
            "1",
            "--fail-mode",
            "kill",
        ],
        num_nodes="{{ params.num_nodes }}",
        nproc_per_node="{{ params.nproc_per_node }}",
        backend="{{ params.backend }}",
        runtime="cpu",
        shard_manifest=shard.output,
        track=True,  # evaluate and register log into this MLflow run
        retries=2,
        retry_delay=timedelta(seconds=0),
        outlets=[CHECKPOINT_ASSET],
    )

    evaluate = EvaluateModelOperator(
        task_id="evaluate",
        script=SCRIPTS + "/evaluate.py",
        checkpoint="{{ ti.xcom_pull(task_ids='train')['final_checkpoint'] }}",
        mlflow_run_id="{{ ti.xcom_pull(task_ids='train')['mlflow_run_id'] }}",
        shard_manifest=shard.output,
        backend="{{ params.backend }}",
        runtime="cpu",
    )

    register = RegisterModelOperator(
        task_id="register",
        model_name=MODEL_NAME,
        run_id="{{ ti.xcom_pull(task_ids='train')['mlflow_run_id'] }}",
        metrics=evaluate.output,
        gate="{{ params.quality_gate }}",
        promote=False,  # the champion moves only after the approval below
        outlets=[MODEL_ASSET],
    )

    approve = ModelApprovalOperator(
        task_id="approve",
        registration=register.output,
        require_approval="{{ params.require_approval }}",
    )

    promote = PromoteModelOperator(task_id="promote", registration=register.output, outlets=[CHAMPION_ASSET])

    train >> evaluate >> register >> approve >> promote
