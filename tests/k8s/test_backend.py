"""The Kubernetes backend over HTTP, through the provider's hooks, against the fake API server.

Each test drives pods the way the scheduler, kubelet and Job controller would, and checks what
the backend asked the API for and what it concluded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time

import pytest

from airflow_torchrun.backends.base import GroupHandle, RelaunchKind
from airflow_torchrun.backends.kubernetes.backend import KubernetesBackend
from airflow_torchrun.backends.kubernetes.render import KUEUE_QUEUE_LABEL
from airflow_torchrun.backends.kubernetes.runtimes import BUILTIN_RUNTIMES, parse_runtime
from airflow_torchrun.errors import GroupLaunchError
from airflow_torchrun.naming import GroupIdentity
from airflow_torchrun.status import NodePhase, Outcome, group_status

from .conftest import IDENTITY, NAMESPACE, make_spec, settle
from .fake_api import FakeKubeAPI

NS = NAMESPACE

AGENT_REPORT = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
/opt/trainer/train.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_10:00:05
  host      : pipeline-train-1
  rank      : 1 (local_rank: 0)
  exitcode  : -9 (pid: 42)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 42
============================================================"""


def launch(backend: KubernetesBackend, identity: GroupIdentity = IDENTITY, **spec_overrides: object):
    spec = make_spec(**spec_overrides)
    plan = backend.plan(spec, identity, {"TRAIN_CHECKPOINT_URI": "s3://bucket/ckpt"})
    return plan, backend.launch(plan, watch_caller=True)


def running_group(
    fake: FakeKubeAPI, backend: KubernetesBackend, identity: GroupIdentity = IDENTITY, **spec_overrides: object
):
    """A launched group whose pods the fake's control plane has started."""
    _, handle = launch(backend, identity, **spec_overrides)
    job_name = handle.job_name
    fake.create_pods(NS, job_name)
    fake.set_running(NS, job_name)
    return handle, job_name


def assert_foreground_delete(fake: FakeKubeAPI, job: str) -> None:
    deletes = [c for c in fake.calls_to("DELETE", "jobs") if c.path.endswith(f"/jobs/{job}")]
    assert deletes, "the Job was never deleted"
    assert all(c.propagation_policy == "Foreground" for c in deletes)


