"""The Kubernetes backend under a real scheduler: one ``airflow standalone`` (api-server, scheduler,
dag-processor, triggerer, LocalExecutor on SQLite) pointed at the real cluster through the Airflow
connection of ``make cluster``, runs triggered over REST as a user runs them.

- A deferred task's triggerer is killed (kill -9, it and its processes) mid-run and a new one is
  started: the new triggerer watches the real API again and the task succeeds in its first try with
  one Job and the uninterrupted run's weights. Meanwhile the Training view's API reads the real pods:
  every rank running, on which node, its progress.
- The Airflow worker running a sync task is killed (kill -9 of the executor's worker process and the
  task under it): the scheduler finds the task dead and retries it; the next try attaches to the
  group the dead worker left, never a second group running beside it, and the training ends with the
  uninterrupted run's weights.
- A rank fails for good (an exit code in ``fail_on_exit_codes``): the view shows the failed rank,
  its exit code and the failure's text read from the real pods.

After each test nothing of the standalone's deployment may be left on the cluster (Jobs, Pods,
Services, NetworkPolicies, Secrets) and no rank process may run.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from tests.standalone import Standalone, Triggerers, alive, cmdline, descendants, start_standalone, wait_for

from .conftest import (
    FINAL,
    LONG_TRAINER_ARGS,
    Airflow,
    Code,
    Recorder,
    home_env,
    nothing_left,
    training_dag,
    uninterrupted,
    wait_for_step,
)

DEFERRED = "e2e_deferred"
WORKER_KILL = "e2e_worker_kill"
FAILING = "e2e_failing"
HEALTH_THRESHOLD_S = 15
HEARTBEAT_TIMEOUT_S = 30
RUN_DEADLINE_S = 900


@pytest.fixture(scope="module")
def standalone(cluster_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    root = tmp_path_factory.mktemp("e2e-standalone")
    dags = root / "dags"
    dags.mkdir()
    (dags / f"{DEFERRED}.py").write_text(
        training_dag(
            DEFERRED,
            script_args=LONG_TRAINER_ARGS,
            deferrable=True,
            defer_after=0,
            poll_interval=1.0,
            max_preemptions=0,
        )
    )
    (dags / f"{WORKER_KILL}.py").write_text(
        training_dag(
            WORKER_KILL,
            script_args=LONG_TRAINER_ARGS,
            deferrable=False,
            retries=1,
            retry_delay=Code("timedelta(0)"),
            max_preemptions=0,
        )
    )
    (dags / f"{FAILING}.py").write_text(
        training_dag(
            FAILING,
            script_args=["--epochs", "12", "--checkpoint-every", "20", "--fail-at-step", "30", "--fail-rank", "1"],
            fail_on_exit_codes=[1],
            retries=1,
        )
    )
    deployment = f"e2e-standalone-{os.getpid()}"
    extra = {
        **cluster_env,
        "AIRFLOW__TORCHRUN__DEPLOYMENT": deployment,
        # A new triggerer takes over a dead one's triggers once its heartbeat is this old (default 30 s).
        "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": str(HEALTH_THRESHOLD_S),
        # The scheduler calls a task whose worker stopped heartbeating dead after this (default 300 s).
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT_S),
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
    }
    with start_standalone(root, dags, DEFERRED, "train", extra_env=extra) as server:
        for dag_id in (DEFERRED, WORKER_KILL, FAILING):
            server.wait_parsed(dag_id)
            server.unpause(dag_id)
        yield server
    nothing_left(deployment)


@pytest.fixture(scope="module")
def expected(cluster_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The uninterrupted run's final step and weights (``airflow dags test`` in an Airflow home of its own)."""
    home = tmp_path_factory.mktemp("e2e-uninterrupted")
    (home / "airflow").mkdir()
    (home / "dags").mkdir()
    env = home_env(cluster_env, home, f"e2e-uninterrupted-{os.getpid()}")
    airflow = Airflow(home / "airflow", home / "dags", env)
    assert airflow.run("db", "migrate", timeout=300).returncode == 0
    try:
        return uninterrupted(airflow, LONG_TRAINER_ARGS)
    finally:
        nothing_left(env["AIRFLOW__TORCHRUN__DEPLOYMENT"])


def deployment_of(server: Standalone) -> str:
    raw = Path(f"/proc/{server.proc.pid}/environ").read_bytes().decode(errors="replace")
    return next(v.split("=", 1)[1] for v in raw.split("\0") if v.startswith("AIRFLOW__TORCHRUN__DEPLOYMENT="))


def view(server: Standalone, dag_id: str, run_id: str, try_number: int | None = None) -> dict[str, Any]:
    path = f"/torchrun/api/v1/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/train"
    return dict(server.ok("GET", path + (f"?try_number={try_number}" if try_number else "")))


def final_of(server: Standalone, run_id: str, try_number: int = 1) -> tuple[str, str] | None:
    found = FINAL.findall(server.task_log(run_id, try_number, "train"))
    return found[-1] if found else None


