"""Pure translation of real Kubernetes objects into one :class:`NodeObservation` per node.

Inputs are the API's own JSON shapes (what ``kubectl get -o json`` prints): the Job, its pods,
the Job's events (only read while pods are missing: quota errors live there) and Kueue Workloads
(only read while the Job is suspended). The sync and the async backend both call
:func:`node_observations`; :func:`airflow_torchrun.status.group_status` then decides the group's
state. No I/O here.

Reasons are the platform's words, prefixed so that code can tell them apart:

* ``Preempted (...)`` / ``Evicted (...)``: the rank was disrupted by the platform (DisruptionTarget
  condition, kubelet eviction, Kueue eviction). :func:`disruption` finds them; the operator
  relaunches such a group within the same try.
* ``OOMKilled``, ``ResourceLimitExceeded: ...``, ``DeadlineExceeded: ...``: real failures, retryable.
* ``ErrImagePull: ...`` (a missing image or denied access), ``InvalidImageName``,
  ``CreateContainerConfigError``, ``StartError``: a retry cannot fix them (``retryable=False``).
* pending: ``Unschedulable: <scheduler message>``, ``FailedCreate: <quota message>``,
  ``waiting for Kueue admission ...``, ``ImagePullBackOff: ...`` (transient), ``ContainerCreating``.
"""

from __future__ import annotations

import re
import signal as _signal
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from airflow_torchrun.backends.kubernetes.render import (
    COMPLETION_INDEX_ANNOTATION,
    COMPLETION_INDEX_LABEL,
    CONTAINER,
    INIT_CONTAINER,
)
from airflow_torchrun.status import GroupStatus, NodeObservation, NodePhase, Outcome

Obj = Mapping[str, Any]

DISRUPTION_PREFIXES = ("Preempted", "Evicted")
# Waiting reasons no retry can fix: the pod spec itself is wrong.
_PERMANENT_WAITING = frozenset({"InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError"})
_IMAGE_PULL = frozenset({"ErrImagePull", "ImagePullBackOff"})
# What registries answer for an image that does not exist or may not be pulled; a timeout or
# rate limit ("toomanyrequests") stays pending and may recover.
_PERMANENT_PULL = re.compile(
    r"not found|manifest unknown|name unknown|unauthorized|authentication required|denied|"
    r"forbidden|repository does not exist|invalid reference format",
    re.IGNORECASE,
)
# Terminated reasons of a container that never ran its command (bad command or image).
_PERMANENT_TERMINATED = frozenset({"StartError", "ContainerCannotRun"})
# A kubelet eviction for the pod's own usage (ephemeral storage over its limit) is a failure.
_OVER_LIMIT = re.compile(r"exceed\w*\b.*\blimit", re.IGNORECASE)
_PREEMPTION_REASONS = frozenset({"PreemptionByScheduler", "PreemptionByKubeScheduler"})
# The Job controller's podFailurePolicy verdict names the pod that decided it ("Container trainer for
# pod <ns>/<name> failed with exit code 1 matching FailJob rule at index 1"); the name is the Job
# controller's (<job>-<index>-<suffix>), nothing a rank can write.
_VERDICT_POD = re.compile(r"\bfor pod [^/\s]+/([a-z0-9][-a-z0-9.]*) failed\b")


def parse_time(value: object) -> float | None:
    """RFC 3339 (``2026-11-30T10:00:00Z``, fractions allowed) -> epoch seconds."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _signal_of(exit_code: int | None) -> str | None:
    if exit_code is None or exit_code <= 128:
        return None
    try:
        return _signal.Signals(exit_code - 128).name
    except ValueError:
        return None


def completion_index(pod: Obj) -> int | None:
    meta = pod.get("metadata") or {}
    raw = (meta.get("annotations") or {}).get(COMPLETION_INDEX_ANNOTATION)
    if raw is None:
        raw = (meta.get("labels") or {}).get(COMPLETION_INDEX_LABEL)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def parse_indexes(text: str | None) -> set[int]:
    """A Job's ``completedIndexes`` / ``failedIndexes``: ``"0,2-4"`` -> {0, 2, 3, 4}."""
    out: set[int] = set()
    for raw in (text or "").split(","):
        part = raw.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _conditions(obj: Obj) -> dict[str, Obj]:
    return {c.get("type", ""): c for c in (obj.get("status") or {}).get("conditions") or []}