def test_success_creates_job_then_owned_service_streams_logs_and_tears_down(
    fake_api: FakeKubeAPI, backend: KubernetesBackend
) -> None:
    plan, handle = launch(backend)
    job_name = handle.job_name

    # Job first, then the Service and the NetworkPolicy, each carrying an ownerReference to the Job's uid.
    posts = [c for c in fake_api.calls if c.method == "POST"]
    assert [c.path.rsplit("/", 1)[-1] for c in posts] == ["jobs", "services", "networkpolicies"]
    job = fake_api.job(NS, job_name)
    service = fake_api.objects[("services", NS, job_name)]
    policy = fake_api.objects[("networkpolicies", NS, job_name)]
    uid = job["metadata"]["uid"]
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": job_name, "uid": uid, "controller": True}
    assert service["metadata"]["ownerReferences"] == policy["metadata"]["ownerReferences"] == [owner]
    # Only the Job's own pods (by the uid label the Job controller sets), and only from them.
    only_ours = {"matchLabels": {"batch.kubernetes.io/controller-uid": job["metadata"]["uid"]}}
    assert policy["spec"] == {
        "podSelector": only_ours,
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": only_ours}]}],
    }
    assert handle.group_id == plan.group_id and handle.num_nodes == 2 and handle.namespace == NS
    assert handle.master_addr == plan.master_addr == f"{job_name}-0.{job_name}.{NS}.svc"

    fake_api.create_pods(NS, job_name)
    nodes = backend.observe(handle)
    assert [n.phase for n in nodes] == [NodePhase.PENDING, NodePhase.PENDING]

    fake_api.set_running(NS, job_name)
    pod0 = fake_api.pod(NS, job_name, 0)["metadata"]["name"]
    pod1 = fake_api.pod(NS, job_name, 1)["metadata"]["name"]
    fake_api.add_log(pod0, "INFO:torch.distributed.run:starting", "[node 0 rank 0] step 1 loss 0.9")
    fake_api.add_log(pod1, "[node 1 rank 1] step 1 loss 0.9")
    status = settle(backend, handle, lambda s: all(n.phase is NodePhase.RUNNING for n in s.nodes))
    assert status.state is Outcome.RUNNING
    assert backend.read_new_log_lines(handle) == [
        "[node 0 agent] INFO:torch.distributed.run:starting",
        "[node 0 rank 0] step 1 loss 0.9",
    ]
    fake_api.add_log(pod0, "[node 0 rank 0] step 2 loss 0.5")
    assert backend.read_new_log_lines(handle) == ["[node 0 rank 0] step 2 loss 0.5"]
    assert backend.read_new_log_lines(handle) == []

    fake_api.set_terminated(NS, job_name, None, exit_code=0, reason="Completed")
    status = settle(backend, handle, lambda s: s.state.terminal)
    assert status.state is Outcome.SUCCEEDED
    assert status.exit_codes == [0, 0]

    backend.teardown(handle)
    assert_foreground_delete(fake_api, job_name)
    assert ("jobs", NS, job_name) not in fake_api.objects
    assert ("services", NS, job_name) not in fake_api.objects  # owned: garbage-collected with the Job
    assert ("networkpolicies", NS, job_name) not in fake_api.objects
    backend.teardown(handle)  # idempotent: everything already gone (404s) is fine


def test_every_rank_log_streams_with_all_ranks_logs(fake_api: FakeKubeAPI, kubeconfig) -> None:
    backend = KubernetesBackend(
        namespace=NS, config_file=str(kubeconfig), watch_seconds=1.0, runtimes=BUILTIN_RUNTIMES, all_ranks_logs=True
    )
    handle, job_name = running_group(fake_api, backend)
    for index in (0, 1):
        fake_api.add_log(fake_api.pod(NS, job_name, index)["metadata"]["name"], f"[node {index} rank {index}] hello")
    backend.observe(handle)
    assert backend.read_new_log_lines(handle) == ["[node 0 rank 0] hello", "[node 1 rank 1] hello"]


def test_oom_killed_rank_fails_the_group_naming_it_and_is_retryable(
    fake_api: FakeKubeAPI, backend: KubernetesBackend
) -> None:
    handle, job_name = running_group(fake_api, backend)
    backend.observe(handle)
    pod1 = fake_api.pod(NS, job_name, 1)["metadata"]["name"]
    fake_api.add_log(pod1, "[node 1 rank 1] allocating 40 GiB", *AGENT_REPORT.splitlines())
    # The kubelet reports the OOM kill; the Job controller fails the Job (podFailurePolicy) and
    # stops the other rank.
    fake_api.set_terminated(NS, job_name, 1, exit_code=137, reason="OOMKilled", finished_offset=-2)
    fake_api.fail_job(
        NS, job_name, "PodFailurePolicy", f"Container trainer for pod {NS}/{pod1} failed with exit code 137"
    )
    fake_api.delete_pod_gracefully(NS, job_name, 0)

    status = settle(backend, handle, lambda s: s.state.terminal)
    assert status.state is Outcome.FAILED
    assert status.failed_node == 1
    assert "OOMKilled" in status.reason
    assert backend.relaunch_reason(handle, status) is None  # a real failure: Airflow's retries, not a relaunch

    backend.teardown(handle)  # the operator tears down before it explains: the tail was kept
    report = backend.explain(handle, status)
    assert report.retryable
    assert "Kubernetes reports: node 1 was killed by SIGKILL (OOMKilled)" in report.message
    assert "rank 1 (node 1, local rank 0) was killed by signal SIGKILL" in report.message
    assert "[node 1 rank 1] allocating 40 GiB" in report.message
    assert "raise the runtime's memory" in report.message
    assert f"pod {NS}/{pod1}" in report.message
    assert_foreground_delete(fake_api, job_name)


