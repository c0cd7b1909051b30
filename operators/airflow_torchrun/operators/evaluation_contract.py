"""Evaluation's rank contract: the checkpoint evaluated as every rank's resume point, and where rank 0
reports its metrics (``EVAL_METRICS_URI``), read back into XCom and the training's MLflow run."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from airflow_torchrun import contract
from airflow_torchrun.compat import AirflowFailException

if TYPE_CHECKING:
    from airflow_torchrun.backends.handles import GroupHandle
    from airflow_torchrun.books import TryBooks
    from airflow_torchrun.operators.contracts import TaskIO
    from airflow_torchrun.spec import GroupSpec
    from airflow_torchrun.watch import Verdict


class EvaluationContract:
    """Evaluation's rank contract: the checkpoint as the resume point, where rank 0 reports metrics."""

    def __init__(
        self,
        io: TaskIO,
        *,
        dag_id: str,
        checkpoint: str,
        mlflow_run_id: str | None,
        mlflow_tracking_uri: str | None,
        metrics_prefix: str,
        shard_manifest: str | None,
        trust_sharded: bool = False,
    ) -> None:
        self.io, self.dag_id, self.checkpoint = io, dag_id, checkpoint
        self.trust_sharded = trust_sharded
        self.mlflow_run_id, self.mlflow_tracking_uri = mlflow_run_id, mlflow_tracking_uri
        self.metrics_prefix, self.shard_manifest = metrics_prefix, shard_manifest

    def state(self) -> dict[str, Any]:
        return {}  # everything it needs is derived again from the task and its try

    def ended(self, handle: GroupHandle, succeeded: bool) -> None:
        return None

    def books(self) -> TryBooks | None:
        return None  # an evaluation resumes nothing: no goodput ledger, no audit

    def env(self) -> dict[str, str]:
        from airflow_torchrun.storage.checkpoints import CheckpointStore
        from airflow_torchrun.storage.lineage import ref_from_uri

        io = self.io
        if not self.checkpoint:
            raise AirflowFailException(f"{io.where}: checkpoint is empty; did the training task save one?")
        ref = ref_from_uri(self.checkpoint)
        store = CheckpointStore(self._checkpoint_root(), io.resolved_storage_options())
        # Only a committed checkpoint is evaluated, and only one whose files match its marker.
        io.preflight("reading the checkpoint's commit marker", lambda: store.read_marker(ref.step))
        problems = io.preflight("checking the checkpoint's files", lambda: store.verify(ref.step, content=False))
        if problems:
            raise AirflowFailException(
                f"{io.where}: checkpoint {self.checkpoint} is damaged ({'; '.join(problems)}); evaluate another step"
            )
        io.log.info("Evaluating %s (step %d); metrics go to %s", self.checkpoint, ref.step, self._metrics_location())
        return self.relaunch_env()

    def relaunch_env(self) -> dict[str, str]:
        """Every variable, without the checks of the checkpoint :meth:`env` made in this try (the
        checkpoint evaluated is the task's argument: no launch changes it)."""
        # Storage credentials by the same rule as training's: never in plain pod env.
        env = self.io.rank_storage_env()
        env.update(self._variables(self._metrics_location()))
        return env

    def preview(self) -> dict[str, str]:
        # A checkpoint known only at run time (an upstream output, shown as a placeholder by
        # ``airflow-torchrun render``) has no folder yet: the metrics file is named beside it.
        root = self._checkpoint_root() or f"<the folder of {self.checkpoint}>"
        return self._variables(self._metrics_location(root))

    def _variables(self, metrics_uri: str) -> dict[str, str]:
        """The contract's own variables (no I/O): what the launch sets and ``render`` shows alike."""
        env = {
            contract.RESUME_FROM: str(self.checkpoint),
            contract.EVAL_CHECKPOINT_URI: str(self.checkpoint),
            contract.EVAL_METRICS_URI: metrics_uri,
        }
        if self.trust_sharded or self._in_this_runs_area():
            env[contract.CHECKPOINT_TRUST_SHARDED] = "1"
        if self.shard_manifest:
            env[contract.SHARD_MANIFEST] = str(self.shard_manifest)
        if self.mlflow_run_id:
            from airflow_torchrun.tracking import rank_env, resolve_tracking_uri

            env.update(rank_env(str(self.mlflow_run_id), resolve_tracking_uri(self.mlflow_tracking_uri)))
        return env

    def _in_this_runs_area(self) -> bool:
        """Whether the checkpoint lies where this DAG run's training tasks keep theirs by default
        (``<[torchrun] checkpoint_base>/<dag>/<run>``): a place this deployment configured, unlike
        the lineage its marker names, which whoever writes the store writes too."""
        from airflow_torchrun.naming import join, segment
        from airflow_torchrun.operators.training_contract import checkpoint_base
        from airflow_torchrun.storage.uri import is_within

        area = join(checkpoint_base(), segment(self.dag_id), segment(str(self.io.context["run_id"])))
        try:
            return is_within(self.checkpoint, area)
        except Exception:  # not a URI this store understands: not in the area
            return False

    def _checkpoint_root(self) -> str:
        return self.checkpoint.rstrip("/").rpartition("/")[0]

    def _metrics_location(self, root: str | None = None) -> str:
        """Beside the checkpoint, one file per try (deterministic: a deferred re-entry finds it)."""
        from airflow_torchrun.naming import eval_metrics_uri

        io = self.io  # from the context alone: ``airflow-torchrun render`` previews without a task instance
        task_id = str(io.context["task"].task_id)
        return eval_metrics_uri(root or self._checkpoint_root(), task_id, io.map_index, io.try_number)

    def finish(self, handle: GroupHandle, verdict: Verdict, spec: GroupSpec) -> dict[str, float]:
        io = self.io
        metrics = self._read_metrics(self._metrics_location())
        io.push(
            "group_summary",
            {
                "group_id": handle.group_id,
                "backend": handle.backend,
                "world_size": handle.world_size,
                "node_exit_codes": [n.exit_code for n in verdict.nodes],
                "log_dir": handle.log_dir,
            },
        )
        io.log.info("Evaluation metrics: %s", json.dumps(metrics, sort_keys=True))
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
            self.io.log.warning(
                "Could not log the evaluation metrics into MLflow run %s (%s); they are in this task's XCom",
                self.mlflow_run_id,
                exc,
            )

    def _read_metrics(self, metrics_uri: str) -> dict[str, float]:
        from airflow_torchrun.storage.checkpoints import CheckpointStore

        root, _, name = metrics_uri.rpartition("/")
        store = CheckpointStore(root, self.io.resolved_storage_options())
        try:
            with store.fs.open(f"{store.path_of(root)}/{name}", "r") as fp:
                data = json.load(fp)
        except FileNotFoundError as exc:
            raise AirflowFailException(
                f"{self.io.where}: the evaluation script finished without reporting metrics; call "
                "airflow_torchrun.worker.metrics.report_metrics({...}) on rank 0"
            ) from exc
        return {str(k): float(v) for k, v in data.items()}
