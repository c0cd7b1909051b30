"""The Kubernetes backend: every node is a pod of one Indexed Job, found by a headless Service.

All API traffic goes through the cncf-kubernetes provider's hooks: :class:`KubernetesHook` for
the sync path (the operator) and :class:`AsyncKubernetesHook` for the async path (the trigger),
with ``kubernetes_conn_id`` naming the Airflow connection. This class only wires the parts:

- rendering, pure: :mod:`~airflow_torchrun.backends.kubernetes.render`;
- the requests, pure descriptions: :mod:`~airflow_torchrun.backends.kubernetes.api`, sent by the thin
  sync and async executors of :mod:`~airflow_torchrun.backends.kubernetes.client`;
- the flows that yield them: launch, find and teardown (:mod:`~airflow_torchrun.backends.kubernetes.lifecycle`),
  one look at the group (:mod:`~airflow_torchrun.backends.kubernetes.observe`), logs and progress
  (:mod:`~airflow_torchrun.backends.kubernetes.logs`);
- reading objects back, pure: :mod:`~airflow_torchrun.backends.kubernetes.status` and
  :mod:`~airflow_torchrun.backends.kubernetes.explain`.

Errors: every API failure is a :class:`~airflow_torchrun.backends.kubernetes.api.ClusterApiError`, transient
or not by :func:`airflow_torchrun.errors.is_transient`'s rules; ``observe`` raises it (the watch
core decides), ``launch`` turns it into ``GroupLaunchError`` after deleting what it created.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from airflow_torchrun.backends.base import Backend, FailureReport, GroupHandle, Relaunch, RelaunchKind
from airflow_torchrun.backends.handles import MAX_NODES, MAX_RELAUNCH, MAX_WORLD_SIZE, KubernetesHandle, bounded_int
from airflow_torchrun.backends.kubernetes import checks
from airflow_torchrun.backends.kubernetes.api import ClusterApiError
from airflow_torchrun.backends.kubernetes.client import Connection, Flow, SyncExecutor, run_async
from airflow_torchrun.backends.kubernetes.explain import explain_failure, nodes_to_read
from airflow_torchrun.backends.kubernetes.lifecycle import (
    TeardownError,
    find_flow,
    handle_from_job,
    launch_flow,
    read_job_flow,
    teardown_flow,
)
from airflow_torchrun.backends.kubernetes.logs import new_lines_flow, progress_flow, progress_lines_flow, tail_flow
from airflow_torchrun.backends.kubernetes.observe import JobMemory, observe_flow, pods_flow
from airflow_torchrun.backends.kubernetes.render import (
    ANN_RUNTIME,
    COMPLETION_INDEX_LABEL,
    CONTAINER,
    CONTROLLER_UID_LABEL,
    GROUP_LABEL,
    INSTANCE_LABEL,
    TORCHRUN_LOG_DIR,
    RenderedGroup,
    master_addr,
    render_group,
)
from airflow_torchrun.backends.kubernetes.runtimes import Runtime, RuntimeCatalog, get_runtime, load_runtimes
from airflow_torchrun.backends.kubernetes.status import preemption_reason
from airflow_torchrun.deployment import DEPLOYMENT_VARIABLE, deployment_name, stored_deployment_name, torchrun_config
from airflow_torchrun.errors import InvalidSpecError
from airflow_torchrun.naming import DEFAULT_DEPLOYMENT, LABEL_VALUE_RULE, GroupIdentity, is_label_value
from airflow_torchrun.spec import GroupSpec
from airflow_torchrun.status import GroupStatus, NodeObservation, ProgressMark
from airflow_torchrun.wiring import DEFAULT_MASTER_PORT, GroupPlan, plan

if TYPE_CHECKING:
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    from airflow_torchrun.backends.base import BackendOptions

__all__ = [
    "DEPLOYMENT_VARIABLE",
    "ClusterApiError",
    "KubernetesBackend",
    "TeardownError",
    "deployment_name",
    "stored_deployment_name",
]

log = logging.getLogger(__name__)

DEFAULT_CONN_ID = "kubernetes_default"
DEFAULT_NAMESPACE = "default"
PROGRESS_READ_EVERY = 5.0  # seconds between two reads of the pods' logs for progress records


def view_namespaces() -> list[str]:
    """The namespaces the view reads groups in: ``[torchrun] kubernetes_namespace`` and those listed
    in ``[torchrun] kubernetes_view_namespaces`` (comma-separated)."""
    extra = [n.strip() for n in (torchrun_config("kubernetes_view_namespaces") or "").split(",") if n.strip()]
    return [torchrun_config("kubernetes_namespace") or DEFAULT_NAMESPACE, *extra]


def _seconds(value: object, fallback: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return fallback
    return float(value)


class _TtlCache:
    """Answers kept for a few seconds: every open view polls every 3 s, and each answer is a
    request to the cluster."""

    def __init__(self, ttl: float, size: int = 256) -> None:
        self.ttl, self.size = ttl, size
        self._items: dict[Any, tuple[float, Any]] = {}
        self._lock = threading.Lock()

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        now = time.monotonic()
        with self._lock:
            hit = self._items.get(key)
            if hit is not None and now - hit[0] < self.ttl:
                return hit[1]
        value = make()
        with self._lock:
            self._items[key] = (now, value)
            while len(self._items) > self.size:
                self._items.pop(next(iter(self._items)))
        return value

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


_VIEWED_JOBS = _TtlCache(10.0)


class KubernetesBackend(Backend[KubernetesHandle]):
    """Runs a group as an Indexed Job plus a headless Service in one namespace.

    :param namespace: Namespace of the group's objects; default ``[torchrun] kubernetes_namespace``,
        else ``default``.
    :param kubernetes_conn_id: Airflow connection of the cluster (``kubernetes`` type); default
        ``[torchrun] kubernetes_conn_id``, else ``kubernetes_default``.
    :param config_file: A kubeconfig file to use instead of the connection.
    :param cluster_context: kubeconfig context to use.
    :param in_cluster: Use the pod's service account (Airflow itself runs in the cluster).
    :param all_ranks_logs: Stream every node's log into the task log, not only node 0's.
    :param watch_seconds: Longest one :meth:`observe` waits for a change before it looks again.
    :param request_timeout: Seconds one API request may take.
    :param runtimes: The runtimes to choose from; default: those configured (see
        :mod:`airflow_torchrun.backends.kubernetes.runtimes`).
    :param deployment: The Airflow deployment's name in the Jobs' identity and labels; default
        ``[torchrun] deployment``, else ``default``. The operator passes :func:`deployment_name`,
        which gives every deployment a name of its own. Two deployments that share a namespace
        must have different ones, or they could attach to each other's groups (same dag and run ids).
    :param active_deadline_seconds: The Job's ``activeDeadlineSeconds`` (the operator passes the
        task's ``execution_timeout``); ``None``: no deadline of the Job's own.
    :param watch_pods: Let :meth:`observe` wait on a watch of the pods (the worker and the trigger);
        ``False`` for a reader that must never hold a request open (the API server's view).
    :param log_read_limit: Bytes of each pod's log one progress read may fetch (``None``: all that is
        new); a first read then starts at the log's last lines.
    """

    name = "kubernetes"

    def __init__(
        self,
        *,
        namespace: str | None = None,
        kubernetes_conn_id: str | None = None,
        config_file: str | None = None,
        cluster_context: str | None = None,
        in_cluster: bool | None = None,
        all_ranks_logs: bool = False,
        watch_seconds: float = 5.0,
        request_timeout: float = 30.0,
        runtimes: RuntimeCatalog | Mapping[str, Runtime] | None = None,
        deployment: str | None = None,
        active_deadline_seconds: float | None = None,
        watch_pods: bool = True,
        log_read_limit: int | None = None,
    ) -> None:
        problems = []
        if watch_seconds <= 0 or request_timeout <= 0:
            problems.append("watch_seconds and request_timeout must be positive numbers of seconds")
        if config_file is not None and in_cluster:
            problems.append("give config_file or in_cluster=True, not both")
        deployment = deployment or torchrun_config("deployment") or DEFAULT_DEPLOYMENT
        if not is_label_value(deployment):
            problems.append(f"deployment {deployment!r} ([torchrun] deployment) must be {LABEL_VALUE_RULE}")
        if log_read_limit is not None and (
            isinstance(log_read_limit, bool) or not isinstance(log_read_limit, int) or log_read_limit < 1
        ):
            problems.append(f"log_read_limit must be a whole number of bytes >= 1, got {log_read_limit!r}")
        if active_deadline_seconds is not None and not active_deadline_seconds > 0:
            problems.append(
                f"active_deadline_seconds must be a positive number of seconds, got {active_deadline_seconds!r}"
            )
        if problems:
            raise InvalidSpecError(problems, "KubernetesBackend")
        self.namespace = namespace or torchrun_config("kubernetes_namespace") or DEFAULT_NAMESPACE
        self.deployment = deployment
        self.active_deadline_seconds = (
            None if active_deadline_seconds is None else max(1, math.ceil(active_deadline_seconds))
        )
        self.connection = Connection(
            conn_id=kubernetes_conn_id or torchrun_config("kubernetes_conn_id") or DEFAULT_CONN_ID,
            config_file=config_file,
            cluster_context=cluster_context,
            in_cluster=in_cluster,
        )
        self.all_ranks_logs = all_ranks_logs
        if not isinstance(watch_pods, bool):  # bool("false") is True
            raise TypeError(f"watch_pods must be True or False, got {watch_pods!r}")
        self.watch_pods = watch_pods
        self.log_read_limit = log_read_limit
        self.watch_seconds = float(watch_seconds)
        self.request_timeout = float(request_timeout)
        if isinstance(runtimes, Mapping):
            runtimes = RuntimeCatalog(runtimes, ("given to KubernetesBackend",))
        self._catalog = runtimes
        self._sync_hook: KubernetesHook | None = None
        self._sync = SyncExecutor(self._hook, self.request_timeout)
        self._progress_read_at: dict[str, float] = {}
        self._groups: dict[str, JobMemory] = {}

    @classmethod
    def from_handle(cls, handle: GroupHandle) -> KubernetesBackend:
        """A backend that reaches the cluster of ``handle`` again (a trigger, a retry)."""
        if not isinstance(handle, KubernetesHandle):
            raise TypeError(f"not a Kubernetes group's handle: {handle!r}")
        return cls(
            namespace=handle.namespace,
            kubernetes_conn_id=handle.kubernetes_conn_id,
            config_file=handle.config_file,
            cluster_context=handle.cluster_context,
            in_cluster=handle.in_cluster,
            all_ranks_logs=handle.all_ranks_logs,
            deployment=handle.deployment,
        )

    # -- DAG parse time -----------------------------------------------------------------------
    @classmethod
    def for_task(cls, options: BackendOptions) -> KubernetesBackend:
        """The task's cluster, namespace and Job deadline, in this Airflow deployment's name."""
        return cls(
            deployment=deployment_name(),
            namespace=options.namespace,
            kubernetes_conn_id=options.kubernetes_conn_id,
            all_ranks_logs=options.all_ranks_logs,
            active_deadline_seconds=options.active_deadline_seconds,
        )

    @classmethod
    def default_nproc_per_node(cls, runtime: str | None, where: str) -> int:
        """The runtime's (an unknown runtime fails here, at parse time)."""
        return get_runtime(runtime, where=where).nproc_per_node

    @classmethod
    def spec_problems(cls, spec: GroupSpec) -> list[str]:
        return checks.env_problems(spec.env)

    @classmethod
    def task_problems(
        cls,
        *,
        checkpoint_uri: str | None,
        default_checkpoint_base: str | None,
        tracking_uri: str | None,
        options: BackendOptions | None = None,
    ) -> list[str]:
        return checks.task_problems(
            checkpoint_uri=checkpoint_uri, default_checkpoint_base=default_checkpoint_base, tracking_uri=tracking_uri
        ) + checks.namespace_problems(options.namespace if options is not None else None)

    def rank_storage_env(
        self, options: Mapping[str, Any], aws_conn_id: str | None, log: logging.Logger
    ) -> dict[str, str]:
        """Never credentials in plain pod env: the pods get them from the runtime's Secrets or service account."""
        from airflow_torchrun.storage.aws import SECRET_OPTIONS, storage_env

        public = {k: v for k, v in options.items() if k not in SECRET_OPTIONS}
        if len(public) != len(options):
            log.warning(
                "Not passing the credentials of aws_conn_id=%s to the pods in plain text; give the runtime "
                "env_from_secrets or a service account with access to the bucket",
                aws_conn_id,
            )
        return storage_env(public)

    @property
    def conn_id(self) -> str:
        return self.connection.conn_id

    @property
    def config_file(self) -> str | None:
        return self.connection.config_file

    def _hook(self) -> KubernetesHook:
        if self._sync_hook is None:
            self._sync_hook = self.connection.sync_hook()
        return self._sync_hook

    def _state(self, handle: KubernetesHandle) -> JobMemory:
        return self._groups.setdefault(handle.job_name, JobMemory())

    async def _run_async(self, flow: Flow[Any]) -> Any:
        return await run_async(flow, self.connection, self.request_timeout)

    # -- planning ---------------------------------------------------------------------------
    def runtime_for(self, spec: GroupSpec) -> Runtime:
        return get_runtime(spec.runtime, catalog=self._catalog or load_runtimes(), where="backend kubernetes")

    def named(self, identity: GroupIdentity) -> GroupIdentity:
        """In this Airflow deployment's name: two deployments' groups of equal ids never share a Job."""
        return replace(identity, deployment=self.deployment)

    def plan(self, spec: GroupSpec, identity: GroupIdentity, extra_env: Mapping[str, str]) -> GroupPlan:
        """The wiring's plan with node 0's DNS name as rendezvous address. Pure."""
        runtime = self.runtime_for(spec)
        identity = self.named(identity)
        name = identity.group_id
        # The task's env= is refused such names when the DAG is parsed (checks.env_problems); the
        # contract's own variables never carry credentials: this says so if one ever did.
        exposed = checks.credential_names({**extra_env, **spec.env})
        if exposed:
            # Plain env values are part of the Job object: anyone who may read Jobs sees them.
            log.warning(
                "Variables %s look like credentials; they will be readable in Job %s's spec. Provide them "
                "through the runtime's env_from_secrets (a Kubernetes Secret) or the pods' service account.",
                ", ".join(exposed),
                name,
            )
        return plan(
            spec,
            identity,
            master_addr=master_addr(name, self.namespace),
            master_port=spec.rdzv_port or DEFAULT_MASTER_PORT,
            python="python",
            log_dir=TORCHRUN_LOG_DIR,
            cpus_per_node=runtime.cpus,
            # The operator's contract variables win over the platform's defaults.
            extra_env={**runtime.env, **extra_env},
        )

    def render(self, group_plan: GroupPlan) -> RenderedGroup:
        """The objects :meth:`launch` would create for ``group_plan``. Pure."""
        return render_group(
            group_plan,
            self.runtime_for(group_plan.spec),
            namespace=self.namespace,
            active_deadline_seconds=self.active_deadline_seconds,
        )

    # -- lifecycle --------------------------------------------------------------------------
    def launch(self, plan: GroupPlan, *, watch_caller: bool = True) -> KubernetesHandle:
        """Create the Job, then the Service owned by it; raises ``GroupLaunchError`` (transient or
        not, see :mod:`~airflow_torchrun.backends.kubernetes.lifecycle`) with nothing left behind.

        ``watch_caller`` has no meaning here: pods outlive the worker on purpose, so that a
        restarted task can reattach (:meth:`find_existing`); ``on_kill`` and the operator's
        teardown delete the group.
        """
        rendered = self.render(plan)
        created = self._sync.run(launch_flow(rendered))
        log.info(
            "Created Job %s/%s: %d node(s), runtime %s",
            rendered.namespace,
            rendered.name,
            len(plan.nodes),
            rendered.job["metadata"]["annotations"][ANN_RUNTIME],
        )
        return handle_from_job(created, self.connection, all_ranks_logs=self.all_ranks_logs, spec=plan.spec)

    def find_existing(self, identity: GroupIdentity, spec: GroupSpec | None = None) -> KubernetesHandle | None:
        """The group this task instance (same dag, task, run, map index; any try) left running.

        A restarted worker attaches to it instead of launching a second group; of several, the
        newest (try, then relaunch) wins. Completed Jobs count, failed ones and Jobs being
        deleted do not. The handle, ``relaunch`` included, is read from the Job's annotations.
        """
        job = self._sync.run(find_flow(self.namespace, self.named(identity).instance_key))
        if job is None:
            return None
        handle = handle_from_job(job, self.connection, all_ranks_logs=self.all_ranks_logs, spec=spec)
        if spec is not None and handle.num_nodes != spec.num_nodes:
            log.warning(
                "Reattaching to Job %s/%s with %d node(s) although the task now asks for %d",
                handle.namespace,
                handle.job_name,
                handle.num_nodes,
                spec.num_nodes,
            )
        log.info("Found running group %s (Job %s/%s)", handle.group_id, handle.namespace, handle.job_name)
        return handle

    @classmethod
    def for_view(
        cls, identity: GroupIdentity, hint: Mapping[str, Any], *, log_read_limit: int
    ) -> tuple[KubernetesHandle, KubernetesBackend] | str | None:
        """This try's group through this deployment's own connection (``[torchrun]
        kubernetes_conn_id``), in the configured namespace or one of ``[torchrun]
        kubernetes_view_namespaces``, under this deployment's identity: the Job of the derived name,
        whose own metadata gives the counts. Of ``hint`` only the namespace (when it is one of
        those), the relaunch and, once the Job is gone (deleted when done), bounded counts are used."""
        allowed = view_namespaces()
        asked = hint.get("namespace")
        if asked is not None and asked not in allowed:
            return (
                f"the group's namespace {asked!r} is not one this API server reads ({', '.join(allowed)}); list it "
                "in [torchrun] kubernetes_view_namespaces to see the group here"
            )
        namespace = str(asked) if asked is not None else allowed[0]
        backend = cls(
            namespace=namespace,
            kubernetes_conn_id=torchrun_config("kubernetes_conn_id"),
            deployment=stored_deployment_name(),
            watch_pods=False,
            log_read_limit=log_read_limit,
        )
        relaunch = bounded_int(hint.get("relaunch", 0), low=0, high=MAX_RELAUNCH) or 0
        identity = replace(identity, relaunch=relaunch, deployment=backend.deployment)
        found = _VIEWED_JOBS.get((namespace, identity), lambda: backend.handle_of(identity))
        if found is not None:
            if bounded_int(found.num_nodes, low=1, high=MAX_NODES) is None:
                return f"group {found.group_id} claims {found.num_nodes!r} nodes"
            if bounded_int(found.world_size, low=found.num_nodes, high=MAX_WORLD_SIZE) is None:
                found = replace(found, world_size=found.num_nodes)
            return found, backend
        nodes = bounded_int(hint.get("num_nodes"), low=1, high=MAX_NODES) or 1
        handle = KubernetesHandle(
            group_id=identity.group_id,
            num_nodes=nodes,
            world_size=bounded_int(hint.get("world_size"), low=nodes, high=MAX_WORLD_SIZE) or nodes,
            launched_at=_seconds(hint.get("launched_at"), time.time()),
            startup_timeout=_seconds(hint.get("startup_timeout"), 600.0),
            teardown_grace=_seconds(hint.get("teardown_grace"), 10.0),
            relaunch=relaunch,
            namespace=namespace,
            job_name=identity.group_id,
            kubernetes_conn_id=backend.conn_id,
            deployment=backend.deployment,
        )
        return handle, backend

    def handle_of(self, identity: GroupIdentity) -> KubernetesHandle | None:
        """The handle of the group ``identity`` names (this backend's namespace and deployment), from
        its Job's own metadata; None when there is no such Job, or the one of that name is not
        airflow-torchrun's for that very task instance."""
        identity = self.named(identity)
        job = self._sync.run(read_job_flow(self.namespace, identity.group_id))
        if job is None:
            return None
        labels = (job.get("metadata") or {}).get("labels") or {}
        if labels.get(INSTANCE_LABEL) != identity.instance_key:
            log.warning("Job %s/%s is not the group of %s", self.namespace, identity.group_id, identity)
            return None
        return handle_from_job(job, self.connection, all_ranks_logs=self.all_ranks_logs)

    def teardown(self, handle: KubernetesHandle) -> None:
        """Delete the group (Foreground), keeping the failed nodes' log tails first. Idempotent;
        raises ``TeardownError`` when the Job could not be deleted."""
        self._sync.run(teardown_flow(handle, self._state(handle)))

    async def teardown_async(self, handle: KubernetesHandle) -> None:
        await self._run_async(teardown_flow(handle, self._state(handle)))

    # -- watching ---------------------------------------------------------------------------
    def observe(self, handle: KubernetesHandle) -> list[NodeObservation]:
        """Every node's state; blocks up to ``watch_seconds`` waiting for a change first. Raises
        ``ClusterApiError`` when the API cannot be read; a deleted Job gives LOST nodes."""
        nodes: list[NodeObservation] = self._sync.run(
            observe_flow(handle, self._state(handle), watch_seconds=self.watch_seconds, watch=self.watch_pods)
        )
        return nodes

    async def observe_async(self, handle: KubernetesHandle) -> list[NodeObservation]:
        """:meth:`observe` for the triggerer: the async hook and client only, no thread."""
        nodes: list[NodeObservation] = await self._run_async(
            observe_flow(handle, self._state(handle), watch_seconds=self.watch_seconds, watch=self.watch_pods)
        )
        return nodes

    def progress_mark(self, handle: KubernetesHandle) -> ProgressMark | None:
        """Changes whenever a running node's log grows (the last line's timestamp per running
        node); ``None`` while no node runs."""
        return last_lines_mark(self._sync.run(progress_flow(handle, self._state(handle))))

    async def progress_mark_async(self, handle: KubernetesHandle) -> ProgressMark | None:
        return last_lines_mark(await self._run_async(progress_flow(handle, self._state(handle))))

    def relaunch_reason(self, handle: KubernetesHandle, status: GroupStatus) -> Relaunch | None:
        """A preempted or evicted group (any disrupted rank, even when a peer is seen failing
        first) may be relaunched within the try; a real failure may not."""
        why = preemption_reason(status)
        return Relaunch(RelaunchKind.PREEMPTION, why) if why else None

    # -- logs and failures ------------------------------------------------------------------
    def log_locations(self, handle: KubernetesHandle) -> list[str]:
        ns, name = handle.namespace, handle.job_name
        pods = f"{CONTROLLER_UID_LABEL}={handle.job_uid}" if handle.job_uid else f"{GROUP_LABEL}={name}"
        return [
            f"kubectl logs -n {ns} -l {pods},{COMPLETION_INDEX_LABEL}={n} -c {CONTAINER}"
            for n in range(handle.num_nodes)
        ]

    def read_new_log_lines(self, handle: KubernetesHandle) -> list[str]:
        """New lines of node 0's log (every node's with ``all_ranks_logs``)."""
        lines: list[str] = self._sync.run(new_lines_flow(handle, self._state(handle), all_ranks=self.all_ranks_logs))
        return lines

    def read_progress_lines(self, handle: KubernetesHandle) -> list[str]:
        """New progress-record lines of every node's log: one log read per pod, at most every
        ``PROGRESS_READ_EVERY`` seconds (a watch looks far more often than records are written)."""
        from airflow_torchrun.contract.progress import MARKER

        if not self._progress_due(handle):
            return []
        lines: list[str] = self._sync.run(
            progress_lines_flow(handle, self._state(handle), MARKER, limit_bytes=self.log_read_limit)
        )
        return lines

    async def read_progress_lines_async(self, handle: KubernetesHandle) -> list[str]:
        from airflow_torchrun.contract.progress import MARKER

        if not self._progress_due(handle):
            return []
        lines: list[str] = await self._run_async(
            progress_lines_flow(handle, self._state(handle), MARKER, limit_bytes=self.log_read_limit)
        )
        return lines

    def _progress_due(self, handle: KubernetesHandle) -> bool:
        now = time.monotonic()
        if now - self._progress_read_at.get(handle.group_id, -PROGRESS_READ_EVERY) < PROGRESS_READ_EVERY:
            return False
        self._progress_read_at[handle.group_id] = now
        return True

    def explain(self, handle: KubernetesHandle, status: GroupStatus) -> FailureReport:
        """The failing pod's platform reason and log tail, torchrun's own report when present."""
        report: FailureReport = self._sync.run(_explain_flow(handle, self._state(handle), status))
        return report


def last_lines_mark(last_lines: tuple[tuple[int, str], ...] | None) -> ProgressMark | None:
    """``(node rank, timestamp of its last log line)`` per running pod as a mark: output once any has a line."""
    if last_lines is None:
        return None
    return ProgressMark(last_lines, output=any(stamp for _, stamp in last_lines))


def _explain_flow(handle: KubernetesHandle, state: JobMemory, status: GroupStatus) -> Flow[FailureReport]:
    try:
        pods = yield from pods_flow(handle, state)
    except ClusterApiError as exc:  # explain what is known rather than lose the failure
        log.warning("Could not list the pods of %s to explain its failure: %s", handle.group_id, exc)
        pods = {}
    logs = {}
    for n in nodes_to_read(status):
        logs[n] = yield from tail_flow(handle, state, n, pods.get(n))
    return explain_failure(
        handle.group_id, status, namespace=handle.namespace, job_name=handle.job_name, pods=pods, logs=logs
    )