def test_an_oom_is_never_taken_for_a_preemption_when_the_verdict_falls_between_two_reads(
    fake_api: FakeKubeAPI, backend: KubernetesBackend
) -> None:
    """One look reads the Job and lists the pods, and the Job controller may act between the two:
    its verdict (FailureTarget) and its deletion of the other rank's pod. Seen in CI: the Job read
    before the verdict and the pods after it made that deletion look like someone taking the pod
    away (a disruption), and the try relaunched its group after an OOM instead of failing."""
    handle, job_name = running_group(fake_api, backend)
    backend.observe(handle)
    pod1 = fake_api.pod(NS, job_name, 1)["metadata"]["name"]
    fake_api.set_terminated(NS, job_name, 1, exit_code=137, reason="OOMKilled")
    reads = [f"/jobs/{job_name}", "/pods"]

    def verdict_after_the_first_read(call) -> None:
        if call.method == "GET" and any(call.path.endswith(r) for r in reads) and fake_api.answered:
            fake_api.answered = None
            fake_api.fail_job(NS, job_name, "PodFailurePolicy", f"Container trainer for pod {NS}/{pod1} failed")
            fake_api.delete_pod_gracefully(NS, job_name, 0)

    fake_api.answered = verdict_after_the_first_read
    status = settle(backend, handle, lambda s: s.state.terminal)
    assert fake_api.answered is None  # the verdict did fall inside that look
    assert status.state is Outcome.FAILED and "OOMKilled" in status.reason
    assert not any((n.reason or "").startswith("Evicted") for n in status.nodes), status.nodes
    assert backend.relaunch_reason(handle, status) is None
    # Every later look agrees: the deletion came after the verdict.
    status = settle(backend, handle, lambda s: s.state.terminal)
    assert backend.relaunch_reason(handle, status) is None, status.nodes


def test_a_pod_deleted_and_gone_before_it_was_seen_is_a_disruption(
    fake_api: FakeKubeAPI, backend: KubernetesBackend
) -> None:
    """Seen on the real cluster (CI rehearsal, deferred task): the deleted pod, its exit and the
    Job controller's verdict all came and went between two looks of the trigger; what is left is
    the verdict naming the pod and the kubelet's Killing event. A disruption, relaunched within the
    try, never the crash the verdict's exit code 1 would make it."""
    handle, job_name = running_group(fake_api, backend)
    backend.observe(handle)
    name = fake_api.take_pod_away(NS, job_name, 1)
    fake_api.delete_pod_gracefully(NS, job_name, 0)  # the Job controller stops the rest

    status = settle(backend, handle, lambda s: s.state.terminal)
    assert status.state is Outcome.FAILED
    relaunch = backend.relaunch_reason(handle, status)
    assert relaunch is not None and relaunch.kind is RelaunchKind.PREEMPTION, status.nodes
    assert f"node 1: Evicted (deleted): pod {name} was stopped by its kubelet while it ran" == relaunch.why
    events = [c for c in fake_api.calls if c.path.endswith("/events") and "Pod" in str(c.query)]
    assert events and f"involvedObject.name={name}" in events[-1].query.get("fieldSelector", "")


