"""The training task with ``backend="kubernetes"`` through ``dag.test()``, against the fake API server.

An autopilot thread plays scheduler, kubelet and Job controller: whenever a Job appears it creates
its pods, runs them, writes their logs and ends them the way the scenario says. The task talks to
the fake through the Airflow connection ``kubernetes_default`` (defined in the environment).
Scenarios: success, OOM with retries, missing image, deferred; preemption relaunched within the
try (sync and deferred) and its budget; a restarted task attaching to its group; on_kill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_torchrun.backends.kubernetes.backend import DEPLOYMENT_VARIABLE, KubernetesBackend, deployment_name
from airflow_torchrun.backends.kubernetes.render import CONTROLLER_UID_LABEL, INSTANCE_LABEL
from airflow_torchrun.naming import GroupIdentity
from airflow_torchrun.storage.checkpoints import CheckpointStore
from tests.conftest import DagResult

from .conftest import NAMESPACE
from .fake_api import Call, FakeKubeAPI

NS = "default"  # the operator's namespace when none is configured


class Autopilot:
    """Drives every new Job of the fake through one scenario.

    Past ``max_jobs`` Jobs (a runaway relaunch loop) a Job's image is missing, which fails the
    task without retry: such a bug ends in seconds, with the Job count in the assertions. A
    scenario that raises is recorded and fails the test on exit.
    """

    def __init__(self, fake: FakeKubeAPI, scenario: Callable[[FakeKubeAPI, str], None], max_jobs: int = 4) -> None:
        self.fake, self.scenario, self.max_jobs = fake, scenario, max_jobs
        self.seen: list[str] = []
        self._uids: set[str] = set()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for (resource, ns, name), obj in list(self.fake.objects.items()):
                uid = obj["metadata"]["uid"]  # by uid: a Job created again under a used name is new
                if resource == "jobs" and ns == NS and uid not in self._uids:
                    self._uids.add(uid)
                    self.seen.append(name)
                    scenario = self.scenario if len(self.seen) <= self.max_jobs else missing_image
                    try:
                        scenario(self.fake, name)
                    except Exception as exc:  # keep driving the other Jobs; the test fails on exit
                        self.errors.append(f"{name}: {exc!r}")
            self._stop.wait(0.05)

    def __enter__(self) -> Autopilot:
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if exc_type is None and self.errors:
            raise AssertionError(f"the autopilot failed: {self.errors}")


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


def oom_once_watched(fake: FakeKubeAPI, job: str) -> None:
    """:func:`oom`, once a watch of the pods is open (the trigger's async client watching): a
    fixed delay raced the deferral on a loaded machine, and the first look already saw the end."""
    fake.create_pods(NS, job)
    fake.set_running(NS, job)
    pod1 = fake.pod(NS, job, 1)["metadata"]["name"]
    fake.add_log(pod1, "[node 1 rank 1] allocating activations")
    deadline = time.monotonic() + 120
    while not any(c.is_watch for c in fake.calls) and time.monotonic() < deadline:
        time.sleep(0.05)
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
    body = TASK.replace("track=False,", "track=False,\n    execution_timeout=datetime.timedelta(minutes=30),")
    with Autopilot(cluster, succeed):
        result = run_dag(body, imports="import datetime")
    assert result.task_states == {"train": "success"}, result.log[-3000:]
    (job,) = created_jobs(cluster)
    assert job.endswith("-t1")
    posts = [c.path.rsplit("/", 1)[-1] for c in cluster.calls if c.method == "POST"]
    assert posts == ["jobs", "services", "networkpolicies"]
    deletes = [c for c in cluster.calls if c.method == "DELETE" and c.path.endswith(f"/jobs/{job}")]
    assert deletes and all(c.propagation_policy == "Foreground" for c in deletes)
    assert "[node 0 rank 0] step 1 loss 0.50" in result.log  # rank 0's log streamed into the task log
    assert "[node 1 rank 1]" not in result.log  # only rank 0 by default
    assert result.xcom("train")["node_exit_codes"] == [0, 0]
    # The task's execution_timeout is the Job's own deadline (a backstop when no worker is left).
    assert posted_jobs(cluster)[0]["spec"]["activeDeadlineSeconds"] == 1800


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
    with Autopilot(cluster, oom_once_watched):
        result = run_dag(TASK.replace("track=False,", "track=False,\n    deferrable=True,\n    defer_after=0,"))
    assert result.task_states == {"train": "failed"}
    assert "deferring: the triggerer watches it" in result.log
    assert "OOMKilled" in result.log
    # The re-entry (a fresh backend) deleted the group after keeping the failed pod's log tail.
    assert "[node 1 rank 1] allocating activations" in result.log
    (job,) = created_jobs(cluster)
    assert any(c.method == "DELETE" and c.path.endswith(f"/jobs/{job}") for c in cluster.calls)
    assert any(c.is_watch for c in cluster.calls)


def succeed_once_watched(fake: FakeKubeAPI, job: str) -> None:
    """Rank 0's last line written while the trigger watches (its watch of the pods is open)."""
    fake.create_pods(NS, job)
    fake.set_running(NS, job)
    deadline = time.monotonic() + 120
    while not any(c.is_watch for c in fake.calls) and time.monotonic() < deadline:
        time.sleep(0.05)
    fake.add_log(fake.pod(NS, job, 0)["metadata"]["name"], "[node 0 rank 0] FINAL step=40 weights_sha256=ab12")
    fake.set_terminated(NS, job, None, exit_code=0, reason="Completed")


def test_a_deferred_groups_last_lines_reach_the_task_log_before_its_pods_go(cluster: FakeKubeAPI, run_dag) -> None:
    """Found on the real cluster: the trigger streams no log lines, and the re-entry read the logs
    only after its teardown had deleted the pods: rank 0's last lines (FINAL ...) never reached the
    task log of a deferred task."""
    with Autopilot(cluster, succeed_once_watched):
        result = run_dag(TASK.replace("track=False,", "track=False,\n    deferrable=True,\n    defer_after=0,"))
    assert result.task_states == {"train": "success"}, result.log[-3000:]
    assert "deferring: the triggerer watches it" in result.log
    assert "[node 0 rank 0] FINAL step=40 weights_sha256=ab12" in result.log


# -- preemption, reattach, on_kill ---------------------------------------------------------------
PREEMPTED = ("PreemptionByScheduler", "Preempted in order to admit critical pod")


def task(**extra: object) -> str:
    """``TASK`` with more arguments; ``startup_timeout`` keeps a group nobody drives from hanging a test."""
    args = {"startup_timeout": 20, **extra}
    return TASK.replace("track=False,", "track=False," + "".join(f"\n    {k}={v!r}," for k, v in args.items()))


def trainer_env(job: dict[str, Any]) -> dict[str, str]:
    """The plain environment of a Job's trainer container (what every rank starts with)."""
    (trainer,) = [c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer"]
    return {e["name"]: e["value"] for e in trainer.get("env", []) if "value" in e}


def posted_jobs(fake: FakeKubeAPI) -> list[dict[str, Any]]:
    return [c.body for c in fake.calls if c.method == "POST" and c.path.endswith("/jobs")]


def preempt(fake: FakeKubeAPI, job: str) -> None:
    """The group runs and commits a checkpoint, then the scheduler preempts node 0: its peer loses
    it and fails too, and the Job's podFailurePolicy (DisruptionTarget rule) fails the Job."""
    fake.create_pods(NS, job)
    fake.set_running(NS, job)
    store = CheckpointStore(trainer_env(fake.job(NS, job))["TRAIN_CHECKPOINT_URI"])
    step = 5 * len(posted_jobs(fake))  # launch n "trained" up to step 5n
    store.fs.pipe_file(f"{store.step_path(step)}/state.pt", b"weights")
    store.commit(step)
    pod0 = fake.pod(NS, job, 0)["metadata"]["name"]
    fake.add_log(pod0, f"[node 0 rank 0] checkpoint step {step} committed")
    time.sleep(0.3)
    fake.set_terminated(NS, job, 0, exit_code=143, reason="Error", disruption=PREEMPTED)
    fake.set_terminated(NS, job, 1, exit_code=1, reason="Error", finished_offset=1)
    fake.fail_job(
        NS, job, "PodFailurePolicy", f"Pod {NS}/{pod0} has condition DisruptionTarget matching FailJob rule at index 1"
    )


def preempt_first_launch(fake: FakeKubeAPI, job: str) -> None:
    (succeed if job.endswith("-r1") else preempt)(fake, job)


def keep_running(fake: FakeKubeAPI, job: str) -> None:
    fake.create_pods(NS, job)
    fake.set_running(NS, job)
    fake.add_log(fake.pod(NS, job, 0)["metadata"]["name"], "[node 0 rank 0] step 1 loss 0.50")


def wait_for_call(fake: FakeKubeAPI, match: Callable[[Call], bool], *, after: int = 0, timeout: float = 10.0) -> int:
    """Index of the first call at or after ``after`` that matches, -1 if none came in time."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for i, call in enumerate(list(fake.calls)[after:], start=after):
            if match(call):
                return i
        time.sleep(0.02)
    return -1


def try_number(result: DagResult, task_id: str = "train") -> int:
    return result.try_number(task_id)


def foreground_deletes(fake: FakeKubeAPI, job: str) -> list[int]:
    """Indexes of the DELETE calls of ``job``, every one with propagationPolicy Foreground."""
    deletes = [i for i, c in enumerate(fake.calls) if c.method == "DELETE" and c.path.endswith(f"/jobs/{job}")]
    assert all(fake.calls[i].propagation_policy == "Foreground" for i in deletes), [fake.calls[i] for i in deletes]
    return deletes


@pytest.mark.parametrize("deferrable", [False, True], ids=["sync", "deferrable"])
def test_preempted_group_is_relaunched_within_the_same_try_and_resumes(
    cluster: FakeKubeAPI, run_dag, deferrable: bool
) -> None:
    with Autopilot(cluster, preempt_first_launch):
        result = run_dag(task(retries=0, deferrable=deferrable, defer_after=0))
    assert result.task_states == {"train": "success"}, result.log[-3000:]
    assert try_number(result) == 1  # no Airflow retry spent (and retries=0 could not have saved it)
    first, second = created_jobs(cluster)
    assert first.endswith("-t1") and second == f"{first}-r1"
    # The preempted Job was deleted (Foreground) before its replacement was created.
    creates = [i for i, c in enumerate(cluster.calls) if c.method == "POST" and c.path.endswith("/jobs")]
    assert creates[0] < foreground_deletes(cluster, first)[0] < creates[1]
    assert foreground_deletes(cluster, second)  # and the relaunched one once it succeeded
    assert "preemption 1 of max_preemptions=3" in result.log
    assert "Preempted (PreemptionByScheduler): Preempted in order to admit critical pod" in result.log
    # The relaunch resumes from what the preempted group committed, in the same checkpoint location.
    env1, env2 = (trainer_env(job) for job in posted_jobs(cluster))
    assert env1["TRAIN_RESUME_FROM"] == ""
    assert env2["TRAIN_CHECKPOINT_URI"] == env1["TRAIN_CHECKPOINT_URI"]
    assert env2["TRAIN_RESUME_FROM"] == CheckpointStore(env1["TRAIN_CHECKPOINT_URI"]).step_uri(5)
    assert result.xcom("train")["group_id"] == second


@pytest.mark.parametrize("deferrable", [False, True], ids=["sync", "deferrable"])
def test_preemptions_past_max_preemptions_fail_the_task(cluster: FakeKubeAPI, run_dag, deferrable: bool) -> None:
    with Autopilot(cluster, preempt):
        result = run_dag(task(retries=0, max_preemptions=1, deferrable=deferrable, defer_after=0))
    assert result.task_states == {"train": "failed"}
    assert try_number(result) == 1
    jobs = created_jobs(cluster)
    assert len(jobs) == 2 and jobs[1] == f"{jobs[0]}-r1"  # one relaunch, then no more
    for job in jobs:
        assert foreground_deletes(cluster, job)
    assert not [k for k in cluster.objects if k[0] in ("jobs", "pods")]  # nothing left running
    # The task's error is the last group's preemption; the log says the one relaunch spent the budget.
    assert f"Training group {jobs[1]} failed: node 0 was killed by SIGTERM (Preempted (PreemptionByScheduler)" in (
        result.log
    ), result.log[-3000:]
    assert "preemption 1 of max_preemptions=1" in result.log
    assert "its preemption budget is spent (1 relaunch(es), max_preemptions=1); failing this try" in result.log


def leave_group_behind(**context: Any) -> None:
    """What a worker that died after launching left behind: try 1's group of ``train``, running.

    An upstream task of the same DAG run, because only the run knows its ``run_id``; the Job it
    launches is the one try 1 of ``train`` would have launched (same backend, same plan).
    """
    ti = context["ti"]
    train = context["dag"].get_task("train")
    backend = KubernetesBackend(
        namespace=train.namespace, kubernetes_conn_id=train.kubernetes_conn_id, deployment=deployment_name()
    )
    identity = GroupIdentity(dag_id=ti.dag_id, task_id="train", run_id=ti.run_id, try_number=1)
    backend.launch(backend.plan(train.group_spec(), identity, {}))


def test_a_restarted_task_attaches_to_the_group_it_left_running(cluster: FakeKubeAPI, run_dag) -> None:
    def finish_once_attached(fake: FakeKubeAPI, job: str) -> None:
        keep_running(fake, job)
        # Complete only after the task looked for its group and then watched this one's pods.
        found = wait_for_call(fake, lambda c: INSTANCE_LABEL in c.query.get("labelSelector", ""))
        pods = f"{CONTROLLER_UID_LABEL}={fake.job(NS, job)['metadata']['uid']}"
        if found < 0 or wait_for_call(fake, lambda c: c.query.get("labelSelector") == pods, after=found) < 0:
            fake.set_terminated(NS, job, None, exit_code=1, reason="Error")  # nobody attached: fail fast
            return
        time.sleep(0.3)
        fake.set_terminated(NS, job, None, exit_code=0, reason="Completed")

    body = 'left = PythonOperator(task_id="worker_that_died", python_callable=leave_group_behind)\n'
    body += task().strip() + " << left\n"
    imports = (
        "from airflow.providers.standard.operators.python import PythonOperator\n"
        "from tests.k8s.test_operator_k8s import leave_group_behind"
    )
    with Autopilot(cluster, finish_once_attached):
        result = run_dag(body, imports=imports, **RETRY_ONCE)
    assert result.task_states == {"worker_that_died": "success", "train": "success"}, result.log[-3000:]
    assert try_number(result) == 1
    (job,) = created_jobs(cluster)  # the one left behind
    assert job.endswith("-t1")
    lookup = next(i for i, c in enumerate(cluster.calls) if INSTANCE_LABEL in c.query.get("labelSelector", ""))
    assert not [c for c in cluster.calls[lookup:] if c.method == "POST"]  # the task created nothing
    assert f"Attaching to group {job}" in result.log
    assert result.xcom("train")["group_id"] == job
    assert "[node 0 rank 0] step 1 loss 0.50" in result.log  # the attached group's log streamed
    assert foreground_deletes(cluster, job)


def test_on_kill_deletes_the_group(cluster: FakeKubeAPI, run_dag) -> None:
    def kill_once_watched(fake: FakeKubeAPI, job: str) -> None:
        keep_running(fake, job)
        pods = f"{CONTROLLER_UID_LABEL}={fake.job(NS, job)['metadata']['uid']}"
        if wait_for_call(fake, lambda c: c.is_watch and c.query.get("labelSelector") == pods) < 0:
            raise AssertionError(f"the task never watched {job}")
        # What Airflow's task runner receives when the task is cleared or marked failed in the UI.
        os.kill(os.getpid(), signal.SIGTERM)

    with Autopilot(cluster, kill_once_watched):
        result = run_dag(task(retries=0))
    assert result.task_states == {"train": "failed"}
    (job,) = created_jobs(cluster)
    assert f"on_kill: tearing down group {job}" in result.log
    # on_kill's delete, then the task's own teardown finding nothing left (without on_kill's
    # delete there would be only the second); the task says it was killed, not that a rank failed.
    assert len(foreground_deletes(cluster, job)) == 2
    assert f"Group {job} was stopped: the task was killed (on_kill)" in result.log
    assert "no longer exists" not in result.log
    assert not [k for k in cluster.objects if k[0] in ("jobs", "pods", "services", "networkpolicies")]


# -- two deployments on the defaults -----------------------------------------------------------------
SHARED_DAG = """
import pendulum
from airflow.sdk import DAG
from airflow_torchrun import DistributedTrainingOperator

with DAG("shared_ids", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False) as dag:
    DistributedTrainingOperator(
        task_id="train", backend="kubernetes", runtime="cpu", script="/opt/trainer/train.py", num_nodes=2,
        poll_interval=0.05, startup_timeout=20, track=False,
    )

if __name__ == "__main__":  # one run whose run id is the same in every deployment, like a scheduled one
    when = pendulum.datetime(2026, 1, 1)
    run = dag.test(run_after=when, logical_date=when)
    print("RUN", run.run_id, run.state)
"""


def deployment_env(home: Path, dags: Path) -> dict[str, str]:
    """An Airflow deployment of its own: its home, metadata database and state; no [torchrun] deployment."""
    env = {k: v for k, v in os.environ.items() if k != "AIRFLOW__TORCHRUN__DEPLOYMENT"}
    home.mkdir()
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home}/airflow.db",
        AIRFLOW__CORE__DAGS_FOLDER=str(dags),
        AIRFLOW__TORCHRUN__STATE_DIR=str(home / "torchrun"),
    )
    # A checkpoint store of its own, as docs/kubernetes.md asks of a second deployment: one shared with
    # equal run ids is refused before launch (the lineage names its deployment).
    base = env.get("AIRFLOW__TORCHRUN__CHECKPOINT_BASE")
    if base:
        env["AIRFLOW__TORCHRUN__CHECKPOINT_BASE"] = f"{base.rstrip('/')}/{home.name}"
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, capture_output=True)
    return env


def stored_deployment(env: dict[str, str]) -> str:
    command = [sys.executable, "-m", "airflow", "variables", "get", DEPLOYMENT_VARIABLE]
    return subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.slow
def test_two_deployments_on_the_defaults_never_attach_to_each_others_group(
    cluster: FakeKubeAPI, tmp_path: Path
) -> None:
    """Two Airflow deployments, each with its own database and neither with ``[torchrun]
    deployment`` set, run the same DAG with the same run id (what every scheduled run is) into one
    namespace. The second starts while the first one's group runs: it launches a Job of its own,
    and the first one's Job is neither attached to nor deleted until the first task ends it."""
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "shared_ids.py").write_text(textwrap.dedent(SHARED_DAG))
    first_env, second_env = deployment_env(tmp_path / "first", dags), deployment_env(tmp_path / "second", dags)
    release = threading.Event()

    def first_runs_until_released(fake: FakeKubeAPI, job: str) -> None:
        if created_jobs(fake)[0] != job:
            return succeed(fake, job)
        keep_running(fake, job)
        threading.Thread(target=lambda: (release.wait(120), succeed_now(fake, job)), daemon=True).start()

    command = [sys.executable, str(dags / "shared_ids.py")]
    with Autopilot(cluster, first_runs_until_released):
        first = subprocess.Popen(command, env=first_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 120
            while not created_jobs(cluster) and time.monotonic() < deadline and first.poll() is None:
                time.sleep(0.2)
            if not created_jobs(cluster):
                first.kill()
                raise AssertionError(f"the first deployment launched no Job: {first.communicate()[0][-3000:]}")
            (first_job,) = created_jobs(cluster)
            second = subprocess.run(command, env=second_env, capture_output=True, text=True, timeout=240, check=False)
            second_out = second.stdout + second.stderr
            assert ("jobs", NS, first_job) in cluster.objects, (
                f"the first one's Job is gone before its task ended it: {second_out[-3000:]}"
            )
        finally:
            release.set()
            first_out, _ = first.communicate(timeout=240)
    assert first.returncode == 0 and second.returncode == 0, (first_out[-3000:], second_out[-3000:])
    same_run = "RUN manual__2026-01-01T00:00:00+00:00 success"
    assert same_run in first_out and same_run in second_out, (first_out[-3000:], second_out[-3000:])
    first_job, second_job = created_jobs(cluster)
    assert second_job != first_job
    assert "Attaching to group" not in second_out, second_out[-3000:]
    identities = stored_deployment(first_env), stored_deployment(second_env)
    assert identities[0] != identities[1]
    labels = [job["metadata"]["labels"]["airflow-torchrun/deployment"] for job in posted_jobs(cluster)]
    assert labels == list(identities)
    # Each deployment deleted its own Job and only that one.
    deleted = {c.path.rsplit("/", 1)[1] for c in cluster.calls if c.method == "DELETE" and "/jobs/" in c.path}
    assert deleted == {first_job, second_job}


def succeed_now(fake: FakeKubeAPI, job: str) -> None:
    for index in (0, 1):
        fake.add_log(fake.pod(NS, job, index)["metadata"]["name"], f"[node {index} rank {index}] done")
    fake.set_terminated(NS, job, None, exit_code=0, reason="Completed")
