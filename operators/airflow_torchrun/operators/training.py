"""``DistributedTrainingOperator``: one Airflow task = one torchrun group, watched to the end."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_torchrun.compat import AirflowException, AirflowFailException, BaseOperator, conf
from airflow_torchrun.errors import InvalidSpecError
from airflow_torchrun.spec import (
    DEFAULT_RDZV_TIMEOUT,
    DEFAULT_STARTUP_TIMEOUT,
    DEFAULT_TEARDOWN_GRACE,
    GroupSpec,
    is_templated,
)
from airflow_torchrun.status import GroupState, GroupStatus, group_status
from airflow_torchrun.wiring import GroupIdentity

if TYPE_CHECKING:
    from airflow_torchrun.backends.base import Backend, GroupHandle
    from airflow_torchrun.compat import Context

PORT_RACE_RETRIES = 3
HEARTBEAT_SECONDS = 60.0


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
    :param nproc_per_node: Ranks started by each agent.
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
    """

    template_fields: Sequence[str] = ("script", "command", "script_args", "env")
    template_fields_renderers = {"env": "json", "script_args": "py", "command": "py"}
    ui_color = "#ee4c2c"
    ui_fgcolor = "#ffffff"

    def __init__(
        self,
        *,
        script: str | None = None,
        command: Sequence[str] | None = None,
        script_args: Sequence[str] = (),
        num_nodes: int = 1,
        nproc_per_node: int = 1,
        env: Mapping[str, str] | None = None,
        backend: str | None = None,
        runtime: str | None = None,
        rdzv_port: int | None = None,
        rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        teardown_grace: float = DEFAULT_TEARDOWN_GRACE,
        threads_per_proc: int | None = None,
        poll_interval: float = 0.25,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.script = self._resolve_script(script)
        self.command = list(command) if command is not None else None
        self.script_args = list(script_args) if not isinstance(script_args, str) else script_args
        self.env = dict(env) if isinstance(env, Mapping) else env
        self.backend = backend or conf.get("torchrun", "default_backend", fallback="local")
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
        self._handle: GroupHandle | None = None
        self._backend_obj: Backend | None = None
        self._killed = False
        # Parse time: everything that is not a template is checked now.
        self._spec(allow_templates=True)

    # -- spec -------------------------------------------------------------------------------
    @property
    def _where(self) -> str:
        dag_id = self.dag_id if self.has_dag() else "<no dag>"
        return f"task {dag_id}.{self.task_id}"

    def _resolve_script(self, script: str | None) -> str | None:
        if not isinstance(script, str) or is_templated(script) or os.path.isabs(script):
            return script
        if Path(script).is_file():
            return str(Path(script).resolve())
        if self.has_dag() and self.dag.fileloc:
            beside_dag = Path(self.dag.fileloc).parent / script
            if beside_dag.is_file():
                return str(beside_dag)
        return script

    def _spec(self, *, allow_templates: bool = False) -> GroupSpec:
        script = self._resolve_script(self.script) if not allow_templates else self.script
        return GroupSpec.create(
            num_nodes=self.num_nodes,
            nproc_per_node=self.nproc_per_node,
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
                state_dir = conf.get("torchrun", "state_dir", fallback=None)
                if state_dir:
                    options["state_dir"] = state_dir
            self._backend_obj = get_backend(self.backend, **options)
        return self._backend_obj

    def contract_env(self, context: Context) -> dict[str, str]:
        """Variables the operator adds to what every rank sees (beyond torchrun's own)."""
        return {}

    # -- running ----------------------------------------------------------------------------
    def execute(self, context: Context) -> dict[str, Any]:
        try:
            spec = self._spec()
        except InvalidSpecError as exc:
            raise AirflowFailException(str(exc)) from exc
        ti = context["ti"]
        identity = GroupIdentity(
            dag_id=ti.dag_id,
            task_id=ti.task_id,
            run_id=ti.run_id,
            try_number=ti.try_number,
            map_index=ti.map_index if ti.map_index is not None else -1,
        )
        backend = self._get_backend()
        extra_env = self.contract_env(context)
        started = time.monotonic()
        for attempt in range(1, PORT_RACE_RETRIES + 1):
            plan = backend.plan(spec, identity, extra_env)
            handle = backend.launch(plan, watch_caller=True)
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
            try:
                status = self._wait(backend, handle)
            finally:
                # On success this only confirms nothing is left; on any error it stops the group.
                backend.teardown(handle)
                self._flush_logs(backend, handle)
            if status.state is GroupState.SUCCEEDED:
                break
            port_in_use = getattr(backend, "port_in_use", None)
            if callable(port_in_use) and port_in_use(handle) and attempt < PORT_RACE_RETRIES:
                self.log.warning(
                    "Group %s: rendezvous port %s was taken by another process; relaunching on a new port",
                    handle.group_id,
                    plan.master_port,
                )
                continue
            report = backend.explain(handle, status)
            self.log.error("%s", report.message)
            if not report.retryable:
                raise AirflowFailException(f"{report.message}\n(A retry cannot fix this; not retrying.)")
            raise AirflowException(report.message)

        wall = time.monotonic() - started
        self.log.info("Group %s succeeded: every node exited 0 in %.1fs", handle.group_id, wall)
        return {
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

    def _wait(self, backend: Backend, handle: GroupHandle) -> GroupStatus:
        last_heartbeat = time.monotonic()
        last_state: tuple[str, ...] = ()
        while True:
            if self._killed:
                raise AirflowException(f"Group {handle.group_id} was stopped: the task was killed (on_kill)")
            nodes = backend.observe(handle)
            status = group_status(
                nodes, launched_at=handle.launched_at, now=time.time(), startup_timeout=handle.startup_timeout
            )
            self._flush_logs(backend, handle)
            phases = tuple(n.phase.value for n in status.nodes)
            if phases != last_state:
                self.log.info("Group %s nodes: %s", handle.group_id, ", ".join(phases))
                last_state = phases
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