def test_preempted_rank_is_reported_as_preemption_even_when_a_peer_fails_first(
    fake_api: FakeKubeAPI, backend: KubernetesBackend
) -> None:
    handle, job_name = running_group(fake_api, backend)
    backend.observe(handle)
    # The scheduler preempts node 0 (DisruptionTarget at t-3s); node 1 loses its peer and its
    # container ends first (t-2s) while node 0 is still shutting down (t-1s).
    fake_api.set_terminated(
        NS,
        job_name,
        0,
        exit_code=143,
        reason="Error",
        finished_offset=-1,
        disruption=("PreemptionByScheduler", "Preempted in order to admit critical pod"),
        disruption_offset=-3,
    )
    fake_api.set_terminated(NS, job_name, 1, exit_code=1, reason="Error", finished_offset=-2)

    status = settle(backend, handle, lambda s: s.state.terminal)
    assert status.state is Outcome.FAILED
    assert status.failed_node == 0
    relaunch = backend.relaunch_reason(handle, status)
    assert relaunch is not None and relaunch.kind is RelaunchKind.PREEMPTION
    assert relaunch.why.startswith("node 0: Preempted (PreemptionByScheduler)")
    report = backend.explain(handle, status)
    assert "Preempted (PreemptionByScheduler): Preempted in order to admit critical pod" in report.message
    assert report.retryable


def test_unschedulable_past_startup_timeout_reports_the_scheduler_and_deletes_the_group(
    fake_api: FakeKubeAPI, backend: KubernetesBackend
) -> None:
    # Long enough for a look or two before it passes on a loaded machine (at 2.5 s, under 4 xdist
    # workers, it once passed before the first look: a timeout with no watch to see).
    _, handle = launch(backend, startup_timeout=6.0)
    job_name = handle.job_name
    fake_api.create_pods(NS, job_name)
    message = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: 0/4 nodes are available"
    fake_api.set_unschedulable(NS, job_name, message)

    status = settle(backend, handle, lambda s: s.state.terminal)
    assert status.state is Outcome.STARTUP_TIMEOUT
    assert "did not start within startup_timeout=6s" in status.reason
    assert f"Unschedulable: {message}" in status.reason
    # Pending pods were watched, not polled in a tight loop: every wait was a watch request.
    watches = [c for c in fake_api.calls if c.is_watch]
    assert watches and all(c.query.get("resourceVersion") for c in watches)

    report = backend.explain(handle, status)
    assert report.retryable
    assert "could not start" in report.message and "Insufficient nvidia.com/gpu" in report.message
    backend.teardown(handle)
    assert_foreground_delete(fake_api, job_name)
    assert fake_api.pods(NS, job_name) == []


def test_missing_image_fails_without_retry(fake_api: FakeKubeAPI, backend: KubernetesBackend) -> None:
    _, handle = launch(backend)
    job_name = handle.job_name
    fake_api.create_pods(NS, job_name)
    fake_api.set_waiting(
        NS,
        job_name,
        None,
        "ImagePullBackOff",
        'Back-off pulling image "registry.example.com/trainer:0.1.0": ErrImagePull: rpc error: code = NotFound '
        "desc = failed to pull and unpack image: not found",
    )
    status = settle(backend, handle, lambda s: s.state.terminal)
    assert status.state is Outcome.FAILED
    failed = status.nodes[status.failed_node or 0]
    assert not failed.retryable
    assert failed.reason is not None and failed.reason.startswith("ImagePullBackOff (container wait-for-master)")
    report = backend.explain(handle, status)
    assert not report.retryable
    assert "not found" in report.message
    assert "Kubernetes reports: nodes 0,1" in report.message  # identical failures grouped
    assert "check the runtime's image (name, tag, digest) and image_pull_secrets" in report.message


def test_rate_limited_image_pull_stays_pending(fake_api: FakeKubeAPI, backend: KubernetesBackend) -> None:
    _, handle = launch(backend)
    job_name = handle.job_name
    fake_api.create_pods(NS, job_name)
    fake_api.set_waiting(NS, job_name, 1, "ErrImagePull", "429 Too Many Requests - toomanyrequests: rate limit")
    nodes = backend.observe(handle)
    assert nodes[1].phase is NodePhase.PENDING
    assert nodes[1].reason is not None and "toomanyrequests" in nodes[1].reason


