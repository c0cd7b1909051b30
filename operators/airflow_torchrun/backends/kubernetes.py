"""The Kubernetes backend: every node is a pod of one Indexed Job, found by a headless Service.

All API traffic goes through the cncf-kubernetes provider's hooks: :class:`KubernetesHook` for
the sync path (the operator) and :class:`AsyncKubernetesHook` for the async path (the trigger),
with ``kubernetes_conn_id`` naming the Airflow connection. This class only wires the parts:

- rendering, pure: :mod:`~airflow_torchrun.backends.k8s_render`;
- the requests, pure descriptions: :mod:`~airflow_torchrun.backends.k8s_api`, sent by the thin
  sync and async executors of :mod:`~airflow_torchrun.backends.k8s_client`;
- the flows that yield them: launch, find and teardown (:mod:`~airflow_torchrun.backends.k8s_lifecycle`),
  one look at the group (:mod:`~airflow_torchrun.backends.k8s_observe`), logs and progress
  (:mod:`~airflow_torchrun.backends.k8s_logs`);
- reading objects back, pure: :mod:`~airflow_torchrun.backends.k8s_status` and
  :mod:`~airflow_torchrun.backends.k8s_explain`.

Errors: every API failure is a :class:`~airflow_torchrun.backends.k8s_api.ClusterApiError`, transient
or not by :func:`airflow_torchrun.errors.is_transient`'s rules; ``observe`` raises it (the watch
core decides), ``launch`` turns it into ``GroupLaunchError`` after deleting what it created.
"""

from __future__ import annotations

import logging
import math
import re
import secrets
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from airflow_torchrun.backends.base import Backend, FailureReport, GroupHandle, Relaunch, RelaunchKind
from airflow_torchrun.backends.handles import KubernetesHandle
from airflow_torchrun.backends.k8s_api import ClusterApiError
from airflow_torchrun.backends.k8s_client import Connection, Flow, SyncExecutor, run_async
from airflow_torchrun.backends.k8s_explain import explain_failure, nodes_to_read
from airflow_torchrun.backends.k8s_lifecycle import (
    TeardownError,
    find_flow,
    handle_from_job,
    launch_flow,
    teardown_flow,
)
from airflow_torchrun.backends.k8s_logs import new_lines_flow, progress_flow, progress_lines_flow, tail_flow
from airflow_torchrun.backends.k8s_observe import GroupState, observe_flow, pods_flow
from airflow_torchrun.backends.k8s_render import (
    ANN_RUNTIME,
    COMPLETION_INDEX_LABEL,
    CONTAINER,
    CONTROLLER_UID_LABEL,
    DEFAULT_DEPLOYMENT,
    GROUP_LABEL,
    TORCHRUN_LOG_DIR,
    RenderedGroup,
    group_name,
    instance_key,
    label_value,
    master_addr,
    render_group,
)
from airflow_torchrun.backends.k8s_status import preemption_reason
from airflow_torchrun.errors import InvalidSpecError
from airflow_torchrun.runtimes import Runtime, RuntimeCatalog, get_runtime, load_runtimes
from airflow_torchrun.spec import GroupSpec
from airflow_torchrun.status import GroupStatus, NodeObservation
from airflow_torchrun.wiring import DEFAULT_MASTER_PORT, GroupIdentity, GroupPlan, plan

if TYPE_CHECKING:
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

__all__ = ["ClusterApiError", "KubernetesBackend", "TeardownError"]

log = logging.getLogger(__name__)

DEFAULT_CONN_ID = "kubernetes_default"
DEFAULT_NAMESPACE = "default"
PROGRESS_READ_EVERY = 5.0  # seconds between two reads of the pods' logs for progress records

_SECRET_NAME = re.compile(r"SECRET|PASSWORD|TOKEN|PRIVATE_KEY|ACCESS_KEY", re.IGNORECASE)


def _config(key: str) -> str | None:
    try:
        from airflow.sdk import conf
    except ImportError:
        return None
    value = conf.get("torchrun", key, fallback=None)
    return value or None


