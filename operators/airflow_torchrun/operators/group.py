"""``GroupOperator``: what every operator that runs a torchrun group shares, and nothing more.

It owns the group's arguments (what to run, on how many agents, where, how it is watched) and
wires a :class:`~airflow_torchrun.engine.RunEngine`; a subclass adds only its own rank contract
(:meth:`contract_env`) and its own ending (:meth:`finish`). Both modes run through the same
engine: sync watches in this process; deferrable watches here for ``defer_after`` seconds and
then in the triggerer, with the same watch core.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from airflow_torchrun.compat import AirflowException, AirflowFailException, AirflowTaskTimeout, BaseOperator, conf
from airflow_torchrun.errors import InvalidSpecError, TorchrunError, is_transient, retry_transient
from airflow_torchrun.settings import (
    DEFAULT_DEFER_AFTER,
    DEFAULT_PREFLIGHT_BUDGET,
    CheckpointSettings,
    KubernetesSettings,
    RunSettings,
    validate_task,
)
from airflow_torchrun.spec import (
    DEFAULT_RDZV_TIMEOUT,
    DEFAULT_STARTUP_TIMEOUT,
    DEFAULT_TEARDOWN_GRACE,
    GroupSpec,
    is_templated,
)
from airflow_torchrun.state import state_dir
from airflow_torchrun.watch import DEFAULT_ERROR_BUDGET, Outcome
from airflow_torchrun.wiring import GroupIdentity

if TYPE_CHECKING:
    from airflow_torchrun.backends.base import Backend
    from airflow_torchrun.backends.handles import GroupHandle
    from airflow_torchrun.compat import Context
    from airflow_torchrun.engine import Launches, RunEngine
    from airflow_torchrun.runtimes import Runtime
    from airflow_torchrun.watch import Verdict

T = TypeVar("T")
# Credentials never go into plain pod env: anyone who may read Jobs would see them.
_SECRET_STORAGE_OPTIONS = ("key", "secret", "token")


def _codes(value: object) -> tuple[Any, ...]:
    """Exit codes as a tuple (validated with the settings, so a bad value is listed, not raised here)."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | set | frozenset):
        return (value,)
    return tuple(value)


# The trigger fires no sooner than this after the deferral: the deferring process must have been
# reported finished by the executor before the trigger re-queues the task (Airflow 3.3 fails a
# task whose first process reports "success" while it is queued again).
DEFER_SETTLE_SECONDS = 10.0


