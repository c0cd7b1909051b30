"""``DistributedTrainingOperator``: one Airflow task = one torchrun group, watched to the end."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow_torchrun.audit import parse_mode
from airflow_torchrun.backends.base import BackendOptions
from airflow_torchrun.links import CheckpointLink, MlflowRunLink
from airflow_torchrun.operators.contracts import TaskIO
from airflow_torchrun.operators.group import GroupOperator
from airflow_torchrun.operators.training_contract import (
    TrainingContract,
    TrainingSettings,
    checkpoint_base,
    default_checkpoint_uri,
    lineage_of,
)
from airflow_torchrun.settings import CheckpointSettings, flag, seconds_or_none
from airflow_torchrun.storage.lineage import RESUME_AUTO

if TYPE_CHECKING:
    from airflow_torchrun.compat import Context


class DistributedTrainingOperator(GroupOperator):
    """Run a ``torchrun`` training script on ``num_nodes`` x ``nproc_per_node`` ranks.

    Every rank sees torchrun's standard variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...),
    so an unmodified torchrun script runs as is. The task succeeds when every node exits 0; when
    one rank fails the whole group is torn down and the task fails naming the first failing rank,
    its exit code or signal, its traceback and the tail of its log.

    :param script: Path of the Python training script (templated). A relative path is looked up
        in the current directory, then next to the DAG file.
    :param command: Instead of ``script``: an executable and its arguments, run by torchrun with
        ``--no-python`` (templated).
    :param script_args: Arguments passed to the script on every rank (templated).
    :param num_nodes: Number of torchrun agents (machines, pods, or local processes).
    :param nproc_per_node: Ranks started by each agent. Default: the runtime's (Kubernetes), else 1.
    :param env: Extra environment variables for every rank (templated). torchrun's own variables
        cannot be overridden.
    :param backend: Where the agents run: ``"local"`` (this machine) or ``"kubernetes"``.
        Defaults to ``[torchrun] default_backend``, else ``"local"``.
    :param runtime: Name of a platform-defined runtime (Kubernetes backend).
    :param rdzv_port: Rendezvous port of node 0; by default a free port (local) or 29500.
    :param rdzv_timeout: Seconds the agents wait for each other at rendezvous.
    :param startup_timeout: Seconds the whole group may take to start; past that it is torn down.
    :param teardown_grace: Seconds between SIGTERM and SIGKILL when the group is torn down.
    :param threads_per_proc: ``OMP_NUM_THREADS`` per rank; by default the node's cores split
        between its ranks.
    :param poll_interval: Seconds between two looks at the group while waiting (the trigger
        looks at most once a second).
    :param progress_timeout: Seconds without progress (no rank's log grew, no progress record)
        after which a running group is called hung, torn down, and the try fails retryably.
        ``None`` (default): no limit. Enforced in sync and deferrable mode alike.
    :param preflight_budget: Seconds that the calls to storage and tracking around the group (the
        checks before launch, creating the MLflow run, finding the final checkpoint) ride out
        transient trouble (endpoint down, timeouts, 5xx) before the try fails retryably; a
        permanent error (bad credentials, a missing bucket) fails at once, without retry. Default 120.
    :param observe_error_budget: Seconds that looks at the group may fail in a row (a Kubernetes
        API answering 5xx or timing out, a status file read at the wrong moment) before the task
        gives up on the group; a healthy group is never torn down for less. A permanent error
        (403, a malformed answer) gives up at once. Default 300.
    :param checkpoint_uri: Where this task's checkpoints go (``file://...``, ``s3://bucket/...``;
        templated). Default: ``<[torchrun] checkpoint_base>/<dag_id>/<run_id>/<task_id>`` (a mapped
        task instance: ``<task_id>~map<index>``; a segment that is not plain letters, digits, ``.``,
        ``_``, ``-`` is sanitised and gets ``~<hash>``, so different ids never share a directory),
        shared by every try of one DAG run's task, so a retry finds what the failed try saved. Ranks
        see it as ``TRAIN_CHECKPOINT_URI``, and as a path in ``TRAIN_CHECKPOINT_DIR`` (``file://``
        URIs; others unchanged), which ``script_args`` may name as ``${TRAIN_CHECKPOINT_DIR}`` to
        hand a script's own flag the location (``--output_dir``, ``--trainer.default_root_dir``):
        the ranks' launcher replaces it, on both backends. A root belongs to the first task instance that uses it:
        another task, run or DAG on the same root is refused before launch, and nothing is deleted.
    :param resume: ``"auto"`` (default): resume from the latest committed checkpoint under
        ``checkpoint_uri`` that verifies (a damaged one is skipped, with a warning, for the
        previous); ``"never"``; or the URI of a committed checkpoint (or of a checkpoint root) to
        warm-start from. Ranks see it as ``TRAIN_RESUME_FROM`` (empty on a fresh start). Templated.
        With no committed checkpoint of the store, a framework's own checkpoint under
        ``checkpoint_uri`` (Lightning ``*.ckpt``, Trainer ``checkpoint-N/``, accelerate
        ``checkpoint_N/``; see :mod:`airflow_torchrun.integrations.detect`) is what the log and XCom
        ``resumed_from`` (with ``"framework"``) report; the script loads it itself.
    :param resume_from_outside: Allow ``resume`` to name a checkpoint outside ``checkpoint_uri``
        (another run's, another DAG's). Off by default: ``resume`` is templated, so a trigger Param
        could otherwise point every rank at any store, and whoever can write there decides what
        the ranks load.
    :param trust_foreign_sharded: Allow the ranks to load a sharded (``torch.distributed.checkpoint``)
        checkpoint of another lineage (``TRAIN_CHECKPOINT_TRUST_SHARDED``): its metadata is
        unpickled, so only for stores no one untrusted can write to. Off by default.
    :param keep_last: Committed checkpoints to keep (``TRAIN_CHECKPOINT_KEEP_LAST``), default 3;
        ``0`` keeps every one (as ``save_checkpoint(keep_last=0)``). The one resumed from is never deleted.
    :param aws_conn_id: Airflow connection holding S3 credentials and, in its extra,
        ``endpoint_url``/``region_name``. Default: the connection ``checkpoint_uri`` names
        (``s3://<conn_id>@bucket/prefix``), else the standard AWS chain of the worker.
    :param storage_options: Extra fsspec/s3fs options (win over the connection's).
    :param shard_manifest: URI of a ``ShardDatasetOperator`` manifest (``TRAIN_SHARD_MANIFEST``),
        e.g. ``shard.output``. Templated.
    :param track: Create (first try) or reuse (later tries) one MLflow run for this DAG run's task
        and give ranks ``MLFLOW_TRACKING_URI`` and ``MLFLOW_RUN_ID``. ``None`` (default): only when
        a tracking server is configured (``mlflow_tracking_uri``, ``$MLFLOW_TRACKING_URI`` or
        ``[torchrun] mlflow_tracking_uri``), so a script that never logs costs no MLflow run.
        ``True``: always (the default store is SQLite in the state directory); ``False``: never.
    :param check_process_group: After every node exited 0, check that each rank's script joined one
        process group of the task's world size (the launcher records it; local backend, ``script=``
        only). When they did not (every rank trained alone: Hugging Face Trainer on CPU without
        ``--use_cpu``, accelerate without ``ACCELERATE_USE_CPU=1``), ``True`` (default) fails the
        task without retry, naming the fixes; ``False`` only warns.
    :param mlflow_tracking_uri: Default: ``$MLFLOW_TRACKING_URI``, else
        ``[torchrun] mlflow_tracking_uri``, else SQLite in the state directory.
    :param mlflow_experiment: MLflow experiment name (templated); default: the DAG id.
    :param namespace: Kubernetes namespace of the group; default ``[torchrun] kubernetes_namespace``.
    :param kubernetes_conn_id: Airflow connection of the cluster; default
        ``[torchrun] kubernetes_conn_id``, else ``kubernetes_default``.
    :param all_ranks_logs: Kubernetes: stream every rank's log into the task log, not only rank 0's.
    :param max_preemptions: How many times a preempted or evicted group is relaunched within the
        same try (resuming from the latest checkpoint) before the task fails; it does not spend
        ``retries``.
    :param max_restarts: How many times a group that failed retryably (a rank killed by a signal
        or exiting with a retryable code, a hang caught by ``progress_timeout``) is torn down and
        relaunched within the same try, resuming from the latest committed checkpoint, before
        Airflow's ``retries`` are spent (default 0: failures go straight to ``retries``).
    :param retry_on_exit_codes: When given, only these exit codes of the failing rank are retried
        (restarts, then ``retries``); any other exit code fails the task at once. Signals, a peer's
        death, the "stopped to save" code 75 and port races stay retryable.
    :param fail_on_exit_codes: Exit codes of the failing rank that fail the task at once, without
        restart or retry (for example a script's own "bad config" code).
    :param resume_audit: What to do when a resumed launch's recomputed steps (from the step it
        resumed from to the furthest step reported before) did not compute the losses reported
        before (:mod:`airflow_torchrun.audit`: ``exact`` bit-equal, ``close`` within a relative 1e-3,
        ``diverged``): ``"warn"`` (default) logs the audit, ``"fail"`` fails the task without retry
        when it diverged, ``"off"`` skips the audit. The audit needs the ranks' progress records
        (``ProgressLogger`` or ``RunLogger.log_step`` with the loss); XCom ``resume_audit``, the
        MLflow tag ``torchrun.resume_audit``.
    :param mtbf: Mean time between failures of this task's group, in seconds (or a ``timedelta``),
        for ``worker.should_checkpoint`` (``TRAIN_CHECKPOINT_MTBF``), which checkpoints every
        sqrt(2 x save cost x MTBF) seconds (Young/Daly). Default ``None``: the lineage's observed
        failures (failed launches over their time, ``TRAIN_FAILURES_OBSERVED``) decide.
    :param deferrable: Free the worker slot while the group runs: after launching, the task defers
        to a trigger that watches the group from the triggerer, and finishes (success, or failure
        with the same message as in sync mode) when the group is done. Defaults to
        ``[operators] default_deferrable``.
    :param defer_after: Deferrable mode: seconds the worker watches the group itself before it
        defers; default ``[torchrun] defer_after``, else 60, so a group of seconds never defers at
        all. Once deferred, the trigger reports the end no sooner than 10 s after the deferral (a
        task re-queued by its trigger before Airflow has processed the deferring process's exit is
        failed by the scheduler: seen with Airflow 3.3.2).
    """

    template_fields: Sequence[str] = (
        *GroupOperator.group_template_fields,
        "checkpoint_uri",
        "resume",
        "shard_manifest",
        "mlflow_experiment",
    )
    operator_extra_links = (MlflowRunLink(), CheckpointLink())
    ui_color = "#ee4c2c"
    ui_fgcolor = "#ffffff"

    def __init__(
        self,
        *,
        checkpoint_uri: str | None = None,
        resume: str = RESUME_AUTO,
        resume_from_outside: bool = False,
        trust_foreign_sharded: bool = False,
        keep_last: int = 3,
        shard_manifest: str | None = None,
        track: bool | None = None,
        mlflow_experiment: str | None = None,
        all_ranks_logs: bool = False,
        check_process_group: bool = True,
        resume_audit: str = "warn",
        mtbf: float | timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.checkpoint_uri = checkpoint_uri
        self.resume = resume
        self.shard_manifest = shard_manifest
        self.mlflow_experiment = mlflow_experiment
        problems = self._problems
        self.training = TrainingSettings(
            keep_last=keep_last,
            resume_from_outside=flag("resume_from_outside", resume_from_outside, problems),
            trust_foreign_sharded=flag("trust_foreign_sharded", trust_foreign_sharded, problems),
            track=flag("track", track, problems, allow_none=True),
            check_process_group=flag("check_process_group", check_process_group, problems),
            mlflow_tracking_uri=self.mlflow_tracking_uri,
            resume_audit=parse_mode(resume_audit, problems),
            mtbf=seconds_or_none("mtbf", mtbf, problems),
        )
        self.backend_options = BackendOptions(
            namespace=self.backend_options.namespace,
            kubernetes_conn_id=self.backend_options.kubernetes_conn_id,
            all_ranks_logs=flag("all_ranks_logs", all_ranks_logs, problems),
        )
        # Parse time: everything that is not a template is checked now, every problem at once.
        self.validate(allow_templates=True)

    def checkpoint_settings(self) -> CheckpointSettings:
        return CheckpointSettings(
            checkpoint_uri=self.checkpoint_uri,
            resume=self.resume,
            keep_last=self.training.keep_last,
            aws_conn_id=self.aws_conn_id,
            storage_options=self.storage_options,
            default_base=checkpoint_base() if self.checkpoint_uri is None else None,
        )

    def tracking_uri(self) -> str | None:
        return self.training.tracking_uri()

    def default_checkpoint_uri(self, context: Context) -> str:
        """``<[torchrun] checkpoint_base>/<dag_id>/<run_id>/<task_id>``: shared by every try of one run."""
        io = TaskIO(context=context, where=self._where, log=self.log, backend=None, preflight_budget=0.0)
        return default_checkpoint_uri(lineage_of(io, str(self.dag_id), str(self.task_id)))

    def storage_uris(self) -> Sequence[object]:
        return (self.checkpoint_uri,)

    def rank_contract(self, io: TaskIO, state: dict[str, Any] | None = None) -> TrainingContract:
        return TrainingContract(io, self.training, **self.contract_arguments(state))

    def contract_arguments(self, state: dict[str, Any] | None) -> dict[str, Any]:
        """What the training contract takes from this task (``@task.torchrun``'s contract too)."""
        return {
            "dag_id": str(self.dag_id),
            "task_id": str(self.task_id),
            "checkpoint_uri": self.checkpoint_uri,
            "resume": self.resume,
            "shard_manifest": self.shard_manifest,
            "mlflow_experiment": self.mlflow_experiment,
            "outlets": self.outlets,
            "state": state,
        }

    # -- OpenLineage (the openlineage extra; imported only when the provider asks) -------------------
    def get_openlineage_facets_on_start(self) -> Any:
        from airflow_torchrun.lineage_openlineage import training_lineage_of

        return training_lineage_of(self, None)

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        from airflow_torchrun.lineage_openlineage import training_lineage_of

        return training_lineage_of(self, task_instance)

    def get_openlineage_facets_on_failure(self, task_instance: Any) -> Any:
        from airflow_torchrun.lineage_openlineage import training_lineage_of

        return training_lineage_of(self, task_instance)