# The Variable in which a deployment keeps the identity it made itself, when ``[torchrun]
# deployment`` is unset: every worker of one deployment reads the same metadata database, and no
# other deployment does, so the name is shared where it must be and differs where it must.
DEPLOYMENT_VARIABLE = "torchrun_deployment"
_DEPLOYMENT_DESCRIPTION = (
    "airflow-torchrun: this Airflow deployment's identity in the names and labels of its training Jobs, made "
    "on first use. Keep it while Jobs of this deployment may still exist; never copy it to another deployment "
    "(set [torchrun] deployment instead to choose the name)."
)


def deployment_name(*, create: bool = True) -> str:
    """This deployment's identity in its Jobs: ``[torchrun] deployment``, else its own Variable.

    With neither, inside a task (``create``) a random name is kept in :data:`DEPLOYMENT_VARIABLE`
    and read back (two tasks that both find it missing use the one stored last, unless one reads
    back before the other writes: a race of milliseconds, once per deployment). Where no
    Variable can be read or written (``render`` without a database, tests outside Airflow), the
    name is :data:`DEFAULT_DEPLOYMENT`, as before deployments had identities, with a warning when
    a task meant to create one.
    """
    configured = _config("deployment")
    if configured:
        return configured
    try:
        from airflow.sdk import Variable

        stored = Variable.get(DEPLOYMENT_VARIABLE, default=None)
        if stored is None and create:
            Variable.set(DEPLOYMENT_VARIABLE, f"af-{secrets.token_hex(5)}", description=_DEPLOYMENT_DESCRIPTION)
            stored = Variable.get(DEPLOYMENT_VARIABLE, default=None)
    except Exception as exc:  # no metadata database or API server here: the old shared default
        if create:
            log.warning(
                "The Variable %s (this deployment's identity in its Jobs) cannot be read or written here (%s); "
                "Jobs are named for deployment %r, which another Airflow deployment sharing the namespace may use "
                "too. Set [torchrun] deployment to a name of this deployment's own.",
                DEPLOYMENT_VARIABLE,
                exc,
                DEFAULT_DEPLOYMENT,
            )
        return DEFAULT_DEPLOYMENT
    return str(stored) if stored else DEFAULT_DEPLOYMENT


