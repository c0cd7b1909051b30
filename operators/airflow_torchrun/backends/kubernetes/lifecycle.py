"""Launching, finding and tearing down a Kubernetes group, as flows shared by the sync and async path.

Launch creates the Job, then the Service and the NetworkPolicy owned by it (each selecting the
Job's pods by its uid; no NetworkPolicy where the runtime says ``network_policy: false``). When
the API refuses any (a 4xx: the objects are invalid, not allowed, the namespace is missing)
the launch fails for good; when it does not answer (5xx, timeouts) the launch fails retryably.
Either way whatever of this group may have been created is deleted first (by uid, never another's
object of the same name): there is no half-started group.

A Job of the very same name that is already there (409) is ours from an earlier attempt of this
same launch (the name derives from deployment, dag, task, run, map index, try and relaunch): one
that failed half-way, or whose create timed out after the server had made it. It is deleted (by
its uid) and created anew, never attached to: this launch owns exactly the group it was asked for (its environment,
resume point included, may differ from the earlier attempt's). Attaching to a live group of an
earlier *try* is :func:`find_flow`'s job, before any launch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from airflow_torchrun.backends.handles import KubernetesHandle
from airflow_torchrun.backends.kubernetes import api
from airflow_torchrun.backends.kubernetes.api import ClusterApiError
from airflow_torchrun.backends.kubernetes.client import Connection, Flow
from airflow_torchrun.backends.kubernetes.explain import MAX_TAILS
from airflow_torchrun.backends.kubernetes.logs import tail_flow
from airflow_torchrun.backends.kubernetes.observe import JobMemory, pods_flow
from airflow_torchrun.backends.kubernetes.render import (
    ANN_DEPLOYMENT,
    ANN_GROUP_ID,
    ANN_MASTER_ADDR,
    ANN_MASTER_PORT,
    ANN_QUEUE,
    ANN_RELAUNCH,
    ANN_RUNTIME,
    ANN_STARTUP_TIMEOUT,
    ANN_TEARDOWN_GRACE,
    ANN_TRY_NUMBER,
    ANN_WORLD_SIZE,
    GROUP_LABEL,
    INSTANCE_LABEL,
    RenderedGroup,
    policy_for_job,
    service_for_job,
)
from airflow_torchrun.backends.kubernetes.status import parse_time, pod_observation
from airflow_torchrun.errors import GroupLaunchError, TorchrunError
from airflow_torchrun.spec import GroupSpec
from airflow_torchrun.status import NodePhase
from airflow_torchrun.wiring import DEFAULT_MASTER_PORT

log = logging.getLogger(__name__)

# After a Foreground delete the old Job lingers until its pods are gone (their grace period).
RECREATE_WAIT_EXTRA_SECONDS = 60.0
DELETION_POLL_SECONDS = 1.0


class TeardownError(TorchrunError):
    """The group's Job could not be deleted; pods may still be running."""


def _kubectl_delete(ns: str, name: str) -> str:
    return f"`kubectl delete job -n {ns} {name} --cascade=foreground`"


# -- launch -----------------------------------------------------------------------------------
def launch_flow(rendered: RenderedGroup) -> Flow[dict[str, Any]]:
    """Create the Job, then its Service; the created Job. Raises ``GroupLaunchError``."""
    ns = rendered.namespace
    try:
        try:
            created: dict[str, Any] = yield api.create_job(ns, rendered.job)
        except ClusterApiError as exc:
            if exc.status != 409:
                raise
            created = yield from _replace_earlier_attempt(rendered, exc)
    except ClusterApiError as exc:
        # No answer or a 5xx: the server may have made the Job all the same. A 4xx made nothing.
        cleaned = (yield from _delete_quietly(rendered, None)) if exc.status is None or exc.transient else True
        raise launch_error(exc, rendered, "Job", cleaned) from exc
    uid = created["metadata"]["uid"]
    owned = [(SERVICE, rendered.service, service_for_job(rendered.service, created))]
    if rendered.network_policy is not None:
        owned.append((NETWORK_POLICY, rendered.network_policy, policy_for_job(rendered.network_policy, created)))
    for kind, ours, obj in owned:
        try:
            try:
                yield kind.create(ns, obj)
            except ClusterApiError as exc:
                if exc.status != 409:
                    raise
                yield from _replace_owned(rendered, kind, ours, obj, exc)
        except ClusterApiError as exc:
            cleaned = yield from _delete_quietly(rendered, uid)
            raise launch_error(exc, rendered, kind.kind, cleaned) from exc
        except GroupLaunchError:
            yield from _delete_quietly(rendered, uid)
            raise
    return created


