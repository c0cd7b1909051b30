"""Training's rank contract: checkpoints (where, owned by whom, resumed from what), data, the MLflow run.

It gives every rank ``TRAIN_CHECKPOINT_URI``/``_DIR``, ``TRAIN_RESUME_FROM`` (checked before any rank
starts: a bad URI, a missing bucket or wrong credentials fail here without retry; an unreachable
store is waited for, then fails retryably), the lineage and retention variables,
``TRAIN_SHARD_MANIFEST``, and ``MLFLOW_TRACKING_URI``/``MLFLOW_RUN_ID`` when the task tracks. Its
result is the group's summary with the final checkpoint; on the way it checks that the ranks
formed one process group. Secrets travel only in the ranks' environment, never in logs or XCom.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow_torchrun import contract
from airflow_torchrun.audit import AuditMode
from airflow_torchrun.compat import AirflowFailException, conf
from airflow_torchrun.links import CHECKPOINT_URL_KEY, MLFLOW_RUN_URL_KEY
from airflow_torchrun.operators.policy import NOT_RETRYING
from airflow_torchrun.state import state_dir
from airflow_torchrun.storage.lineage import RESUME_AUTO

if TYPE_CHECKING:
    from airflow_torchrun.backends.handles import GroupHandle
    from airflow_torchrun.books import TryBooks
    from airflow_torchrun.integrations.detect import FrameworkCheckpoint
    from airflow_torchrun.operators.contracts import TaskIO
    from airflow_torchrun.spec import GroupSpec
    from airflow_torchrun.storage.checkpoints import CheckpointStore
    from airflow_torchrun.storage.lineage import Lineage
    from airflow_torchrun.watch import Verdict

XCOM_MLFLOW_RUN_ID = "mlflow_run_id"
XCOM_CHECKPOINT_URI = "checkpoint_uri"
XCOM_RESUMED_FROM = "resumed_from"


def checkpoint_base() -> str:
    """``[torchrun] checkpoint_base``, else ``file://<state_dir>/checkpoints``."""
    return conf.get("torchrun", "checkpoint_base", fallback=None) or f"file://{state_dir() / 'checkpoints'}"


@dataclass(frozen=True)
class TrainingSettings:
    """Training's arguments that are not templated: checked and frozen when the DAG is parsed."""

    keep_last: int = 3
    resume_from_outside: bool = False
    trust_foreign_sharded: bool = False
    track: bool | None = None
    check_process_group: bool = True
    mlflow_tracking_uri: str | None = None
    resume_audit: AuditMode = AuditMode.WARN
    mtbf: float | None = None  # seconds; None: the lineage's observed failures decide

    def tracking(self) -> bool:
        """Whether the task has an MLflow run: ``track``, or (None) whether a tracking URI is configured."""
        if self.track is not None:
            return self.track
        from airflow_torchrun.tracking import tracking_configured

        return tracking_configured(self.mlflow_tracking_uri)

    def tracking_uri(self) -> str | None:
        """The MLflow store the ranks log into, when the task tracks."""
        if not self.tracking():
            return None
        from airflow_torchrun.tracking import resolve_tracking_uri

        return resolve_tracking_uri(self.mlflow_tracking_uri)


def lineage_of(io: TaskIO, dag_id: str, task_id: str) -> Lineage:
    """The task instance lineage that owns this task's checkpoints (every try of it)."""
    from airflow_torchrun.storage.lineage import Lineage

    context = io.context
    ti = context.get("ti")
    run_id = str(ti.run_id if ti is not None else context["run_id"])
    raw_index = ti.map_index if ti is not None else context.get("map_index", -1)
    map_index = int(raw_index) if isinstance(raw_index, int) else -1
    # Two deployments sharing a store have equal run ids: the deployment's identity tells their
    # lineages apart (a root of another deployment is refused before launch, nothing deleted).
    from airflow_torchrun.deployment import deployment_name

    deployment = deployment_name(create=ti is not None)
    return Lineage(dag_id=dag_id, run_id=run_id, task_id=task_id, map_index=map_index, deployment=deployment)


