"""The e2e suite against the real cluster of ``make cluster`` (``cluster/``).

The session fixture uses the running cluster or brings it up; where it cannot (not root, no Go),
the suite is skipped with the reason, except in CI (``CI=true``), where that is a failure. Every
test drives the public contract only: DAG files with ``DistributedTrainingOperator(backend=
"kubernetes", ...)`` run by ``airflow dags test`` (or ``airflow standalone``), with the Airflow
connection ``kubernetes_default`` that the cluster's environment file defines, and kubectl. After
each test, nothing of its DAG may be left on the cluster (Jobs, Pods, Services, Secrets) and no
rank process may run on the machine.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cluster import kube
from cluster.layout import NAMESPACE, NODES, ROOT, state
from cluster.up import airflow_env, home_env

IN_CI = os.environ.get("CI", "").strip().lower() == "true"
RUN_DEADLINE_S = 900.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A pipeline on the cluster takes minutes on two cores: the suite-wide 300 s is not for these.
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.timeout(1800))


def _cluster_running() -> bool:
    try:
        return kube.api_ready() and len(kube.ready_nodes()) == len(NODES)
    except SystemExit:  # kubectl not built yet
        return False


@pytest.fixture(scope="session")
def cluster_env() -> dict[str, str]:
    """The environment an Airflow process needs for the cluster (from its environment file)."""
    if not _cluster_running():
        why = ""
        if os.geteuid() != 0:
            why = "the cluster needs root (kubelets, containerd)"
        else:
            done = subprocess.run([sys.executable, "-m", "cluster", "up"], cwd=ROOT, check=False)
            if done.returncode != 0:
                why = f"python -m cluster up exited {done.returncode}"
        if why or not _cluster_running():
            message = f"no Kubernetes cluster: {why or 'it did not become ready'} (make cluster)"
            if IN_CI:
                pytest.fail(message)
            pytest.skip(message)
    return airflow_env(state())


@dataclass
class DagRun:
    rc: int
    output: str
    tasks: dict[str, tuple[str, int]] = field(default_factory=dict)

    def state(self, task_id: str) -> str:
        return self.tasks.get(task_id, ("missing", 0))[0]

    def tries(self, task_id: str) -> int:
        return self.tasks.get(task_id, ("missing", 0))[1]


@dataclass
class Airflow:
    """An Airflow home of its own (SQLite) with a DAGs folder, pointed at the cluster."""

    home: Path
    dags: Path
    env: dict[str, str]

    def write_dag(self, name: str, source: str) -> Path:
        path = self.dags / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        return path

    def run(self, *args: str, timeout: float = RUN_DEADLINE_S) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "airflow", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def dags_test(self, dag_id: str, conf: dict[str, Any] | None = None, timeout: float = RUN_DEADLINE_S) -> DagRun:
        args = ["dags", "test", dag_id]
        if conf:
            args += ["-c", json.dumps(conf)]
        done = self.run(*args, timeout=timeout)
        output = done.stdout + done.stderr
        (self.home / f"{dag_id}.log").write_text(output)
        return DagRun(done.returncode, output, self.task_states(dag_id))

    def task_states(self, dag_id: str) -> dict[str, tuple[str, int]]:
        with sqlite3.connect(self.home / "airflow.db") as db:
            run = db.execute("select run_id from dag_run where dag_id=? order by id desc limit 1", (dag_id,)).fetchone()
            if run is None:
                return {}
            rows = db.execute(
                "select task_id, state, try_number from task_instance where dag_id=? and run_id=?", (dag_id, run[0])
            ).fetchall()
        return {task: (str(st), int(tries)) for task, st, tries in rows}

    def xcom(self, dag_id: str, task_id: str, key: str = "return_value") -> Any:
        with sqlite3.connect(self.home / "airflow.db") as db:
            row = db.execute(
                "select value from xcom where dag_id=? and task_id=? and key=? order by dag_run_id desc limit 1",
                (dag_id, task_id, key),
            ).fetchone()
        return None if row is None else json.loads(row[0])


@pytest.fixture
def airflow(cluster_env: dict[str, str], tmp_path: Path) -> Iterator[Airflow]:
    """The test's Airflow; afterwards, none of its objects may be on the cluster and no rank
    process may run (polled: pods are deleted gracefully)."""
    home, dags = tmp_path / "airflow", tmp_path / "dags"
    home.mkdir()
    dags.mkdir()
    # One deployment name per test: a test's Jobs are told from every other test's by it.
    env = home_env(cluster_env, tmp_path, f"e2e-{os.getpid()}-{time.monotonic_ns() % 10**6}")
    af = Airflow(home, dags, env)
    done = af.run("db", "migrate", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    yield af
    nothing_left(af.env["AIRFLOW__TORCHRUN__DEPLOYMENT"])


def objects_of(deployment: str) -> dict[str, list[str]]:
    """Every Job, Pod, Service, NetworkPolicy and Secret of one deployment's groups still on the cluster."""
    found = {}
    for kind in ("jobs", "pods", "services", "networkpolicies", "secrets"):
        items = kube.kubectl_json("get", kind, "-n", NAMESPACE, "-l", f"airflow-torchrun/deployment={deployment}")
        found[kind] = [i["metadata"]["name"] for i in items["items"]]
    return found


