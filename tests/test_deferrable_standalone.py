"""Deferrable training under ``airflow standalone``: a real scheduler, LocalExecutor and triggerer.

One ``airflow standalone`` (api-server, scheduler, dag-processor, triggerer; SQLite) is started in
a temporary AIRFLOW_HOME for the module and driven through its REST API, as a user would:

- success: while the group trains the task instance is ``deferred``; releasing the ranks ends
  the task ``success``, with nothing left running;
- a rank exiting with code 7: the task fails with the same message as in sync mode;
- marking the deferred task failed: the triggerer calls the trigger's ``on_kill``, which tears
  the group down.

The ranks hold their outcome until the test releases them, and the test releases them only once
the scheduler has processed the executor's report of the worker that deferred. Airflow 3.3.2 fails
a task whose trigger fires before that report is processed while the resumed try is already
queued or running ("state mismatch"; apache/airflow#67287, #71580, #72716, open): a real race for
groups that fail within seconds, but not what these tests are about.

Slow (the services need about half a minute to come up on two cores): ``-m slow``.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from airflow_torchrun.backends.base import GroupHandle
from airflow_torchrun.backends.local import LocalBackend
from airflow_torchrun.wiring import GroupIdentity

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DAG_ID = "torchrun_deferrable"
TASK_ID = "train"
STARTUP_DEADLINE_S = 300.0
RUN_DEADLINE_S = 240.0

# Each rank joins the group and waits for the file argv[2]; then "ok" finishes, "fail" makes
# rank 1 exit with code 7 while rank 0 carries on.
SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"rank {rank} joined, sum={int(t.item())}", flush=True)
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.1)
    if sys.argv[1] == "fail":
        if rank == 1:
            # Leave the group first: exiting with a live gloo group intermittently ends in
            # SIGABRT ("terminate called without an active exception") instead of the exit code.
            dist.destroy_process_group()
            sys.exit(7)
        time.sleep(300)  # rank 0 stays healthy: the operator tears it down
    dist.barrier()
    dist.destroy_process_group()
    """
)

DAG_FILE = textwrap.dedent(
    """
    import pendulum
    from airflow.sdk import DAG
    from airflow_torchrun import DistributedTrainingOperator

    with DAG({dag_id!r}, schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False) as dag:
        DistributedTrainingOperator(
            task_id={task_id!r},
            script={script!r},
            script_args=["{{{{ dag_run.conf['mode'] }}}}", "{{{{ dag_run.conf['release'] }}}}"],
            num_nodes=2,
            nproc_per_node=1,
            teardown_grace=3.0,
            poll_interval=0.5,
            deferrable=True,
            retries=0,
        )
    """
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(what: str, check: Callable[[], Any], deadline_s: float, interval: float = 0.5) -> Any:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + deadline_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {deadline_s:.0f}s waiting for {what} (last seen: {last!r})")


@dataclass
class Standalone:
    home: Path
    base_url: str
    state_dir: Path
    work_dir: Path
    proc: subprocess.Popen[bytes]
    output: Path
    token: str = ""

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.base_url}{path}", data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            return 0, str(exc)

    def ok(self, method: str, path: str, body: Any = None) -> Any:
        code, data = self.request(method, path, body)
        assert 200 <= code < 300, f"{method} {path} -> {code}: {data}\n{self.tail()}"
        return data

    def tail(self, lines: int = 60) -> str:
        text = self.output_text()
        return "airflow standalone output (last lines):\n" + "\n".join(text.splitlines()[-lines:])

    def trigger(self, conf: dict[str, str]) -> str:
        run = self.ok("POST", f"/api/v2/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": conf})
        return str(run["dag_run_id"])

    def ti(self, run_id: str) -> dict[str, Any]:
        code, data = self.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{TASK_ID}")
        return data if code == 200 and isinstance(data, dict) else {}

    def wait_ti_state(self, run_id: str, states: set[str], deadline_s: float = RUN_DEADLINE_S) -> str:
        seen: list[str] = []

        def check() -> str | None:
            state = str(self.ti(run_id).get("state"))
            if not seen or seen[-1] != state:
                seen.append(state)
            return state if state in states else None

        try:
            return str(_wait(f"task {TASK_ID} of {run_id} to reach {sorted(states)}", check, deadline_s))
        except AssertionError as exc:
            raise AssertionError(f"{exc}; states seen: {seen}\n{self.task_log(run_id)}\n{self.tail()}") from None

    def wait_deferred(self, run_id: str, try_number: int = 1) -> None:
        """Deferred, and the scheduler has processed the executor's report of the deferring worker."""
        assert self.wait_ti_state(run_id, {"deferred", "failed", "success"}) == "deferred"
        key = f"TaskInstanceKey(dag_id={DAG_ID!r}, task_id={TASK_ID!r}, run_id={run_id!r}, try_number={try_number},"
        line = f"Received executor event with state success for task instance {key}"
        _wait(f"the scheduler to process the defer exit of {run_id}", lambda: line in self.output_text(), 120)

    def output_text(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def task_log(self, run_id: str, try_number: int = 1) -> str:
        logs = [p for p in (self.home / "logs").rglob(f"attempt={try_number}.log") if f"run_id={run_id}" in str(p)]
        return "\n".join(p.read_text(errors="replace") for p in logs)


def _read_group(location: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads((location / "group.json").read_text()))
    except (FileNotFoundError, ValueError):
        return None


def _operator_is_deferrable() -> bool:
    from airflow_torchrun.operators.training import DistributedTrainingOperator

    return "deferrable" in inspect.signature(DistributedTrainingOperator.__init__).parameters


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    if not _operator_is_deferrable():
        pytest.skip("DistributedTrainingOperator has no deferrable argument yet")
    root = tmp_path_factory.mktemp("standalone")
    home, dags, state_dir, work_dir = (root / n for n in ("airflow", "dags", "torchrun", "work"))
    for d in (home, dags, state_dir, work_dir):
        d.mkdir()
    script = work_dir / "tiny_dist.py"
    script.write_text(SCRIPT)
    (dags / f"{DAG_ID}.py").write_text(DAG_FILE.format(dag_id=DAG_ID, task_id=TASK_ID, script=str(script)))

    port = _free_port()
    env = {
        **os.environ,
        # standalone starts its services as `airflow ...` from PATH: this interpreter's one
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__TORCHRUN__STATE_DIR": str(state_dir),
        # Other helpers may run their own standalone: no fixed port anywhere.
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": f"http://localhost:{port}",
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(_free_port()),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(_free_port()),
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "OMP_NUM_THREADS": "1",
    }
    output = root / "standalone.out"
    with open(output, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "airflow", "standalone"],
            env=env,
            cwd=work_dir,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its services share this process group: stopped by it below
        )
    server = Standalone(home, f"http://127.0.0.1:{port}", state_dir, work_dir, proc, output)
    try:

        def healthy() -> bool:
            assert proc.poll() is None, f"airflow standalone exited with {proc.returncode}\n{server.tail()}"
            # a service that could not start is reported on the output, the process stays up
            assert "Exception in thread" not in server.tail(400), f"a service failed to start\n{server.tail()}"
            code, data = server.request("GET", "/api/v2/monitor/health")
            if code != 200 or not isinstance(data, dict):
                return False
            return all((data.get(c) or {}).get("status") == "healthy" for c in ("scheduler", "triggerer"))

        _wait("airflow standalone to be healthy", healthy, STARTUP_DEADLINE_S, interval=1.0)
        passwords = home / "simple_auth_manager_passwords.json.generated"
        users = json.loads(_wait("the admin password file", lambda: passwords.exists() and passwords.read_text(), 60))
        username, password = next(iter(users.items()))
        server.token = server.ok("POST", "/auth/token", {"username": username, "password": password})["access_token"]
        _wait(f"DAG {DAG_ID} to be parsed", lambda: server.request("GET", f"/api/v2/dags/{DAG_ID}")[0] == 200, 120)
        server.ok("PATCH", f"/api/v2/dags/{DAG_ID}", {"is_paused": False})
        yield server
    finally:
        _stop_process_group(proc)
        # The groups' supervisors run in sessions of their own: stop whatever a test left behind.
        backend = LocalBackend(state_dir)
        leftovers = {}
        for location in (state_dir / "groups").glob("*"):
            data = _read_group(location)
            if data is not None:
                handle = GroupHandle.from_dict(data)
                if backend.running_pids(handle):
                    leftovers[handle.group_id] = backend.running_pids(handle)
                backend.teardown(handle)
        assert not leftovers, f"groups still running when the module ended: {leftovers}"


