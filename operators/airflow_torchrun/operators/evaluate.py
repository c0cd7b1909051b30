"""``EvaluateModelOperator``: an evaluation script on a checkpoint, through the same run engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow_torchrun.operators.evaluation_contract import EvaluationContract
from airflow_torchrun.operators.group import GroupOperator
from airflow_torchrun.settings import flag

if TYPE_CHECKING:
    from airflow_torchrun.operators.contracts import TaskIO


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
    :param trust_sharded: Let the ranks load a sharded (``torch.distributed.checkpoint``) checkpoint
        from outside this DAG run's default checkpoint area (``<[torchrun] checkpoint_base>/<dag>/<run>``):
        its metadata is unpickled, so only for stores no one untrusted can write to. A checkpoint
        inside that area (a training task of this run on its default ``checkpoint_uri``) needs none:
        trust comes from where the checkpoint is, never from what its commit marker says.

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
        trust_sharded: bool = False,
        num_nodes: int = 1,
        nproc_per_node: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(num_nodes=num_nodes, nproc_per_node=nproc_per_node, **kwargs)
        self.trust_sharded = flag("trust_sharded", trust_sharded, self._problems)
        self.checkpoint = checkpoint
        self.mlflow_run_id = mlflow_run_id
        self.metrics_prefix = metrics_prefix
        self.shard_manifest = shard_manifest
        self.validate(allow_templates=True)

    def storage_uris(self) -> Sequence[object]:
        return (self.checkpoint,)

    def rank_contract(self, io: TaskIO, state: dict[str, Any] | None = None) -> EvaluationContract:
        return EvaluationContract(
            io,
            dag_id=str(self.dag_id),
            checkpoint=self.checkpoint,
            mlflow_run_id=self.mlflow_run_id,
            mlflow_tracking_uri=self.mlflow_tracking_uri,
            metrics_prefix=self.metrics_prefix,
            shard_manifest=self.shard_manifest,
            trust_sharded=self.trust_sharded,
        )

    # -- OpenLineage (the openlineage extra; imported only when the provider asks) -------------------
    def get_openlineage_facets_on_start(self) -> Any:
        from airflow_torchrun.lineage_openlineage import evaluation_lineage_of

        return evaluation_lineage_of(self, None)

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        from airflow_torchrun.lineage_openlineage import evaluation_lineage_of

        return evaluation_lineage_of(self, task_instance)

    def get_openlineage_facets_on_failure(self, task_instance: Any) -> Any:
        from airflow_torchrun.lineage_openlineage import evaluation_lineage_of

        return evaluation_lineage_of(self, task_instance)