class KubernetesBackend(Backend):
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
        :mod:`airflow_torchrun.runtimes`).
    :param deployment: The Airflow deployment's name in the Jobs' identity and labels; default
        ``[torchrun] deployment``, else ``default``. The operator passes :func:`deployment_name`,
        which gives every deployment a name of its own. Two deployments that share a namespace
        must have different ones, or they could attach to each other's groups (same dag and run ids).
    :param active_deadline_seconds: The Job's ``activeDeadlineSeconds`` (the operator passes the
        task's ``execution_timeout``); ``None``: no deadline of the Job's own.
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
    ) -> None:
        problems = []
        if watch_seconds <= 0 or request_timeout <= 0:
            problems.append("watch_seconds and request_timeout must be positive numbers of seconds")
        if config_file is not None and in_cluster:
            problems.append("give config_file or in_cluster=True, not both")
        deployment = deployment or _config("deployment") or DEFAULT_DEPLOYMENT
        if len(deployment) > 63 or label_value(deployment) != deployment:
            problems.append(
                f"deployment {deployment!r} ([torchrun] deployment) must be a Kubernetes label value: at most 63 "
                "letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
            )
        if active_deadline_seconds is not None and not active_deadline_seconds > 0:
            problems.append(
                f"active_deadline_seconds must be a positive number of seconds, got {active_deadline_seconds!r}"
            )
        if problems:
            raise InvalidSpecError(problems, "KubernetesBackend")
        self.namespace = namespace or _config("kubernetes_namespace") or DEFAULT_NAMESPACE
        self.deployment = deployment
        self.active_deadline_seconds = (
            None if active_deadline_seconds is None else max(1, math.ceil(active_deadline_seconds))
        )
        self.connection = Connection(
            conn_id=kubernetes_conn_id or _config("kubernetes_conn_id") or DEFAULT_CONN_ID,
            config_file=config_file,
            cluster_context=cluster_context,
            in_cluster=in_cluster,
        )
        self.all_ranks_logs = all_ranks_logs
        self.watch_seconds = float(watch_seconds)
        self.request_timeout = float(request_timeout)
        if isinstance(runtimes, Mapping):
            runtimes = RuntimeCatalog(runtimes, ("given to KubernetesBackend",))
        self._catalog = runtimes
        self._sync_hook: KubernetesHook | None = None
        self._sync = SyncExecutor(self._hook, self.request_timeout)
        self._progress_read_at: dict[str, float] = {}
        self._groups: dict[str, GroupState] = {}

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

    def _state(self, handle: KubernetesHandle) -> GroupState:
        return self._groups.setdefault(handle.job_name, GroupState())

    async def _run_async(self, flow: Flow[Any]) -> Any:
        return await run_async(flow, self.connection, self.request_timeout)

    # -- planning ---------------------------------------------------------------------------
    def runtime_for(self, spec: GroupSpec) -> Runtime:
        return get_runtime(spec.runtime, catalog=self._catalog or load_runtimes(), where="backend kubernetes")

    def plan(self, spec: GroupSpec, identity: GroupIdentity, extra_env: Mapping[str, str]) -> GroupPlan:
        """The wiring's plan with node 0's DNS name as rendezvous address. Pure."""
        runtime = self.runtime_for(spec)
        name = group_name(identity, self.deployment)
        exposed = sorted(k for k in {**extra_env, **spec.env} if _SECRET_NAME.search(k))
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
            group_id=name,  # what kubectl shows is what the task log and XCom say
        )

    def render(self, group_plan: GroupPlan) -> RenderedGroup:
        """The objects :meth:`launch` would create for ``group_plan``. Pure."""
        return render_group(
            group_plan,
            self.runtime_for(group_plan.spec),
            namespace=self.namespace,
            deployment=self.deployment,
            active_deadline_seconds=self.active_deadline_seconds,
        )

    # -- lifecycle --------------------------------------------------------------------------
    def launch(self, plan: GroupPlan, *, watch_caller: bool = True) -> KubernetesHandle:
        """Create the Job, then the Service owned by it; raises ``GroupLaunchError`` (transient or
        not, see :mod:`~airflow_torchrun.backends.k8s_lifecycle`) with nothing left behind.

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
        job = self._sync.run(find_flow(self.namespace, instance_key(identity, self.deployment)))
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
            observe_flow(handle, self._state(handle), watch_seconds=self.watch_seconds)
        )
        return nodes

    async def observe_async(self, handle: KubernetesHandle) -> list[NodeObservation]:
        """:meth:`observe` for the triggerer: the async hook and client only, no thread."""
        nodes: list[NodeObservation] = await self._run_async(
            observe_flow(handle, self._state(handle), watch_seconds=self.watch_seconds)
        )
        return nodes

    def progress_mark(self, handle: KubernetesHandle) -> object | None:
        """Changes whenever a running node's log grows (the last line's timestamp per running
        node); ``None`` while no node runs."""
        mark: object | None = self._sync.run(progress_flow(handle, self._state(handle)))
        return mark

    async def progress_mark_async(self, handle: KubernetesHandle) -> object | None:
        mark: object | None = await self._run_async(progress_flow(handle, self._state(handle)))
        return mark

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
        from airflow_torchrun.worker.progress import MARKER

        if not self._progress_due(handle):
            return []
        lines: list[str] = self._sync.run(progress_lines_flow(handle, self._state(handle), MARKER))
        return lines

    async def read_progress_lines_async(self, handle: KubernetesHandle) -> list[str]:
        from airflow_torchrun.worker.progress import MARKER

        if not self._progress_due(handle):
            return []
        lines: list[str] = await self._run_async(progress_lines_flow(handle, self._state(handle), MARKER))
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


def _explain_flow(handle: KubernetesHandle, state: GroupState, status: GroupStatus) -> Flow[FailureReport]:
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