def _true(cond: Obj | None) -> bool:
    return cond is not None and cond.get("status") == "True"


def _pick(pods: Sequence[Obj]) -> Obj:
    """Several pods for one index (a replacement, a terminating one): a failure matters most,
    then the newest."""
    return max(
        pods,
        key=lambda p: (
            (p.get("status") or {}).get("phase") == "Failed",
            parse_time((p.get("metadata") or {}).get("creationTimestamp")) or 0.0,
        ),
    )


def _with_message(reason: str, message: str | None) -> str:
    message = " ".join((message or "").split())
    return f"{reason}: {message}" if message else reason


def _container_statuses(status: Obj) -> list[tuple[str, Obj]]:
    out = [("init", cs) for cs in status.get("initContainerStatuses") or []]
    out += [("main", cs) for cs in status.get("containerStatuses") or []]
    return out


def pod_observation(node_rank: int, pod: Obj, *, job_failing_since: float | None = None) -> NodeObservation:
    """One pod -> what its node is doing, with the platform's reason.

    ``job_failing_since``: when the Job controller decided the Job fails (its FailureTarget or
    Failed condition), ``inf`` while it has not; None when unknown (the Job was not read).
    """
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    phase = status.get("phase") or "Pending"
    conditions = _conditions(pod)
    started_at = parse_time(status.get("startTime"))
    statuses = _container_statuses(status)

    for _kind, cs in statuses:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        message = waiting.get("message")
        if reason in _PERMANENT_WAITING or (reason in _IMAGE_PULL and _PERMANENT_PULL.search(message or "")):
            return NodeObservation(
                node_rank=node_rank,
                phase=NodePhase.FAILED,
                started_at=started_at,
                reason=_with_message(f"{reason} (container {cs.get('name')})", message),
                retryable=False,
            )

    if phase == "Succeeded":
        term = _terminated(statuses, CONTAINER) or {}
        return NodeObservation(
            node_rank=node_rank,
            phase=NodePhase.SUCCEEDED,
            exit_code=0,
            started_at=started_at,
            finished_at=parse_time(term.get("finishedAt")),
        )

    if phase == "Failed":
        return _failed(
            node_rank,
            meta=meta,
            status=status,
            conditions=conditions,
            statuses=statuses,
            started_at=started_at,
            job_failing_since=job_failing_since,
        )

    if phase == "Running":
        return NodeObservation(node_rank=node_rank, phase=NodePhase.RUNNING, started_at=started_at)

    if phase == "Unknown":
        # The node stopped reporting; Kubernetes marks the pod failed (DisruptionTarget) once
        # the node is declared lost, so keep waiting with the reason shown.
        return NodeObservation(
            node_rank=node_rank,
            phase=NodePhase.RUNNING,
            started_at=started_at,
            reason=_with_message("Unknown", status.get("message") or "the pod's node stopped reporting"),
        )

    return NodeObservation(node_rank=node_rank, phase=NodePhase.PENDING, reason=_pending_reason(conditions, statuses))


def _deletion_requested(meta: Obj) -> float | None:
    """When the pod's deletion was asked for: its deletionTimestamp is that moment plus the grace
    period (the deadline for SIGKILL)."""
    deadline = parse_time(meta.get("deletionTimestamp"))
    if deadline is None:
        return None
    grace = meta.get("deletionGracePeriodSeconds")
    return deadline - float(grace) if isinstance(grace, int | float) and not isinstance(grace, bool) else deadline


def _job_failing_since(job: Obj) -> float:
    """When the Job controller decided the Job fails; ``inf`` while it has not."""
    conditions = _conditions(job)
    times = [
        parse_time(c.get("lastTransitionTime")) or 0.0
        for c in (conditions.get("FailureTarget"), conditions.get("Failed"))
        if c is not None and _true(c)
    ]
    return min(times) if times else float("inf")