@dataclass(frozen=True)
class _OwnedKind:
    """An object the group's Job owns (created after it, garbage-collected with it)."""

    kind: str
    kubectl: str  # its resource name for kubectl
    create: Callable[[str, Mapping[str, Any]], api.Request]
    read: Callable[[str, str], api.Request]
    delete: Callable[[str, str, str], api.Request]


SERVICE = _OwnedKind("Service", "service", api.create_service, api.read_service, api.delete_service)
NETWORK_POLICY = _OwnedKind(
    "NetworkPolicy", "networkpolicy", api.create_network_policy, api.read_network_policy, api.delete_network_policy
)


def _replace_earlier_attempt(rendered: RenderedGroup, conflict: ClusterApiError) -> Flow[dict[str, Any]]:
    ns, name = rendered.namespace, rendered.name
    existing: dict[str, Any] | None = yield api.read_job(ns, name)
    if existing is not None and not _same_group(existing, rendered.job):
        raise GroupLaunchError(
            f"a Job {ns}/{name} exists that airflow-torchrun did not create for this group (another Airflow "
            "deployment's? see [torchrun] deployment); nothing was changed. Delete it "
            f"({_kubectl_delete(ns, name)}) if it is a leftover, or use another namespace",
            transient=False,
        ) from conflict
    if existing is not None and not existing["metadata"].get("deletionTimestamp"):
        log.warning("Job %s/%s is left from an earlier attempt of this launch: deleting it to start afresh", ns, name)
        yield api.delete_job(ns, name, existing["metadata"].get("uid"))
    pod_spec = ((existing or {}).get("spec") or {}).get("template", {}).get("spec", {})
    wait = float(pod_spec.get("terminationGracePeriodSeconds", 30)) + RECREATE_WAIT_EXTRA_SECONDS
    deadline = time.monotonic() + wait
    while existing is not None:
        if time.monotonic() > deadline:
            raise GroupLaunchError(
                f"Job {ns}/{name} from an earlier launch is still being deleted after {wait:g}s (pods stuck "
                f"terminating?); check `kubectl get pods -n {ns} -l {GROUP_LABEL}={name}`",
                transient=True,
            ) from conflict
        yield api.Sleep(DELETION_POLL_SECONDS)
        existing = yield api.read_job(ns, name)
    created: dict[str, Any] = yield api.create_job(ns, rendered.job)
    return created


def _replace_owned(
    rendered: RenderedGroup, kind: _OwnedKind, ours: Mapping[str, Any], obj: dict[str, Any], conflict: ClusterApiError
) -> Flow[None]:
    """An object of the group's name is there: one left from an earlier Job of this very group
    (garbage collection lags) is replaced; anyone else's is left alone and the launch fails."""
    ns, name = rendered.namespace, rendered.name
    existing: dict[str, Any] | None = yield kind.read(ns, name)
    if existing is not None:
        if not _same_instance(existing, ours):
            raise GroupLaunchError(
                f"a {kind.kind} {ns}/{name} exists that airflow-torchrun did not create for this group; nothing "
                f"was changed. Delete it (`kubectl delete {kind.kubectl} -n {ns} {name}`) if it is a leftover, or "
                "use another namespace",
                transient=False,
            ) from conflict
        yield kind.delete(ns, name, existing["metadata"]["uid"])
    yield kind.create(ns, obj)