def test_quota_refusal_is_the_pending_reason(fake_api: FakeKubeAPI, backend: KubernetesBackend) -> None:
    _, handle = launch(backend)
    job_name = handle.job_name
    quota = (
        f'Error creating: pods "{job_name}-0-x7k2p" is forbidden: exceeded quota: gpu-quota, requested: '
        "requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=8, limited: requests.nvidia.com/gpu=8"
    )
    fake_api.add_object(
        "events",
        NS,
        {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{job_name}.17f0"},
            "involvedObject": {"kind": "Job", "name": job_name, "namespace": NS, "apiVersion": "batch/v1"},
            "reason": "FailedCreate",
            "message": quota,
            "type": "Warning",
            "lastTimestamp": "2026-11-30T10:00:00Z",
        },
    )
    nodes = backend.observe(handle)
    assert {n.phase for n in nodes} == {NodePhase.PENDING}
    assert nodes[0].reason == f"FailedCreate: {quota}"
    assert any(
        c.query.get("fieldSelector") == f"involvedObject.kind=Job,involvedObject.name={job_name}"
        for c in fake_api.calls
    )


def test_kueue_queue_creates_a_suspended_job_and_reports_admission(fake_api: FakeKubeAPI, kubeconfig) -> None:
    queued = parse_runtime("queued", {"image": "trainer:1", "queue": "team-a", "resources": {"cpu": "1"}})
    backend = KubernetesBackend(
        namespace=NS, config_file=str(kubeconfig), watch_seconds=1.0, runtimes={"queued": queued}
    )
    _, handle = launch(backend, runtime="queued")
    job = fake_api.job(NS, handle.job_name)
    assert job["spec"]["suspend"] is True
    assert job["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "team-a"
    nodes = backend.observe(handle)
    assert nodes[0].reason == "waiting for Kueue admission in queue team-a (Job suspended)"

    fake_api.add_object(
        "workloads",
        NS,
        {
            "apiVersion": "kueue.x-k8s.io/v1beta1",
            "kind": "Workload",
            "metadata": {"name": "job-x-1", "labels": {"kueue.x-k8s.io/job-uid": job["metadata"]["uid"]}},
            "status": {
                "conditions": [
                    {
                        "type": "QuotaReserved",
                        "status": "False",
                        "reason": "Pending",
                        "message": "couldn't assign flavors to pod set main: insufficient unused quota for cpu",
                        "lastTransitionTime": "2026-11-30T10:00:00Z",
                    }
                ]
            },
        },
    )
    nodes = backend.observe(handle)
    assert nodes[1].reason == (
        "waiting for Kueue admission in queue team-a: couldn't assign flavors to pod set main: "
        "insufficient unused quota for cpu"
    )


def test_restarted_worker_reattaches_to_the_running_group(
    fake_api: FakeKubeAPI, backend: KubernetesBackend, kubeconfig
) -> None:
    spec = make_spec()
    handle, job_name = running_group(fake_api, backend)

    # A new process (fresh backend, next try of the same task instance) finds the same group.
    again = KubernetesBackend(namespace=NS, config_file=str(kubeconfig), watch_seconds=1.0, runtimes=BUILTIN_RUNTIMES)
    found = again.find_existing(dataclasses.replace(IDENTITY, try_number=2), spec)
    assert found is not None
    assert found.job_name == job_name
    assert found.group_id == handle.group_id
    assert found.to_dict()["master_addr"] == handle.master_addr
    assert abs(found.launched_at - handle.launched_at) < 5  # the Job's creation time
    assert [n.phase for n in again.observe(found)] == [NodePhase.RUNNING, NodePhase.RUNNING]
    assert not [c for c in fake_api.calls if c.method == "POST" and c.path.endswith("/jobs")][1:]

    other_run = dataclasses.replace(IDENTITY, run_id="scheduled__2026-12-01T00:00:00+00:00")
    assert again.find_existing(other_run, spec) is None


def test_a_job_being_deleted_is_not_reattached_and_is_waited_out_on_relaunch(
    fake_api: FakeKubeAPI, backend: KubernetesBackend
) -> None:
    plan, handle = launch(backend)
    fake_api.hold_deletion = True
    backend.teardown(handle)
    assert backend.find_existing(IDENTITY, make_spec()) is None

    # Relaunching the very same group waits until the old Job is gone, then creates it.
    threading.Timer(0.5, fake_api.release_deletions).start()
    fake_api.hold_deletion = False
    again = backend.launch(plan, watch_caller=True)
    assert again.job_name == handle.job_name
    assert again.job_uid != handle.job_uid


def test_a_leftover_job_of_an_earlier_attempt_of_this_launch_is_replaced(
    fake_api: FakeKubeAPI, backend: KubernetesBackend
) -> None:
    """409 AlreadyExists for our own Job (same group: an attempt that failed half-way, or whose
    create timed out after the server made it): delete it and create the group afresh."""
    plan, first = launch(backend)
    again = backend.launch(plan, watch_caller=True)
    assert again.job_name == first.job_name and again.job_uid != first.job_uid
    assert_foreground_delete(fake_api, first.job_name)
    assert [k for k in fake_api.objects if k[0] == "jobs"] == [("jobs", NS, first.job_name)]
    assert ("services", NS, first.job_name) in fake_api.objects


def test_a_foreign_job_of_the_same_name_is_a_permanent_launch_error(
    fake_api: FakeKubeAPI, backend: KubernetesBackend
) -> None:
    plan = backend.plan(make_spec(), IDENTITY, {})
    name = backend.render(plan).name
    fake_api.add_object("jobs", NS, {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name}})
    with pytest.raises(GroupLaunchError, match="airflow-torchrun did not create") as info:
        backend.launch(plan, watch_caller=True)
    assert info.value.transient is False
    assert ("jobs", NS, name) in fake_api.objects  # not ours: left alone