def _terminated(statuses: Iterable[tuple[str, Obj]], name: str | None = None) -> Obj | None:
    for _kind, cs in statuses:
        if name is not None and cs.get("name") != name:
            continue
        term = (cs.get("state") or {}).get("terminated")
        if term:
            return term
    return None


def _pending_reason(conditions: Mapping[str, Obj], statuses: Sequence[tuple[str, Obj]]) -> str:
    scheduled = conditions.get("PodScheduled")
    if scheduled is not None and scheduled.get("status") == "False":
        return _with_message(scheduled.get("reason") or "Unschedulable", scheduled.get("message"))
    for kind, cs in statuses:
        state = cs.get("state") or {}
        if kind == "init" and cs.get("name") == INIT_CONTAINER and "running" in state:
            return "waiting for node 0's DNS name to resolve"
        waiting = state.get("waiting")
        if waiting and waiting.get("reason") not in (None, "PodInitializing"):
            return _with_message(waiting["reason"], waiting.get("message"))
    return "starting"


def _failed(
    node_rank: int,
    *,
    meta: Obj,
    status: Obj,
    conditions: Mapping[str, Obj],
    statuses: Sequence[tuple[str, Obj]],
    started_at: float | None,
    job_failing_since: float | None = None,
) -> NodeObservation:
    # The container that failed: the trainer, else the init container (DNS wait timed out).
    term = _terminated(statuses, CONTAINER)
    failed_init = None
    if term is None or term.get("exitCode") in (None, 0):
        for kind, cs in statuses:
            t = (cs.get("state") or {}).get("terminated") or {}
            if kind == "init" and t.get("exitCode") not in (None, 0):
                term, failed_init = t, cs.get("name")
                break
    term = term or {}
    exit_code = term.get("exitCode")
    finished_at = parse_time(term.get("finishedAt"))
    retryable = True
    stopped_by = None

    disruption = conditions.get("DisruptionTarget")
    disrupted = disruption is not None and _true(disruption)
    pod_reason = status.get("reason")
    if disruption is not None and disrupted:
        cause = disruption.get("reason") or "DisruptionTarget"
        kind = "Preempted" if cause in _PREEMPTION_REASONS else "Evicted"
        reason: str | None = _with_message(f"{kind} ({cause})", disruption.get("message"))
        # The disruption started this node's end, and its peers' failures follow from it.
        began = parse_time(disruption.get("lastTransitionTime"))
        if began is not None:
            finished_at = min(began, finished_at) if finished_at is not None else began
    elif pod_reason == "Evicted":
        message = status.get("message") or ""
        if _OVER_LIMIT.search(message):
            reason = _with_message("ResourceLimitExceeded", message)  # its own usage, not a preemption
        else:
            reason = _with_message("Evicted (kubelet)", message)
    elif term.get("reason") == "OOMKilled":
        reason = "OOMKilled"
    elif term.get("reason") in _PERMANENT_TERMINATED:
        reason = _with_message(term["reason"], term.get("message"))
        retryable = False
    elif failed_init:
        reason = f"init container {failed_init} failed"
    elif pod_reason:
        reason = _with_message(pod_reason, status.get("message"))
    else:
        reason = None
    deleted_at = _deletion_requested(meta)
    if deleted_at is not None and not disrupted:
        if job_failing_since is not None and deleted_at < job_failing_since:
            # Deleted before the Job was failing: nobody of the group's own (the Job controller
            # deletes pods only after its verdict, a teardown only after ours) but someone who
            # took the pod away (kubectl delete, a controller): the real API server gives such a
            # pod no DisruptionTarget, so this is the only sign. A disruption, not a failure.
            reason = _with_message("Evicted (deleted)", "the pod was deleted while it ran")
            finished_at = min(deleted_at, finished_at) if finished_at is not None else deleted_at
        else:
            # Deleted while running: the Job controller stopping the rest of a failed group, or
            # a teardown; not the cause of the failure.
            stopped_by = "deleted"
    return NodeObservation(
        node_rank=node_rank,
        phase=NodePhase.FAILED,
        exit_code=exit_code,
        signal=_signal_of(exit_code),
        started_at=started_at,
        finished_at=finished_at,
        reason=reason,
        retryable=retryable,
        stopped_by=stopped_by,
    )