def _identity_key(obj: Mapping[str, Any]) -> tuple[object, object]:
    meta = obj.get("metadata") or {}
    return (meta.get("labels") or {}).get(INSTANCE_LABEL), (meta.get("labels") or {}).get(GROUP_LABEL)


def _same_instance(existing: Mapping[str, Any], ours: Mapping[str, Any]) -> bool:
    return _identity_key(existing) == _identity_key(ours)


def _same_group(existing: Mapping[str, Any], job: Mapping[str, Any]) -> bool:
    def key(obj: Mapping[str, Any]) -> tuple[object, object]:
        meta = obj.get("metadata") or {}
        return (meta.get("labels") or {}).get(INSTANCE_LABEL), (meta.get("annotations") or {}).get(ANN_GROUP_ID)

    return key(existing) == key(job)


def _delete_quietly(rendered: RenderedGroup, uid: str | None) -> Flow[bool]:
    """Delete the Job a failed launch may have left (its Service is owned by it); whether that is
    known to be done. Without ``uid`` (the create got no answer) the Job of the group's name is
    read first and deleted only when it is this group's, by its uid."""
    ns, name = rendered.namespace, rendered.name
    try:
        if uid is None:
            existing: dict[str, Any] | None = yield api.read_job(ns, name)
            if existing is None or not _same_group(existing, rendered.job):
                return True  # nothing was made, or what is there is not ours to delete
            uid = existing["metadata"].get("uid")
        yield api.delete_job(ns, name, uid)
    except ClusterApiError as exc:
        log.warning("Could not delete the half-launched group %s/%s: %s", ns, name, exc)
        return False
    return True


def launch_error(exc: ClusterApiError, rendered: RenderedGroup, kind: str, cleaned: bool) -> GroupLaunchError:
    """What happened, why it likely happened and what to change; transient as the API error is."""
    ns, name = rendered.namespace, rendered.name
    runtime = rendered.job["metadata"]["annotations"].get(ANN_RUNTIME)
    said = f"{exc.status} {exc.reason}: {exc.api_message}".strip() if exc.status is not None else exc.api_message
    what = f"could not create {kind} {ns}/{name}"
    if exc.status in (400, 422):
        hint = (
            f"the API server refused the object as invalid. Fix the runtime {runtime!r} (its labels, annotations, "
            "pod_overrides, resources) or the task's spec; `airflow-torchrun render ... | kubectl apply "
            "--dry-run=server -f -` shows the same answer without starting anything"
        )
    elif exc.status in (401, 403):
        hint = (
            "the connection's identity may not do this: give it the Role in docs/kubernetes.md in namespace "
            f"{ns} (or pick another namespace, or fix the connection's credentials)"
        )
    elif exc.status == 404:
        hint = f"namespace {ns} (or the batch/v1 API) does not exist: create it, or set the task's namespace"
    elif exc.transient:
        hint = "the API server did not answer properly; a later try may succeed"
    else:
        hint = "the API server refused the request"
    left = (
        "nothing of the group was left behind"
        if cleaned
        else f"the group may be left behind: {_kubectl_delete(ns, name)}"
    )
    return GroupLaunchError(f"{what} ({said}): {hint}; {left}", transient=exc.transient)


