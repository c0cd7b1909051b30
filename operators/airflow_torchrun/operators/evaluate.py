"""``EvaluateModelOperator``: an evaluation script on a checkpoint, through the same group machinery."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow_torchrun.compat import AirflowFailException
from airflow_torchrun.operators.training import DistributedTrainingOperator
from airflow_torchrun.worker.metrics import METRICS_ENV

if TYPE_CHECKING:
    from airflow_torchrun.backends.base import Backend, GroupHandle
    from airflow_torchrun.compat import Context
    from airflow_torchrun.spec import GroupSpec
    from airflow_torchrun.status import GroupStatus


class EvaluateModelOperator(DistributedTrainingOperator):
    """Evaluate a trained checkpoint with a torchrun script (1 node x 1 process by default).

    The script is an ordinary torchrun script. Its ranks see ``TRAIN_RESUME_FROM`` (and
    ``EVAL_CHECKPOINT_URI``) set to ``checkpoint``, so ``load_checkpoint()`` returns the trained
    state, and ``EVAL_METRICS_URI``, where ``airflow_torchrun.worker.metrics.report_metrics()``
    (rank 0) writes the metrics. The task returns those metrics through XCom (e.g. for
    ``RegisterModelOperator(metrics=evaluate.output)``) and logs them, prefixed with
    ``metrics_prefix``, into the MLflow run ``mlflow_run_id`` (the training run).

    :param checkpoint: URI of the committed checkpoint to evaluate (templated), e.g.
        ``"{{ ti.xcom_pull('train')['final_checkpoint'] }}"``.
    :param mlflow_run_id: MLflow run to log the metrics into (templated); none: not logged.
    :param metrics_prefix: Prefix of the metric names in MLflow (default ``eval_``).

    Every other argument is :class:`DistributedTrainingOperator`'s.
    """

    template_fields: Sequence[str] = (*DistributedTrainingOperator.template_fields, "checkpoint", "mlflow_run_id")
    ui_color = "#6a5acd"

    def __init__(
        self,
        *,
        checkpoint: str,
        mlflow_run_id: str | None = None,
        metrics_prefix: str = "eval_",
        num_nodes: int = 1,
        nproc_per_node: int = 1,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("track", False)
        kwargs.setdefault("resume", "never")
        super().__init__(num_nodes=num_nodes, nproc_per_node=nproc_per_node, **kwargs)
        self.checkpoint = checkpoint
        self.mlflow_run_id = mlflow_run_id
        self.metrics_prefix = metrics_prefix
        self._metrics_uri: str | None = None

    def contract_env(self, context: Context) -> dict[str, str]:
        from airflow_torchrun.checkpoint import CheckpointStore, ref_from_uri, storage_env

        if not self.checkpoint:
            raise AirflowFailException(f"{self._where}: checkpoint is empty; did the training task save one?")
        ref = ref_from_uri(self.checkpoint)
        root = self.checkpoint.rstrip("/").rpartition("/")[0]
        options = self._storage_options()
        CheckpointStore(root, options).read_marker(ref.step)  # only a committed checkpoint is evaluated
        self._metrics_uri = self._metrics_location(context)
        self.log.info("Evaluating %s (step %d); metrics go to %s", self.checkpoint, ref.step, self._metrics_uri)
        env = storage_env(options)
        env.update(
            {
                "TRAIN_RESUME_FROM": self.checkpoint,
                "EVAL_CHECKPOINT_URI": self.checkpoint,
                METRICS_ENV: self._metrics_uri,
            }
        )
        if self.shard_manifest:
            env["TRAIN_SHARD_MANIFEST"] = str(self.shard_manifest)
        if self.mlflow_run_id:
            from airflow_torchrun.tracking import rank_env, resolve_tracking_uri

            env.update(rank_env(self.mlflow_run_id, resolve_tracking_uri(self.mlflow_tracking_uri)))
        return env

    def _metrics_location(self, context: Context) -> str:
        """Beside the checkpoint, one file per try (deterministic: a deferred re-entry finds it)."""
        ti = context["ti"]
        root = self.checkpoint.rstrip("/").rpartition("/")[0]
        return f"{root}/eval/{ti.task_id}-try{ti.try_number}.json"

    def _finish(
        self, context: Context, spec: GroupSpec, backend: Backend, handle: GroupHandle, status: GroupStatus
    ) -> dict[str, Any]:
        summary = super()._finish(context, spec, backend, handle, status)  # raises when the group failed
        self._metrics_uri = self._metrics_location(context)
        metrics = self._read_metrics()
        context["ti"].xcom_push(key="group_summary", value=summary)
        self.log.info("Evaluation metrics: %s", json.dumps(metrics, sort_keys=True))
        if self.mlflow_run_id:
            from airflow_torchrun.tracking import client

            mlflow = client(self.mlflow_tracking_uri)
            for key, value in metrics.items():
                mlflow.log_metric(self.mlflow_run_id, f"{self.metrics_prefix}{key}", value)
        return metrics

    def _read_metrics(self) -> dict[str, float]:
        from airflow_torchrun.checkpoint import CheckpointStore

        if self._metrics_uri is None:
            raise AirflowFailException(f"{self._where}: no metrics location was prepared")
        root, _, name = self._metrics_uri.rpartition("/")
        store = CheckpointStore(root, self._storage_options())
        try:
            with store.fs.open(f"{store.path_of(root)}/{name}", "r") as fp:
                data = json.load(fp)
        except FileNotFoundError as exc:
            raise AirflowFailException(
                f"{self._where}: the evaluation script finished without reporting metrics; call "
                "airflow_torchrun.worker.metrics.report_metrics({...}) on rank 0"
            ) from exc
        return {str(k): float(v) for k, v in data.items()}
