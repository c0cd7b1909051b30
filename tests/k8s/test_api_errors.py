"""The Kubernetes backend when the API server misbehaves: the fake answers 5xx, refuses, or hangs.

``observe`` raises what :func:`airflow_torchrun.errors.is_transient` calls transient during an
outage (the watch core rides it out) and works again after it; ``launch`` fails for good on a
4xx and retryably on a 5xx, and leaves nothing behind either way.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from airflow_torchrun.backends.kubernetes.api import ClusterApiError
from airflow_torchrun.backends.kubernetes.backend import KubernetesBackend
from airflow_torchrun.backends.kubernetes.runtimes import BUILTIN_RUNTIMES, parse_runtime
from airflow_torchrun.errors import GroupLaunchError, is_transient
from airflow_torchrun.status import NodePhase

from .conftest import IDENTITY, NAMESPACE, make_spec
from .fake_api import FakeKubeAPI, Outage
from .test_backend import launch, running_group

NS = NAMESPACE


def wait_out(window: Outage) -> None:
    time.sleep(max(0.0, window.until - time.monotonic()) + 0.05)


def group_objects(fake: FakeKubeAPI) -> list[tuple[str, str, str]]:
    return sorted(k for k in fake.objects if k[0] in ("jobs", "services", "networkpolicies"))


@pytest.mark.parametrize("status", [500, 503, 429])
def test_observe_raises_transient_errors_during_an_outage_and_recovers(
    fake_api: FakeKubeAPI, backend: KubernetesBackend, status: int
) -> None:
    handle, _ = running_group(fake_api, backend)
    assert {n.phase for n in backend.observe(handle)} == {NodePhase.RUNNING}

    window = fake_api.outage(1.0, status=status)
    with pytest.raises(ClusterApiError) as info:
        backend.observe(handle)  # a watch first (the group runs), then the reads: all refused
    assert is_transient(info.value) and info.value.status == status
    assert "fake outage" in str(info.value)

    wait_out(window)
    assert {n.phase for n in backend.observe(handle)} == {NodePhase.RUNNING}


def test_observe_raises_a_transient_timeout_when_the_api_hangs(
    fake_api: FakeKubeAPI, kubeconfig, backend: KubernetesBackend
) -> None:
    # Launched with the default timeout: on a loaded machine the fake may take longer than 0.3 s
    # to answer a create, and the launch is not what this test is about.
    handle, _ = running_group(fake_api, backend)
    backend = KubernetesBackend(
        namespace=NS, config_file=str(kubeconfig), watch_seconds=1.0, request_timeout=0.3, runtimes=BUILTIN_RUNTIMES
    )

    window = fake_api.outage(4.0, hang=True)
    started = time.monotonic()
    with pytest.raises(ClusterApiError) as info:
        backend.observe(handle)
    assert is_transient(info.value) and info.value.status is None
    assert "no answer within 0.3s" in str(info.value)
    assert time.monotonic() - started < window.until - started  # gave up before the server answered

    wait_out(window)
    assert {n.phase for n in backend.observe(handle)} == {NodePhase.RUNNING}


def test_a_permanent_refusal_while_observing_is_not_transient(
    fake_api: FakeKubeAPI, backend: KubernetesBackend
) -> None:
    handle, _ = running_group(fake_api, backend)
    fake_api.outage(5.0, status=403, resource="pods")
    with pytest.raises(ClusterApiError) as info:
        backend.observe(handle)
    assert info.value.status == 403 and not is_transient(info.value)


def test_observe_async_raises_transient_errors_during_an_outage_and_recovers(
    fake_api: FakeKubeAPI, k8s_connection: str, backend: KubernetesBackend
) -> None:
    handle, _ = running_group(fake_api, backend)
    watcher = KubernetesBackend(namespace=NS, kubernetes_conn_id=k8s_connection, watch_seconds=1.0, request_timeout=0.5)

    async def scenario() -> tuple[list[NodePhase], BaseException, BaseException, list[NodePhase]]:
        before = [n.phase for n in await watcher.observe_async(handle)]
        errors = []
        for hang in (False, True):
            # Open until the look has failed (a fixed 1.5 s could end before a loaded machine's
            # client sent its request), then over.
            window = fake_api.outage(60.0, status=503, hang=hang)
            try:
                await watcher.observe_async(handle)
            except Exception as exc:
                errors.append(exc)
            window.until = time.monotonic()
            await asyncio.sleep(0.05)
        after = [n.phase for n in await watcher.observe_async(handle)]
        return before, errors[0], errors[1], after

    before, refused, hung, after = asyncio.run(scenario())
    assert before == after == [NodePhase.RUNNING, NodePhase.RUNNING]
    assert isinstance(refused, ClusterApiError) and refused.status == 503 and is_transient(refused)
    assert isinstance(hung, ClusterApiError) and hung.status is None and is_transient(hung)
    assert "no answer within" in str(hung)
    assert watcher._sync_hook is None  # never a sync client inside async code


def test_progress_mark_async_raises_during_an_outage(
    fake_api: FakeKubeAPI, k8s_connection: str, backend: KubernetesBackend
) -> None:
    handle, job_name = running_group(fake_api, backend)
    fake_api.add_log(fake_api.pod(NS, job_name, 0)["metadata"]["name"], "[node 0 rank 0] step 1")
    watcher = KubernetesBackend(namespace=NS, kubernetes_conn_id=k8s_connection, watch_seconds=1.0)

    async def scenario() -> tuple[object, BaseException | None]:
        await watcher.observe_async(handle)
        mark = await watcher.progress_mark_async(handle)
        fake_api.outage(5.0, status=502, resource="log")
        try:
            await watcher.progress_mark_async(handle)
        except Exception as exc:
            return mark, exc
        return mark, None

    mark, error = asyncio.run(scenario())
    assert mark is not None and [node for node, _ in mark.token] == [0, 1]
    assert isinstance(error, ClusterApiError) and is_transient(error)


def test_progress_mark_is_none_while_no_node_runs(fake_api: FakeKubeAPI, backend: KubernetesBackend) -> None:
    _, handle = launch(backend)
    fake_api.create_pods(NS, handle.job_name)
    backend.observe(handle)
    assert backend.progress_mark(handle) is None  # pending pods: nothing to tell progress by


def test_launch_refused_with_422_for_a_label_with_a_space_is_permanent_and_leaves_nothing(
    fake_api: FakeKubeAPI, kubeconfig
) -> None:
    spaced = parse_runtime("spaced", {"image": "trainer:1", "labels": {"team": "research east"}})
    backend = KubernetesBackend(namespace=NS, config_file=str(kubeconfig), runtimes={"spaced": spaced})
    with pytest.raises(GroupLaunchError) as info:
        launch(backend, runtime="spaced")
    message = str(info.value)
    assert info.value.transient is False and not is_transient(info.value)
    assert "422 Invalid" in message and 'Invalid value: "research east"' in message  # the API's own words
    assert "Fix the runtime 'spaced' (its labels" in message  # what to change
    assert "nothing of the group was left behind" in message
    assert group_objects(fake_api) == []


@pytest.mark.parametrize("resource", ["jobs", "services", "networkpolicies"])
def test_launch_against_a_503_is_transient_and_leaves_nothing(
    fake_api: FakeKubeAPI, backend: KubernetesBackend, resource: str
) -> None:
    fake_api.outage(5.0, status=503, method="POST", resource=resource)
    with pytest.raises(GroupLaunchError) as info:
        launch(backend)
    assert info.value.transient is True and is_transient(info.value)
    assert "503 ServiceUnavailable" in str(info.value)
    assert group_objects(fake_api) == []  # a Job created before the Service (or policy) failed is deleted again
    deletes = fake_api.calls_to("DELETE", "jobs")
    if resource == "jobs":
        # The create got no good answer: the Job of that name is read first (the server may have
        # made it); there is none, so nothing is deleted by name.
        assert [c.method for c in fake_api.calls_to("GET", "jobs")] == ["GET"] and deletes == []
    else:
        assert len(fake_api.calls_to("POST", "jobs")) == 1
        (delete,) = deletes
        assert delete.propagation_policy == "Foreground"
        assert delete.precondition_uid is not None  # that very Job, by its uid


def test_launch_refused_with_403_names_the_role(fake_api: FakeKubeAPI, backend: KubernetesBackend) -> None:
    fake_api.outage(5.0, status=403, method="POST", resource="jobs")
    with pytest.raises(GroupLaunchError, match=r"Role in docs/kubernetes\.md") as info:
        launch(backend)
    assert info.value.transient is False
    assert group_objects(fake_api) == []


def test_launch_when_the_api_hangs_is_transient(fake_api: FakeKubeAPI, kubeconfig) -> None:
    backend = KubernetesBackend(
        namespace=NS, config_file=str(kubeconfig), request_timeout=0.3, runtimes=BUILTIN_RUNTIMES
    )
    window = fake_api.outage(3.0, hang=True)
    with pytest.raises(GroupLaunchError) as info:
        launch(backend)
    assert info.value.transient is True
    # The cleanup could not get through either: the error says how to delete what may be left.
    assert "kubectl delete job" in str(info.value)
    wait_out(window)
    time.sleep(0.2)  # the held requests are answered now, the create among them
    # The next attempt of the same launch replaces whatever the held create made.
    patient = KubernetesBackend(namespace=NS, config_file=str(kubeconfig), runtimes=BUILTIN_RUNTIMES)
    again = patient.launch(patient.plan(make_spec(), IDENTITY, {}), watch_caller=True)
    assert [k for k in group_objects(fake_api) if k[0] == "jobs"] == [("jobs", NS, again.job_name)]


def test_teardown_async_deletes_the_group_with_the_async_hook_only(
    fake_api: FakeKubeAPI, k8s_connection: str, backend: KubernetesBackend
) -> None:
    handle, job_name = running_group(fake_api, backend)
    watcher = KubernetesBackend(namespace=NS, kubernetes_conn_id=k8s_connection)  # a trigger's: no kubeconfig file
    asyncio.run(watcher.teardown_async(handle))
    asyncio.run(watcher.teardown_async(handle))  # idempotent
    assert group_objects(fake_api) == [] and fake_api.pods(NS, job_name) == []
    assert watcher._sync_hook is None
