"""``DistributedTrainingOperator``: one Airflow task = one torchrun group, watched to the end."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow_torchrun.checkpoint import RESUME_AUTO
from airflow_torchrun.compat import conf
from airflow_torchrun.links import CHECKPOINT_URL_KEY, MLFLOW_RUN_URL_KEY, CheckpointLink, MlflowRunLink
from airflow_torchrun.operators.group import GroupOperator
from airflow_torchrun.settings import CheckpointSettings, KubernetesSettings
from airflow_torchrun.state import state_dir

if TYPE_CHECKING:
    from airflow_torchrun.backends.handles import GroupHandle
    from airflow_torchrun.checkpoint import CheckpointStore, Lineage
    from airflow_torchrun.compat import Context
    from airflow_torchrun.integrations.detect import FrameworkCheckpoint
    from airflow_torchrun.watch import Verdict

XCOM_MLFLOW_RUN_ID = "mlflow_run_id"
XCOM_CHECKPOINT_URI = "checkpoint_uri"


def checkpoint_base() -> str:
    """``[torchrun] checkpoint_base``, else ``file://<state_dir>/checkpoints``."""
    return conf.get("torchrun", "checkpoint_base", fallback=None) or f"file://{state_dir() / 'checkpoints'}"


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
    :param keep_last: Committed checkpoints to keep (``TRAIN_CHECKPOINT_KEEP_LAST``); the one
        resumed from is never deleted.
    :param aws_conn_id: Airflow connection holding S3 credentials and, in its extra,
        ``endpoint_url``/``region_name``. Default: the standard AWS chain of the worker.
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
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.checkpoint_uri = checkpoint_uri
        self.resume = resume
        self.resume_from_outside = bool(resume_from_outside)
        self.trust_foreign_sharded = bool(trust_foreign_sharded)
        self.keep_last = keep_last
        self.shard_manifest = shard_manifest
        self.track = track
        self.check_process_group = bool(check_process_group)
        self.mlflow_experiment = mlflow_experiment
        self.all_ranks_logs = all_ranks_logs
        self._mlflow_run_id: str | None = None
        # Parse time: everything that is not a template is checked now, every problem at once.
        self.validate(allow_templates=True)

    def checkpoint_settings(self) -> CheckpointSettings:
        return CheckpointSettings(
            checkpoint_uri=self.checkpoint_uri,
            resume=self.resume,
            keep_last=self.keep_last,
            aws_conn_id=self.aws_conn_id,
            storage_options=self.storage_options,
            default_base=checkpoint_base() if self.checkpoint_uri is None else None,
        )

    def kubernetes_settings(self) -> KubernetesSettings:
        return KubernetesSettings(
            namespace=self.namespace,
            kubernetes_conn_id=self.kubernetes_conn_id,
            all_ranks_logs=self.all_ranks_logs,
            active_deadline_seconds=self.execution_timeout_seconds(),
        )

    def tracking_uri(self) -> str | None:
        if not self._tracking():  # track=None: tracked when a tracking URI is configured
            return None
        from airflow_torchrun.tracking import resolve_tracking_uri

        return resolve_tracking_uri(self.mlflow_tracking_uri)

    # -- the rank contract --------------------------------------------------------------------
    def default_checkpoint_uri(self, context: Context) -> str:
        """``<[torchrun] checkpoint_base>/<dag_id>/<run_id>/<task_id>``: shared by every try of one run.

        Derived by :func:`airflow_torchrun.naming.lineage_path`: injective in dag, run, task and
        map index.
        """
        from airflow_torchrun.naming import lineage_path

        base = checkpoint_base()
        lineage = self.lineage(context)
        return f"{base.rstrip('/')}/{lineage_path(lineage.dag_id, lineage.run_id, lineage.task_id, lineage.map_index)}"

    def lineage(self, context: Context) -> Lineage:
        """The task instance lineage that owns this task's checkpoints (every try of it)."""
        from airflow_torchrun.checkpoint import Lineage

        ti = context.get("ti")
        run_id = str(ti.run_id if ti is not None else context["run_id"])
        raw_index = ti.map_index if ti is not None else context.get("map_index", -1)
        map_index = int(raw_index) if isinstance(raw_index, int) else -1
        return Lineage(dag_id=str(self.dag_id), run_id=run_id, task_id=str(self.task_id), map_index=map_index)

    def contract_env_preview(self, context: Context) -> dict[str, str]:
        from airflow_torchrun.contract import checkpoint_dir

        uri = str(self.checkpoint_uri or self.default_checkpoint_uri(context))
        preview = {
            "TRAIN_CHECKPOINT_URI": uri,
            "TRAIN_CHECKPOINT_DIR": checkpoint_dir(uri),
            "TRAIN_RESUME_FROM": "<latest committed checkpoint, or empty on a fresh start>",
            "TRAIN_CHECKPOINT_KEEP_LAST": str(self.keep_last),
        }
        if self.shard_manifest:
            preview["TRAIN_SHARD_MANIFEST"] = str(self.shard_manifest)
        if self._tracking():
            from airflow_torchrun.tracking import resolve_tracking_uri

            preview["MLFLOW_TRACKING_URI"] = resolve_tracking_uri(self.mlflow_tracking_uri)
            preview["MLFLOW_RUN_ID"] = "<created on the first try, reused by retries>"
        return preview

    def contract_env(self, context: Context) -> dict[str, str]:
        """What the operator adds to every rank's environment (beyond torchrun's own variables).

        Checkpoints: ``TRAIN_CHECKPOINT_URI``, ``TRAIN_RESUME_FROM`` (checked before any rank
        starts: a bad URI, missing bucket or wrong credentials fail here, without retry; an
        unreachable store is waited for, then fails retryably); MLflow: ``MLFLOW_TRACKING_URI``,
        ``MLFLOW_RUN_ID``; data: ``TRAIN_SHARD_MANIFEST``. Secrets travel only in the ranks'
        environment, never in logs, XCom or rendered fields.
        """
        from airflow_torchrun.checkpoint import CheckpointStore, claim_lineage, resolve_resume
        from airflow_torchrun.contract import checkpoint_dir

        ti = context["ti"]
        uri = self.checkpoint_uri or self.default_checkpoint_uri(context)
        if self.backend == "kubernetes" and uri.startswith("file://"):
            self.log.warning(
                "Checkpoints go to %s, a path inside each pod: a retry cannot resume from it. Set "
                "checkpoint_uri='s3://...' or [torchrun] checkpoint_base to storage the pods share",
                uri,
            )
        self.checkpoint_uri = uri
        ti.xcom_push(key=XCOM_CHECKPOINT_URI, value=uri)  # the training view lists its checkpoints while it runs
        options = self.storage_options_resolved()
        store = CheckpointStore(uri, options)
        self.preflight("checking checkpoint storage", lambda: store.check_access(write=True))
        lineage = self.lineage(context)
        self.preflight("checking who owns the checkpoints", lambda: claim_lineage(store, lineage))
        ref = self.preflight(
            "finding the checkpoint to resume from",
            lambda: resolve_resume(uri, self.resume, options, allow_outside=self.resume_from_outside),
        )
        resumed: dict[str, Any] | None = {"uri": ref.uri, "step": ref.step} if ref else None
        if ref is not None:
            self.log.info("Checkpoints: %s; resuming from %s (step %d)", uri, ref.uri, ref.step)
        else:
            own = self._framework_checkpoint(store)
            if own is None:
                self.log.info("Checkpoints: %s; fresh start (resume=%s)", uri, self.resume)
            else:
                resumed = own.to_xcom()
                self.log.info(
                    "Checkpoints: %s; no committed checkpoint of the store, but the script's own %s checkpoint "
                    "%s (step %s) is there: resuming from it, as the script loads it itself (resume=%s)",
                    uri,
                    own.framework,
                    own.uri,
                    own.step if own.step is not None else "unknown",
                    self.resume,
                )
        ti.xcom_push(key="resumed_from", value=resumed)
        env = self.rank_storage_env(options)
        env.update(
            {
                "TRAIN_CHECKPOINT_URI": store.uri,
                "TRAIN_CHECKPOINT_DIR": checkpoint_dir(store.uri),
                "TRAIN_RESUME_FROM": ref.uri if ref else "",
                "TRAIN_CHECKPOINT_KEEP_LAST": str(self.keep_last),
                "TRAIN_CHECKPOINT_LINEAGE": json.dumps(
                    {**lineage.to_dict(), "try_number": ti.try_number}, sort_keys=True
                ),
            }
        )
        if self.trust_foreign_sharded:
            env["TRAIN_CHECKPOINT_TRUST_SHARDED"] = "1"
        if self.shard_manifest:
            env["TRAIN_SHARD_MANIFEST"] = str(self.shard_manifest)
        if self._tracking():
            env.update(self._tracking_env(context))
        else:  # the extra link finds "no run" instead of logging an error for a missing XCom
            ti.xcom_push(key=MLFLOW_RUN_URL_KEY, value=None)
        return env

    def _framework_checkpoint(self, store: CheckpointStore) -> FrameworkCheckpoint | None:
        """A framework's own checkpoint under the root (``resume="auto"`` only); never fails the task."""
        if self.resume != RESUME_AUTO:
            return None
        from airflow_torchrun.integrations.detect import find_framework_checkpoint

        try:
            return find_framework_checkpoint(store)
        except Exception as exc:  # only what the log says: never worth failing a launch for
            self.log.warning("Could not look for a framework's own checkpoints under %s: %s", store.uri, exc)
            return None

    def _tracking(self) -> bool:
        """Whether this task has an MLflow run: ``track``, or (None) whether a tracking URI is configured."""
        if self.track is not None:
            return bool(self.track)
        from airflow_torchrun.tracking import tracking_configured

        return tracking_configured(self.mlflow_tracking_uri)

    def _tracking_env(self, context: Context) -> dict[str, str]:
        from airflow_torchrun.tracking import check_tracking_uri, ensure_run, rank_env, resolve_tracking_uri, run_url

        ti = context["ti"]
        tracking_uri = resolve_tracking_uri(self.mlflow_tracking_uri)
        self.preflight("reaching the MLflow tracking server", lambda: check_tracking_uri(tracking_uri))
        run_id = self.preflight(
            "creating the MLflow run", lambda: ensure_run(context, self.mlflow_experiment, tracking_uri)
        )
        self._mlflow_run_id = run_id
        ti.xcom_push(key=XCOM_MLFLOW_RUN_ID, value=run_id)
        try:
            ti.xcom_push(key=MLFLOW_RUN_URL_KEY, value=run_url(run_id, tracking_uri))
        except Exception as exc:  # only the link: never worth failing the task for
            self.log.warning("MLflow run %s: could not build its UI link: %s", run_id, exc)
        return rank_env(run_id, tracking_uri)

    # -- the end ------------------------------------------------------------------------------
    def _run_id(self, context: Context) -> str | None:
        """This try's MLflow run: set by contract_env, or (re-entry after deferral, a new process) its XCom."""
        if self._mlflow_run_id is None and self._tracking():
            ti = context["ti"]
            self._mlflow_run_id = ti.xcom_pull(task_ids=self.task_id, key=XCOM_MLFLOW_RUN_ID, map_indexes=ti.map_index)
        return self._mlflow_run_id

    def on_group_end(self, context: Context, succeeded: bool) -> None:
        """Close the MLflow run: best effort, a tracking outage never fails a finished group."""
        from airflow_torchrun.tracking import DEFAULT_FINISH_BUDGET, finish_run

        run_id = self._run_id(context)
        if run_id:
            self._track_warnings(run_id)
            finish_run(
                run_id,
                succeeded=succeeded,
                tracking_uri=self.mlflow_tracking_uri,
                try_number=context["ti"].try_number,
                budget=min(DEFAULT_FINISH_BUDGET, float(self.preflight_budget)),
            )

    def _track_warnings(self, run_id: str) -> None:
        """Starvation and straggler warnings of the whole try (replayed from the ranks' progress
        records) as tags and metrics of the MLflow run. Best effort."""
        from airflow_torchrun.progress import STARVATION, STRAGGLER, ProgressThresholds, replay
        from airflow_torchrun.tracking import client
        from airflow_torchrun.worker.progress import parse_records

        engine = self._engine
        if engine is None or engine.handle is None:
            return
        handle = engine.handle
        try:
            from airflow_torchrun.backends.base import backend_from_handle

            records = parse_records(backend_from_handle(handle).read_progress_lines(handle))
            nproc = max(1, handle.world_size // max(1, handle.num_nodes))
            board, seen = replay(records, nproc_per_node=nproc, thresholds=ProgressThresholds.from_conf())
            if not seen and not board.seen:
                return
            tags: dict[str, str] = {}
            metrics: dict[str, float] = {}
            starved = [a for a in seen if a.kind == STARVATION]
            stragglers = [a for a in seen if a.kind == STRAGGLER]
            if starved:
                tags["torchrun.data_starvation"] = starved[-1].message[:5000]
                metrics["torchrun_data_wait_median"] = max(a.value or 0.0 for a in starved)
            if stragglers:
                tags["torchrun.straggler_ranks"] = ",".join(sorted({str(a.rank) for a in stragglers}))
                tags["torchrun.straggler"] = stragglers[-1].message[:5000]
                metrics["torchrun_straggler_ratio"] = max(a.value or 0.0 for a in stragglers)
            summary = board.summary()
            if summary is not None and summary.data_wait is not None:
                metrics["torchrun_final_data_wait"] = summary.data_wait
            mlflow = client(self.mlflow_tracking_uri)
            for key, value in tags.items():
                mlflow.set_tag(run_id, key, value)
            for key, number in metrics.items():
                mlflow.log_metric(run_id, key, number)
        except Exception as exc:  # never fails a finished group
            self.log.warning("Could not record the training's warnings in MLflow run %s: %s", run_id, exc)

    def _publish_checkpoint(self, context: Context, uri: str, step: int | None) -> None:
        """The 'Checkpoint' link, and the asset event's metadata: checkpoint URI, step, final metrics."""
        from airflow_torchrun.assets import annotate_outlets
        from airflow_torchrun.links import checkpoint_url

        try:
            context["ti"].xcom_push(key=CHECKPOINT_URL_KEY, value=checkpoint_url(uri))
        except Exception as exc:  # only the link
            self.log.warning("Could not build the checkpoint's link for %s: %s", uri, exc)
        if self.outlets:
            extra = {"checkpoint_uri": uri, "step": step, "metrics": self._final_metrics(context)}
            annotate_outlets(context, self.outlets, extra, self.log)

    def _final_metrics(self, context: Context) -> dict[str, float]:
        """The MLflow run's latest metrics (best effort: none when tracking is off or away)."""
        run_id = self._run_id(context)
        if not run_id:
            return {}
        try:
            from airflow_torchrun.tracking import client

            return {str(k): float(v) for k, v in client(self.mlflow_tracking_uri).get_run(run_id).data.metrics.items()}
        except Exception as exc:
            self.log.warning("Could not read the final metrics of MLflow run %s: %s", run_id, exc)
            return {}

    def finish(self, context: Context, handle: GroupHandle, verdict: Verdict) -> dict[str, Any]:
        """The group's summary (XCom ``return_value``)."""
        from airflow_torchrun.checkpoint import CheckpointStore, final_checkpoint

        wall = time.time() - handle.launched_at
        assert self._engine is not None  # finish runs only after the engine did
        self._check_process_group(handle)
        self.log.info("Group %s succeeded: every node exited 0, %.1fs after launch", handle.group_id, wall)
        if self.checkpoint_uri is None:  # re-entry after deferral: a new process, same default
            self.checkpoint_uri = self.default_checkpoint_uri(context)
        store = CheckpointStore(self.checkpoint_uri, self.storage_options_resolved())
        ref = self.preflight("reading the final checkpoint", lambda: final_checkpoint(store, self.lineage(context)))
        if ref is not None:
            self.log.info("Final checkpoint: %s (step %d)", ref.uri, ref.step)
        self._publish_checkpoint(context, ref.uri if ref else self.checkpoint_uri, ref.step if ref else None)
        spec, backend = self._engine.spec, self._engine.backend
        return {
            "checkpoint_uri": self.checkpoint_uri,
            "final_checkpoint": ref.uri if ref else None,
            "mlflow_run_id": self._run_id(context),
            "group_id": handle.group_id,
            "backend": handle.backend,
            "world_size": spec.world_size,
            "num_nodes": spec.num_nodes,
            "nproc_per_node": spec.nproc_per_node,
            "node_exit_codes": [n.exit_code for n in verdict.nodes],
            "wall_time_s": round(wall, 3),
            "log_dir": handle.log_dir,
            "logs": backend.log_locations(handle),
        }

    def _check_process_group(self, handle: GroupHandle) -> None:
        """Fail (or warn) when the ranks did not form one process group of the world size."""
        from airflow_torchrun import diagnosis
        from airflow_torchrun.compat import AirflowFailException

        assert self._engine is not None
        try:
            records = self._engine.backend.process_groups(handle)
        except Exception as exc:  # what the launchers noted is a check, not the training
            self.log.warning("Group %s: could not read the ranks' process group records: %s", handle.group_id, exc)
            return
        problem = diagnosis.process_group_problem(records, self._engine.spec.world_size)
        if problem is None:
            if records:
                self.log.info(
                    "Group %s: every rank joined one process group of world size %d",
                    handle.group_id,
                    self._engine.spec.world_size,
                )
            return
        message = f"Group {handle.group_id}: {problem}"
        if not self.check_process_group:
            self.log.warning("%s (check_process_group=False: not failing the task)", message)
            return
        self.log.error("%s", message)
        raise AirflowFailException(
            f"{message}. Set check_process_group=False to accept it.\n(A retry cannot fix this; not retrying.)"
        )
