"""The Kubernetes backend: every node is a pod of one Indexed Job, found by a headless Service.

All API traffic goes through the cncf-kubernetes provider's hooks: :class:`KubernetesHook` for
the sync path (the operator) and :class:`AsyncKubernetesHook` for the async path (the trigger),
with ``kubernetes_conn_id`` naming the Airflow connection. Rendering is pure
(:mod:`~airflow_torchrun.backends.k8s_render`), and so is reading the objects back
(:mod:`~airflow_torchrun.backends.k8s_status`); this module only moves them over the wire.

Waiting watches instead of sleep-polling: after the first look, :meth:`KubernetesBackend.observe`
watches the group's pods from the last list's ``resourceVersion`` and returns as soon as anything
changes, or after ``watch_seconds`` when nothing does (the operator's loop then looks again, which
also drives the startup timeout and log streaming).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_torchrun.backends.base import FailureReport, GroupHandle
from airflow_torchrun.backends.k8s_explain import MAX_TAILS, explain_failure, nodes_to_read
from airflow_torchrun.backends.k8s_logs import LogCursor
from airflow_torchrun.backends.k8s_render import (
    ANN_GROUP_ID,
    ANN_MASTER_ADDR,
    ANN_MASTER_PORT,
    ANN_QUEUE,
    ANN_RUNTIME,
    ANN_STARTUP_TIMEOUT,
    ANN_TEARDOWN_GRACE,
    ANN_WORLD_SIZE,
    COMPLETION_INDEX_LABEL,
    CONTAINER,
    GROUP_LABEL,
    INSTANCE_LABEL,
    TORCHRUN_LOG_DIR,
    RenderedGroup,
    group_name,
    instance_key,
    master_addr,
    owner_reference,
    render_group,
)
from airflow_torchrun.backends.k8s_status import (
    completion_index,
    needs_events,
    needs_workloads,
    node_observations,
    parse_time,
    pod_observation,
    preemption_reason,
)
from airflow_torchrun.errors import GroupLaunchError, InvalidSpecError, TorchrunError
from airflow_torchrun.runtimes import Runtime, RuntimeCatalog, get_runtime, load_runtimes
from airflow_torchrun.spec import GroupSpec
from airflow_torchrun.status import GroupStatus, NodeObservation, NodePhase
from airflow_torchrun.wiring import DEFAULT_MASTER_PORT, GroupIdentity, GroupPlan, plan

if TYPE_CHECKING:
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook, KubernetesHook

log = logging.getLogger(__name__)

DEFAULT_CONN_ID = "kubernetes_default"
DEFAULT_NAMESPACE = "default"
KUEUE_GROUP, KUEUE_VERSION, KUEUE_PLURAL = "kueue.x-k8s.io", "v1beta1", "workloads"
LOG_TAIL_LINES = 200
# After a Foreground delete the old Job lingers until its pods are gone (their grace period).
RECREATE_WAIT_EXTRA_SECONDS = 60.0


_SECRET_NAME = re.compile(r"SECRET|PASSWORD|TOKEN|PRIVATE_KEY|ACCESS_KEY", re.IGNORECASE)


class TeardownError(TorchrunError):
    """The group's Job could not be deleted; pods may still be running."""


@dataclass
class _GroupState:
    """What one backend instance remembers about a group between calls (never required:
    a fresh instance, in another process, rebuilds it from the API)."""

    resource_version: str | None = None
    pods: list[dict[str, Any]] = field(default_factory=list)
    nodes: list[NodeObservation] = field(default_factory=list)
    cursors: dict[str, LogCursor] = field(default_factory=dict)
    # node rank -> log tail, saved before teardown deletes the pods
    tails: dict[int, str] = field(default_factory=dict)


def _config(key: str) -> str | None:
    try:
        from airflow.sdk import conf
    except ImportError:
        return None
    value = conf.get("torchrun", key, fallback=None)
    return value or None


def _api_status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    return int(status) if isinstance(status, int) else None