def _event_time(event: Obj, order: Sequence[str]) -> float | None:
    """An event's time: the first of its ``order`` fields that is set, else its creation."""
    for key in order:
        t = parse_time(event.get(key))
        if t is not None:
            return t
    return parse_time((event.get("metadata") or {}).get("creationTimestamp"))


_LAST_SEEN = ("lastTimestamp", "eventTime", "firstTimestamp")
_FIRST_SEEN = ("eventTime", "firstTimestamp", "lastTimestamp")


def _latest(items: Iterable[Obj]) -> Obj | None:
    items = list(items)
    return max(items, key=lambda e: _event_time(e, _LAST_SEEN) or 0.0) if items else None


def verdict_pod(job: Obj | None) -> str | None:
    """The pod whose failure decided the Job's podFailurePolicy verdict, if the Job has one."""
    conditions = _conditions(job or {})
    for cond in (conditions.get("FailureTarget"), conditions.get("Failed")):
        if cond is not None and _true(cond) and cond.get("reason") == "PodFailurePolicy":
            match = _VERDICT_POD.search(cond.get("message") or "")
            if match:
                return match.group(1)
    return None


def needs_kill_events(job: Obj | None, pods: Sequence[Obj]) -> str | None:
    """The pod that decided the Job's verdict when it is gone from the API: whether its kubelet
    stopped it (a deletion) is then only in that pod's events."""
    name = verdict_pod(job)
    if name is None or any((p.get("metadata") or {}).get("name") == name for p in pods):
        return None
    return name


def _taken_away(node_rank: int, job: Obj, killed: Sequence[Obj]) -> NodeObservation | None:
    """This node's pod decided the Job's verdict, is gone, and its kubelet had been told to stop it
    (a ``Killing`` event: the kubelet stops a container for a deletion, an eviction, a probe, never
    when it exits on its own). Seen on the real cluster: a pod deleted with ``kubectl delete pod``
    gets no DisruptionTarget, torchrun exits 1 on the SIGTERM, the verdict follows within a second
    and the Job controller removes the pod; a watch polling every few seconds (the trigger's) saw
    neither the pod nor its deletionTimestamp. A disruption, as when the pod is still there."""
    name = verdict_pod(job)
    prefix = f"{(job.get('metadata') or {}).get('name')}-{node_rank}-"
    if name is None or not name.startswith(prefix):
        return None
    stops = [e for e in killed if e.get("reason") == "Killing" and (e.get("involvedObject") or {}).get("name") == name]
    if not stops:
        return None
    return NodeObservation(
        node_rank=node_rank,
        phase=NodePhase.FAILED,
        finished_at=min((t for e in stops if (t := _event_time(e, _FIRST_SEEN)) is not None), default=None),
        reason=_with_message("Evicted (deleted)", f"pod {name} was stopped by its kubelet while it ran"),
    )