def test_a_foreign_network_policy_of_the_same_name_fails_the_launch_and_leaves_nothing_of_ours(
    fake_api: FakeKubeAPI, backend: KubernetesBackend
) -> None:
    plan = backend.plan(make_spec(), IDENTITY, {})
    name = backend.render(plan).name
    foreign = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": name}}
    fake_api.add_object("networkpolicies", NS, foreign)
    with pytest.raises(GroupLaunchError, match=r"a NetworkPolicy .* airflow-torchrun did not create") as info:
        backend.launch(plan, watch_caller=True)
    assert info.value.transient is False
    fake_api.release_deletions()
    assert ("jobs", NS, name) not in fake_api.objects and ("services", NS, name) not in fake_api.objects
    assert ("networkpolicies", NS, name) in fake_api.objects  # not ours: left alone


def test_a_runtime_may_opt_out_of_the_network_policy(fake_api: FakeKubeAPI, kubeconfig) -> None:
    open_runtime = parse_runtime("open", {"image": "trainer:1", "network_policy": False})
    backend = KubernetesBackend(namespace=NS, config_file=str(kubeconfig), runtimes={"open": open_runtime})
    _, handle = launch(backend, runtime="open")
    assert ("services", NS, handle.job_name) in fake_api.objects
    assert not [k for k in fake_api.objects if k[0] == "networkpolicies"]


def test_api_server_rejection_is_a_permanent_launch_error(fake_api: FakeKubeAPI, kubeconfig) -> None:
    broken = parse_runtime("broken", {"image": "trainer:1", "pod_overrides": {"hostNetworkk": True}})
    backend = KubernetesBackend(namespace=NS, config_file=str(kubeconfig), runtimes={"broken": broken})
    with pytest.raises(GroupLaunchError, match="422 Invalid: Job is invalid") as info:
        launch(backend, runtime="broken")
    assert info.value.transient is False
    assert "Fix the runtime 'broken'" in str(info.value)
    assert ("jobs", NS) not in {(k[0], k[1]) for k in fake_api.objects}