def _api_message(exc: BaseException) -> str:
    body = getattr(exc, "body", None)
    if body:
        try:
            data = json.loads(body)
            if isinstance(data, dict) and data.get("message"):
                return str(data["message"])
        except (TypeError, ValueError):
            pass
    return str(getattr(exc, "reason", None) or exc).strip()


class KubernetesBackend:
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
    ) -> None:
        problems = []
        if watch_seconds <= 0 or request_timeout <= 0:
            problems.append("watch_seconds and request_timeout must be positive numbers of seconds")
        if config_file is not None and in_cluster:
            problems.append("give config_file or in_cluster=True, not both")
        if problems:
            raise InvalidSpecError(problems, "KubernetesBackend")
        self.namespace = namespace or _config("kubernetes_namespace") or DEFAULT_NAMESPACE
        self.conn_id = kubernetes_conn_id or _config("kubernetes_conn_id") or DEFAULT_CONN_ID
        self.config_file = config_file
        self.cluster_context = cluster_context
        self.in_cluster = in_cluster
        self.all_ranks_logs = all_ranks_logs
        self.watch_seconds = float(watch_seconds)
        self.request_timeout = float(request_timeout)
        if isinstance(runtimes, Mapping):
            runtimes = RuntimeCatalog(runtimes, ("given to KubernetesBackend",))
        self._catalog = runtimes
        self._sync_hook: KubernetesHook | None = None
        self._async_hook_obj: AsyncKubernetesHook | None = None
        self._groups: dict[str, _GroupState] = {}

    # -- hooks ------------------------------------------------------------------------------
    def _hook(self) -> KubernetesHook:
        if self._sync_hook is None:
            from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

            if self.config_file:
                # No connection at all: the file is the whole configuration.
                self._sync_hook = KubernetesHook(
                    conn_id=None,
                    kubernetes_conn_id=None,
                    config_file=self.config_file,
                    cluster_context=self.cluster_context,
                )
            else:
                self._sync_hook = KubernetesHook(
                    conn_id=self.conn_id, cluster_context=self.cluster_context, in_cluster=self.in_cluster
                )
        return self._sync_hook

    async def _async_hook(self) -> AsyncKubernetesHook:
        if self._async_hook_obj is None:
            self._async_hook_obj = await self._new_async_hook()
        return self._async_hook_obj

    async def _new_async_hook(self) -> AsyncKubernetesHook:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook

        if self.config_file:
            # AsyncKubernetesHook reads kubeconfig paths only from the connection; hand it the
            # file's content instead (read off the event loop).
            import yaml

            text = await asyncio.to_thread(Path(self.config_file).read_text)
            return AsyncKubernetesHook(
                config_dict=yaml.safe_load(text),
                connection_extras={},
                conn_id=None,
                kubernetes_conn_id=None,
                cluster_context=self.cluster_context,
            )
        return AsyncKubernetesHook(
            conn_id=self.conn_id, cluster_context=self.cluster_context, in_cluster=self.in_cluster
        )

    def _sync_json(self, call: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # Raw JSON, not the client's models: the pure status code reads the API's own shapes,
        # including fields newer than the installed client.
        resp = call(*args, _preload_content=False, _request_timeout=self.request_timeout, **kwargs)
        return json.loads(resp.data)  # type: ignore[no-any-return]

    # -- planning ---------------------------------------------------------------------------
    def runtime_for(self, spec: GroupSpec) -> Runtime:
        return get_runtime(spec.runtime, catalog=self._catalog or load_runtimes(), where="backend kubernetes")

    def plan(self, spec: GroupSpec, identity: GroupIdentity, extra_env: Mapping[str, str]) -> GroupPlan:
        """The wiring's plan with node 0's DNS name as rendezvous address. Pure."""
        runtime = self.runtime_for(spec)
        exposed = sorted(k for k in {**extra_env, **spec.env} if _SECRET_NAME.search(k))
        if exposed:
            # Plain env values are part of the Job object: anyone who may read Jobs sees them.
            log.warning(
                "Variables %s look like credentials; they will be readable in Job %s's spec. Provide them "
                "through the runtime's env_from_secrets (a Kubernetes Secret) or the pods' service account.",
                ", ".join(exposed),
                group_name(identity),
            )
        name = group_name(identity)
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
        return render_group(group_plan, self.runtime_for(group_plan.spec), namespace=self.namespace)

    # -- launching --------------------------------------------------------------------------
    def launch(self, plan: GroupPlan, *, watch_caller: bool = True) -> GroupHandle:
        """Create the Job, then the Service owned by it.

        ``watch_caller`` has no meaning here: pods outlive the worker on purpose, so that a
        restarted task can reattach (:meth:`find_existing`); ``on_kill`` and the operator's
        teardown delete the group.
        """
        from kubernetes.client.exceptions import ApiException

        rendered = self.render(plan)
        batch = self._hook().batch_v1_client
        ns, name = rendered.namespace, rendered.name
        try:
            created = self._create_job(rendered)
        except ApiException as exc:
            raise self._launch_error(exc, "Job", name) from exc
        log.info(
            "Created Job %s/%s: %d node(s), runtime %s",
            ns,
            name,
            len(plan.nodes),
            rendered.job["metadata"]["annotations"][ANN_RUNTIME],
        )
        service = {
            **rendered.service,
            "metadata": {**rendered.service["metadata"], "ownerReferences": [owner_reference(created)]},
        }
        try:
            self._create_service(service)
        except ApiException as exc:
            try:
                batch.delete_namespaced_job(
                    name, ns, propagation_policy="Foreground", _request_timeout=self.request_timeout
                )
            except ApiException:
                log.exception("Could not delete Job %s/%s after its Service failed", ns, name)
            raise self._launch_error(exc, "Service", name) from exc
        return self._handle(created, plan.spec)

    def _create_job(self, rendered: RenderedGroup) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException

        batch = self._hook().batch_v1_client
        ns, name = rendered.namespace, rendered.name
        try:
            return self._sync_json(batch.create_namespaced_job, ns, rendered.job)
        except ApiException as exc:
            if _api_status(exc) != 409:
                raise
            existing = self._read_job(name, ns)
            if existing is not None and not existing["metadata"].get("deletionTimestamp"):
                raise GroupLaunchError(
                    f"Job {ns}/{name} already exists and is not being deleted: this try's group is already "
                    "running. Attach to it (KubernetesBackend.find_existing) or delete it with "
                    f"`kubectl delete job -n {ns} {name} --cascade=foreground`."
                ) from exc
            # The previous launch of this very group is still being deleted: wait it out.
            pod_spec = ((existing or {}).get("spec") or {}).get("template", {}).get("spec", {})
            grace = float(pod_spec.get("terminationGracePeriodSeconds", 30))
            deadline = time.monotonic() + grace + RECREATE_WAIT_EXTRA_SECONDS
            while self._read_job(name, ns) is not None:
                if time.monotonic() > deadline:
                    raise GroupLaunchError(
                        f"Job {ns}/{name} from an earlier launch is still being deleted after "
                        f"{grace + RECREATE_WAIT_EXTRA_SECONDS:g}s (pods stuck terminating?); check "
                        f"`kubectl get pods -n {ns} -l {GROUP_LABEL}={name}`"
                    ) from exc
                time.sleep(1.0)
            return self._sync_json(batch.create_namespaced_job, ns, rendered.job)

    def _create_service(self, service: dict[str, Any]) -> None:
        from kubernetes.client.exceptions import ApiException

        core = self._hook().core_v1_client
        ns, name = service["metadata"]["namespace"], service["metadata"]["name"]
        try:
            self._sync_json(core.create_namespaced_service, ns, service)
        except ApiException as exc:
            if _api_status(exc) != 409:
                raise
            # A Service left from an earlier Job of this name (garbage collection lags): replace it.
            core.delete_namespaced_service(name, ns, _request_timeout=self.request_timeout)
            self._sync_json(core.create_namespaced_service, ns, service)

    def _launch_error(self, exc: BaseException, kind: str, name: str) -> Exception:
        status, message = _api_status(exc), _api_message(exc)
        if status in (400, 422):
            return InvalidSpecError(
                [f"the API server rejected {kind} {name}: {message}"], f"namespace {self.namespace}"
            )
        if status == 403:
            return GroupLaunchError(
                f"not allowed to create {kind} {name} in namespace {self.namespace}: {message}. Give the "
                "connection's identity the Role in docs/kubernetes.md (or pick another namespace)."
            )
        return GroupLaunchError(f"could not create {kind} {name} in namespace {self.namespace}: {message}")

    def _handle(self, job: Mapping[str, Any], spec: GroupSpec | None) -> GroupHandle:
        meta = job.get("metadata") or {}
        ann = meta.get("annotations") or {}

        def number(key: str, fallback: float) -> float:
            try:
                return float(ann[key])
            except (KeyError, ValueError):
                return fallback

        completions = int((job.get("spec") or {}).get("completions") or (spec.num_nodes if spec else 1))
        return GroupHandle(
            backend=self.name,
            group_id=ann.get(ANN_GROUP_ID) or meta["name"],
            num_nodes=completions,
            launched_at=parse_time(meta.get("creationTimestamp")) or time.time(),
            location=meta.get("namespace") or self.namespace,
            startup_timeout=number(ANN_STARTUP_TIMEOUT, spec.startup_timeout if spec else 600.0),
            teardown_grace=number(ANN_TEARDOWN_GRACE, spec.teardown_grace if spec else 10.0),
            extra={
                "job_name": meta["name"],
                "job_uid": meta.get("uid"),
                "master_addr": ann.get(ANN_MASTER_ADDR),
                "master_port": int(number(ANN_MASTER_PORT, DEFAULT_MASTER_PORT)),
                "world_size": int(number(ANN_WORLD_SIZE, 0)),
                "runtime": ann.get(ANN_RUNTIME),
                "queue": ann.get(ANN_QUEUE),
                # How to reach the cluster again from another process (trigger, retry).
                "kubernetes_conn_id": self.conn_id,
                "config_file": self.config_file,
                "cluster_context": self.cluster_context,
                "in_cluster": self.in_cluster,
                "all_ranks_logs": self.all_ranks_logs,
            },
        )

    @staticmethod
    def options_from_handle(handle: GroupHandle) -> dict[str, Any]:
        """Constructor options that reach the cluster of ``handle`` again (for a trigger, a retry):
        ``KubernetesBackend(**KubernetesBackend.options_from_handle(handle))``."""
        extra = handle.extra
        options: dict[str, Any] = {"namespace": handle.location}
        for key in ("kubernetes_conn_id", "config_file", "cluster_context", "in_cluster", "all_ranks_logs"):
            if extra.get(key) is not None:
                options[key] = extra[key]
        return options

    # -- reattaching ------------------------------------------------------------------------
    def find_existing(self, identity: GroupIdentity, spec: GroupSpec | None = None) -> GroupHandle | None:
        """The group this task instance (same dag, task, run, map index; any try) left running.

        A restarted worker attaches to it instead of launching a second group; of several, the
        newest wins. A Job that completed is returned too (its success is the task's, nothing
        runs again). Ignored: Jobs being deleted, and failed Jobs (left over when an earlier try's
        teardown did not get through): attaching to one would only repeat its failure, so the
        task starts a fresh group, as ``ResumableJobMixin`` does for a failed job.
        """
        batch = self._hook().batch_v1_client
        listed = self._sync_json(
            batch.list_namespaced_job, self.namespace, label_selector=f"{INSTANCE_LABEL}={instance_key(identity)}"
        )
        live = []
        for job in listed.get("items") or []:
            meta = job.get("metadata") or {}
            if meta.get("deletionTimestamp"):
                continue
            if any(
                c.get("type") == "Failed" and c.get("status") == "True"
                for c in (job.get("status") or {}).get("conditions") or []
            ):
                log.warning(
                    "Not reattaching to failed Job %s/%s of an earlier try; delete it with "
                    "`kubectl delete job -n %s %s --cascade=foreground`",
                    self.namespace,
                    meta.get("name"),
                    self.namespace,
                    meta.get("name"),
                )
                continue
            live.append(job)
        if not live:
            return None
        job = max(live, key=lambda j: parse_time(j["metadata"].get("creationTimestamp")) or 0.0)
        handle = self._handle(job, spec)
        if spec is not None and handle.num_nodes != spec.num_nodes:
            log.warning(
                "Reattaching to Job %s/%s with %d node(s) although the task now asks for %d",
                handle.location,
                handle.extra["job_name"],
                handle.num_nodes,
                spec.num_nodes,
            )
        log.info("Found running group %s (Job %s/%s)", handle.group_id, handle.location, handle.extra["job_name"])
        return handle

    # -- watching ---------------------------------------------------------------------------
    def _names(self, handle: GroupHandle) -> tuple[str, str]:
        return str(handle.extra.get("job_name") or handle.group_id), handle.location

    def _state(self, handle: GroupHandle) -> _GroupState:
        return self._groups.setdefault(handle.group_id, _GroupState())

    @staticmethod
    def _should_wait(state: _GroupState) -> bool:
        """Watch only once there is a list to watch from and the group is not finished."""
        if state.resource_version is None or not state.nodes:
            return False
        if any(n.phase in (NodePhase.FAILED, NodePhase.LOST) for n in state.nodes):
            return False
        return not all(n.phase is NodePhase.SUCCEEDED for n in state.nodes)

    def _read_job(self, name: str, ns: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self._sync_json(self._hook().batch_v1_client.read_namespaced_job, name, ns)
        except ApiException as exc:
            if _api_status(exc) == 404:
                return None
            raise

    def observe(self, handle: GroupHandle) -> list[NodeObservation]:
        """Every node's state; blocks up to ``watch_seconds`` waiting for a change first."""
        from kubernetes.client.exceptions import ApiException

        name, ns = self._names(handle)
        state = self._state(handle)
        core = self._hook().core_v1_client
        selector = f"{GROUP_LABEL}={name}"
        if self._should_wait(state):
            self._watch_once(core, ns, selector, state.resource_version)
        job = self._read_job(name, ns)
        listed = self._sync_json(core.list_namespaced_pod, ns, label_selector=selector)
        pods = listed.get("items") or []
        events: list[dict[str, Any]] = []
        workloads: list[dict[str, Any]] = []
        if needs_events(handle.num_nodes, job, pods):
            events = (
                self._sync_json(
                    core.list_namespaced_event, ns, field_selector=f"involvedObject.kind=Job,involvedObject.name={name}"
                ).get("items")
                or []
            )
        if job is not None and needs_workloads(job):
            try:
                workloads = (
                    self._sync_json(
                        self._hook().custom_object_client.list_namespaced_custom_object,
                        KUEUE_GROUP,
                        KUEUE_VERSION,
                        ns,
                        KUEUE_PLURAL,
                        label_selector=f"kueue.x-k8s.io/job-uid={job['metadata'].get('uid')}",
                    ).get("items")
                    or []
                )
            except ApiException as exc:
                if _api_status(exc) not in (403, 404):  # Kueue absent or not readable: no details
                    raise
        return self._record(handle, state=state, listed=listed, pods=pods, job=job, events=events, workloads=workloads)

    def _record(
        self,
        handle: GroupHandle,
        *,
        state: _GroupState,
        listed: Mapping[str, Any],
        pods: list[dict[str, Any]],
        job: Mapping[str, Any] | None,
        events: Sequence[Mapping[str, Any]],
        workloads: Sequence[Mapping[str, Any]],
    ) -> list[NodeObservation]:
        nodes = node_observations(handle.num_nodes, job, pods, events=events, workloads=workloads)
        state.resource_version = (listed.get("metadata") or {}).get("resourceVersion")
        state.pods = pods
        if [(n.phase, n.reason) for n in nodes] != [(n.phase, n.reason) for n in state.nodes]:
            log.debug("Group %s: %s", handle.group_id, "; ".join(f"{n.node_rank}={n.phase.value}" for n in nodes))
        state.nodes = nodes
        return nodes

    def _watch_args(self, selector: str, resource_version: str | None) -> dict[str, Any]:
        """One watch of the group's pods from ``resource_version``: the server ends it after
        ``watch_seconds``; the client gives up a request timeout later."""
        return {
            "label_selector": selector,
            "resource_version": resource_version,
            "timeout_seconds": max(1, math.ceil(self.watch_seconds)),
            "_request_timeout": self.watch_seconds + self.request_timeout,
        }

    def _watch_once(self, core: Any, ns: str, selector: str, resource_version: str | None) -> None:
        """Block until the group's pods change or ``watch_seconds`` pass."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        w = watch.Watch()
        stream = w.stream(
            core.list_namespaced_pod, ns, **self._watch_args(selector, resource_version), deserialize=False
        )
        try:
            for _event in stream:
                break
        except ApiException as exc:
            # 410 Gone: the resourceVersion expired; the list that follows starts afresh.
            log.debug("Watch of %s ended: %s", selector, _api_message(exc))
        finally:
            w.stop()
            stream.close()

    async def observe_async(self, handle: GroupHandle) -> list[NodeObservation]:
        """:meth:`observe` for the triggerer: the async hook and client only, no thread."""
        from kubernetes_asyncio import client as async_client

        name, ns = self._names(handle)
        state = self._state(handle)
        selector = f"{GROUP_LABEL}={name}"
        hook = await self._async_hook()
        async with hook.get_conn() as api:
            core = async_client.CoreV1Api(api)
            batch = async_client.BatchV1Api(api)
            if self._should_wait(state):
                await self._watch_once_async(core, ns, selector, state.resource_version)
            job = await self._async_json(batch.read_namespaced_job, name, ns, missing_ok=True)
            listed = await self._async_json(core.list_namespaced_pod, ns, label_selector=selector) or {}
            pods = listed.get("items") or []
            events: list[dict[str, Any]] = []
            workloads: list[dict[str, Any]] = []
            if needs_events(handle.num_nodes, job, pods):
                found = await self._async_json(
                    core.list_namespaced_event, ns, field_selector=f"involvedObject.kind=Job,involvedObject.name={name}"
                )
                events = (found or {}).get("items") or []
            if job is not None and needs_workloads(job):
                custom = async_client.CustomObjectsApi(api)
                found = await self._async_json(
                    custom.list_namespaced_custom_object,
                    KUEUE_GROUP,
                    KUEUE_VERSION,
                    ns,
                    KUEUE_PLURAL,
                    label_selector=f"kueue.x-k8s.io/job-uid={job['metadata'].get('uid')}",
                    missing_ok=True,
                    forbidden_ok=True,
                )
                workloads = (found or {}).get("items") or []
        return self._record(handle, state=state, listed=listed, pods=pods, job=job, events=events, workloads=workloads)

    async def _async_json(
        self, call: Any, *args: Any, missing_ok: bool = False, forbidden_ok: bool = False, **kwargs: Any
    ) -> dict[str, Any] | None:
        from kubernetes_asyncio.client.exceptions import ApiException

        resp = await call(*args, _preload_content=False, _request_timeout=self.request_timeout, **kwargs)
        try:
            body = await resp.read()
            if (resp.status == 404 and missing_ok) or (resp.status == 403 and forbidden_ok):
                return None
            if not 200 <= resp.status <= 299:
                raise ApiException(status=resp.status, reason=body.decode("utf-8", "replace")[:500])
            return json.loads(body)  # type: ignore[no-any-return]
        finally:
            resp.release()

    async def _watch_once_async(self, core: Any, ns: str, selector: str, resource_version: str | None) -> None:
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client.exceptions import ApiException

        async with watch.Watch() as w:
            try:
                async for _event in w.stream(
                    core.list_namespaced_pod, ns, **self._watch_args(selector, resource_version)
                ):
                    break
            except ApiException as exc:
                log.debug("Watch of %s ended: %s", selector, _api_message(exc))

    async def progress_mark(self, handle: GroupHandle) -> object:
        """Changes whenever a running node's log grows: the timestamp of each running pod's last
        log line (the trigger's ``progress_timeout`` detects a hung collective with it)."""
        from kubernetes_asyncio import client as async_client

        state = self._state(handle)
        running = sorted(
            (idx, p["metadata"]["name"])
            for p in state.pods
            if _container_running(p) and (idx := completion_index(p)) is not None
        )
        marks: list[tuple[int, str]] = []
        hook = await self._async_hook()
        async with hook.get_conn() as api:
            core = async_client.CoreV1Api(api)
            for node_rank, pod_name in running:
                resp: Any = await core.read_namespaced_pod_log(
                    pod_name,
                    handle.location,
                    container=CONTAINER,
                    tail_lines=1,
                    timestamps=True,
                    _preload_content=False,
                    _request_timeout=self.request_timeout,
                )
                try:
                    text = (await resp.read()).decode("utf-8", "replace") if resp.status == 200 else ""
                finally:
                    resp.release()
                marks.append((node_rank, text.split(" ", 1)[0]))
        return tuple(marks)

    # -- logs -------------------------------------------------------------------------------
    def log_locations(self, handle: GroupHandle) -> list[str]:
        name, ns = self._names(handle)
        return [
            f"kubectl logs -n {ns} -l {GROUP_LABEL}={name},{COMPLETION_INDEX_LABEL}={n} -c {CONTAINER}"
            for n in range(handle.num_nodes)
        ]

    def _pods_by_node(self, handle: GroupHandle) -> dict[int, dict[str, Any]]:
        state = self._state(handle)
        if not state.pods:
            name, ns = self._names(handle)
            listed = self._sync_json(
                self._hook().core_v1_client.list_namespaced_pod, ns, label_selector=f"{GROUP_LABEL}={name}"
            )
            state.pods = listed.get("items") or []
        out: dict[int, dict[str, Any]] = {}
        for pod in state.pods:
            idx = completion_index(pod)
            if idx is not None:
                out[idx] = pod
        return out

    def read_new_log_lines(self, handle: GroupHandle) -> list[str]:
        """New lines of node 0's log (every node's with ``all_ranks_logs``), rank lines prefixed
        ``[node N rank R]`` by torchrun, the agent's own lines ``[node N agent]``."""
        from kubernetes.client.exceptions import ApiException

        state = self._state(handle)
        out: list[str] = []
        for node_rank, pod in sorted(self._pods_by_node(handle).items()):
            if node_rank != 0 and not self.all_ranks_logs:
                continue
            if not _container_started(pod):
                continue
            pod_name = pod["metadata"]["name"]
            cursor = state.cursors.setdefault(pod_name, LogCursor())
            query = [("container", CONTAINER), ("timestamps", "true")]
            since = cursor.since_time()
            if since is not None:
                query.append(("sinceTime", since))
            try:
                resp = self._read_log(pod_name, handle.location, query)
            except ApiException as exc:
                if _api_status(exc) in (400, 404):  # not started yet, or already gone
                    continue
                raise
            for line in cursor.feed(resp.data.decode("utf-8", "replace")):
                out.append(line if line.startswith("[node ") else f"[node {node_rank} agent] {line}")
        return out

    def _read_log(self, pod: str, ns: str, query: list[tuple[str, str]]) -> Any:
        """GET the pod's log through the hook's API client. The generated
        ``read_namespaced_pod_log`` lacks the API's ``sinceTime`` parameter (only the clock-skew
        prone ``sinceSeconds``), so the same request is made with the full query."""
        return self._hook().api_client.call_api(
            "/api/v1/namespaces/{namespace}/pods/{name}/log",
            "GET",
            path_params={"namespace": ns, "name": pod},
            query_params=query,
            header_params={"Accept": "*/*"},
            auth_settings=["BearerToken"],
            _return_http_data_only=True,
            _preload_content=False,
            _request_timeout=self.request_timeout,
        )

    def _log_tail(self, handle: GroupHandle, node_rank: int, pod: Mapping[str, Any] | None) -> str:
        from kubernetes.client.exceptions import ApiException

        state = self._state(handle)
        if node_rank in state.tails:
            return state.tails[node_rank]
        text = ""
        if pod is not None:
            try:
                resp = self._hook().core_v1_client.read_namespaced_pod_log(
                    pod["metadata"]["name"],
                    handle.location,
                    container=CONTAINER,
                    tail_lines=LOG_TAIL_LINES,
                    _preload_content=False,
                    _request_timeout=self.request_timeout,
                )
                text = resp.data.decode("utf-8", "replace")
            except ApiException as exc:
                log.debug("No log for node %d of %s: %s", node_rank, handle.group_id, _api_message(exc))
            if not text:
                # terminationMessagePolicy FallbackToLogsOnError: the tail lives in the status.
                text = _termination_message(pod)
        state.tails[node_rank] = text
        return text

    # -- failure ----------------------------------------------------------------------------
    def preemption(self, status: GroupStatus) -> str | None:
        """Why the group was disrupted (preempted, evicted) rather than failed, or None.

        A disrupted group should be relaunched within the same try (see ``docs/kubernetes.md``).
        """
        return preemption_reason(status)

    def explain(self, handle: GroupHandle, status: GroupStatus) -> FailureReport:
        """The failing pod's platform reason and log tail, torchrun's own report when present."""
        name, ns = self._names(handle)
        pods = self._pods_by_node(handle)
        logs = {n: self._log_tail(handle, n, pods.get(n)) for n in nodes_to_read(status)}
        return explain_failure(handle.group_id, status, namespace=ns, job_name=name, pods=pods, logs=logs)

    # -- teardown ---------------------------------------------------------------------------
    def teardown(self, handle: GroupHandle) -> None:
        """Delete the Job with Foreground propagation (its pods, then the Job; the Service is
        owned by the Job) and the Service by name in case a launch stopped half-way.

        Idempotent: what is already gone is fine. The failing nodes' log tails are kept first,
        for :meth:`explain` after the pods are gone.
        """
        from kubernetes.client.exceptions import ApiException

        name, ns = self._names(handle)
        self._keep_failure_logs(handle)
        hook = self._hook()
        try:
            hook.batch_v1_client.delete_namespaced_job(
                name, ns, propagation_policy="Foreground", _request_timeout=self.request_timeout
            )
            log.info("Deleted Job %s/%s (propagation Foreground)", ns, name)
        except ApiException as exc:
            if _api_status(exc) != 404:
                raise TeardownError(
                    f"could not delete Job {ns}/{name}: {_api_message(exc)}; its pods may still run. Delete it "
                    f"with `kubectl delete job -n {ns} {name} --cascade=foreground`"
                ) from exc
        try:
            hook.core_v1_client.delete_namespaced_service(name, ns, _request_timeout=self.request_timeout)
        except ApiException as exc:
            if _api_status(exc) != 404:
                log.warning("Could not delete Service %s/%s: %s", ns, name, _api_message(exc))

    def _keep_failure_logs(self, handle: GroupHandle) -> None:
        """Read the failed pods' log tails while they still exist (a fresh backend instance, as
        in a deferred task's re-entry, lists the pods first)."""
        from kubernetes.client.exceptions import ApiException

        try:
            pods = self._pods_by_node(handle)
            failed = [pod_observation(n, pod) for n, pod in pods.items()]
            failed = [o for o in failed if o.phase is NodePhase.FAILED and o.stopped_by is None]
            failed.sort(key=lambda o: (o.finished_at if o.finished_at is not None else float("inf"), o.node_rank))
            for obs in failed[:MAX_TAILS]:
                self._log_tail(handle, obs.node_rank, pods[obs.node_rank])
        except ApiException as exc:  # best effort: never block a teardown on it
            log.debug("Could not keep the log tails of %s: %s", handle.group_id, _api_message(exc))


def _container_started(pod: Mapping[str, Any]) -> bool:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        state = cs.get("state") or {}
        if cs.get("name") == CONTAINER and ("running" in state or "terminated" in state):
            return True
    return False


def _container_running(pod: Mapping[str, Any]) -> bool:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == CONTAINER and "running" in (cs.get("state") or {}):
            return True
    return False


def _termination_message(pod: Mapping[str, Any]) -> str:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        if cs.get("name") == CONTAINER and term.get("message"):
            return str(term["message"])
    return ""