# -- handles and finding ----------------------------------------------------------------------
def handle_from_job(
    job: Mapping[str, Any], connection: Connection, *, all_ranks_logs: bool, spec: GroupSpec | None = None
) -> KubernetesHandle:
    """The handle of a created or found Job, from its own metadata (the render's annotations)."""
    meta = job.get("metadata") or {}
    ann = meta.get("annotations") or {}

    def number(key: str, fallback: float) -> float:
        try:
            return float(ann[key])
        except (KeyError, TypeError, ValueError):
            return fallback

    completions = int((job.get("spec") or {}).get("completions") or (spec.num_nodes if spec else 1))
    return KubernetesHandle(
        group_id=ann.get(ANN_GROUP_ID) or meta["name"],
        num_nodes=completions,
        world_size=int(number(ANN_WORLD_SIZE, spec.world_size if spec else 0)),
        launched_at=parse_time(meta.get("creationTimestamp")) or time.time(),
        startup_timeout=number(ANN_STARTUP_TIMEOUT, spec.startup_timeout if spec else 600.0),
        teardown_grace=number(ANN_TEARDOWN_GRACE, spec.teardown_grace if spec else 10.0),
        relaunch=int(number(ANN_RELAUNCH, 0)),
        namespace=meta["namespace"],
        job_name=meta["name"],
        job_uid=meta.get("uid"),
        master_addr=ann.get(ANN_MASTER_ADDR),
        master_port=int(number(ANN_MASTER_PORT, DEFAULT_MASTER_PORT)),
        runtime=ann.get(ANN_RUNTIME),
        queue=ann.get(ANN_QUEUE),
        kubernetes_conn_id=connection.conn_id,
        config_file=connection.config_file,
        cluster_context=connection.cluster_context,
        in_cluster=connection.in_cluster,
        all_ranks_logs=all_ranks_logs,
        deployment=ann.get(ANN_DEPLOYMENT),
    )


def read_job_flow(ns: str, name: str) -> Flow[dict[str, Any] | None]:
    """The Job of that name, or None when there is none."""
    job: dict[str, Any] | None = yield api.read_job(ns, name)
    return job


def find_flow(ns: str, instance: str) -> Flow[dict[str, Any] | None]:
    """The newest Job this task instance (any try) left that is neither being deleted nor failed.

    A completed Job counts (its success is the task's). A failed one does not: attaching to it
    would only repeat its failure, so the task starts a fresh group.
    """
    live = []
    for job in api.items((yield api.list_jobs(ns, f"{INSTANCE_LABEL}={instance}"))):
        meta = job.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        if any(
            c.get("type") == "Failed" and c.get("status") == "True"
            for c in (job.get("status") or {}).get("conditions") or []
        ):
            log.warning(
                "Not reattaching to failed Job %s/%s of an earlier try; delete it with %s",
                ns,
                meta.get("name"),
                _kubectl_delete(ns, str(meta.get("name"))),
            )
            continue
        live.append(job)
    return max(live, key=_newest) if live else None


def _newest(job: Mapping[str, Any]) -> tuple[int, int, float]:
    meta = job.get("metadata") or {}
    ann = meta.get("annotations") or {}

    def whole(key: str) -> int:
        try:
            return int(ann[key])
        except (KeyError, TypeError, ValueError):
            return 0

    return whole(ANN_TRY_NUMBER), whole(ANN_RELAUNCH), parse_time(meta.get("creationTimestamp")) or 0.0


# -- teardown ---------------------------------------------------------------------------------
def teardown_flow(handle: KubernetesHandle, state: JobMemory) -> Flow[None]:
    """Delete the Job with Foreground propagation (its pods, then the Job; the Service is owned by
    the Job and goes with it). Only the Job launched (a uid precondition): another of the same
    name is never touched. What is gone is fine.

    The failed nodes' log tails are kept first, for ``explain`` after the pods are gone.
    """
    ns, name = handle.namespace, handle.job_name
    try:
        pods = yield from pods_flow(handle, state)
        failed = [pod_observation(n, pod) for n, pod in pods.items()]
        failed = [o for o in failed if o.phase is NodePhase.FAILED and o.stopped_by is None]
        failed.sort(key=lambda o: (o.finished_at if o.finished_at is not None else float("inf"), o.node_rank))
        for obs in failed[:MAX_TAILS]:
            yield from tail_flow(handle, state, obs.node_rank, pods[obs.node_rank])
    except ClusterApiError as exc:  # best effort: never block a teardown on it
        log.debug("Could not keep the log tails of %s: %s", handle.group_id, exc)
    try:
        yield api.delete_job(ns, name, handle.job_uid)
    except ClusterApiError as exc:
        raise TeardownError(
            f"could not delete Job {ns}/{name} ({exc}); its pods may still run. Delete it with "
            f"{_kubectl_delete(ns, name)}",
            transient=exc.transient,
        ) from exc
    log.info("Deleted Job %s/%s (propagation Foreground)", ns, name)