def test_triggerer_killed_mid_run_the_task_succeeds_in_its_first_try_and_the_view_reads_the_pods(
    standalone: Standalone, expected: tuple[str, str]
) -> None:
    server = standalone.for_dag(DEFERRED, "train")
    deployment = deployment_of(server)
    triggerers = Triggerers(server)
    try:
        with Recorder(deployment) as seen:
            run_id = server.trigger({})
            server.wait_deferred(run_id)
            server.wait_trigger_watching(run_id)
            pods = wait_for_step(deployment, 20)
            # The view, while the group trains: every rank running, on the pod of its node, progressing.
            docs: list[dict[str, Any]] = []

            def running_with_progress() -> dict[str, Any] | None:
                docs.append(view(server, DEFERRED, run_id))
                d = docs[-1]
                ranks = [r["state"] for r in d["ranks"]]
                moving = (d["progress"] or {}).get("step")  # "reached" once the group ended
                return d if d["state"] == "running" and ranks == ["running", "running"] and moving else None

            try:
                doc = wait_for("the view to show both ranks running with progress", running_with_progress, 60, 2.0)
            except AssertionError as exc:
                looked = [
                    (
                        d["state"],
                        [r["state"] for r in d["ranks"]],
                        (d["progress"] or {}).get("step"),
                        d.get("group_not_shown"),
                    )
                    for d in docs
                ]
                raise AssertionError(f"{exc}; the view showed: {looked}") from None
            assert (doc["backend"], doc["num_nodes"], doc["world_size"]) == ("kubernetes", 2, 2), doc
            assert doc["group_id"] == pods["0"]["metadata"]["labels"]["airflow-torchrun/group"], doc
            # The launches table names the Job that runs (it once derived an id without the deployment).
            assert [launch["group_id"] for launch in doc["launches"]] == [doc["group_id"]], doc["launches"]
            env, victims = triggerers.kill_current()
            time.sleep(2)
            assert not any(alive(p) for p in victims), "the triggerer survived kill -9"
            triggerers.start(env, 1)
            state = server.wait_run_state(run_id, {"success", "failed"}, RUN_DEADLINE_S)
        ti = server.ti(run_id)
        assert (state, ti.get("try_number")) == ("success", 1), server.task_log(run_id)[-5000:]
        # The new triggerer ran the trigger again (its own log), and no second group was made.
        fresh = [p for p in (server.home / "logs").rglob("attempt=1.log.trigger.*.log") if f"run_id={run_id}" in str(p)]
        assert len(fresh) >= 2 and any("Watching group" in p.read_text() for p in fresh[1:]), fresh
        assert len(seen.jobs) == 1 and seen.most_jobs_running == 1, seen.jobs
        assert final_of(server, run_id) == expected
        done = view(server, DEFERRED, run_id)
        assert done["ti_state"] == "success" and done["progress"]["reached"] == done["progress"]["total_steps"], done
    finally:
        triggerers.stop()
    nothing_left(deployment)


def task_processes(server: Standalone, run_id: str) -> list[int]:
    """The executor's worker process running the task (``airflow worker -- LocalExecutor <ti>``) and
    every process under it (the task runner)."""
    ti_id = server.ti(run_id).get("id")
    found = []
    for pid in descendants(server.proc.pid):
        line = cmdline(pid)
        if "airflow worker --" in line and (WORKER_KILL in line or (ti_id and ti_id in line)) and alive(pid):
            found.append(pid)
    roots = [p for p in found if not any(p in descendants(q) for q in found)]
    return [pid for root in roots for pid in (root, *descendants(root))]


def test_worker_killed_mid_run_the_retry_attaches_and_never_a_second_group_runs(
    standalone: Standalone, expected: tuple[str, str]
) -> None:
    server = standalone.for_dag(WORKER_KILL, "train")
    deployment = deployment_of(server)
    with Recorder(deployment) as seen:
        run_id = server.trigger({})
        wait_for_step(deployment, 20)
        victims = wait_for("the task's worker processes", lambda: task_processes(server, run_id), 60)
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed_at = time.monotonic()
        state = server.wait_run_state(run_id, {"success", "failed"}, RUN_DEADLINE_S)
    ti = server.ti(run_id)
    log2 = server.task_log(run_id, 2, "train")
    assert (state, ti.get("try_number")) == ("success", 2), f"{server.task_log(run_id, 1)[-3000:]}\n{log2[-3000:]}"
    assert "Attaching to group" in log2, log2[-5000:]
    # The dead worker's group trained on and was attached to: one Job, never two running at once.
    assert len(seen.jobs) == 1 and seen.most_jobs_running == 1, seen.jobs
    assert final_of(server, run_id, 2) == expected
    print(f"worker killed -> success in try 2 after {time.monotonic() - killed_at:.0f}s")
    nothing_left(deployment)


def test_a_failed_rank_is_shown_in_the_view_after_its_group_is_gone(standalone: Standalone) -> None:
    server = standalone.for_dag(FAILING, "train")
    deployment = deployment_of(server)
    run_id = server.trigger({})
    state = server.wait_run_state(run_id, {"success", "failed"}, RUN_DEADLINE_S)
    assert state == "failed" and server.ti(run_id).get("try_number") == 1, "fail_on_exit_codes=[1] was retried"
    # The teardown deleted the Job, its pods and their logs: the view shows how the try concluded.
    doc = view(server, FAILING, run_id)
    assert (doc["ti_state"], doc["state"]) == ("failed", "failed"), json.dumps(doc)[-4000:]
    ranks = {r["rank"]: r for r in doc["ranks"]}
    assert ranks[1]["state"] == "failed" and ranks[1]["exit_code"] not in (None, 0), doc["ranks"]
    failure = doc.get("failure") or ""
    assert "rank 1 (node 1, local rank 0) exited with code 1" in failure and "Simulated failure" in failure, failure
    assert "no longer exists" not in failure, failure
    assert doc["progress"]["reached"] >= 20, doc["progress"]
    nothing_left(deployment)