def _stop_process_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    try:  # the group may outlive its leader: stop every member
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def _group(server: Standalone, run_id: str, try_number: int = 1) -> tuple[LocalBackend, GroupHandle]:
    group_id = GroupIdentity(DAG_ID, TASK_ID, run_id, try_number).group_id
    location = server.state_dir / "groups" / group_id
    data = _wait(f"group {group_id} to be launched", lambda: _read_group(location), 60)
    return LocalBackend(server.state_dir), GroupHandle.from_dict(data)


def test_deferred_while_training_then_success(standalone: Standalone) -> None:
    release = standalone.work_dir / f"release-{uuid.uuid4().hex[:8]}"
    run_id = standalone.trigger({"mode": "ok", "release": str(release)})
    standalone.wait_deferred(run_id)
    backend, handle = _group(standalone, run_id)
    assert backend.running_pids(handle), "the group should be training while the task is deferred"
    # Training holds no worker slot: the task stays deferred for as long as the ranks run.
    time.sleep(2)
    assert standalone.ti(run_id).get("state") == "deferred"
    release.touch()
    state = standalone.wait_ti_state(run_id, {"success", "failed", "up_for_retry"})
    assert state == "success", standalone.task_log(run_id)
    assert backend.running_pids(handle) == []
    assert f"Group {handle.group_id} succeeded" in standalone.task_log(run_id)


def test_failing_rank_fails_the_task_with_the_sync_message(standalone: Standalone) -> None:
    release = standalone.work_dir / f"release-{uuid.uuid4().hex[:8]}"
    run_id = standalone.trigger({"mode": "fail", "release": str(release)})
    standalone.wait_deferred(run_id)
    release.touch()
    state = standalone.wait_ti_state(run_id, {"success", "failed", "up_for_retry"})
    log = standalone.task_log(run_id)
    assert state == "failed", log
    assert "rank 1 (node 1, local rank 0) exited with code 7" in log
    backend, handle = _group(standalone, run_id)
    assert backend.running_pids(handle) == []


def test_marking_the_deferred_task_failed_tears_the_group_down(standalone: Standalone) -> None:
    never = standalone.work_dir / "never-released"
    run_id = standalone.trigger({"mode": "ok", "release": str(never)})
    standalone.wait_deferred(run_id)
    backend, handle = _group(standalone, run_id)
    assert backend.running_pids(handle)
    standalone.ok("PATCH", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{TASK_ID}", {"new_state": "failed"})
    # The triggerer cancels the trigger as a user action and awaits its on_kill (teardown).
    _wait(f"group {handle.group_id} to be torn down", lambda: backend.running_pids(handle) == [], 90)
    assert standalone.ti(run_id).get("state") == "failed"
