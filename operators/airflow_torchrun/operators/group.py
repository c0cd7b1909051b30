"""``GroupOperator``: what every operator that runs a torchrun group shares, and nothing more.

It owns the group's arguments: what to run and on how many agents (templated, validated when the
DAG is parsed and again once rendered), and how the group starts, is watched and relaunched
(settings frozen in ``__init__``). A try (:mod:`~airflow_torchrun.operators.one_try`) composes a
:class:`~airflow_torchrun.engine.RunEngine` with the rank contract the subclass builds
(:meth:`GroupOperator.rank_contract`), in sync and deferrable mode alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow_torchrun.backends import DEFAULT_BACKEND
from airflow_torchrun.backends.base import BackendOptions
from airflow_torchrun.compat import AirflowFailException, BaseOperator, conf
from airflow_torchrun.errors import StorageError
from airflow_torchrun.operators import one_try
from airflow_torchrun.operators.contracts import GroupContract, TaskIO
from airflow_torchrun.settings import (
    DEFAULT_DEFER_AFTER,
    DEFAULT_PREFLIGHT_BUDGET,
    CheckpointSettings,
    LaunchOptions,
    RunSettings,
    default_nproc,
    exit_codes,
    flag,
    resolved_script,
    validate_task,
)
from airflow_torchrun.spec import (
    DEFAULT_RDZV_TIMEOUT,
    DEFAULT_STARTUP_TIMEOUT,
    DEFAULT_TEARDOWN_GRACE,
    GroupSpec,
    is_templated,
)
from airflow_torchrun.storage.uri import one_conn_id
from airflow_torchrun.watch import DEFAULT_ERROR_BUDGET

if TYPE_CHECKING:
    from airflow_torchrun.compat import Context
    from airflow_torchrun.engine import RunEngine
    from airflow_torchrun.operators.contracts import RankContract


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
        self._problems: list[str] = []
        # What runs, on how many agents, where: templated fields, checked again once rendered.
        self.backend = backend or conf.get("torchrun", "default_backend", fallback=DEFAULT_BACKEND)
        self.script = resolved_script(self.backend, script, self._dag_file)
        self.command = list(command) if command is not None else None
        self.script_args = list(script_args) if not isinstance(script_args, str) else script_args
        self.env = dict(env) if isinstance(env, Mapping) else env
        self.runtime = runtime
        self.num_nodes = num_nodes
        self.nproc_per_node = nproc_per_node
        # How the group starts, is watched and relaunched, and what it reaches: frozen now.
        if deferrable is None:
            deferrable = conf.getboolean("operators", "default_deferrable", fallback=False)
        if defer_after is None:
            defer_after = conf.getfloat("torchrun", "defer_after", fallback=DEFAULT_DEFER_AFTER)
        self.launch_options = LaunchOptions(
            rdzv_port=rdzv_port,
            rdzv_timeout=rdzv_timeout,
            startup_timeout=startup_timeout,
            teardown_grace=teardown_grace,
            threads_per_proc=threads_per_proc,
        )
        self.run_settings = RunSettings(
            poll_interval=poll_interval,
            progress_timeout=progress_timeout,
            observe_error_budget=observe_error_budget,
            preflight_budget=preflight_budget,
            deferrable=flag("deferrable", deferrable, self._problems),
            defer_after=defer_after,
            max_preemptions=max_preemptions,
            max_restarts=max_restarts,
            retry_on_exit_codes=None if retry_on_exit_codes is None else exit_codes(retry_on_exit_codes),
            fail_on_exit_codes=exit_codes(fail_on_exit_codes),
        )
        self.backend_options = BackendOptions(namespace=namespace, kubernetes_conn_id=kubernetes_conn_id)
        self.aws_conn_id = aws_conn_id
        self.storage_options = dict(storage_options or {})
        self.mlflow_tracking_uri = mlflow_tracking_uri
        self._engine: RunEngine | None = None
        self._io: TaskIO | None = None  # the try's (one_try), for what it still has to send
        self._killed = False

    @property
    def deferrable(self) -> bool:
        return self.run_settings.deferrable

    @property
    def namespace(self) -> str | None:
        return self.backend_options.namespace

    @property
    def kubernetes_conn_id(self) -> str | None:
        return self.backend_options.kubernetes_conn_id

    # -- what a subclass adds -------------------------------------------------------------------
    def rank_contract(self, io: TaskIO, state: dict[str, Any] | None = None) -> RankContract:
        """This try's rank contract (``state``: what :meth:`RankContract.state` gave before a deferral)."""
        return GroupContract()

    def contract_env_preview(self, context: Context) -> dict[str, str]:
        """What the rank contract adds to every rank's environment, without I/O (``airflow-torchrun render``)."""
        io = TaskIO(context=context, where=self._where, log=self.log, backend=None, preflight_budget=0.0)
        return self.rank_contract(io).preview()

    def checkpoint_settings(self) -> CheckpointSettings | None:
        """The task's checkpoint settings, for the checks (training only)."""
        return None

    def tracking_uri(self) -> str | None:
        """The MLflow store the ranks log into, when the task tracks (checked at parse time)."""
        return None

    def storage_uris(self) -> Sequence[object]:
        """The task's storage URIs (training: ``checkpoint_uri``; evaluation: ``checkpoint``)."""
        return ()

    def storage_conn_id(self) -> str | None:
        """The AWS connection of the task's storage (:func:`~airflow_torchrun.storage.uri.one_conn_id`)."""
        uris = [u for u in self.storage_uris() if isinstance(u, str) and not is_templated(u)]
        try:
            return one_conn_id(uris, self.aws_conn_id)
        except StorageError as exc:
            raise AirflowFailException(f"{self._where}: {exc}") from exc

    def task_backend_options(self) -> BackendOptions:
        """What the backend takes from the task; the task's ``execution_timeout`` is the Job's own deadline."""
        from dataclasses import replace

        timeout = self.execution_timeout
        return replace(self.backend_options, active_deadline_seconds=timeout.total_seconds() if timeout else None)

    # -- the spec and settings ----------------------------------------------------------------
    @property
    def _where(self) -> str:
        dag_id = self.dag_id if self.has_dag() else "<no dag>"
        return f"task {dag_id}.{self.task_id}"

    def validate(self, *, allow_templates: bool) -> GroupSpec | None:
        """Spec and settings together: one error listing every problem (parse time, then rendered)."""
        return validate_task(
            lambda: self._make_spec(allow_templates=allow_templates),
            where=self._where,
            backend=self.backend,
            run=self.run_settings,
            checkpoint=self.checkpoint_settings(),
            tracking_uri=self.tracking_uri(),
            extra=self._problems,
            options=self.backend_options,
        )

    def group_spec(self) -> GroupSpec:
        """The rendered task's spec (raises ``InvalidSpecError`` listing every problem)."""
        spec = self.validate(allow_templates=False)
        assert spec is not None  # validate_task raises whenever the spec could not be made
        return spec

    @property
    def _dag_file(self) -> str | None:
        return self.dag.fileloc if self.has_dag() else None

    def _make_spec(self, *, allow_templates: bool) -> GroupSpec:
        nproc = self.nproc_per_node
        return GroupSpec.create(
            num_nodes=self.num_nodes,
            nproc_per_node=default_nproc(self.backend, self.runtime, self._where) if nproc is None else nproc,
            script=self.script if allow_templates else resolved_script(self.backend, self.script, self._dag_file),
            command=self.command,
            script_args=self.script_args,
            env=self.env,
            backend=self.backend,
            runtime=self.runtime,
            **self.launch_options.spec_arguments(),
            where=self._where,
            allow_templates=allow_templates,
        )

    # -- running (one try: operators/one_try.py) ------------------------------------------------
    def execute(self, context: Context) -> Any:
        return one_try.start(self, context)

    def execute_complete(self, context: Context, event: dict[str, Any], **_: Any) -> Any:
        return one_try.resume(self, context, event)

    def on_kill(self) -> None:
        """Task cleared, marked failed, or timed out in the UI: stop the whole group (or, before it
        exists, launch none)."""
        self._killed = True
        if self._engine is not None:
            self._engine.kill()