class GroupOperator(BaseOperator):
    """Base of the operators that run a torchrun group (see :class:`DistributedTrainingOperator`
    for every argument's meaning; each operator documents the arguments it adds)."""

    group_template_fields: tuple[str, ...] = (
        "num_nodes",
        "nproc_per_node",
        "backend",
        "runtime",
        "script",
        "command",
        "script_args",
        "env",
    )
    template_fields_renderers = {"env": "json", "script_args": "py", "command": "py"}

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
        progress_timeout: float | None = None,
        observe_error_budget: float = DEFAULT_ERROR_BUDGET,
        preflight_budget: float = DEFAULT_PREFLIGHT_BUDGET,
        deferrable: bool | None = None,
        defer_after: float | None = None,
        aws_conn_id: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        mlflow_tracking_uri: str | None = None,
        namespace: str | None = None,
        kubernetes_conn_id: str | None = None,
        max_preemptions: int = 3,
        max_restarts: int = 0,
        retry_on_exit_codes: Sequence[int] | None = None,
        fail_on_exit_codes: Sequence[int] = (),
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
        self.poll_interval = poll_interval
        self.progress_timeout = progress_timeout
        self.observe_error_budget = observe_error_budget
        self.preflight_budget = preflight_budget
        if defer_after is None:
            defer_after = conf.getfloat("torchrun", "defer_after", fallback=DEFAULT_DEFER_AFTER)
        self.defer_after = defer_after
        self.max_preemptions = max_preemptions
        self.max_restarts = max_restarts
        self.retry_on_exit_codes = None if retry_on_exit_codes is None else _codes(retry_on_exit_codes)
        self.fail_on_exit_codes = _codes(fail_on_exit_codes)
        self.aws_conn_id = aws_conn_id
        self.storage_options = dict(storage_options or {})
        self.mlflow_tracking_uri = mlflow_tracking_uri
        self.namespace = namespace
        self.kubernetes_conn_id = kubernetes_conn_id
        self._engine: RunEngine | None = None
        self._killed = False

    # -- what a subclass adds -------------------------------------------------------------------
    def contract_env(self, context: Context) -> dict[str, str]:
        """The rank contract beyond torchrun's variables; may do I/O (checked before any rank starts)."""
        return {}

    def contract_env_preview(self, context: Context) -> dict[str, str]:
        """What :meth:`contract_env` will add, without I/O (for ``airflow-torchrun render``)."""
        return {}

    def finish(self, context: Context, handle: GroupHandle, verdict: Verdict) -> Any:
        """The task's result once the group ended well (failures are raised before this); by
        default the group's id and its nodes' exit codes."""
        return {"group_id": handle.group_id, "node_exit_codes": [n.exit_code for n in verdict.nodes]}

    def on_group_end(self, context: Context, succeeded: bool) -> None:
        """Called once the try's outcome is known (the group's and :meth:`finish`'s), before the task
        succeeds or fails."""

    def checkpoint_settings(self) -> CheckpointSettings | None:
        return None

    def kubernetes_settings(self) -> KubernetesSettings:
        return KubernetesSettings(
            namespace=self.namespace,
            kubernetes_conn_id=self.kubernetes_conn_id,
            active_deadline_seconds=self.execution_timeout_seconds(),
        )

    def tracking_uri(self) -> str | None:
        """The MLflow store the ranks log into, when the task tracks (checked at parse time)."""
        return None

    def execution_timeout_seconds(self) -> float | None:
        timeout = self.execution_timeout
        return timeout.total_seconds() if timeout is not None else None

    # -- the spec and settings ----------------------------------------------------------------
    @property
    def _where(self) -> str:
        dag_id = self.dag_id if self.has_dag() else "<no dag>"
        return f"task {dag_id}.{self.task_id}"

    def run_settings(self) -> RunSettings:
        return RunSettings(
            poll_interval=self.poll_interval,
            progress_timeout=self.progress_timeout,
            observe_error_budget=self.observe_error_budget,
            preflight_budget=self.preflight_budget,
            deferrable=self.deferrable,
            defer_after=self.defer_after,
            max_preemptions=self.max_preemptions,
            max_restarts=self.max_restarts,
            retry_on_exit_codes=self.retry_on_exit_codes,
            fail_on_exit_codes=self.fail_on_exit_codes,
        )

    def validate(self, *, allow_templates: bool) -> GroupSpec | None:
        """Spec and settings together: one error listing every problem (parse time, then rendered)."""
        return validate_task(
            lambda: self._make_spec(allow_templates=allow_templates),
            where=self._where,
            backend=self.backend,
            run=self.run_settings(),
            checkpoint=self.checkpoint_settings(),
            tracking_uri=self.tracking_uri(),
        )

    def group_spec(self) -> GroupSpec:
        """The rendered task's spec (raises ``InvalidSpecError`` listing every problem)."""
        spec = self.validate(allow_templates=False)
        assert spec is not None  # validate_task raises whenever the spec could not be made
        return spec

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

    def _make_spec(self, *, allow_templates: bool) -> GroupSpec:
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

    def _make_backend(self) -> Backend:
        from airflow_torchrun.backends.base import backend_for

        if self.backend == "kubernetes":
            from airflow_torchrun.backends.kubernetes import deployment_name

            k = self.kubernetes_settings()
            return backend_for(
                "kubernetes",
                deployment=deployment_name(),
                namespace=k.namespace,
                kubernetes_conn_id=k.kubernetes_conn_id,
                all_ranks_logs=k.all_ranks_logs,
                active_deadline_seconds=k.active_deadline_seconds,
            )
        return backend_for(self.backend, state_dir=state_dir())

    # -- storage access, shared by every operator ------------------------------------------------
    def storage_options_resolved(self) -> dict[str, Any]:
        from airflow_torchrun.checkpoint import storage_options_from_aws_conn_id

        options: dict[str, Any] = {}
        if self.aws_conn_id:
            # The Amazon provider's hooks: keys, role_arn (assume-role), profiles, web identity.
            conn_id = self.aws_conn_id
            options = self.preflight("resolving the AWS connection", lambda: storage_options_from_aws_conn_id(conn_id))
        return {**options, **self.storage_options}

    def rank_storage_env(self, options: Mapping[str, Any]) -> dict[str, str]:
        """Storage access for the ranks. Local: the connection's credentials in their environment.
        Kubernetes: never credentials in plain pod env; pods get them from the runtime's Secrets or
        service account."""
        from airflow_torchrun.checkpoint import storage_env

        if self.backend != "kubernetes":
            return self._local_storage_env(options)
        public = {k: v for k, v in options.items() if k not in _SECRET_STORAGE_OPTIONS}
        if len(public) != len(options):
            self.log.warning(
                "Not passing the credentials of aws_conn_id=%s to the pods in plain text; give the runtime "
                "env_from_secrets or a service account with access to the bucket",
                self.aws_conn_id,
            )
        return storage_env(public)

    def _local_storage_env(self, options: Mapping[str, Any]) -> dict[str, str]:
        """The connection's credentials in the ranks' environment; with ``role_arn``, a private AWS
        profile instead, so that the ranks assume the role themselves and their session refreshes."""
        from airflow_torchrun.aws import rank_role_for
        from airflow_torchrun.checkpoint import storage_env
        from airflow_torchrun.naming import short_hash

        if not self.aws_conn_id:
            return storage_env(options)
        role, why_not = rank_role_for(self.aws_conn_id)
        if role is None:
            if why_not:
                self.log.warning(
                    "aws_conn_id=%s: the ranks get the role's temporary session, which they cannot refresh (%s); "
                    "a run longer than the role's session duration loses access to storage",
                    self.aws_conn_id,
                    why_not,
                )
            return storage_env(options)
        env = storage_env({k: v for k, v in options.items() if k not in _SECRET_STORAGE_OPTIONS})
        path = state_dir() / "credentials" / f"{short_hash(role.config_text())}.ini"
        env.update(role.write(path))
        self.log.info(
            "aws_conn_id=%s: the ranks assume %s themselves (AWS profile %s in a file only its owner can read), "
            "so their credentials refresh however long the run",
            self.aws_conn_id,
            role.role_arn,
            env["AWS_PROFILE"],
        )
        return env

    def preflight(self, what: str, call: Callable[[], T]) -> T:
        """One call to storage or tracking under the error policy: transient trouble is retried within
        ``preflight_budget`` seconds, then fails the try retryably; a permanent error fails the task
        without retry."""
        budget = float(self.preflight_budget)
        try:
            return retry_transient(call, budget=budget, what=f"{self._where}: {what}", log=self.log)
        except Exception as exc:
            if is_transient(exc):
                raise self._under_policy(exc, f"{what} failed for {budget:g}s") from exc
            if isinstance(exc, TorchrunError):
                raise self._under_policy(exc, f"{what} failed") from exc
            raise

    def _under_policy(self, exc: Exception, what: str = "") -> Exception:
        """The Airflow exception for an error of ours: retryable when transient, else final."""
        head = f"{self._where}: {what + ': ' if what else ''}{exc}"
        if is_transient(exc):
            return AirflowException(f"{head}. A retry may succeed")
        return AirflowFailException(f"{head}\n(A retry cannot fix this; not retrying.)")

    # -- running ------------------------------------------------------------------------------
    def _identity(self, context: Context) -> Callable[[int], GroupIdentity]:
        ti = context["ti"]

        def identity(relaunch: int) -> GroupIdentity:
            return GroupIdentity(
                dag_id=ti.dag_id,
                task_id=ti.task_id,
                run_id=ti.run_id,
                try_number=ti.try_number,
                map_index=ti.map_index if ti.map_index is not None else -1,
                relaunch=relaunch,
            )

        return identity

    def _deadline(self, context: Context, fallback: float) -> float | None:
        if self.execution_timeout is None:
            return None
        started = context["ti"].start_date
        start = started.timestamp() if started is not None else fallback
        return start + self.execution_timeout.total_seconds()

    def _new_engine(self, context: Context, spec: GroupSpec, backend: Backend) -> RunEngine:
        """The engine of this try; it resolves the rank contract for every launch (a relaunch
        resumes from the checkpoint its predecessor committed)."""
        from airflow_torchrun.engine import RunEngine

        ti = context["ti"]
        engine = RunEngine(
            backend=backend,
            spec=spec,
            settings=self.run_settings(),
            log=self.log,
            push=lambda key, value: ti.xcom_push(key=key, value=value),
            identity=self._identity(context),
            contract_env=lambda: self.contract_env(context),
            killed=self._killed,
        )
        self._engine = engine
        return engine

    def _rendered_spec(self) -> GroupSpec:
        try:
            return self.group_spec()
        except InvalidSpecError as exc:
            raise AirflowFailException(str(exc)) from exc

    def execute(self, context: Context) -> Any:
        spec = self._rendered_spec()
        engine = self._new_engine(context, spec, self._make_backend())
        try:
            handle, launches = engine.start()
            engine.deadline = self._deadline(context, handle.launched_at)
            defer = (lambda h, n: self._defer(context, engine, h, n)) if self.deferrable else None
            handle, verdict = engine.drive(handle, launches, defer=defer)
        except TorchrunError as exc:  # a launch the API refused, a teardown that did not get through
            raise self._under_policy(exc) from exc
        return self._end(context, engine, handle, verdict)

    def execute_complete(self, context: Context, event: dict[str, Any], **_: Any) -> Any:
        """Re-entry after the trigger fired: rebuild everything from the event, then go on as sync mode does."""
        from airflow_torchrun.backends.base import backend_from_handle
        from airflow_torchrun.engine import XCOM_LAUNCHES, Launches
        from airflow_torchrun.triggers import GroupEvent

        group_event = GroupEvent.from_payload(event)
        handle = group_event.handle
        backend = backend_from_handle(handle)
        self.log.info("Group %s: trigger reported %s", handle.group_id, group_event.status.value)
        try:
            spec = self._rendered_spec()  # the DAG or a runtime may have changed meanwhile
        except BaseException:
            backend.teardown(handle)  # whatever the trigger saw, nothing may run on unwatched
            raise
        engine = self._new_engine(context, spec, backend)
        engine.handle = handle
        engine.deadline = self._deadline(context, handle.launched_at)
        ti = context["ti"]
        launches = Launches.from_dict(ti.xcom_pull(task_ids=self.task_id, key=XCOM_LAUNCHES, map_indexes=ti.map_index))
        try:
            handle, verdict = engine.drive(
                handle,
                launches,
                verdict=group_event.verdict(),
                defer=lambda h, n: self._defer(context, engine, h, n),
            )
        except TorchrunError as exc:
            raise self._under_policy(exc) from exc
        return self._end(context, engine, handle, verdict)

    def _defer(self, context: Context, engine: RunEngine, handle: GroupHandle, launches: Launches) -> NoReturn:
        from airflow_torchrun.triggers import GroupTrigger

        self.defer(
            trigger=GroupTrigger(
                handle=handle.to_dict(),
                poll_interval=max(float(self.poll_interval), 1.0),
                progress_timeout=self.progress_timeout,
                deadline=engine.deadline,
                error_budget=float(self.observe_error_budget),
                not_before=time.time() + DEFER_SETTLE_SECONDS,
            ),
            method_name="execute_complete",
        )
        raise AssertionError("defer() returned")  # pragma: no cover - defer always raises

    def _end(self, context: Context, engine: RunEngine, handle: GroupHandle, verdict: Verdict) -> Any:
        """Succeed with :meth:`finish`, or fail with the group's story (retryable or not)."""
        if verdict.outcome is Outcome.SUCCEEDED:
            try:
                result = self.finish(context, handle, verdict)
            except BaseException:
                self.on_group_end(context, False)
                raise
            self.on_group_end(context, True)
            return result
        self.on_group_end(context, False)
        if verdict.outcome is Outcome.TIMEOUT:
            raise AirflowTaskTimeout(f"Group {handle.group_id} was stopped: {verdict.reason}")
        if verdict.outcome in (Outcome.ERROR, Outcome.PROGRESS_TIMEOUT):
            where = ", ".join(engine.backend.log_locations(handle))
            message = f"Group {handle.group_id} was torn down: {verdict.reason}. Its logs: {where}"
            if not verdict.transient:  # e.g. the cluster forbids looking at the group: a retry would too
                raise AirflowFailException(f"{message}\n(A retry cannot fix this; not retrying.)")
            raise AirflowException(message)
        report = engine.explain(handle, verdict)
        self.log.error("%s", report.message)
        if not report.retryable:
            raise AirflowFailException(f"{report.message}\n(A retry cannot fix this; not retrying.)")
        why = engine.permanent(handle, verdict)
        if why:
            raise AirflowFailException(f"{report.message}\n(Not retrying: {why}.)")
        raise AirflowException(report.message)

    def on_kill(self) -> None:
        """Task cleared, marked failed, or timed out in the UI: stop the whole group (or, before it
        exists, launch none)."""
        self._killed = True
        if self._engine is not None:
            self._engine.kill()