def test_teardown_on_kill_deletes_a_running_group(fake_api: FakeKubeAPI, backend: KubernetesBackend) -> None:
    handle, job_name = running_group(fake_api, backend)
    backend.observe(handle)

    backend.teardown(handle)  # what on_kill calls
    assert_foreground_delete(fake_api, job_name)
    assert fake_api.pods(NS, job_name) == []
    assert ("services", NS, job_name) not in fake_api.objects
    # What is left to see: the group is gone, as a failure, never as a success.
    assert {n.phase for n in backend.observe(handle)} == {NodePhase.LOST}


def test_observe_returns_as_soon_as_a_pod_changes(fake_api: FakeKubeAPI, kubeconfig) -> None:
    fake_api.max_watch_wait = 30.0  # a watch that only a change ends
    backend = KubernetesBackend(
        namespace=NS, config_file=str(kubeconfig), watch_seconds=30.0, runtimes=BUILTIN_RUNTIMES
    )
    _, handle = launch(backend)
    job_name = handle.job_name
    fake_api.create_pods(NS, job_name)
    backend.observe(handle)  # first look: a list, no watch
    threading.Timer(0.3, fake_api.set_running, args=(NS, job_name)).start()
    started = time.monotonic()
    nodes = backend.observe(handle)  # watches from the list's resourceVersion
    assert [n.phase for n in nodes] == [NodePhase.RUNNING, NodePhase.RUNNING]
    assert time.monotonic() - started < 25  # ended by the change, not by the 30 s watch timeout
    watch = [c for c in fake_api.calls if c.is_watch][-1]
    # The Job's pods by its uid (the Job controller's label), not by a label anyone can set.
    assert watch.query["labelSelector"] == f"batch.kubernetes.io/controller-uid={handle.job_uid}"


def test_relaunch_after_preemption_gets_its_own_name(fake_api: FakeKubeAPI, backend: KubernetesBackend) -> None:
    _, first = launch(backend)
    _, second = launch(backend, dataclasses.replace(IDENTITY, relaunch=1))
    assert second.job_name == f"{first.job_name}-r1"
    found = backend.find_existing(IDENTITY, make_spec())
    assert found is not None and found.job_name == second.job_name
    assert found.relaunch == 1  # from the Job's annotation, not parsed from a name


def test_async_observe_uses_the_async_hook_from_the_connection(
    fake_api: FakeKubeAPI, k8s_connection: str, backend: KubernetesBackend
) -> None:
    handle, job_name = running_group(fake_api, backend)

    # A trigger's backend: no kubeconfig file, only the Airflow connection.
    watcher = KubernetesBackend(
        namespace=NS, kubernetes_conn_id=k8s_connection, watch_seconds=1.0, runtimes=BUILTIN_RUNTIMES
    )

    async def follow() -> list[list[NodePhase]]:
        seen = [[n.phase for n in await watcher.observe_async(handle)]]
        fake_api.set_terminated(NS, job_name, 1, exit_code=137, reason="OOMKilled")
        seen.append([n.phase for n in await watcher.observe_async(handle)])
        return seen

    calls_before = len(fake_api.calls)
    seen = asyncio.run(follow())
    assert seen == [[NodePhase.RUNNING, NodePhase.RUNNING], [NodePhase.RUNNING, NodePhase.FAILED]]
    assert watcher._sync_hook is None  # never built a sync client inside async code
    assert any(c.is_watch for c in fake_api.calls[calls_before:])
    nodes = asyncio.run(watcher.observe_async(handle))
    status = group_status(nodes, launched_at=handle.launched_at, now=time.time(), startup_timeout=60)
    assert status.state is Outcome.FAILED and "OOMKilled" in status.reason