def default_checkpoint_uri(lineage: Lineage) -> str:
    """``<[torchrun] checkpoint_base>/<dag_id>/<run_id>/<task_id>``: shared by every try of one run
    (:func:`airflow_torchrun.naming.lineage_path`: injective in dag, run, task and map index)."""
    from airflow_torchrun.naming import join, lineage_path

    return join(checkpoint_base(), lineage_path(lineage.dag_id, lineage.run_id, lineage.task_id, lineage.map_index))


class TrainingContract:
    """One try's training contract (see the module's docstring)."""

    def __init__(
        self,
        io: TaskIO,
        settings: TrainingSettings,
        *,
        dag_id: str,
        task_id: str,
        checkpoint_uri: str | None,
        resume: str,
        shard_manifest: str | None,
        mlflow_experiment: str | None,
        outlets: Any = None,
        state: dict[str, Any] | None = None,
    ) -> None:
        self.io, self.settings = io, settings
        self.lineage = lineage_of(io, dag_id, task_id)
        self.checkpoint_uri = str(checkpoint_uri or default_checkpoint_uri(self.lineage))
        self.resume, self.shard_manifest, self.mlflow_experiment = resume, shard_manifest, mlflow_experiment
        self.outlets = outlets
        self.mlflow_run_id: str | None = (state or {}).get("mlflow_run_id")
        self._books: TryBooks | None = None

    def state(self) -> dict[str, Any]:
        return {"mlflow_run_id": self.mlflow_run_id}

    def books(self) -> TryBooks:
        """The try's goodput ledger and resume audit, kept across tries in the task state store."""
        if self._books is None:
            from airflow_torchrun.books import TryBooks
            from airflow_torchrun.compat import task_state_store

            ti = self.io.context.get("ti")
            started = getattr(ti, "start_date", None)
            self._books = TryBooks(
                try_number=self.io.try_number,
                mode=self.settings.resume_audit,
                store=task_state_store(self.io.context),
                started_at=started.timestamp() if started is not None else None,
            )
        return self._books

    def _interval_env(self) -> dict[str, str]:
        """``should_checkpoint``'s inputs: the task's ``mtbf``, and the lineage's failures seen so far."""
        failures, seconds = self.books().failures_observed(time.time())
        env = {contract.FAILURES_OBSERVED: json.dumps({"failures": failures, "seconds": round(seconds, 3)})}
        if self.settings.mtbf is not None:
            env[contract.CHECKPOINT_MTBF] = f"{self.settings.mtbf:g}"
        return env

    # -- before launch ----------------------------------------------------------------------
    def preview(self) -> dict[str, str]:
        uri = self.checkpoint_uri
        preview = {
            contract.CHECKPOINT_URI: uri,
            contract.CHECKPOINT_DIR: contract.checkpoint_dir(uri),
            contract.RESUME_FROM: "<latest committed checkpoint, or empty on a fresh start>",
            contract.CHECKPOINT_KEEP_LAST: str(self.settings.keep_last),
        }
        if self.shard_manifest:
            preview[contract.SHARD_MANIFEST] = str(self.shard_manifest)
        tracking_uri = self.settings.tracking_uri()
        if tracking_uri is not None:
            preview[contract.MLFLOW_TRACKING_URI] = tracking_uri
            preview[contract.MLFLOW_RUN_ID] = "<created on the first try, reused by retries>"
        return preview

    def env(self) -> dict[str, str]:
        """The first launch's: storage, the lineage and tracking checked (the preflight), then the
        resume point, then the rest."""
        from airflow_torchrun.storage.checkpoints import CheckpointStore
        from airflow_torchrun.storage.lineage import claim_lineage

        io, uri = self.io, self.checkpoint_uri
        io.push(XCOM_CHECKPOINT_URI, uri, soon=True)  # the training view lists its checkpoints while it runs
        store = CheckpointStore(uri, io.resolved_storage_options())
        io.preflight("checking checkpoint storage", lambda: store.check_access(write=True))
        io.preflight("checking who owns the checkpoints", lambda: claim_lineage(store, self.lineage))
        resume = self._resume_env()
        return {**self._launch_env(checked=False), **resume}

    def relaunch_env(self) -> dict[str, str]:
        """A relaunch's, without the preflight :meth:`env` ran in this try (the MLflow run is the one
        it created; the contract's state carries it through a deferral); the resume point read anew."""
        resume = self._resume_env()
        return {**self._launch_env(checked=True), **resume}

    def _resume_env(self) -> dict[str, str]:
        """The resume point, read now (the group before is gone: what its save on SIGTERM committed
        is there), and the lineage's failures so far (``should_checkpoint``'s input)."""
        from airflow_torchrun.storage.checkpoints import CheckpointStore
        from airflow_torchrun.storage.lineage import resolve_resume

        io, uri = self.io, self.checkpoint_uri
        options = io.resolved_storage_options()
        ref = io.preflight(
            "finding the checkpoint to resume from",
            lambda: resolve_resume(uri, self.resume, options, allow_outside=self.settings.resume_from_outside),
        )
        resumed: dict[str, Any] | None = {"uri": ref.uri, "step": ref.step} if ref else None
        if ref is not None:
            io.log.info("Checkpoints: %s; resuming from %s (step %d)", uri, ref.uri, ref.step)
        else:
            own = self._framework_checkpoint(CheckpointStore(uri, options))
            if own is None:
                io.log.info("Checkpoints: %s; fresh start (resume=%s)", uri, self.resume)
            else:
                resumed = own.to_xcom()
                io.log.info(
                    "Checkpoints: %s; no committed checkpoint of the store, but the script's own %s checkpoint "
                    "%s (step %s) is there: resuming from it, as the script loads it itself (resume=%s)",
                    uri,
                    own.framework,
                    own.uri,
                    own.step if own.step is not None else "unknown",
                    self.resume,
                )
        io.push(XCOM_RESUMED_FROM, resumed, soon=True)
        return {contract.RESUME_FROM: ref.uri if ref else "", **self._interval_env()}

    def _launch_env(self, *, checked: bool) -> dict[str, str]:
        """Every variable but the resume point's. ``checked``: tracking was checked in this try (the
        MLflow run is reused as it is); else it is checked and the run created or found."""
        from airflow_torchrun.storage.checkpoints import CheckpointStore

        io = self.io
        store = CheckpointStore(self.checkpoint_uri, io.resolved_storage_options())
        env = io.rank_storage_env()
        env.update(
            {
                contract.CHECKPOINT_URI: store.uri,
                contract.CHECKPOINT_DIR: contract.checkpoint_dir(store.uri),
                contract.CHECKPOINT_KEEP_LAST: str(self.settings.keep_last),
                contract.CHECKPOINT_LINEAGE: json.dumps(
                    {**self.lineage.to_dict(), "try_number": io.ti.try_number}, sort_keys=True
                ),
            }
        )
        if self.settings.trust_foreign_sharded:
            env[contract.CHECKPOINT_TRUST_SHARDED] = "1"
        if self.shard_manifest:
            env[contract.SHARD_MANIFEST] = str(self.shard_manifest)
        tracking_uri = self.settings.tracking_uri()
        if tracking_uri is not None and checked and self.mlflow_run_id:
            from airflow_torchrun.tracking import rank_env

            env.update(rank_env(self.mlflow_run_id, tracking_uri))
        elif tracking_uri is not None:
            env.update(self._tracking_env(tracking_uri))
        elif not checked:  # the extra link finds "no run" instead of logging an error for a missing XCom
            io.push(MLFLOW_RUN_URL_KEY, None, soon=True)
        if not checked:  # the same for the 'Checkpoint' link of a try that fails (success replaces it)
            io.push(CHECKPOINT_URL_KEY, None, soon=True)
        return env

    def _framework_checkpoint(self, store: CheckpointStore) -> FrameworkCheckpoint | None:
        """A framework's own checkpoint under the root (``resume="auto"`` only); never fails the task."""
        if self.resume != RESUME_AUTO:
            return None
        from airflow_torchrun.integrations.detect import find_framework_checkpoint

        try:
            return find_framework_checkpoint(store)
        except Exception as exc:  # only what the log says: never worth failing a launch for
            self.io.log.warning("Could not look for a framework's own checkpoints under %s: %s", store.uri, exc)
            return None

    def _tracking_env(self, tracking_uri: str) -> dict[str, str]:
        from airflow_torchrun.tracking import check_tracking_uri, ensure_run, rank_env, run_url

        io = self.io
        io.preflight("reaching the MLflow tracking server", lambda: check_tracking_uri(tracking_uri))
        run_id = io.preflight(
            "creating the MLflow run", lambda: ensure_run(io.context, self.mlflow_experiment, tracking_uri)
        )
        self.mlflow_run_id = run_id
        io.push(XCOM_MLFLOW_RUN_ID, run_id, soon=True)
        try:
            io.push(MLFLOW_RUN_URL_KEY, run_url(run_id, tracking_uri), soon=True)
        except Exception as exc:  # only the link: never worth failing the task for
            io.log.warning("MLflow run %s: could not build its UI link: %s", run_id, exc)
        return rank_env(run_id, tracking_uri)

    # -- the end ------------------------------------------------------------------------------
    def ended(self, handle: GroupHandle, succeeded: bool) -> None:
        """Close the MLflow run: best effort, a tracking outage never fails a finished group."""
        if self.mlflow_run_id:
            from airflow_torchrun.publishing import close_run

            close_run(
                self.mlflow_run_id,
                succeeded=succeeded,
                tracking_uri=self.settings.mlflow_tracking_uri,
                try_number=self.io.ti.try_number,
                budget=self.io.preflight_budget,
                handle=handle,
                log=self.io.log,
                goodput=self.books().published(),
            )

    def finish(self, handle: GroupHandle, verdict: Verdict, spec: GroupSpec) -> dict[str, Any]:
        """The group's summary (XCom ``return_value``)."""
        from airflow_torchrun.publishing import final_metrics, publish_checkpoint
        from airflow_torchrun.storage.checkpoints import CheckpointStore
        from airflow_torchrun.storage.lineage import final_checkpoint

        io, backend = self.io, self.io.backend
        assert backend is not None  # a finish follows a launch
        wall = time.time() - handle.launched_at
        self._check_process_group(handle, spec)
        io.log.info("Group %s succeeded: every node exited 0, %.1fs after launch", handle.group_id, wall)
        store = CheckpointStore(self.checkpoint_uri, io.resolved_storage_options())
        ref = io.preflight("reading the final checkpoint", lambda: final_checkpoint(store, self.lineage))
        if ref is not None:
            io.log.info("Final checkpoint: %s (step %d)", ref.uri, ref.step)
        metrics = final_metrics(self.mlflow_run_id, self.settings.mlflow_tracking_uri, io.log) if self.outlets else {}
        publish_checkpoint(
            io.context,
            io.push,
            self.outlets,
            ref.uri if ref else self.checkpoint_uri,
            ref.step if ref else None,
            metrics,
            io.log,
            goodput=self.books().published(),
        )
        return {
            "checkpoint_uri": self.checkpoint_uri,
            "final_checkpoint": ref.uri if ref else None,
            "mlflow_run_id": self.mlflow_run_id,
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

    def _check_process_group(self, handle: GroupHandle, spec: GroupSpec) -> None:
        """Fail (or warn) when the ranks did not form one process group of the world size."""
        from airflow_torchrun import diagnosis

        io = self.io
        assert io.backend is not None  # a finish follows a launch
        try:
            records = io.backend.process_groups(handle)
        except Exception as exc:  # what the launchers noted is a check, not the training
            io.log.warning("Group %s: could not read the ranks' process group records: %s", handle.group_id, exc)
            return
        problem = diagnosis.process_group_problem(records, spec.world_size)
        if problem is None:
            if records:
                io.log.info(
                    "Group %s: every rank joined one process group of world size %d", handle.group_id, spec.world_size
                )
            return
        message = f"Group {handle.group_id}: {problem}"
        if not self.settings.check_process_group:
            io.log.warning("%s (check_process_group=False: not failing the task)", message)
            return
        io.log.error("%s", message)
        raise AirflowFailException(f"{message}. Set check_process_group=False to accept it.\n{NOT_RETRYING}")
