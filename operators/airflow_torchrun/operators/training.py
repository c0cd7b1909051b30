"""``DistributedTrainingOperator``: one Airflow task = one torchrun group, watched to the end."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_torchrun.checkpoint import RESUME_AUTO, RESUME_NEVER
from airflow_torchrun.compat import AirflowException, AirflowFailException, AirflowTaskTimeout, BaseOperator, conf
from airflow_torchrun.errors import InvalidSpecError, StorageError
from airflow_torchrun.links import MLFLOW_RUN_URL_KEY, MlflowRunLink
from airflow_torchrun.spec import (
    DEFAULT_RDZV_TIMEOUT,
    DEFAULT_STARTUP_TIMEOUT,
    DEFAULT_TEARDOWN_GRACE,
    GroupSpec,
    is_templated,
)
from airflow_torchrun.state import state_dir
from airflow_torchrun.status import GroupState, GroupStatus, group_status
from airflow_torchrun.wiring import GroupIdentity

if TYPE_CHECKING:
    from airflow_torchrun.backends.base import Backend, GroupHandle
    from airflow_torchrun.compat import Context
    from airflow_torchrun.runtimes import Runtime

PORT_RACE_RETRIES = 3
HEARTBEAT_SECONDS = 60.0


@dataclass
class Relaunches:
    """Whether a group that ended badly is launched again within the same try, and why.

    A lost rendezvous-port race (local) and a preempted or evicted group (Kubernetes, up to
    ``max_preemptions``, its own budget like Ray's) are not the script's fault: they do not spend
    Airflow's retries. Everything else goes to Airflow's retries.
    """

    port_races: int = 0
    preemptions: int = 0
    refused: str | None = None  # why a disrupted group is *not* relaunched (its budget is spent)

    @property
    def count(self) -> int:
        return self.port_races + self.preemptions

    def decide(self, backend: Backend, handle: GroupHandle, status: GroupStatus, max_preemptions: int) -> str | None:
        if status.state is GroupState.SUCCEEDED:
            return None
        port_in_use = getattr(backend, "port_in_use", None)
        if callable(port_in_use) and self.port_races < PORT_RACE_RETRIES and port_in_use(handle):
            self.port_races += 1
            return "its rendezvous port was taken by another process"
        preemption = getattr(backend, "preemption", None)
        why = preemption(status) if callable(preemption) else None
        if why:
            if self.preemptions >= max_preemptions:
                self.refused = (
                    f"the group was disrupted ({why}) but its preemption budget is spent "
                    f"({self.preemptions} relaunch(es), max_preemptions={max_preemptions}); failing this try"
                )
                return None
            self.preemptions += 1
            return (
                f"the group was disrupted ({why}), preemption {self.preemptions} of max_preemptions={max_preemptions}"
            )
        return None


class DistributedTrainingOperator(BaseOperator):
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
    :param poll_interval: Seconds between two looks at the group while waiting.
    :param checkpoint_uri: Where this task's checkpoints go (``file://...``, ``s3://bucket/...``;
        templated). Default: ``<[torchrun] checkpoint_base>/<dag_id>/<run_id>/<task_id>``, shared
        by every try of one DAG run's task, so a retry finds what the failed try saved. Ranks see it
        as ``TRAIN_CHECKPOINT_URI``.
    :param resume: ``"auto"`` (default): resume from the latest committed checkpoint under
        ``checkpoint_uri``, if any; ``"never"``; or the URI of a committed checkpoint (or of a
        checkpoint root) to warm-start from. Ranks see it as ``TRAIN_RESUME_FROM`` (empty on a
        fresh start). Templated.
    :param keep_last: Committed checkpoints to keep (``TRAIN_CHECKPOINT_KEEP_LAST``); the one
        resumed from is never deleted.
    :param aws_conn_id: Airflow connection holding S3 credentials and, in its extra,
        ``endpoint_url``/``region_name``. Default: the standard AWS chain of the worker.
    :param storage_options: Extra fsspec/s3fs options (win over the connection's).
    :param shard_manifest: URI of a ``ShardDatasetOperator`` manifest (``TRAIN_SHARD_MANIFEST``),
        e.g. ``shard.output``. Templated.
    :param track: Create (first try) or reuse (later tries) one MLflow run for this DAG run's task
        and give ranks ``MLFLOW_TRACKING_URI`` and ``MLFLOW_RUN_ID``.
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
    :param deferrable: Free the worker slot while the group runs: after launching, the task defers
        to a trigger that watches the group from the triggerer, and finishes (success, or failure
        with the same message as in sync mode) when the group is done. Defaults to
        ``[operators] default_deferrable``.
    """

    template_fields: Sequence[str] = (
        "num_nodes",
        "nproc_per_node",
        "backend",
        "runtime",
        "script",
        "command",
        "script_args",
        "env",
        "checkpoint_uri",
        "resume",
        "shard_manifest",
        "mlflow_experiment",
    )
    template_fields_renderers = {"env": "json", "script_args": "py", "command": "py"}
    operator_extra_links = (MlflowRunLink(),)
    ui_color = "#ee4c2c"
    ui_fgcolor = "#ffffff"

    def __init__(
        self,
        *,
        script: str | None = None,
        command: Sequence[str] | None = None,
        script_args: Sequence[str] = (),
        num_nodes: int = 1,
        nproc_per_node: int | None = None,
        env: Mapping[str, str] | None = None,
        backend: str | None = None,
        runtime: str | None = None,
        rdzv_port: int | None = None,
        rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        teardown_grace: float = DEFAULT_TEARDOWN_GRACE,
        threads_per_proc: int | None = None,
        poll_interval: float = 0.1,
        deferrable: bool | None = None,
        checkpoint_uri: str | None = None,
        resume: str = RESUME_AUTO,
        keep_last: int = 3,
        aws_conn_id: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        shard_manifest: str | None = None,
        track: bool = True,
        mlflow_tracking_uri: str | None = None,
        mlflow_experiment: str | None = None,
        namespace: str | None = None,
        kubernetes_conn_id: str | None = None,
        all_ranks_logs: bool = False,
        max_preemptions: int = 3,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if deferrable is None:
            deferrable = conf.getboolean("operators", "default_deferrable", fallback=False)
        self.deferrable = bool(deferrable)
        self.backend = backend or conf.get("torchrun", "default_backend", fallback="local")
        self.script = self._resolve_script(script)
        self.command = list(command) if command is not None else None
        self.script_args = list(script_args) if not isinstance(script_args, str) else script_args
        self.env = dict(env) if isinstance(env, Mapping) else env
        self.runtime = runtime
        self.num_nodes = num_nodes
        self.nproc_per_node = nproc_per_node
        self.rdzv_port = rdzv_port
        self.rdzv_timeout = rdzv_timeout
        self.startup_timeout = startup_timeout
        self.teardown_grace = teardown_grace
        self.threads_per_proc = threads_per_proc
        if not isinstance(poll_interval, int | float) or poll_interval <= 0:
            raise InvalidSpecError([f"poll_interval must be a positive number, got {poll_interval!r}"], self._where)
        self.poll_interval = float(poll_interval)
        self.checkpoint_uri = checkpoint_uri
        self.resume = resume
        self.keep_last = keep_last
        self.aws_conn_id = aws_conn_id
        self.storage_options = dict(storage_options or {})
        self.shard_manifest = shard_manifest
        self.track = track
        self.mlflow_tracking_uri = mlflow_tracking_uri
        self.mlflow_experiment = mlflow_experiment
        self.namespace = namespace
        self.kubernetes_conn_id = kubernetes_conn_id
        self.all_ranks_logs = all_ranks_logs
        if isinstance(max_preemptions, bool) or not isinstance(max_preemptions, int) or max_preemptions < 0:
            raise InvalidSpecError(
                [f"max_preemptions must be a whole number >= 0, got {max_preemptions!r}"], self._where
            )
        self.max_preemptions = max_preemptions
        self._handle: GroupHandle | None = None
        self._backend_obj: Backend | None = None
        self._killed = False
        self._mlflow_run_id: str | None = None
        # Parse time: everything that is not a template is checked now.
        self._spec(allow_templates=True)
        self._check_checkpoint_args()
        if not is_templated(self.backend) and not is_templated(self.checkpoint_uri):
            self._check_backend_fit(self._spec(allow_templates=True))

    # -- spec -------------------------------------------------------------------------------
    @property
    def _where(self) -> str:
        dag_id = self.dag_id if self.has_dag() else "<no dag>"
        return f"task {dag_id}.{self.task_id}"

    def _resolve_script(self, script: str | None) -> str | None:
        """Locally, a relative script is looked up here, then beside the DAG file. Elsewhere the
        path is inside the image and left alone."""
        if self.backend != "local" or not isinstance(script, str) or is_templated(script) or os.path.isabs(script):
            return script
        if Path(script).is_file():
            return str(Path(script).resolve())
        if self.has_dag() and self.dag.fileloc:
            beside_dag = Path(self.dag.fileloc).parent / script
            if beside_dag.is_file():
                return str(beside_dag)
        return script

    def _runtime(self) -> Runtime | None:
        """The platform runtime (Kubernetes backend; an unknown name fails here, at parse time)."""
        if self.backend != "kubernetes" or is_templated(self.runtime):
            return None
        from airflow_torchrun.runtimes import get_runtime

        return get_runtime(self.runtime, where=self._where)

    def _spec(self, *, allow_templates: bool = False) -> GroupSpec:
        script = self._resolve_script(self.script) if not allow_templates else self.script
        runtime = self._runtime()
        nproc = self.nproc_per_node
        if nproc is None:
            nproc = runtime.nproc_per_node if runtime is not None else 1
        return GroupSpec.create(
            num_nodes=self.num_nodes,
            nproc_per_node=nproc,
            script=script,
            command=self.command,
            script_args=self.script_args,
            env=self.env,
            backend=self.backend,
            runtime=self.runtime,
            rdzv_port=self.rdzv_port,
            rdzv_timeout=self.rdzv_timeout,
            startup_timeout=self.startup_timeout,
            teardown_grace=self.teardown_grace,
            threads_per_proc=self.threads_per_proc,
            where=self._where,
            allow_templates=allow_templates,
        )

    def _get_backend(self) -> Backend:
        if self._backend_obj is None:
            from airflow_torchrun.backends.base import get_backend

            options: dict[str, Any] = {}
            if self.backend == "local":
                options["state_dir"] = state_dir()
            elif self.backend == "kubernetes":
                options = {
                    "namespace": self.namespace,
                    "kubernetes_conn_id": self.kubernetes_conn_id,
                    "all_ranks_logs": self.all_ranks_logs,
                }
            self._backend_obj = get_backend(self.backend, **options)
        return self._backend_obj

    def _check_backend_fit(self, spec: GroupSpec) -> None:
        """What a backend cannot do with these values, said before anything starts."""
        if spec.backend == "kubernetes" and self.checkpoint_uri:
            uri = self.checkpoint_uri
            if not is_templated(uri) and (uri.startswith("file://") or uri.startswith("/")):
                raise InvalidSpecError(
                    [
                        f"checkpoint_uri {uri!r} is a local path, which pods on other machines cannot share; "
                        "give checkpoint_uri='s3://...' or set [torchrun] checkpoint_base to shared storage"
                    ],
                    self._where,
                )

    def _check_checkpoint_args(self) -> None:
        from airflow_torchrun.checkpoint import parse_uri

        problems = []
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 1:
            problems.append(f"keep_last must be a whole number >= 1, got {self.keep_last!r}")
        for name in ("checkpoint_uri", "resume"):
            value = getattr(self, name)
            if value is None or is_templated(value) or value in (RESUME_AUTO, RESUME_NEVER):
                continue
            if not isinstance(value, str):
                problems.append(f"{name} must be a string, got {value!r}")
                continue
            try:
                parse_uri(value)
            except StorageError as exc:
                problems.append(f"{name}: {exc}")
        if problems:
            raise InvalidSpecError(problems, self._where)

    def _rank_storage_env(self, options: Mapping[str, Any]) -> dict[str, str]:
        """Storage access for the ranks. Local: the connection's credentials in their environment.
        Kubernetes: never credentials in plain pod env (anyone who can read Jobs would see them);
        pods get them from the runtime's Secrets or service account."""
        from airflow_torchrun.checkpoint import storage_env

        if self.backend != "kubernetes":
            return storage_env(options)
        public = {k: v for k, v in options.items() if k not in ("key", "secret", "token")}
        if len(public) != len(options):
            self.log.warning(
                "Not passing the credentials of aws_conn_id=%s to the pods in plain text; give the runtime "
                "env_from_secrets or a service account with access to the checkpoint bucket",
                self.aws_conn_id,
            )
        return storage_env(public)

    def contract_env_preview(self, context: Context) -> dict[str, str]:
        """What :meth:`contract_env` will add, without I/O (for ``airflow-torchrun render``)."""
        preview = {
            "TRAIN_CHECKPOINT_URI": str(self.checkpoint_uri or self.default_checkpoint_uri(context)),
            "TRAIN_RESUME_FROM": "<latest committed checkpoint, or empty on a fresh start>",
            "TRAIN_CHECKPOINT_KEEP_LAST": str(self.keep_last),
        }
        if self.shard_manifest:
            preview["TRAIN_SHARD_MANIFEST"] = str(self.shard_manifest)
        if self.track:
            from airflow_torchrun.tracking import resolve_tracking_uri

            preview["MLFLOW_TRACKING_URI"] = resolve_tracking_uri(self.mlflow_tracking_uri)
            preview["MLFLOW_RUN_ID"] = "<created on the first try, reused by retries>"
        return preview

    def default_checkpoint_uri(self, context: Context) -> str:
        """``<[torchrun] checkpoint_base>/<dag_id>/<run_id>/<task_id>``: shared by every try of one run."""
        base = conf.get("torchrun", "checkpoint_base", fallback=None) or f"file://{state_dir() / 'checkpoints'}"
        ti = context.get("ti")
        run_id = str(ti.run_id if ti is not None else context["run_id"])
        raw_index = ti.map_index if ti is not None else context.get("map_index", -1)
        map_index = int(raw_index) if isinstance(raw_index, int) else -1
        task = self.task_id if map_index < 0 else f"{self.task_id}-{map_index}"
        run = re.sub(r"[^A-Za-z0-9._=-]+", "_", run_id)
        return f"{base.rstrip('/')}/{self.dag_id}/{run}/{task}"

    def _storage_options(self) -> dict[str, Any]:
        from airflow_torchrun.checkpoint import storage_options_from_aws_connection

        options: dict[str, Any] = {}
        if self.aws_conn_id:
            from airflow_torchrun.compat import BaseHook

            connection = BaseHook.get_connection(self.aws_conn_id)
            options = storage_options_from_aws_connection(
                connection.login, connection.password, connection.extra_dejson
            )
        return {**options, **self.storage_options}

    def contract_env(self, context: Context) -> dict[str, str]:
        """What the operator adds to every rank's environment (beyond torchrun's own variables).

        Checkpoints: ``TRAIN_CHECKPOINT_URI``, ``TRAIN_RESUME_FROM`` (checked before any rank
        starts: a bad URI, missing bucket or wrong credentials fail here); MLflow:
        ``MLFLOW_TRACKING_URI``, ``MLFLOW_RUN_ID``; data: ``TRAIN_SHARD_MANIFEST``. Secrets travel
        only in the ranks' environment, never in logs, XCom or rendered fields.
        """
        from airflow_torchrun.checkpoint import CheckpointStore, resolve_resume

        ti = context["ti"]
        env: dict[str, str] = {}
        uri = self.checkpoint_uri or self.default_checkpoint_uri(context)
        if self.backend == "kubernetes" and uri.startswith("file://"):
            self.log.warning(
                "Checkpoints go to %s, a path inside each pod: a retry cannot resume from it. Set "
                "checkpoint_uri='s3://...' or [torchrun] checkpoint_base to storage the pods share",
                uri,
            )
        self.checkpoint_uri = uri
        options = self._storage_options()
        store = CheckpointStore(uri, options)
        store.check_access(write=True)
        ref = resolve_resume(uri, self.resume, options)
        if ref is None:
            self.log.info("Checkpoints: %s; fresh start (resume=%s)", uri, self.resume)
        else:
            self.log.info("Checkpoints: %s; resuming from %s (step %d)", uri, ref.uri, ref.step)
        ti.xcom_push(key="resumed_from", value={"uri": ref.uri, "step": ref.step} if ref else None)
        env.update(self._rank_storage_env(options))
        env.update(
            {
                "TRAIN_CHECKPOINT_URI": store.uri,
                "TRAIN_RESUME_FROM": ref.uri if ref else "",
                "TRAIN_CHECKPOINT_KEEP_LAST": str(self.keep_last),
            }
        )
        if self.shard_manifest:
            env["TRAIN_SHARD_MANIFEST"] = str(self.shard_manifest)
        if self.track:
            from airflow_torchrun.tracking import (
                check_tracking_uri,
                ensure_run,
                rank_env,
                resolve_tracking_uri,
                run_url,
            )

            tracking_uri = resolve_tracking_uri(self.mlflow_tracking_uri)
            check_tracking_uri(tracking_uri)
            self._mlflow_run_id = ensure_run(context, self.mlflow_experiment, tracking_uri)
            ti.xcom_push(key="mlflow_run_id", value=self._mlflow_run_id)
            ti.xcom_push(key=MLFLOW_RUN_URL_KEY, value=run_url(self._mlflow_run_id, tracking_uri))
            env.update(rank_env(self._mlflow_run_id, tracking_uri))
        return env

    # -- running ----------------------------------------------------------------------------
    def execute(self, context: Context) -> dict[str, Any] | None:
        try:
            spec = self._spec()
            self._check_backend_fit(spec)
        except InvalidSpecError as exc:
            raise AirflowFailException(str(exc)) from exc
        backend = self._get_backend()
        try:
            extra_env = self.contract_env(context)
        except (StorageError, InvalidSpecError) as exc:
            # Nothing was launched: wrong credentials, a missing bucket or a bad URI need a fix, not a retry.
            raise AirflowFailException(f"{self._where}: {exc}") from exc
        attached = self._attach(context, spec, backend)
        handle = attached or self._launch(context, spec, backend, extra_env)
        # An attached group may itself be a relaunch (…-r2): its relaunches count against the budget.
        relaunched = re.search(r"-r(\d+)$", attached.group_id) if attached else None
        launches = Relaunches(preemptions=int(relaunched.group(1)) if relaunched else 0)
        while True:
            if self.deferrable:
                self._defer_to_trigger(context, handle, launches)
            try:
                status = self._wait(backend, handle)
            finally:
                # On success this only confirms nothing is left; on any error it stops the group.
                backend.teardown(handle)
                self._flush_logs(backend, handle)
            why = launches.decide(backend, handle, status, self.max_preemptions)
            if why is None:
                if launches.refused:
                    self.log.warning("Group %s: %s", handle.group_id, launches.refused)
                return self._finish(context, spec, backend, handle, status)
            self.log.warning(
                "Group %s: %s; relaunching (launch %d of this try)", handle.group_id, why, launches.count + 1
            )
            handle = self._launch(context, spec, backend, self.contract_env(context), relaunch=launches.count)

    def execute_complete(
        self, context: Context, event: dict[str, Any], port_races: int = 0, preemptions: int = 0
    ) -> dict[str, Any] | None:
        """Re-entry after the trigger fired: rebuild everything from the event, then finish as sync mode does."""
        from airflow_torchrun.triggers import GroupEvent, GroupEventStatus, backend_for_handle

        spec = self._spec()
        group_event = GroupEvent.from_payload(event)
        handle = group_event.handle
        backend = backend_for_handle(handle)
        self._backend_obj, self._handle = backend, handle
        self._mlflow_run_id = context["ti"].xcom_pull(task_ids=self.task_id, key="mlflow_run_id")
        status = group_event.group_status()
        self.log.info("Group %s: trigger reported %s", handle.group_id, group_event.status.value)
        # Always: on success it only confirms nothing is left (a supervisor exits just after exit.json).
        backend.teardown(handle)
        self._flush_logs(backend, handle)
        if group_event.status is GroupEventStatus.TIMEOUT:
            self._end_tracking(succeeded=False)
            raise AirflowTaskTimeout(f"Group {handle.group_id} was stopped: {group_event.reason}")
        if group_event.status is GroupEventStatus.ERROR:
            self._end_tracking(succeeded=False)
            raise AirflowException(f"Group {handle.group_id} was stopped: {group_event.reason}")
        if group_event.status is GroupEventStatus.PROGRESS_TIMEOUT:
            self.log.error("Group %s: %s", handle.group_id, group_event.reason)
        # The real triggerer hands back the kwargs of defer(); dag.test() only the event: the
        # counters also travel in an XCom of this try, so a runner that drops them cannot make
        # the relaunches endless.
        stored = context["ti"].xcom_pull(task_ids=self.task_id, key="relaunches") or {}
        launches = Relaunches(
            port_races=max(port_races, int(stored.get("port_races", 0))),
            preemptions=max(preemptions, int(stored.get("preemptions", 0))),
        )
        why = launches.decide(backend, handle, status, self.max_preemptions)
        if launches.refused:
            self.log.warning("Group %s: %s", handle.group_id, launches.refused)
        if why is not None:
            self.log.warning("Group %s: %s; relaunching", handle.group_id, why)
            handle = self._launch(context, spec, backend, self.contract_env(context), relaunch=launches.count)
            self._defer_to_trigger(context, handle, launches)
        return self._finish(context, spec, backend, handle, status)

    def _identity(self, context: Context, relaunch: int = 0) -> GroupIdentity:
        ti = context["ti"]
        return GroupIdentity(
            dag_id=ti.dag_id,
            task_id=ti.task_id,
            run_id=ti.run_id,
            try_number=ti.try_number,
            map_index=ti.map_index if ti.map_index is not None else -1,
            relaunch=relaunch,
        )

    def _attach(self, context: Context, spec: GroupSpec, backend: Backend) -> GroupHandle | None:
        """A group an earlier try of this task instance left running: attach to it (Kubernetes:
        a restarted worker must not start a second group), or stop it (local)."""
        identity = self._identity(context)
        stop_earlier = getattr(backend, "stop_earlier_tries", None)
        if callable(stop_earlier):
            for group_id in stop_earlier(identity, spec.teardown_grace):
                self.log.warning("Stopped group %s, left running by an earlier try of this task", group_id)
        find = getattr(backend, "find_existing", None)
        handle = find(identity, spec) if callable(find) else None
        if handle is not None:
            self._handle = handle
            context["ti"].xcom_push(key="group", value=handle.to_dict())
            self.log.info("Attaching to group %s, started by an earlier try of this task", handle.group_id)
        return handle

    def _launch(
        self,
        context: Context,
        spec: GroupSpec,
        backend: Backend,
        extra_env: Mapping[str, str],
        relaunch: int = 0,
    ) -> GroupHandle:
        ti = context["ti"]
        plan = backend.plan(spec, self._identity(context, relaunch), extra_env)
        # In deferrable mode this process exits while the group runs: the group must not follow it.
        handle = backend.launch(plan, watch_caller=not self.deferrable)
        self._handle = handle
        # Push now so that on error (or a dead worker) the group can still be found.
        ti.xcom_push(key="group", value=handle.to_dict())
        self.log.info(
            "Launched group %s on backend %s: %d node(s) x %d proc(s), world size %d, rendezvous %s:%s",
            handle.group_id,
            backend.name,
            spec.num_nodes,
            spec.nproc_per_node,
            spec.world_size,
            plan.master_addr,
            plan.master_port,
        )
        for path in backend.log_locations(handle):
            self.log.info("Group %s log: %s", handle.group_id, path)
        return handle

    def _defer_to_trigger(self, context: Context, handle: GroupHandle, launches: Relaunches) -> None:
        from airflow_torchrun.triggers import GroupTrigger

        deadline = None
        if self.execution_timeout is not None:
            # Airflow does not enforce execution_timeout on a deferred task: the trigger does.
            started = context["ti"].start_date
            start = started.timestamp() if started is not None else handle.launched_at
            deadline = start + self.execution_timeout.total_seconds()
        counters = {"port_races": launches.port_races, "preemptions": launches.preemptions}
        context["ti"].xcom_push(key="relaunches", value=counters)
        self.log.info("Group %s: deferring; the triggerer watches it from now on", handle.group_id)
        self.defer(
            trigger=GroupTrigger(
                handle=handle.to_dict(), poll_interval=max(self.poll_interval, 1.0), deadline=deadline
            ),
            method_name="execute_complete",
            kwargs=counters,
        )

    def _finish(
        self, context: Context, spec: GroupSpec, backend: Backend, handle: GroupHandle, status: GroupStatus
    ) -> dict[str, Any]:
        """Succeed with the group's summary, or fail with the first failing rank's story."""
        if status.state is not GroupState.SUCCEEDED:
            report = backend.explain(handle, status)
            self.log.error("%s", report.message)
            self._end_tracking(succeeded=False)
            if not report.retryable:
                raise AirflowFailException(f"{report.message}\n(A retry cannot fix this; not retrying.)")
            raise AirflowException(report.message)
        wall = time.time() - handle.launched_at
        self.log.info("Group %s succeeded: every node exited 0, %.1fs after launch", handle.group_id, wall)
        self._end_tracking(succeeded=True)
        if self.checkpoint_uri is None:  # re-entry after deferral: a new process, same default
            self.checkpoint_uri = self.default_checkpoint_uri(context)
        final = self._final_checkpoint()
        return {
            "checkpoint_uri": self.checkpoint_uri,
            "final_checkpoint": final,
            "mlflow_run_id": self._mlflow_run_id,
            "group_id": handle.group_id,
            "backend": backend.name,
            "world_size": spec.world_size,
            "num_nodes": spec.num_nodes,
            "nproc_per_node": spec.nproc_per_node,
            "node_exit_codes": status.exit_codes,
            "wall_time_s": round(wall, 3),
            "log_dir": handle.location,
            "logs": backend.log_locations(handle),
        }

    def _final_checkpoint(self) -> str | None:
        """The newest committed checkpoint after the group succeeded (None if the script saved none)."""
        from airflow_torchrun.checkpoint import CheckpointStore

        if not self.checkpoint_uri:
            return None
        ref = CheckpointStore(self.checkpoint_uri, self._storage_options()).latest()
        if ref is None:
            return None
        self.log.info("Final checkpoint: %s (step %d)", ref.uri, ref.step)
        return ref.uri

    def _end_tracking(self, *, succeeded: bool) -> None:
        if self._mlflow_run_id:
            from airflow_torchrun.tracking import finish_run

            finish_run(self._mlflow_run_id, succeeded=succeeded, tracking_uri=self.mlflow_tracking_uri)

    def _wait(self, backend: Backend, handle: GroupHandle) -> GroupStatus:
        last_heartbeat = time.monotonic()
        last_state: tuple[str, ...] = ()
        while True:
            nodes = backend.observe(handle)
            status = group_status(
                nodes, launched_at=handle.launched_at, now=time.time(), startup_timeout=handle.startup_timeout
            )
            self._flush_logs(backend, handle)
            phases = tuple(n.phase.value for n in status.nodes)
            if phases != last_state:
                self.log.info("Group %s nodes: %s", handle.group_id, ", ".join(phases))
                last_state = phases
            # After the look, not before: on_kill runs in a signal handler, often in the middle of
            # it, and what the look then sees (a deleted Job, stopped ranks) is on_kill's teardown.
            if self._killed:
                raise AirflowException(f"Group {handle.group_id} was stopped: the task was killed (on_kill)")
            if status.state.terminal:
                if status.state is not GroupState.SUCCEEDED:
                    self.log.error("Group %s %s: %s", handle.group_id, status.state.value, status.reason)
                return status
            if time.monotonic() - last_heartbeat >= HEARTBEAT_SECONDS:
                last_heartbeat = time.monotonic()
                self.log.info(
                    "Group %s still running, %.0fs since launch", handle.group_id, time.time() - handle.launched_at
                )
            time.sleep(self.poll_interval)

    def _flush_logs(self, backend: Backend, handle: GroupHandle) -> None:
        for line in backend.read_new_log_lines(handle):
            self.log.info("%s", line)

    def on_kill(self) -> None:
        """Task cleared, marked failed, or timed out in the UI: stop the whole group."""
        self._killed = True
        if self._handle is not None and self._backend_obj is not None:
            self.log.info("on_kill: tearing down group %s", self._handle.group_id)
            self._backend_obj.teardown(self._handle)
