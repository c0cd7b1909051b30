"""Provider metadata: ``airflow providers list`` and ``airflow providers get airflow-torchrun --full``
show airflow-torchrun, its integration (with its how-to page and tags), operators, triggers, extra
links, the task decorator, the plugin and the ``[torchrun]`` config options."""

from __future__ import annotations

from typing import Any

from airflow_torchrun import __version__


def _option(description: str, default: str | None, example: str | None = None) -> dict[str, Any]:
    return {
        "description": description,
        "version_added": "0.1.0",
        "type": "string",
        "example": example,
        "default": default,
    }


CONFIG_OPTIONS = {
    "default_backend": _option(
        "Backend used when an operator does not name one: local or kubernetes.", "local", "kubernetes"
    ),
    "state_dir": _option(
        "Local state: each local group's logs and status files, default checkpoints, shards and the default "
        "MLflow store. Default <AIRFLOW_HOME>/torchrun (one per Airflow home, never shared by two).",
        None,
        "/var/lib/airflow/torchrun",
    ),
    "checkpoint_base": _option(
        "Root of the default checkpoint URI <checkpoint_base>/<dag_id>/<run_id>/<task_id>. "
        "Default file://<state_dir>/checkpoints.",
        None,
        "s3://ml-checkpoints/airflow",
    ),
    "mlflow_tracking_uri": _option(
        "MLflow tracking URI for training runs when MLFLOW_TRACKING_URI is not set. "
        "Default sqlite:///<state_dir>/mlflow/mlflow.db.",
        None,
        "http://mlflow.ml.svc:5000",
    ),
    "mlflow_ui_url": _option(
        "Base URL of the MLflow UI, for the task's 'MLflow run' link. Default: the tracking server when the "
        "tracking URI is http(s), else http://localhost:5000.",
        None,
        "https://mlflow.example.com",
    ),
    "local_rank_start": _option(
        "How the local backend starts each rank of a script= or @task.torchrun task: fork (from its node's "
        "torchrun agent, torch already imported: no import per rank and per restart) or exec (a new Python "
        "interpreter per rank, as torchrun does). A task's env={'AIRFLOW_TORCHRUN_RANK_START': 'exec'} "
        "chooses for that task.",
        "fork",
        "exec",
    ),
    "local_agent_start": _option(
        "How the local backend starts each node's supervisor and torchrun agent: fork (from a zygote, a process "
        "per kind of caller that imported torch once and leaves after 10 idle minutes: no import per node and per "
        "restart) or exec (a new Python interpreter each). A task's env={'AIRFLOW_TORCHRUN_AGENT_START': 'exec'} "
        "chooses for that task.",
        "fork",
        "exec",
    ),
    "defer_after": _option(
        "Deferrable tasks: seconds the worker watches a group itself before it defers to the triggerer, "
        "so a group of seconds never defers (operator argument defer_after).",
        "60",
        "0",
    ),
    "checkpoint_console_url": _option(
        "URL template of the 'Checkpoint' link and the training view for s3:// checkpoints; placeholders {uri}, "
        "{bucket}, {key}, {path}. Default: the AWS S3 console. file:// checkpoints show their URI.",
        None,
        "https://minio.example.com/browser/{bucket}/{key}",
    ),
    "data_wait_threshold": _option(
        "Warn of data starvation when the ranks wait for data more than this fraction of each step (sustained).",
        "0.3",
        "0.5",
    ),
    "straggler_factor": _option(
        "Warn of a straggler when one rank's step time stays above this factor of the other ranks' median.",
        "1.3",
        "1.5",
    ),
    "runtimes_file": _option(
        "YAML file of named runtimes for the Kubernetes backend.", None, "/opt/airflow/config/torchrun-runtimes.yaml"
    ),
    "runtimes_variable": _option(
        "Airflow Variable holding more runtimes (JSON or YAML); unset: no Variable is read. Every user with "
        "Variable access can edit it, so its runtimes may only add to the file's, within the file's "
        "_variable_policy.",
        None,
        "torchrun_runtimes",
    ),
    "default_runtime": _option("Runtime used when an operator on the Kubernetes backend names none.", "cpu"),
    "kubernetes_conn_id": _option("Airflow connection of the cluster.", "kubernetes_default"),
    "kubernetes_namespace": _option("Namespace of the training Jobs.", "default", "ml-training"),
    "kubernetes_view_namespaces": _option(
        "Namespaces besides kubernetes_namespace whose groups the Training view may read (comma-separated): "
        "those of tasks that set namespace= themselves. The view never reads a namespace a group's XCom names "
        "unless it is listed here.",
        None,
        "ml-research,ml-batch",
    ),
    "deployment": _option(
        "This Airflow deployment's name in its Jobs' identity and labels (a Kubernetes label value), the same "
        "on all of its workers. Unset, a deployment makes a name of its own on first use and keeps it in the "
        "Variable torchrun_deployment.",
        None,
        "prod-eu",
    ),
}


#: The integration's how-to pages, as paths from the repository root (``/docs/...``, the form
#: Airflow's provider schema asks for); tests/test_provider_info.py checks that each one exists.
HOW_TO_GUIDES = ["/docs/howto.md"]
TAGS = ["software", "machine-learning", "pytorch", "distributed-training"]


def get_provider_info() -> dict[str, Any]:
    modules = ["training", "evaluate", "shard", "register", "approval"]
    return {
        "package-name": "airflow-torchrun",
        "name": "airflow-torchrun",
        "description": "Distributed PyTorch training (torchrun) as one Airflow task.",
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "torchrun",
                "external-doc-url": "https://pytorch.org/docs/stable/elastic/run.html",
                "how-to-guide": HOW_TO_GUIDES,
                "tags": TAGS,
            }
        ],
        "operators": [
            {"integration-name": "torchrun", "python-modules": [f"airflow_torchrun.operators.{m}" for m in modules]}
        ],
        "triggers": [
            {
                "integration-name": "torchrun",
                "python-modules": ["airflow_torchrun.triggers", "airflow_torchrun.watchers"],
            }
        ],
        "extra-links": [
            "airflow_torchrun.links.MlflowRunLink",
            "airflow_torchrun.links.CheckpointLink",
            "airflow_torchrun.links.ModelVersionLink",
        ],
        "task-decorators": [{"name": "torchrun", "class-name": "airflow_torchrun.decorators.torchrun_task"}],
        "plugins": [{"name": "airflow_torchrun", "plugin-class": "airflow_torchrun.plugin.TorchrunPlugin"}],
        "config": {"torchrun": {"description": "Defaults for airflow-torchrun.", "options": CONFIG_OPTIONS}},
    }