def rank_processes() -> list[str]:
    """torchrun agents and ranks running in the cluster's pods (their cgroups), on this machine."""
    cgroup = state().cgroup
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            groups = (proc / "cgroup").read_text()
        except OSError:
            continue
        if cgroup in groups and ("torch.distributed.run" in cmd or "airflow_torchrun.worker" in cmd):
            found.append(f"{proc.name}: {cmd[:160]}")
    return found


def nothing_left(deployment: str) -> None:
    deadline = time.monotonic() + 120
    left: dict[str, list[str]] = {}
    procs: list[str] = []
    while time.monotonic() < deadline:
        left = {k: v for k, v in objects_of(deployment).items() if v}
        procs = rank_processes()
        if not left and not procs:
            return
        time.sleep(2)
    # Clean up for the next test, then fail this one.
    kube.kubectl(
        "delete",
        "jobs,pods,services",
        "-n",
        NAMESPACE,
        "-l",
        f"airflow-torchrun/deployment={deployment}",
        "--wait=false",
        check=False,
    )
    pytest.fail(f"left behind after the test: objects {left}, rank processes {procs}")


class Recorder:
    """What the cluster said about one deployment's Jobs and Pods while a test ran: every distinct
    Job condition and pod state seen, polled once a second (the objects are gone afterwards), and the
    most Jobs of it seen running at once (not finished, not being deleted)."""

    def __init__(self, deployment: str) -> None:
        import threading

        self.deployment = deployment
        self.job_conditions: dict[str, list[dict[str, Any]]] = {}
        self.pod_states: dict[str, list[dict[str, Any]]] = {}
        self.nodes: dict[str, str] = {}
        self.jobs: list[str] = []  # every Job seen, in the order first seen
        self.most_jobs_running = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Recorder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        selector = f"airflow-torchrun/deployment={self.deployment}"
        while not self._stop.wait(1.0):
            try:
                items = kube.kubectl_json("get", "jobs,pods", "-n", NAMESPACE, "-l", selector, timeout=20)["items"]
            except (RuntimeError, subprocess.TimeoutExpired, ValueError):
                continue
            running = [obj["metadata"]["name"] for obj in items if obj["kind"] == "Job" and job_running(obj)]
            self.most_jobs_running = max(self.most_jobs_running, len(running))
            for obj in items:
                name = obj["metadata"]["name"]
                status = obj.get("status", {})
                if obj["kind"] == "Job":
                    if name not in self.jobs:
                        self.jobs.append(name)
                    for cond in status.get("conditions", []):
                        seen = self.job_conditions.setdefault(name, [])
                        if cond not in seen:
                            seen.append(cond)
                else:
                    if obj["spec"].get("nodeName"):
                        self.nodes[name] = obj["spec"]["nodeName"]
                    snapshot = {
                        "phase": status.get("phase"),
                        "reason": status.get("reason"),
                        "conditions": sorted(
                            (c["type"], c["status"], c.get("reason")) for c in status.get("conditions", [])
                        ),
                        "containers": [c.get("state") for c in status.get("containerStatuses", [])],
                    }
                    seen = self.pod_states.setdefault(name, [])
                    if snapshot not in seen:
                        seen.append(snapshot)


