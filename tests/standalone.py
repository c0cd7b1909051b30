"""One real ``airflow standalone`` for a test module, driven through its REST API as a user would.

``start_standalone()`` starts api-server, scheduler, dag-processor, triggerer and LocalExecutor
(SQLite) in a temporary AIRFLOW_HOME on free ports, waits until the scheduler and triggerer are
healthy, logs in as the generated admin and waits for the named DAG to be parsed. On exit it stops
the whole process group and tears down any training group a test left behind (the groups'
supervisors run in sessions of their own, outside standalone's process group).

On two cores the services take about half a minute to come up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

from airflow_torchrun.backends.base import GroupHandle
from airflow_torchrun.backends.local.backend import LocalBackend
from tests.ports import reserved_ports

STARTUP_DEADLINE_S = 300.0
RUN_DEADLINE_S = 240.0
PARSE_DEADLINE_S = 120.0


def wait_for(what: str, check: Callable[[], Any], deadline_s: float, interval: float = 0.5) -> Any:
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
    """A running ``airflow standalone``; ``dag_id`` and ``task_id`` are the defaults of the helpers."""

    home: Path
    base_url: str
    state_dir: Path
    work_dir: Path
    proc: subprocess.Popen[bytes]
    output: Path
    dag_id: str
    task_id: str
    token: str = ""
    username: str = ""
    password: str = ""

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """``(status, JSON body)``; an HTTP error gives its body as text, no connection gives status 0."""
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
        """The JSON body of a 2xx answer; anything else fails the test with the services' output."""
        code, data = self.request(method, path, body)
        assert 200 <= code < 300, f"{method} {path} -> {code}: {data}\n{self.tail()}"
        return data

    def tail(self, lines: int = 60) -> str:
        text = self.output_text()
        return "airflow standalone output (last lines):\n" + "\n".join(text.splitlines()[-lines:])

    def for_dag(self, dag_id: str, task_id: str) -> Standalone:
        """The same running services, with ``dag_id`` and ``task_id`` as the helpers' defaults."""
        return replace(self, dag_id=dag_id, task_id=task_id)

    def wait_parsed(self, dag_id: str, deadline_s: float = PARSE_DEADLINE_S) -> None:
        wait_for(
            f"DAG {dag_id} to be parsed", lambda: self.request("GET", f"/api/v2/dags/{dag_id}")[0] == 200, deadline_s
        )

    def unpause(self, dag_id: str | None = None) -> None:
        self.ok("PATCH", f"/api/v2/dags/{dag_id or self.dag_id}", {"is_paused": False})

    def trigger(self, conf: Mapping[str, Any], dag_id: str | None = None) -> str:
        """Trigger a manual run with ``conf``; its run id."""
        body = {"logical_date": None, "conf": dict(conf)}
        run = self.ok("POST", f"/api/v2/dags/{dag_id or self.dag_id}/dagRuns", body)
        return str(run["dag_run_id"])

    def xcom(self, run_id: str, key: str, task_id: str | None = None) -> Any:
        """An XCom value of the task instance as the REST API gives it; ``None`` while there is none."""
        path = f"/api/v2/dags/{self.dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id or self.task_id}"
        code, data = self.request("GET", f"{path}/xcomEntries/{key}")
        return data.get("value") if code == 200 and isinstance(data, dict) else None

    def ti(self, run_id: str, task_id: str | None = None) -> dict[str, Any]:
        """The task instance as the REST API shows it; ``{}`` while it does not exist."""
        path = f"/api/v2/dags/{self.dag_id}/dagRuns/{run_id}/taskInstances/{task_id or self.task_id}"
        code, data = self.request("GET", path)
        return data if code == 200 and isinstance(data, dict) else {}

    def wait_ti_state(self, run_id: str, states: set[str], deadline_s: float = RUN_DEADLINE_S) -> str:
        seen: list[str] = []

        def check() -> str | None:
            state = str(self.ti(run_id).get("state"))
            if not seen or seen[-1] != state:
                seen.append(state)
            return state if state in states else None

        try:
            return str(wait_for(f"task {self.task_id} of {run_id} to reach {sorted(states)}", check, deadline_s))
        except AssertionError as exc:
            raise AssertionError(f"{exc}; states seen: {seen}\n{self.task_log(run_id)}\n{self.tail()}") from None

    def wait_deferred(self, run_id: str, try_number: int = 1) -> None:
        """Deferred, and the scheduler has processed the executor's report of the deferring worker."""
        assert self.wait_ti_state(run_id, {"deferred", "failed", "success"}) == "deferred"
        key = (
            f"TaskInstanceKey(dag_id={self.dag_id!r}, task_id={self.task_id!r}, run_id={run_id!r}, "
            f"try_number={try_number},"
        )
        line = f"Received executor event with state success for task instance {key}"
        wait_for(f"the scheduler to process the defer exit of {run_id}", lambda: line in self.output_text(), 120)

    def wait_trigger_watching(self, run_id: str, try_number: int = 1) -> None:
        """The triggerer runs the task's trigger (its log says so). Before that, Airflow has no
        running trigger to cancel: marking the task failed then cannot reach ``on_kill``."""

        def watching() -> bool:
            logs = (self.home / "logs").rglob(f"attempt={try_number}.log.trigger.*.log")
            return any(f"run_id={run_id}" in str(p) and "Watching group" in p.read_text(errors="replace") for p in logs)

        wait_for(f"the triggerer to watch the group of {run_id}", watching, 120)

    def wait_run_state(self, run_id: str, states: set[str], deadline_s: float = RUN_DEADLINE_S) -> str:
        """Wait for the DAG run to reach one of ``states``; on timeout, fail with the task states seen."""

        def check() -> str | None:
            code, data = self.request("GET", f"/api/v2/dags/{self.dag_id}/dagRuns/{run_id}")
            if code == 0 or code >= 500:
                # The API server's one worker stalls while a task starts on SQLite (its PATCH .../run
                # waited 33 s for the database here): not an answer, so ask again.
                return None
            assert code == 200 and isinstance(data, dict), f"GET the run {run_id} -> {code}: {data}"
            state = str(data.get("state"))
            return state if state in states else None

        try:
            return str(wait_for(f"DAG run {run_id} to reach {sorted(states)}", check, deadline_s, interval=2.0))
        except AssertionError as exc:
            tis = self.ok("GET", f"/api/v2/dags/{self.dag_id}/dagRuns/{run_id}/taskInstances")
            states_now = {t["task_id"]: (t["state"], t["try_number"]) for t in tis["task_instances"]}
            raise AssertionError(f"{exc}; task instances: {states_now}\n{self.tail()}") from None

    def output_text(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def task_log(self, run_id: str, try_number: int = 1, task_id: str | None = None) -> str:
        """The task logs of ``run_id``'s ``try_number`` as written on disk (every task, or ``task_id``'s)."""
        logs = [p for p in (self.home / "logs").rglob(f"attempt={try_number}.log") if f"run_id={run_id}" in str(p)]
        if task_id is not None:
            logs = [p for p in logs if f"task_id={task_id}" in str(p)]
        return "\n".join(p.read_text(errors="replace") for p in logs)


@contextmanager
def start_standalone(
    root: Path,
    dags_folder: Path,
    dag_id: str,
    task_id: str,
    extra_env: Mapping[str, str] | None = None,
    base_path: str = "",
) -> Iterator[Standalone]:
    """Run ``airflow standalone`` with ``root/{airflow,torchrun,work}`` as home, state dir and cwd.

    ``base_path`` (e.g. ``"/airflow"``): serve Airflow under that subpath (``[api] base_url``); the
    helpers' ``base_url`` includes it.

    Yields once ``dag_id`` is parsed (still paused: :meth:`Standalone.unpause`). On exit the whole
    process group is stopped and no training group may be left running.
    """
    home, state_dir, work_dir = (root / n for n in ("airflow", "torchrun", "work"))
    for d in (home, state_dir, work_dir):
        d.mkdir(parents=True, exist_ok=True)
    # Held until the services are stopped: they bind them only after their start-up (tens of seconds).
    with reserved_ports(3) as (port, worker_log_port, trigger_log_port):
        env = {
            **os.environ,
            # standalone starts its services as `airflow ...` from PATH: this interpreter's one
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "AIRFLOW__TORCHRUN__STATE_DIR": str(state_dir),
            # Other helpers may run their own standalone: no fixed port anywhere.
            "AIRFLOW__API__PORT": str(port),
            "AIRFLOW__API__BASE_URL": f"http://localhost:{port}{base_path}/"
            if base_path
            else f"http://localhost:{port}",
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(worker_log_port),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(trigger_log_port),
            "AIRFLOW__CORE__PARALLELISM": "4",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "OMP_NUM_THREADS": "1",
            # The OpenLineage provider (the openlineage extra) has no transport here; tests that want
            # lineage configure one (tests/test_openlineage.py).
            "AIRFLOW__OPENLINEAGE__DISABLED": "True",
        }
        # The state dir's own SQLite store, not a tracking server of the developer's environment.
        env.pop("MLFLOW_TRACKING_URI", None)
        env.update(extra_env or {})
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
        url = f"http://127.0.0.1:{port}{base_path}"
        server = Standalone(home, url, state_dir, work_dir, proc, output, dag_id, task_id)
        try:

            def healthy() -> bool:
                assert proc.poll() is None, f"airflow standalone exited with {proc.returncode}\n{server.tail()}"
                # a service that could not start is reported on the output, the process stays up
                assert "Exception in thread" not in server.tail(400), f"a service failed to start\n{server.tail()}"
                code, data = server.request("GET", "/api/v2/monitor/health")
                if code != 200 or not isinstance(data, dict):
                    return False
                return all((data.get(c) or {}).get("status") == "healthy" for c in ("scheduler", "triggerer"))

            wait_for("airflow standalone to be healthy", healthy, STARTUP_DEADLINE_S, interval=1.0)
            passwords = home / "simple_auth_manager_passwords.json.generated"
            text = wait_for("the admin password file", lambda: passwords.exists() and passwords.read_text(), 60)
            users = json.loads(text)
            server.username, server.password = next(iter(users.items()))
            credentials = {"username": server.username, "password": server.password}
            server.token = server.ok("POST", "/auth/token", credentials)["access_token"]
            server.wait_parsed(dag_id)
            yield server
        finally:
            stop_process_group(proc)
            leftovers = teardown_groups(state_dir)
            assert not leftovers, f"groups still running when the module ended: {leftovers}"


def read_group(location: Path) -> dict[str, Any] | None:
    """The group handle a local launch wrote to ``location/group.json``; None while there is none."""
    try:
        return dict(json.loads((location / "group.json").read_text()))
    except (FileNotFoundError, ValueError):
        return None


def teardown_groups(state_dir: Path) -> dict[str, list[int]]:
    """Tear down every local group under ``state_dir``; the ones that were still running, with their pids."""
    backend = LocalBackend(state_dir)
    leftovers: dict[str, list[int]] = {}
    for location in (state_dir / "groups").glob("*"):
        data = read_group(location)
        if data is not None:
            handle = GroupHandle.from_dict(data)
            pids = backend.running_pids(handle)
            if pids:
                leftovers[handle.group_id] = list(pids)
            backend.teardown(handle)
    return leftovers


def stop_process_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group led by ``proc``, then SIGKILL whatever of it is left."""
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


# -- the processes of a running standalone ------------------------------------------------------
def descendants(pid: int, depth: int = 1 << 10) -> list[int]:
    """The descendants of ``pid`` down to ``depth`` generations (read from /proc)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out: list[int] = []
    todo = [(pid, 0)]
    while todo:
        parent, level = todo.pop()
        if level < depth:
            for child in parents.get(parent, []):
                out.append(child)
                todo.append((child, level + 1))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie is dead, only not yet reaped by its parent


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class Triggerers:
    """The triggerer now running (standalone's at first, then each one a trial started)."""

    server: Standalone
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def current(self) -> int:
        if self.started:
            return self.started[-1].pid
        found = [p for p in descendants(self.server.proc.pid, depth=1) if " triggerer" in cmdline(p) and alive(p)]
        assert len(found) == 1, f"airflow standalone should run one triggerer, found {found}"
        return found[0]

    def kill_current(self) -> tuple[dict[str, str], list[int]]:
        """SIGKILL the triggerer and every process under it; its environment and the pids killed."""
        pid = self.current()
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
        victims = [pid, *descendants(pid)]
        for victim in victims:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return env, victims

    def start(self, env: dict[str, str], n: int) -> subprocess.Popen[bytes]:
        with open(self.server.home.parent / f"triggerer-{n}.out", "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "airflow", "triggerer"],
                env=env,
                cwd=self.server.work_dir,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # stopped by its process group below
            )
        self.started.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.started:
            stop_process_group(proc)
