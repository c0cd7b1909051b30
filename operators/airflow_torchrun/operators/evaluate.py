"""``EvaluateModelOperator``: an evaluation script on a checkpoint, through the same run engine."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow_torchrun.compat import AirflowFailException
from airflow_torchrun.operators.group import GroupOperator
from airflow_torchrun.worker.metrics import METRICS_ENV

if TYPE_CHECKING:
    from airflow_torchrun.backends.handles import GroupHandle
    from airflow_torchrun.compat import Context
    from airflow_torchrun.watch import Verdict


class EvaluateModelOperator(GroupOperator):
    """Evaluate a trained checkpoint with a torchrun script (1 node x 1 process by default).

    The script is an ordinary torchrun script. Its ranks see ``TRAIN_RESUME_FROM`` (and
    ``EVAL_CHECKPOINT_URI``) set to ``checkpoint``, so ``load_checkpoint()`` returns the trained
    state, and ``EVAL_METRICS_URI``, where ``airflow_torchrun.worker.metrics.report_metrics()``
    (rank 0) writes the metrics. The task returns those metrics through XCom (e.g. for
    ``RegisterModelOperator(metrics=evaluate.output)``) and logs them, prefixed with
    ``metrics_prefix``, into the MLflow run ``mlflow_run_id`` (the training run); the group's
    summary is under the XCom key ``group_summary``.

    :param checkpoint: URI of the committed checkpoint to evaluate (templated), e.g.
        ``"{{ ti.xcom_pull('train')['final_checkpoint'] }}"``.
    :param mlflow_run_id: MLflow run to log the metrics into (templated); none: not logged.
    :param metrics_prefix: Prefix of the metric names in MLflow (default ``eval_``).
    :param shard_manifest: URI of a ``ShardDatasetOperator`` manifest (``TRAIN_SHARD_MANIFEST``;
        the evaluation split is in it). Templated.

    The group's arguments (``script``, ``num_nodes``, ``backend``, ``runtime``, timeouts,
    ``deferrable``, storage access...) mean what they mean for
    :class:`~airflow_torchrun.DistributedTrainingOperator`.
    """

    template_fields: Sequence[str] = (
        *GroupOperator.group_template_fields,
        "checkpoint",
        "mlflow_run_id",
        "shard_manifest",
    )
    ui_color = "#6a5acd"

    def __init__(
        self,
        *,
        checkpoint: str,
        mlflow_run_id: str | None = None,
        metrics_prefix: str = "eval_",
        shard_manifest: str | None = None,
        num_nodes: int = 1,
        nproc_per_node: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(num_nodes=num_nodes, nproc_per_node=nproc_per_node, **kwargs)
        self.checkpoint = checkpoint
        self.mlflow_run_id = mlflow_run_id
        self.metrics_prefix = metrics_prefix
        self.shard_manifest = shard_manifest
        self.validate(allow_templates=True)

    def contract_env(self, context: Context) -> dict[str, str]:
        from airflow_torchrun.checkpoint import CheckpointStore, ref_from_uri

        if not self.checkpoint:
            raise AirflowFailException(f"{self._where}: checkpoint is empty; did the training task save one?")
        ref = ref_from_uri(self.checkpoint)
        options = self.storage_options_resolved()
        store = CheckpointStore(self._checkpoint_root(), options)
        # Only a committed checkpoint is evaluated, and only one whose files match its marker.
        marker = self.preflight("reading the checkpoint's commit marker", lambda: store.read_marker(ref.step))
        problems = self.preflight("checking the checkpoint's files", lambda: store.verify(ref.step, content=False))
        if problems:
            raise AirflowFailException(
                f"{self._where}: checkpoint {self.checkpoint} is damaged ({'; '.join(problems)}); evaluate another step"
            )
        metrics_uri = self._metrics_location(context)
        self.log.info("Evaluating %s (step %d); metrics go to %s", self.checkpoint, ref.step, metrics_uri)
        # Storage credentials by the same rule as training's: never in plain pod env.
        env = self.rank_storage_env(options)
        env.update(
            {"TRAIN_RESUME_FROM": self.checkpoint, "EVAL_CHECKPOINT_URI": self.checkpoint, METRICS_ENV: metrics_uri}
        )
        lineage = marker.get("lineage") if isinstance(marker, dict) else None
        ti = context["ti"]
        if isinstance(lineage, dict) and (lineage.get("dag_id"), lineage.get("run_id")) == (self.dag_id, ti.run_id):
            # A sibling task of this DAG run wrote it: the DAG's own trust domain, sharded or not.
            env["TRAIN_CHECKPOINT_TRUST_SHARDED"] = "1"
        if self.shard_manifest:
            env["TRAIN_SHARD_MANIFEST"] = str(self.shard_manifest)
        if self.mlflow_run_id:
            from airflow_torchrun.tracking import rank_env, resolve_tracking_uri

            env.update(rank_env(self.mlflow_run_id, resolve_tracking_uri(self.mlflow_tracking_uri)))
        return env

    def contract_env_preview(self, context: Context) -> dict[str, str]:
        return {
            "TRAIN_RESUME_FROM": str(self.checkpoint),
            "EVAL_CHECKPOINT_URI": str(self.checkpoint),
            METRICS_ENV: self._metrics_location(context),
        }

    def _checkpoint_root(self) -> str:
        return self.checkpoint.rstrip("/").rpartition("/")[0]

    def _metrics_location(self, context: Context) -> str:
        """Beside the checkpoint, one file per try (deterministic: a deferred re-entry finds it)."""
        ti = context["ti"]
        return f"{self._checkpoint_root()}/eval/{ti.task_id}-try{ti.try_number}.json"

    def finish(self, context: Context, handle: GroupHandle, verdict: Verdict) -> dict[str, float]:
        metrics = self._read_metrics(self._metrics_location(context))
        context["ti"].xcom_push(
            key="group_summary",
            value={
                "group_id": handle.group_id,
                "backend": handle.backend,
                "world_size": handle.world_size,
                "node_exit_codes": [n.exit_code for n in verdict.nodes],
                "log_dir": handle.log_dir,
            },
        )
        self.log.info("Evaluation metrics: %s", json.dumps(metrics, sort_keys=True))
        if self.mlflow_run_id:
            self._log_metrics(metrics)
        return metrics

    def _log_metrics(self, metrics: dict[str, float]) -> None:
        """Into the training run; best effort: the metrics are in XCom whatever MLflow does."""
        from airflow_torchrun.tracking import client

        try:
            mlflow = client(self.mlflow_tracking_uri)
            for key, value in metrics.items():
                mlflow.log_metric(str(self.mlflow_run_id), f"{self.metrics_prefix}{key}", value)
        except Exception as exc:
            self.log.warning(
                "Could not log the evaluation metrics into MLflow run %s (%s); they are in this task's XCom",
                self.mlflow_run_id,
                exc,
            )

    def _read_metrics(self, metrics_uri: str) -> dict[str, float]:
        from airflow_torchrun.checkpoint import CheckpointStore

        root, _, name = metrics_uri.rpartition("/")
        store = CheckpointStore(root, self.storage_options_resolved())
        try:
            with store.fs.open(f"{store.path_of(root)}/{name}", "r") as fp:
                data = json.load(fp)
        except FileNotFoundError as exc:
            raise AirflowFailException(
                f"{self._where}: the evaluation script finished without reporting metrics; call "
                "airflow_torchrun.worker.metrics.report_metrics({...}) on rank 0"
            ) from exc
        return {str(k): float(v) for k, v in data.items()}