def test_a_trigger_rebuilds_the_backend_from_the_handle_and_sees_progress(
    fake_api: FakeKubeAPI, backend: KubernetesBackend
) -> None:
    handle, job_name = running_group(fake_api, backend)
    pod0 = fake_api.pod(NS, job_name, 0)["metadata"]["name"]
    fake_api.add_log(pod0, "[node 0 rank 0] step 1")

    stored = GroupHandle.from_dict(json.loads(json.dumps(handle.to_dict())))  # as XCom / a trigger keeps it
    watcher = KubernetesBackend.from_handle(stored)
    assert (watcher.namespace, watcher.config_file) == (NS, backend.config_file)

    async def marks() -> tuple[object, object, object]:
        await watcher.observe_async(stored)
        first = await watcher.progress_mark_async(stored)
        same = await watcher.progress_mark_async(stored)
        fake_api.add_log(pod0, "[node 0 rank 0] step 2")
        return first, same, await watcher.progress_mark_async(stored)

    first, same, later = asyncio.run(marks())
    assert first == same != later


def test_a_fresh_backend_keeps_the_failure_for_explain_across_teardown(
    fake_api: FakeKubeAPI, backend: KubernetesBackend, kubeconfig
) -> None:
    """A deferred task's re-entry: new process, teardown first, then explain."""
    handle, job_name = running_group(fake_api, backend)
    pod1 = fake_api.pod(NS, job_name, 1)["metadata"]["name"]
    fake_api.add_log(
        pod1, "[node 1 rank 1] Traceback (most recent call last):", "[node 1 rank 1] ValueError: bad batch"
    )
    fake_api.set_terminated(NS, job_name, 1, exit_code=1, reason="Error")
    status = settle(backend, handle, lambda s: s.state.terminal)

    reentry = KubernetesBackend(namespace=NS, config_file=str(kubeconfig), runtimes=BUILTIN_RUNTIMES)
    reentry.teardown(handle)
    assert fake_api.pods(NS, job_name) == []
    report = reentry.explain(handle, status)
    assert "[node 1 rank 1] ValueError: bad batch" in report.message
    assert "node 1 exited with code 1" in report.message


def test_credentials_in_plain_env_are_flagged(backend: KubernetesBackend, caplog: pytest.LogCaptureFixture) -> None:
    """A task's env= never gets here with such names (refused when the DAG is parsed: test_spec_checks);
    a contract variable that ever carried one is named in the log, its value never."""
    spec = make_spec(env={"EPOCHS": "3", "TOKENIZERS_PARALLELISM": "false"})
    with caplog.at_level("WARNING", logger="airflow_torchrun.backends.kubernetes.backend"):
        backend.plan(spec, IDENTITY, {"AWS_SECRET_ACCESS_KEY": "t0ps3cret", "WANDB_API_KEY": "t0ps3cret"})
    assert "AWS_SECRET_ACCESS_KEY, WANDB_API_KEY look like credentials" in caplog.text
    assert "t0ps3cret" not in caplog.text and "TOKENIZERS_PARALLELISM" not in caplog.text


def test_a_failed_leftover_job_is_not_reattached_but_a_completed_one_is(
    fake_api: FakeKubeAPI, backend: KubernetesBackend
) -> None:
    _, failed_name = running_group(fake_api, backend)
    fake_api.fail_job(NS, failed_name, "BackoffLimitExceeded", "Job has reached the specified backoff limit")
    try3 = dataclasses.replace(IDENTITY, try_number=3)
    assert backend.find_existing(try3, make_spec()) is None  # would only repeat the failure

    _, done_name = running_group(fake_api, backend, dataclasses.replace(IDENTITY, try_number=2))
    fake_api.set_terminated(NS, done_name, None, exit_code=0, reason="Completed")
    found = backend.find_existing(try3, make_spec())
    assert found is not None and found.job_name == done_name
    status = settle(backend, found, lambda s: s.state.terminal)
    assert status.state is Outcome.SUCCEEDED
