"""The training task with ``backend="kubernetes"`` through ``dag.test()``, against the fake API server.

An autopilot thread plays scheduler, kubelet and Job controller: whenever a Job appears it creates
its pods, runs them, writes their logs and ends them the way the scenario says. The task talks to
the fake through the Airflow connection ``kubernetes_default`` (defined in the environment).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from .conftest import NAMESPACE
from .fake_api import FakeKubeAPI

NS = "default"  # the operator's namespace when none is configured


class Autopilot:
    """Drives every new Job of the fake through one scenario."""

    def __init__(self, fake: FakeKubeAPI, scenario: Callable[[FakeKubeAPI, str], None]) -> None:
        self.fake, self.scenario = fake, scenario
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for (resource, ns, name), _ in list(self.fake.objects.items()):
                if resource == "jobs" and ns == NS and name not in self.seen:
                    self.seen.append(name)
                    self.scenario(self.fake, name)
            self._stop.wait(0.05)

    def __enter__(self) -> Autopilot:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def succeed(fake: FakeKubeAPI, job: str) -> None:
    fake.create_pods(NS, job)
    fake.set_running(NS, job)
    for index in (0, 1):
        pod = fake.pod(NS, job, index)["metadata"]["name"]
        fake.add_log(pod, f"[node {index} rank {index}] step 1 loss 0.50", f"[node {index} rank {index}] done")
    time.sleep(0.5)
    fake.set_terminated(NS, job, None, exit_code=0, reason="Completed")


def oom(fake: FakeKubeAPI, job: str) -> None:
    fake.create_pods(NS, job)
    fake.set_running(NS, job)
    pod1 = fake.pod(NS, job, 1)["metadata"]["name"]
    fake.add_log(pod1, "[node 1 rank 1] allocating activations")
    time.sleep(0.3)
    fake.set_terminated(NS, job, 1, exit_code=137, reason="OOMKilled")
    fake.fail_job(NS, job, "PodFailurePolicy", f"Container trainer for pod {NS}/{pod1} failed with exit code 137")
    fake.delete_pod_gracefully(NS, job, 0)


def missing_image(fake: FakeKubeAPI, job: str) -> None:
    fake.create_pods(NS, job)
    fake.set_waiting(NS, job, None, "ErrImagePull", "failed to pull image: manifest unknown")


TASK = """
DistributedTrainingOperator(
    task_id="train",
    backend="kubernetes",
    runtime="cpu",
    script="/opt/trainer/train.py",
    num_nodes=2,
    poll_interval=0.05,
    track=False,
)
"""
RETRY_ONCE = {"default_args": {"retries": 1, "retry_delay": 0}}


@pytest.fixture
def cluster(fake_api: FakeKubeAPI, k8s_connection: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeKubeAPI]:
    monkeypatch.delenv("AIRFLOW__TORCHRUN__KUBERNETES_NAMESPACE", raising=False)
    assert NAMESPACE != NS  # the kubeconfig's namespace is not what the operator uses
    yield fake_api


def created_jobs(fake: FakeKubeAPI) -> list[str]:
    return [c.body["metadata"]["name"] for c in fake.calls if c.method == "POST" and c.path.endswith("/jobs")]


def test_task_succeeds_and_its_group_is_deleted(cluster: FakeKubeAPI, run_dag) -> None:
    with Autopilot(cluster, succeed):
        result = run_dag(TASK)
    assert result.task_states == {"train": "success"}, result.log[-3000:]
    (job,) = created_jobs(cluster)
    assert job.endswith("-t1")
    assert [c.path.rsplit("/", 1)[-1] for c in cluster.calls if c.method == "POST"] == ["jobs", "services"]
    deletes = [c for c in cluster.calls if c.method == "DELETE" and c.path.endswith(f"/jobs/{job}")]
    assert deletes and all(c.propagation_policy == "Foreground" for c in deletes)
    assert "[node 0 rank 0] step 1 loss 0.50" in result.log  # rank 0's log streamed into the task log
    assert "[node 1 rank 1]" not in result.log  # only rank 0 by default
    assert result.xcom("train")["node_exit_codes"] == [0, 0]


def test_oom_killed_rank_fails_the_try_and_airflow_retries_with_a_new_group(cluster: FakeKubeAPI, run_dag) -> None:
    with Autopilot(cluster, oom):
        result = run_dag(TASK, **RETRY_ONCE)
    assert result.task_states == {"train": "failed"}
    jobs = created_jobs(cluster)
    assert [j[-3:] for j in jobs] == ["-t1", "-t2"]  # one group per try, named by the try
    for job in jobs:
        assert any(c.method == "DELETE" and c.path.endswith(f"/jobs/{job}") for c in cluster.calls)
    assert "OOMKilled" in result.log
    assert "[node 1 rank 1] allocating activations" in result.log  # the failing rank's log tail


def test_missing_image_fails_without_retry(cluster: FakeKubeAPI, run_dag) -> None:
    with Autopilot(cluster, missing_image):
        result = run_dag(TASK, **RETRY_ONCE)
    assert result.task_states == {"train": "failed"}
    assert len(created_jobs(cluster)) == 1  # no second try
    assert "manifest unknown" in result.log and "A retry cannot fix this" in result.log


def test_deferred_task_is_watched_by_the_trigger_through_the_async_hook(cluster: FakeKubeAPI, run_dag) -> None:
    with Autopilot(cluster, oom):
        result = run_dag(TASK.replace("track=False,", "track=False,\n    deferrable=True,"))
    assert result.task_states == {"train": "failed"}
    assert "deferring; the triggerer watches it" in result.log
    assert "OOMKilled" in result.log
    # The re-entry (a fresh backend) deleted the group after keeping the failed pod's log tail.
    assert "[node 1 rank 1] allocating activations" in result.log
    (job,) = created_jobs(cluster)
    assert any(c.method == "DELETE" and c.path.endswith(f"/jobs/{job}") for c in cluster.calls)
    assert any(c.is_watch for c in cluster.calls)