def job_running(job: dict[str, Any]) -> bool:
    """A Job that may still have ranks at work: not being deleted, no final (or failing) condition."""
    if job["metadata"].get("deletionTimestamp"):
        return False
    done = {"Complete", "Failed", "FailureTarget", "SuccessCriteriaMet"}
    return not any(c["type"] in done and c["status"] == "True" for c in job.get("status", {}).get("conditions", []))


# -- the shipped trainer as one training task, and its uninterrupted result ---------------------
FINAL = re.compile(r"FINAL step=(\d+) weights_sha256=([0-9a-f]{64})")
STEP = re.compile(r"step (\d+)/")
TRAINER = "/opt/trainer/train.py"
# 264 steps on two 1-CPU pods, about 8 s of training; a checkpoint every 20 steps.
TRAINER_ARGS = ["--epochs", "12", "--checkpoint-every", "20", "--log-every", "20"]
# 3300 steps, about a minute: long enough to look at, and to kill something beside it.
LONG_TRAINER_ARGS = ["--epochs", "150", "--checkpoint-every", "100", "--log-every", "20"]


class Code(str):
    """An operator argument written into the DAG file as it is (``Code("timedelta(0)")``)."""


def training_dag(dag_id: str, **operator: Any) -> str:
    """A DAG of one ``DistributedTrainingOperator`` (the shipped trainer on two nodes of the cluster's
    ``cpu`` runtime); ``operator`` adds or overrides its arguments (Python literals)."""
    arguments: dict[str, Any] = {
        "task_id": "train",
        "backend": "kubernetes",
        "runtime": "cpu",
        "script": TRAINER,
        "script_args": TRAINER_ARGS,
        "num_nodes": 2,
        "nproc_per_node": 1,
        "track": False,
        "retries": 0,
        "startup_timeout": 300,
        **operator,
    }
    rendered = ", ".join(f"{k}={v if isinstance(v, Code) else repr(v)}" for k, v in arguments.items())
    return textwrap.dedent(
        f"""
        import pendulum
        from datetime import timedelta
        from airflow.sdk import DAG
        from airflow_torchrun import DistributedTrainingOperator

        with DAG({dag_id!r}, schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False):
            DistributedTrainingOperator({rendered})
        """
    )


_UNINTERRUPTED: dict[tuple[str, ...], tuple[str, str]] = {}


def uninterrupted(airflow: Airflow, script_args: list[str] = TRAINER_ARGS) -> tuple[str, str]:
    """The final step and weights digest of the training task run with nothing in its way (once per
    session and arguments, through ``airflow dags test`` on the cluster): what every interrupted run
    with the same arguments must end with."""
    key = tuple(script_args)
    if key not in _UNINTERRUPTED:
        dag_id = f"uninterrupted_{len(_UNINTERRUPTED)}"
        airflow.write_dag(dag_id, training_dag(dag_id, script_args=list(script_args)))
        run = airflow.dags_test(dag_id)
        assert run.state("train") == "success", run.output[-5000:]
        found = FINAL.findall(run.output)
        assert found, run.output[-5000:]
        _UNINTERRUPTED[key] = found[-1]
    return _UNINTERRUPTED[key]


def last_step(pod_log: str) -> int:
    return max((int(s) for s in STEP.findall(pod_log)), default=0)


def group_pods(deployment: str) -> list[dict[str, Any]]:
    items = kube.kubectl_json("get", "pods", "-n", NAMESPACE, "-l", f"airflow-torchrun/deployment={deployment}")
    return list(items["items"])


def pod_log(pod: str) -> str:
    return kube.kubectl("logs", "-n", NAMESPACE, pod, "-c", "trainer", check=False, timeout=30)


def wait_for_step(deployment: str, step: int, deadline_s: float = 600) -> dict[str, dict[str, Any]]:
    """Wait until node 0's pod of the deployment's running group has logged ``step`` (or later);
    the running pods by completion index."""
    deadline = time.monotonic() + deadline_s
    by_index: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        running = [p for p in group_pods(deployment) if p["status"].get("phase") == "Running"]
        by_index = {p["metadata"]["labels"].get("batch.kubernetes.io/job-completion-index", ""): p for p in running}
        if "0" in by_index and last_step(pod_log(by_index["0"]["metadata"]["name"])) >= step:
            return by_index
        time.sleep(1)
    raise AssertionError(f"no pod of {deployment} reached step {step} in {deadline_s:.0f}s (running: {list(by_index)})")
