"""The pure translation of Kubernetes objects into node observations: a table of real-shaped cases."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_torchrun.backends.kubernetes.logs import LogCursor, split_stamp
from airflow_torchrun.backends.kubernetes.status import (
    disruption,
    needs_events,
    needs_kill_events,
    needs_workloads,
    node_observations,
    parse_indexes,
    parse_time,
    pod_observation,
    preemption_reason,
)
from airflow_torchrun.status import NodePhase, Outcome, group_status

T0 = "2026-11-30T10:00:00Z"
T1 = "2026-11-30T10:00:01Z"
T5 = "2026-11-30T10:00:05Z"
T9 = "2026-11-30T10:00:09Z"


def cstatus(name: str, state: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "image": "trainer:1", "imageID": "", "ready": False, "restartCount": 0, "state": state}


def pod(
    index: int,
    phase: str,
    *,
    conditions: list[dict[str, Any]] | None = None,
    init: dict[str, Any] | None = None,
    main: dict[str, Any] | None = None,
    reason: str | None = None,
    message: str | None = None,
    deleting: bool = False,
    created: str = T0,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": f"g-{index}-abcde",
        "creationTimestamp": created,
        "annotations": {"batch.kubernetes.io/job-completion-index": str(index)},
        "labels": {"batch.kubernetes.io/job-completion-index": str(index)},
    }
    if deleting:
        meta["deletionTimestamp"] = T9
    status: dict[str, Any] = {"phase": phase, "startTime": T0, "conditions": conditions or []}
    if init is not None:
        status["initContainerStatuses"] = [cstatus("wait-for-master", init)]
    if main is not None:
        status["containerStatuses"] = [cstatus("trainer", main)]
    if reason:
        status["reason"] = reason
    if message:
        status["message"] = message
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status}


def cond(
    type_: str, status: str, reason: str | None = None, message: str | None = None, at: str = T0
) -> dict[str, Any]:
    c = {"type": type_, "status": status, "lastTransitionTime": at}
    if reason:
        c["reason"] = reason
    if message:
        c["message"] = message
    return c


def terminated(code: int, reason: str, finished: str = T5, message: str | None = None) -> dict[str, Any]:
    t: dict[str, Any] = {"terminated": {"exitCode": code, "reason": reason, "finishedAt": finished}}
    if message:
        t["terminated"]["message"] = message
    return t


def job(
    *, suspend: bool = False, conditions: list[dict[str, Any]] | None = None, completed: str | None = None
) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": conditions or []}
    if completed:
        status["completedIndexes"] = completed
    labels = {"kueue.x-k8s.io/queue-name": "team-a"} if suspend else {}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "g", "uid": "u-1", "labels": labels},
        "spec": {"completions": 2, "suspend": suspend},
        "status": status,
    }


UNSCHEDULABLE = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."

POD_CASES = [
    pytest.param(
        pod(0, "Pending", conditions=[cond("PodScheduled", "False", "Unschedulable", UNSCHEDULABLE)]),
        (NodePhase.PENDING, f"Unschedulable: {UNSCHEDULABLE}", True, None),
        id="unschedulable",
    ),
    pytest.param(
        pod(0, "Pending", conditions=[cond("PodScheduled", "False", "SchedulingGated", "Scheduling is blocked")]),
        (NodePhase.PENDING, "SchedulingGated: Scheduling is blocked", True, None),
        id="scheduling-gated",
    ),
    pytest.param(
        pod(0, "Pending", init={"running": {"startedAt": T0}}, main={"waiting": {"reason": "PodInitializing"}}),
        (NodePhase.PENDING, "waiting for node 0's DNS name to resolve", True, None),
        id="waiting-for-dns",
    ),
    pytest.param(
        pod(0, "Pending", main={"waiting": {"reason": "ContainerCreating"}}),
        (NodePhase.PENDING, "ContainerCreating", True, None),
        id="container-creating",
    ),
    pytest.param(
        pod(1, "Pending", main={"waiting": {"reason": "ErrImagePull", "message": "manifest unknown: trainer:nope"}}),
        (NodePhase.FAILED, "ErrImagePull (container trainer): manifest unknown: trainer:nope", False, None),
        id="image-missing",
    ),
    pytest.param(
        pod(1, "Pending", main={"waiting": {"reason": "ImagePullBackOff", "message": "pull access denied"}}),
        (NodePhase.FAILED, "ImagePullBackOff (container trainer): pull access denied", False, None),
        id="image-denied",
    ),
    pytest.param(
        pod(1, "Pending", main={"waiting": {"reason": "ErrImagePull", "message": "i/o timeout"}}),
        (NodePhase.PENDING, "ErrImagePull: i/o timeout", True, None),
        id="image-pull-transient",
    ),
    pytest.param(
        pod(0, "Pending", main={"waiting": {"reason": "InvalidImageName", "message": 'couldn\'t parse "A:B:C"'}}),
        (NodePhase.FAILED, 'InvalidImageName (container trainer): couldn\'t parse "A:B:C"', False, None),
        id="invalid-image",
    ),
    pytest.param(
        pod(
            0, "Pending", main={"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "s3" not found'}}
        ),
        (NodePhase.FAILED, 'CreateContainerConfigError (container trainer): secret "s3" not found', False, None),
        id="missing-secret",
    ),
    pytest.param(
        pod(0, "Running", main={"running": {"startedAt": T1}}),
        (NodePhase.RUNNING, None, True, None),
        id="running",
    ),
    pytest.param(
        pod(0, "Succeeded", main=terminated(0, "Completed")),
        (NodePhase.SUCCEEDED, None, True, None),
        id="succeeded",
    ),
    pytest.param(
        pod(1, "Failed", main=terminated(137, "OOMKilled")),
        (NodePhase.FAILED, "OOMKilled", True, None),
        id="oom-killed",
    ),
    pytest.param(
        pod(1, "Failed", main=terminated(1, "OOMKilled")),
        (NodePhase.FAILED, "OOMKilled", True, None),
        id="oom-killed-worker-agent-exit-1",
    ),
    pytest.param(
        pod(1, "Failed", main=terminated(3, "Error")),
        (NodePhase.FAILED, None, True, None),
        id="error-exit",
    ),
    pytest.param(
        pod(
            0,
            "Failed",
            main=terminated(143, "Error"),
            conditions=[cond("DisruptionTarget", "True", "PreemptionByScheduler", "Preempted by ns/critical")],
        ),
        (NodePhase.FAILED, "Preempted (PreemptionByScheduler): Preempted by ns/critical", True, None),
        id="preempted",
    ),
    pytest.param(
        pod(
            0,
            "Failed",
            main=terminated(143, "Error"),
            conditions=[cond("DisruptionTarget", "True", "EvictionByEvictionAPI", "Eviction API: evicting")],
            deleting=True,
        ),
        (NodePhase.FAILED, "Evicted (EvictionByEvictionAPI): Eviction API: evicting", True, None),
        id="drained",
    ),
    pytest.param(
        pod(0, "Failed", reason="Evicted", message="The node was low on resource: memory."),
        (NodePhase.FAILED, "Evicted (kubelet): The node was low on resource: memory.", True, None),
        id="kubelet-eviction",
    ),
    pytest.param(
        pod(0, "Failed", reason="Evicted", message="Pod ephemeral local storage usage exceeds the total limit of 1Gi."),
        (
            NodePhase.FAILED,
            "ResourceLimitExceeded: Pod ephemeral local storage usage exceeds the total limit of 1Gi.",
            True,
            None,
        ),
        id="over-own-limit",
    ),
    pytest.param(
        pod(0, "Failed", main=terminated(128, "StartError", message='exec: "python": executable file not found')),
        (NodePhase.FAILED, 'StartError: exec: "python": executable file not found', False, None),
        id="start-error",
    ),
    pytest.param(
        pod(1, "Failed", init=terminated(1, "Error"), main={"waiting": {"reason": "PodInitializing"}}),
        (NodePhase.FAILED, "init container wait-for-master failed", True, None),
        id="dns-wait-gave-up",
    ),
    pytest.param(
        pod(0, "Failed", main=terminated(143, "Error"), deleting=True),
        (NodePhase.FAILED, None, True, "deleted"),
        id="stopped-by-job-controller",
    ),
]


@pytest.mark.parametrize(("obj", "expected"), POD_CASES)
def test_pod_observation(obj: dict[str, Any], expected: tuple[NodePhase, str | None, bool, str | None]) -> None:
    obs = pod_observation(int(obj["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"]), obj)
    assert (obs.phase, obs.reason, obs.retryable, obs.stopped_by) == expected


def test_exit_codes_and_signals() -> None:
    oom = pod_observation(1, pod(1, "Failed", main=terminated(137, "OOMKilled")))
    assert (oom.exit_code, oom.signal) == (137, "SIGKILL")
    err = pod_observation(1, pod(1, "Failed", main=terminated(3, "Error")))
    assert (err.exit_code, err.signal) == (3, None)


def test_missing_pods_by_job_state() -> None:
    assert [n.reason for n in node_observations(2, job(), [])] == ["pod not created yet"] * 2
    quota = {
        "reason": "FailedCreate",
        "message": "exceeded quota: q",
        "lastTimestamp": T5,
        "involvedObject": {"kind": "Job", "name": "g"},
    }
    older = {**quota, "message": "older", "lastTimestamp": T1}
    assert node_observations(1, job(), [], events=[older, quota])[0].reason == "FailedCreate: exceeded quota: q"
    done = node_observations(2, job(completed="0-1"), [])
    assert [n.phase for n in done] == [NodePhase.SUCCEEDED] * 2
    failed = node_observations(
        2,
        job(conditions=[cond("Failed", "True", "BackoffLimitExceeded", "Job has reached the specified backoff limit")]),
        [],
    )
    assert failed[0].phase is NodePhase.FAILED and failed[0].stopped_by == "kubernetes"
    assert (
        failed[0].reason
        == "stopped: the Job failed (BackoffLimitExceeded): Job has reached the specified backoff limit"
    )
    lost = node_observations(2, None, [])
    assert [n.phase for n in lost] == [NodePhase.LOST] * 2


def test_kueue_admission_and_eviction() -> None:
    suspended = job(suspend=True)
    assert (
        node_observations(1, suspended, [])[0].reason == "waiting for Kueue admission in queue team-a (Job suspended)"
    )
    pending = {"status": {"conditions": [cond("QuotaReserved", "False", "Pending", "insufficient quota for cpu")]}}
    assert node_observations(1, suspended, [], workloads=[pending])[0].reason == (
        "waiting for Kueue admission in queue team-a: insufficient quota for cpu"
    )
    evicted = {"status": {"conditions": [cond("Evicted", "True", "Preempted", "Preempted to accommodate a workload")]}}
    obs = node_observations(2, suspended, [], workloads=[evicted])
    assert obs[0].phase is NodePhase.FAILED
    assert obs[0].reason == "Preempted (Kueue: Preempted): Preempted to accommodate a workload"
    status = group_status(obs, launched_at=0, now=1, startup_timeout=60)
    assert preemption_reason(status) == "node 0: Preempted (Kueue: Preempted): Preempted to accommodate a workload"


def test_several_pods_for_one_index_prefer_the_failure() -> None:
    old_failed = pod(0, "Failed", main=terminated(137, "OOMKilled"), created=T0)
    replacement = pod(0, "Pending", created=T5)
    (obs,) = node_observations(1, job(), [replacement, old_failed])
    assert obs.reason == "OOMKilled"


def test_preemption_is_found_among_collateral_failures() -> None:
    pods = [
        pod(
            0,
            "Failed",
            main=terminated(143, "Error", finished=T9),
            conditions=[cond("DisruptionTarget", "True", "DeletionByTaintManager", "Taint manager: deleting", at=T1)],
        ),
        pod(1, "Failed", main=terminated(1, "Error", finished=T5)),
    ]
    nodes = node_observations(2, job(), pods)
    status = group_status(nodes, launched_at=0, now=2e9, startup_timeout=60)
    assert status.state is Outcome.FAILED and status.failed_node == 0  # the disruption began first
    hit = disruption(nodes)
    assert hit is not None and hit.node_rank == 0
    assert preemption_reason(status) == "node 0: Evicted (DeletionByTaintManager): Taint manager: deleting"
    real = node_observations(1, job(), [pod(0, "Failed", main=terminated(1, "Error"))])
    assert preemption_reason(group_status(real, launched_at=0, now=1, startup_timeout=60)) is None


def test_what_to_read_besides_pods() -> None:
    assert needs_events(2, job(), [pod(0, "Running")])
    assert not needs_events(1, job(), [pod(0, "Running")])
    assert not needs_events(2, job(suspend=True), [])
    assert needs_workloads(job(suspend=True)) and not needs_workloads(job()) and not needs_workloads(None)


@pytest.mark.parametrize(
    ("text", "expected"), [("", set()), ("0", {0}), ("0,2-4", {0, 2, 3, 4}), ("1-2, 5", {1, 2, 5})]
)
def test_parse_indexes(text: str, expected: set[int]) -> None:
    assert parse_indexes(text) == expected


def test_log_cursor_returns_each_line_once() -> None:
    cursor = LogCursor()
    first = "2026-11-30T10:00:00.5Z a\n2026-11-30T10:00:01.000000001Z b\n2026-11-30T10:00:01.000000001Z c\n"
    assert cursor.feed(first) == ["a", "b", "c"]
    assert cursor.since_time() == "2026-11-30T10:00:01Z"
    # The next read from sinceTime (whole seconds) repeats the last second's lines.
    again = "2026-11-30T10:00:01.000000001Z b\n2026-11-30T10:00:01.000000001Z c\n2026-11-30T10:00:01.000000001Z d\n"
    assert cursor.feed(again + "2026-11-30T10:00:02.25Z e f\n") == ["d", "e f"]
    assert cursor.feed("2026-11-30T10:00:02.25Z e f\n") == []
    assert split_stamp("2026-11-30T10:00:02.25+01:00 x") == ((1796029202, 250000000), "x")
    assert split_stamp("no stamp") == (None, "no stamp")


def test_a_large_failed_group_reads_a_bounded_number_of_log_tails() -> None:
    from airflow_torchrun.backends.kubernetes.explain import MAX_TAILS, nodes_to_read

    pods = [pod(i, "Failed", main=terminated(1, "Error", finished=T5 if i else T1)) for i in range(40)]
    status = group_status(node_observations(40, job(), pods), launched_at=0, now=2e9, startup_timeout=60)
    ranks = nodes_to_read(status)
    assert len(ranks) == MAX_TAILS and ranks[0] == 0  # the earliest failure first


def test_a_job_the_controller_is_failing_is_failed_before_its_failed_condition() -> None:
    """Seen on the real cluster (v1.37): the Job controller first sets FailureTarget (reason
    PodFailurePolicy) and adds Failed only once every pod has terminated; the fake set Failed at
    once. A node whose pod is already gone then is failed, not "pod not created yet"."""
    message = "Container trainer for pod ml/g-1-x failed with exit code 1 matching FailJob rule at index 1"
    target = cond("FailureTarget", "True", "PodFailurePolicy", message)
    nodes = node_observations(2, job(conditions=[target]), [])
    assert [n.phase for n in nodes] == [NodePhase.FAILED] * 2
    assert nodes[0].stopped_by == "kubernetes"
    assert nodes[0].reason == f"stopped: the Job failed (PodFailurePolicy): {message}"


def test_a_pod_deleted_while_the_job_ran_is_a_disruption_and_the_job_controllers_deletions_are_not() -> None:
    """Seen on the real cluster (v1.37): `kubectl delete pod` gives the pod no DisruptionTarget
    (only the Eviction API, preemption, taints and the kubelet do); its torchrun exits 1 on the
    SIGTERM, and the task failed as if the rank had crashed. A pod whose deletion was asked for
    before the Job controller's verdict was taken away: a disruption, relaunched within the try.
    The pods the controller deletes after its verdict stay its collateral."""
    deleted = pod(1, "Failed", main=terminated(1, "Error"), deleting=True)
    deleted["metadata"]["deletionGracePeriodSeconds"] = 8  # asked at T1, SIGKILL due at T9
    peer = pod(0, "Failed", main=terminated(1, "Error", finished=T9))
    verdict = cond("FailureTarget", "True", "PodFailurePolicy", "Container trainer ... exit code 1", at=T5)
    nodes = node_observations(2, job(conditions=[verdict]), [peer, deleted])
    assert nodes[1].reason is not None and nodes[1].reason.startswith("Evicted (deleted)"), nodes[1]
    assert nodes[1].stopped_by is None
    status = group_status(nodes, launched_at=0, now=2e9, startup_timeout=60)
    assert preemption_reason(status) is not None and "node 1: Evicted (deleted)" in preemption_reason(status)
    # Deleted after the verdict (the Job controller stopping the group): not the cause.
    late = cond("FailureTarget", "True", "PodFailurePolicy", "Container trainer ... exit code 1", at=T0)
    collateral = node_observations(2, job(conditions=[late]), [peer, deleted])
    assert collateral[1].stopped_by == "deleted" and not (collateral[1].reason or "").startswith("Evicted")


def test_a_deleted_pod_gone_before_it_was_seen_is_a_disruption_by_its_kubelets_killing_event() -> None:
    """Seen on the real cluster: after `kubectl delete pod` the pod, its exit and the verdict can all
    pass between two looks; the verdict still names the pod, and its kubelet's Killing event tells
    that it was stopped, not that it crashed. The peer the Job controller stops after its verdict
    has a Killing event too, but did not decide the verdict: collateral."""
    message = "Container trainer for pod ml/g-1-abcde failed with exit code 1 matching FailJob rule at index 1"
    failing = job(conditions=[cond("FailureTarget", "True", "PodFailurePolicy", message, at=T5)])

    def killing(pod_name: str, at: str) -> dict[str, object]:
        return {"reason": "Killing", "firstTimestamp": at, "involvedObject": {"kind": "Pod", "name": pod_name}}

    assert needs_kill_events(failing, []) == "g-1-abcde"
    assert needs_kill_events(failing, [pod(1, "Failed", main=terminated(1, "Error"))]) is None  # still there
    assert needs_kill_events(job(), []) is None

    killed = [killing("g-1-abcde", T1), killing("g-0-abcde", T9)]
    nodes = node_observations(2, failing, [], killed=killed)
    assert nodes[1].reason == "Evicted (deleted): pod g-1-abcde was stopped by its kubelet while it ran"
    assert nodes[1].stopped_by is None and nodes[1].finished_at == parse_time(T1)
    assert nodes[0].stopped_by == "kubernetes"  # collateral
    status = group_status(nodes, launched_at=0, now=2e9, startup_timeout=60)
    assert preemption_reason(status) == f"node 1: {nodes[1].reason}"
    # Without the event (the pod exited on its own): the verdict stands, a failure.
    crashed = node_observations(2, failing, [], killed=[killing("g-0-abcde", T9)])
    assert crashed[1].reason == f"stopped: the Job failed (PodFailurePolicy): {message}"
    assert preemption_reason(group_status(crashed, launched_at=0, now=2e9, startup_timeout=60)) is None


def test_a_rank_cannot_start_a_line_of_another_rank_inside_its_own() -> None:
    # torchrun's tee and the container runtime end lines at "\n" only; a rank printing U+2028 (or
    # \x85, \x1c) must not make the rest of its line a line of its own with another rank's prefix.
    from airflow_torchrun.contract.progress import parse_bound_records

    forged = '[node 0 rank 0] @torchrun-progress {"rank": 0, "step": 99, "time": 1.0}'
    text = "".join(
        f"2026-11-30T10:00:0{i}Z [node 0 rank 1] hi{sep}{forged}\n" for i, sep in enumerate(("\u2028", "\x85", "\x1c"))
    )
    lines = LogCursor().feed(text + "2026-11-30T10:00:05Z ok\r\n")
    assert len(lines) == 4 and lines[-1] == "ok", lines
    assert parse_bound_records(lines) == []
