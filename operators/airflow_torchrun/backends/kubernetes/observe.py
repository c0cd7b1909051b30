"""One look at a Kubernetes group, as a flow shared by the sync and the async path.

After the first look, the flow watches the group's pods from the last list's ``resourceVersion``
and returns as soon as anything changes (or after ``watch_seconds``), rather than sleeping
between polls. Then it lists the pods, reads the Job and, only when they explain something, the
Job's events (pods not created) and Kueue's Workloads (Job suspended), and reduces all of it to
node observations (:mod:`~airflow_torchrun.backends.kubernetes.status`, pure).

API trouble is raised, never turned into a node state: the watch core decides what an error
means. A Job that is gone (or was replaced by another of the same name) is a group that is
gone: every node LOST.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_torchrun.backends.handles import KubernetesHandle
from airflow_torchrun.backends.kubernetes import api
from airflow_torchrun.backends.kubernetes.client import Flow
from airflow_torchrun.backends.kubernetes.render import CONTROLLER_UID_LABEL, GROUP_LABEL
from airflow_torchrun.backends.kubernetes.status import (
    completion_index,
    needs_events,
    needs_kill_events,
    needs_workloads,
    node_observations,
)
from airflow_torchrun.status import NodeObservation, NodePhase

if TYPE_CHECKING:
    from airflow_torchrun.backends.kubernetes.logs import LogCursor

log = logging.getLogger(__name__)


@dataclass
class JobMemory:
    """What one backend instance remembers about a group between calls (never required: a fresh
    instance, in another process, rebuilds it from the API)."""

    resource_version: str | None = None
    pods: list[dict[str, Any]] = field(default_factory=list)
    nodes: list[NodeObservation] = field(default_factory=list)
    cursors: dict[str, LogCursor] = field(default_factory=dict)
    # node rank -> log tail, kept before teardown deletes the pods
    tails: dict[int, str] = field(default_factory=dict)

    def should_wait(self) -> bool:
        """Watch only once there is a list to watch from and the group is not finished."""
        if self.resource_version is None or not self.nodes:
            return False
        if any(n.phase in (NodePhase.FAILED, NodePhase.LOST) for n in self.nodes):
            return False
        return not all(n.phase is NodePhase.SUCCEEDED for n in self.nodes)


def selector(handle: KubernetesHandle) -> str:
    """The Job's pods: by the controller-uid label the Job controller sets (its value is the
    Job's uid), not by labels of ours that any pod could carry; by name for a handle without uid."""
    if handle.job_uid:
        return f"{CONTROLLER_UID_LABEL}={handle.job_uid}"
    return f"{GROUP_LABEL}={handle.job_name}"


def owned_pods(handle: KubernetesHandle, pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pods whose controller is the handle's Job (a label can be copied, an owner is checked)."""
    if not handle.job_uid:
        return pods
    return [
        pod
        for pod in pods
        if any(
            ref.get("uid") == handle.job_uid and ref.get("controller")
            for ref in (pod.get("metadata") or {}).get("ownerReferences") or []
        )
    ]


def observe_flow(
    handle: KubernetesHandle, state: JobMemory, *, watch_seconds: float, watch: bool = True
) -> Flow[list[NodeObservation]]:
    """Every node's state; waits up to ``watch_seconds`` for a change first (unless not ``watch``)."""
    ns, name = handle.namespace, handle.job_name
    if watch and state.should_wait():
        yield api.watch_pods(ns, selector(handle), state.resource_version, max(1, math.ceil(watch_seconds)))
    # The pods before the Job: the Job controller gives its verdict (FailureTarget) before it
    # deletes the rest of a failed group, so a deletion seen in the list is also in the Job read
    # after it. Read the other way round, a verdict falling between the two reads made the Job
    # controller's deletion look like someone else's (a disruption: a relaunch after an OOM).
    listed: dict[str, Any] = yield api.list_pods(ns, selector(handle))
    pods = owned_pods(handle, api.items(listed))
    job: dict[str, Any] | None = yield api.read_job(ns, name)
    if job is not None and handle.job_uid and (job.get("metadata") or {}).get("uid") != handle.job_uid:
        log.warning("Job %s/%s is not the one launched (uid %s): the group is gone", ns, name, handle.job_uid)
        job = None
    events: list[dict[str, Any]] = []
    workloads: list[dict[str, Any]] = []
    if needs_events(handle.num_nodes, job, pods):
        events = api.items((yield api.list_job_events(ns, name)))
    if job is not None and needs_workloads(job):
        # None when Kueue is absent or not readable: less precise pending reasons, nothing else.
        workloads = api.items((yield api.list_workloads(ns, job["metadata"].get("uid"))))
    killed: list[dict[str, Any]] = []
    victim = needs_kill_events(job, pods)
    if victim is not None:
        killed = api.items((yield api.list_pod_events(ns, victim, reason="Killing")))
    nodes = node_observations(handle.num_nodes, job, pods, events=events, workloads=workloads, killed=killed)
    state.resource_version = (listed.get("metadata") or {}).get("resourceVersion")
    state.pods = pods
    if [(n.phase, n.reason) for n in nodes] != [(n.phase, n.reason) for n in state.nodes]:
        log.debug("Group %s: %s", handle.group_id, "; ".join(f"{n.node_rank}={n.phase.value}" for n in nodes))
    state.nodes = nodes
    return nodes


def pods_flow(handle: KubernetesHandle, state: JobMemory) -> Flow[dict[int, dict[str, Any]]]:
    """The group's pods by node rank: the last look's, else listed now."""
    if not state.pods:
        state.pods = owned_pods(handle, api.items((yield api.list_pods(handle.namespace, selector(handle)))))
    return pods_by_node(state.pods)


def pods_by_node(pods: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for pod in pods:
        idx = completion_index(pod)
        if idx is not None:
            out[idx] = pod
    return out


def container_state(pod: Mapping[str, Any], container: str) -> Mapping[str, Any]:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == container:
            return cs.get("state") or {}
    return {}