def _missing_pod(
    node_rank: int, job: Obj, events: Sequence[Obj], workloads: Sequence[Obj], killed: Sequence[Obj] = ()
) -> NodeObservation:
    """A node whose pod does not exist: not created yet, waiting for admission, or gone."""
    spec = job.get("spec") or {}
    status = job.get("status") or {}
    conditions = _conditions(job)
    if node_rank in parse_indexes(status.get("completedIndexes")):
        return NodeObservation(node_rank=node_rank, phase=NodePhase.SUCCEEDED, exit_code=0)
    # The Job controller (Kubernetes 1.31+) decides first (FailureTarget) and sets Failed only once
    # every pod has terminated; either means the Job is failing.
    failed = next((c for c in (conditions.get("Failed"), conditions.get("FailureTarget")) if c and _true(c)), None)
    if failed is not None:
        taken = _taken_away(node_rank, job, killed)
        if taken is not None:
            return taken
        return NodeObservation(
            node_rank=node_rank,
            phase=NodePhase.FAILED,
            finished_at=parse_time(failed.get("lastTransitionTime")),
            reason=_with_message(
                f"stopped: the Job failed ({failed.get('reason') or 'Failed'})", failed.get("message")
            ),
            stopped_by="kubernetes",
        )
    if spec.get("suspend"):
        queue = ((job.get("metadata") or {}).get("labels") or {}).get("kueue.x-k8s.io/queue-name")
        for wl in workloads:
            wl_conditions = _conditions(wl)
            evicted = wl_conditions.get("Evicted") or wl_conditions.get("Preempted")
            # Evicted is only ever set on a Workload that had been admitted: this group ran.
            if evicted is not None and _true(evicted):
                return NodeObservation(
                    node_rank=node_rank,
                    phase=NodePhase.FAILED,
                    finished_at=parse_time(evicted.get("lastTransitionTime")),
                    reason=_with_message(
                        f"Preempted (Kueue: {evicted.get('reason') or 'Evicted'})", evicted.get("message")
                    ),
                )
            reserved = wl_conditions.get("QuotaReserved")
            if reserved is not None and reserved.get("status") == "False" and reserved.get("message"):
                return NodeObservation(
                    node_rank=node_rank,
                    phase=NodePhase.PENDING,
                    reason=_with_message(f"waiting for Kueue admission in queue {queue}", reserved.get("message")),
                )
        where = f" in queue {queue}" if queue else ""
        return NodeObservation(
            node_rank=node_rank, phase=NodePhase.PENDING, reason=f"waiting for Kueue admission{where} (Job suspended)"
        )
    failed_create = _latest(e for e in events if e.get("reason") == "FailedCreate")
    if failed_create is not None:
        return NodeObservation(
            node_rank=node_rank,
            phase=NodePhase.PENDING,
            reason=_with_message("FailedCreate", failed_create.get("message")),
        )
    return NodeObservation(node_rank=node_rank, phase=NodePhase.PENDING, reason="pod not created yet")


def needs_events(num_nodes: int, job: Obj | None, pods: Sequence[Obj]) -> bool:
    """Events are worth a request only while some node has no pod and the Job runs unsuspended."""
    if job is None or (job.get("spec") or {}).get("suspend"):
        return False
    return len({completion_index(p) for p in pods}) < num_nodes


def needs_workloads(job: Obj | None) -> bool:
    return job is not None and bool((job.get("spec") or {}).get("suspend"))


def node_observations(
    num_nodes: int,
    job: Obj | None,
    pods: Sequence[Obj],
    *,
    events: Sequence[Obj] = (),
    workloads: Sequence[Obj] = (),
    killed: Sequence[Obj] = (),
) -> list[NodeObservation]:
    """What every node (completion index) of the group is doing. ``killed``: the ``Killing`` events
    of the pod :func:`needs_kill_events` names."""
    if job is None:
        return [
            NodeObservation(
                node_rank=n,
                phase=NodePhase.LOST,
                reason="its Job no longer exists (deleted outside this task, or by a TTL)",
            )
            for n in range(num_nodes)
        ]
    by_index: dict[int, list[Obj]] = {}
    for pod in pods:
        idx = completion_index(pod)
        if idx is not None and 0 <= idx < num_nodes:
            by_index.setdefault(idx, []).append(pod)
    failing_since = _job_failing_since(job)
    out = []
    for n in range(num_nodes):
        candidates = by_index.get(n)
        out.append(
            pod_observation(n, _pick(candidates), job_failing_since=failing_since)
            if candidates
            else _missing_pod(n, job, events, workloads, killed)
        )
    return out


def disruption(nodes: Sequence[NodeObservation]) -> NodeObservation | None:
    """The first node that was preempted or evicted by the platform, if any."""
    hits = [n for n in nodes if n.phase is NodePhase.FAILED and (n.reason or "").startswith(DISRUPTION_PREFIXES)]
    return min(hits, key=lambda n: (n.finished_at or float("inf"), n.node_rank)) if hits else None


def preemption_reason(status: GroupStatus) -> str | None:
    """When a failed group failed because the platform disrupted one of its ranks: why.

    Any disrupted rank counts, even when a peer's failure is seen first: the peers of a
    preempted rank fail because it vanished.
    """
    if status.state is not Outcome.FAILED:
        return None
    hit = disruption(status.nodes)
    return f"node {hit.node_rank}: {hit.reason}" if hit else None
