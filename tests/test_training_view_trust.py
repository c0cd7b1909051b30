"""Issue 23: the training view's API and XCom-driven links, each with the review's probe as its scenario.

XCom is data others can write: every task of the DAG, every user the REST API lets edit XComs (what
these tests do, through the same table), and rank 0 of a ``@task.torchrun`` task (its return value).
The API server must not let it choose a directory, a connection, an identity or a loop's size
(finding 2), a link's scheme or host (4), what a user without the task-log or XCom permission
sees (9), or how long a request holds the server (11).

A real task instance (``dag.test()`` of a task that does nothing), its XComs written afterwards,
group state written where a group's files live, and the API in process behind Airflow's own JWTs
and ``requires_access_dag``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import yaml
from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

from tests.conftest import STATE_DIR, DagResult
from tests.k8s.fake_api import FakeKubeAPI

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SECRET = "SECRET-OF-ANOTHER-DAG-7f3a"
TI_ONLY = "ti_only"  # may read the DAG's task instances, not their logs or XComs


class TrustAuthManager(SimpleAuthManager):
    """Airflow's simple auth manager, except that ``ti_only`` may read task instances only."""

    def is_authorized_dag(self, *, method: Any, user: Any, access_entity: Any = None, details: Any = None) -> bool:
        from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity

        if user.get_name() == TI_ONLY and access_entity in (DagAccessEntity.TASK_LOGS, DagAccessEntity.XCOM):
            return False
        return bool(super().is_authorized_dag(method=method, user=user, access_entity=access_entity, details=details))


def _sources() -> Any:
    """The view's sources module, or a stand-in where it does not exist (to run these against e4ca0ea)."""
    import importlib
    import types

    try:
        return importlib.import_module("airflow_torchrun.ui.sources")
    except ImportError:
        return types.SimpleNamespace(clear_caches=lambda: None, MAX_RANK_ROWS=1024)


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Callable[[str], dict[str, str]]]]:
    from airflow.api_fastapi import app as airflow_app
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
    from fastapi.testclient import TestClient

    from airflow_torchrun.ui import api as view_api

    sources = _sources()
    monkeypatch.setenv("AIRFLOW__CORE__AUTH_MANAGER", f"{__name__}.{TrustAuthManager.__name__}")
    monkeypatch.setenv("AIRFLOW__API_AUTH__JWT_SECRET", "a-secret-for-these-tests-only-0123456789")
    monkeypatch.setattr(view_api, "LOOK_EVERY_S", 0.0, raising=False)
    sources.clear_caches()
    airflow_app._AuthManagerState.instance = None
    manager = airflow_app.create_auth_manager()

    def headers(user: str) -> dict[str, str]:
        token = manager.generate_jwt(SimpleAuthManagerUser(username=user, role="viewer"))
        return {"Authorization": f"Bearer {token}"}

    try:
        yield TestClient(view_api.create_app()), headers
    finally:
        airflow_app._AuthManagerState.instance = None
        sources.clear_caches()


@pytest.fixture
def task_instance(run_dag: Callable[..., DagResult]) -> DagResult:
    """A finished task instance called ``train`` (a task that does nothing: no group of its own)."""
    result = run_dag(
        """
        @task(task_id="train")
        def train_task():
            return None

        train_task()
        """,
        imports="from airflow.sdk import task",
    )
    assert result.state == "success", result.log[-3000:]
    return result


def forge(result: DagResult, key: str, value: Any) -> None:
    """What a user with XCom access writes through the REST API (or another task of the DAG)."""
    from airflow.models.xcom import XComModel

    XComModel.set(key, value, dag_id=result.dag_id, task_id="train", run_id=result.run_id, map_index=-1)


def doc_path(result: DagResult) -> str:
    return f"/api/v1/dags/{result.dag_id}/dagRuns/{quote(result.run_id, safe='')}/taskInstances/train"


def local_group(result: DagResult, *, world_size: int = 1, failed_log: str | None = None) -> dict[str, Any]:
    """A local group's files where this task instance's group lives (what a launch writes), and its handle."""
    from airflow_torchrun.naming import GroupIdentity

    group_id = GroupIdentity(result.dag_id, "train", result.run_id, try_number=1).group_id
    group_dir = STATE_DIR / "groups" / group_id
    (group_dir / "node-0").mkdir(parents=True, exist_ok=True)
    handle = {
        "backend": "local",
        "group_id": group_id,
        "num_nodes": 1,
        "world_size": world_size,
        "launched_at": time.time(),
        "startup_timeout": 600.0,
        "teardown_grace": 10.0,
        "relaunch": 0,
        "group_dir": str(group_dir),
        "master_port": 29500,
    }
    (group_dir / "group.json").write_text(json.dumps(handle))
    if failed_log is not None:
        (group_dir / "node-0" / "node.log").write_text(failed_log)
        exit_info = {"returncode": 1, "signal": None, "stopped_by": None, "started_at": 1.0, "finished_at": 2.0}
        (group_dir / "node-0" / "exit.json").write_text(json.dumps(exit_info))
    return handle


# -- finding 2: the view trusted the group handle in XCom ---------------------------------------------
def test_the_view_never_reads_a_directory_or_a_count_from_xcom(
    task_instance: DagResult, api: tuple[Any, Callable[[str], dict[str, str]]], tmp_path: Path
) -> None:
    """The probe: a handle in XCom whose ``group_dir`` is another DAG's group (its log holds that
    DAG's secret) and whose ``world_size`` is 3,000,000 (43 s and 1.6 GB of the API server's per poll)."""
    victim = tmp_path / "another-dags-group"
    (victim / "node-0").mkdir(parents=True)
    (victim / "node-0" / "node.log").write_text(f"[node 0 rank 0] Traceback: {SECRET}\n")
    (victim / "node-0" / "exit.json").write_text(json.dumps({"returncode": 1, "signal": None}))
    forged = {
        "backend": "local",
        "group_id": "another-dag-train-0123456789-t1",
        "num_nodes": 1,
        "world_size": 3_000_000,
        "launched_at": time.time(),
        "startup_timeout": 600.0,
        "teardown_grace": 10.0,
        "group_dir": str(victim),
        "master_port": 29500,
    }
    forge(task_instance, "group", forged)
    client, headers = api
    started = time.monotonic()
    answer = client.get(doc_path(task_instance), headers=headers("reader"))
    took = time.monotonic() - started
    assert answer.status_code == 200, answer.text
    assert SECRET not in answer.text
    doc = answer.json()
    assert doc["group_id"] is None and doc["ranks"] == [], doc  # this task instance launched no group here
    assert took < 10, f"one poll took {took:.1f}s"


def test_a_group_claiming_3000000_ranks_is_shown_bounded(
    task_instance: DagResult, api: tuple[Any, Callable[[str], dict[str, str]]]
) -> None:
    """The group's own files (which its ranks, running as the same user, could write) claim
    3,000,000 ranks: the document lists a bounded number of them, quickly."""
    max_rows = _sources().MAX_RANK_ROWS
    handle = local_group(task_instance, world_size=3_000_000)
    forge(task_instance, "group", handle)
    client, headers = api
    started = time.monotonic()
    doc = client.get(doc_path(task_instance), headers=headers("reader")).json()
    assert time.monotonic() - started < 10
    assert doc["world_size"] == 3_000_000 and len(doc["ranks"]) == doc.get("ranks_shown") == max_rows, {
        k: v for k, v in doc.items() if k != "ranks"
    }


@pytest.fixture
def clusters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeKubeAPI, FakeKubeAPI, Path]]:
    """The deployment's own cluster (its configured connection and namespace) and another one,
    whose kubeconfig a forged handle names."""
    ours, theirs = FakeKubeAPI().start(), FakeKubeAPI().start()
    mine, other = tmp_path / "ours.kubeconfig", tmp_path / "theirs.kubeconfig"
    mine.write_text(yaml.safe_dump(ours.kubeconfig("ml")))
    other.write_text(yaml.safe_dump(theirs.kubeconfig("kube-system")))
    conn = {"conn_type": "kubernetes", "extra": {"kube_config_path": str(mine)}}
    monkeypatch.setenv("AIRFLOW_CONN_KUBERNETES_DEFAULT", json.dumps(conn))
    monkeypatch.setenv("AIRFLOW__TORCHRUN__KUBERNETES_NAMESPACE", "ml")
    monkeypatch.setenv("AIRFLOW__TORCHRUN__DEPLOYMENT", "prod")
    try:
        yield ours, theirs, other
    finally:
        ours.stop()
        theirs.stop()


def _kubernetes_handle(result: DagResult, **fields: Any) -> dict[str, Any]:
    return {
        "backend": "kubernetes",
        "group_id": "forged",
        "num_nodes": 2,
        "world_size": 2,
        "launched_at": time.time(),
        "startup_timeout": 600.0,
        "teardown_grace": 10.0,
        "namespace": "ml",
        "job_name": "forged",
        **fields,
    }


def test_the_view_reaches_the_cluster_only_through_the_deployments_own_connection(
    task_instance: DagResult, api: tuple[Any, Callable[[str], dict[str, str]]], clusters: Any
) -> None:
    """The probe: a handle in XCom naming a kubeconfig of its own (the API server's identity sent
    to any server), another connection, and the namespace ``kube-system``."""
    ours, theirs, other_kubeconfig = clusters
    forge(
        task_instance,
        "group",
        _kubernetes_handle(
            task_instance, config_file=str(other_kubeconfig), kubernetes_conn_id="someone_elses", job_name="coredns"
        ),
    )
    client, headers = api
    answer = client.get(doc_path(task_instance), headers=headers("reader"))
    assert answer.status_code == 200, answer.text
    assert theirs.calls == [], [c.path for c in theirs.calls]
    assert ours.calls and all("/namespaces/ml/" in c.path for c in ours.calls), [c.path for c in ours.calls]
    assert not any(c.path.endswith("/jobs/coredns") for c in ours.calls)  # the Job's name is derived, too
    # A namespace this API server does not read is not looked into at all.
    ours.calls.clear()
    _sources().clear_caches()
    forge(task_instance, "group", _kubernetes_handle(task_instance, namespace="kube-system"))
    doc = client.get(doc_path(task_instance), headers=headers("reader")).json()
    assert "kube-system" in doc["group_not_shown"] and "kubernetes_view_namespaces" in doc["group_not_shown"]
    assert ours.calls == [] and theirs.calls == []


def test_an_ended_kubernetes_group_is_shown_as_its_try_concluded_not_as_a_deleted_job(
    task_instance: DagResult, api: tuple[Any, Callable[[str], dict[str, str]]], clusters: Any
) -> None:
    """Found on the real cluster: once the task's teardown had deleted its failed group's Job, the
    view said "node 0 was lost: its Job no longer exists" instead of the rank's failure."""
    from airflow_torchrun.naming import GroupIdentity

    group_id = GroupIdentity(task_instance.dag_id, "train", task_instance.run_id, 1, deployment="prod").group_id
    forge(task_instance, "group", _kubernetes_handle(task_instance, group_id=group_id, job_name=group_id))
    failure = f"Training group {group_id} failed: rank 1 (node 1, local rank 0) exited with code 1."
    nodes = [
        {"node_rank": 0, "phase": "failed", "exit_code": 1, "signal": None, "reason": None, "stopped_by": None},
        {"node_rank": 1, "phase": "failed", "exit_code": 3, "signal": None, "reason": None, "stopped_by": None},
    ]
    record = {"group_id": group_id, "outcome": "failed", "nodes": nodes, "failure": failure}
    forge(task_instance, "group_end", record)
    client, headers = api
    doc = client.get(doc_path(task_instance), headers=headers("reader")).json()
    assert (doc["group_id"], doc["state"], doc["failure"]) == (group_id, "failed", failure), doc
    assert [(r["state"], r["exit_code"]) for r in doc["ranks"]] == [("failed", 1), ("failed", 3)]
    # The record of another group, or one of another shape, is not taken for this group's end.
    for forged in ({**record, "group_id": "another"}, {**record, "nodes": [{"node_rank": 7, "phase": "failed"}]}):
        _sources().clear_caches()
        from airflow_torchrun.ui import api as view_api

        view_api._FOLLOWED.clear()
        forge(task_instance, "group_end", forged)
        doc = client.get(doc_path(task_instance), headers=headers("reader")).json()
        assert doc["failure"] != failure and "no longer exists" in (doc["failure"] or ""), doc["failure"]


# -- finding 11: the API server could be tied up ---------------------------------------------------------
def test_the_view_holds_no_pod_watch_and_reads_logs_bounded(
    task_instance: DagResult, api: tuple[Any, Callable[[str], dict[str, str]]], clusters: Any
) -> None:
    """The probe: every poll of every open view held a 5 s pod watch in the API server's shared
    pool and read whole pod logs; now a look is a few plain requests and log reads carry a limit."""
    from airflow_torchrun.backends.kubernetes.backend import KubernetesBackend
    from airflow_torchrun.backends.kubernetes.runtimes import BUILTIN_RUNTIMES
    from airflow_torchrun.contract.progress import ProgressRecord
    from airflow_torchrun.naming import GroupIdentity
    from airflow_torchrun.spec import GroupSpec

    ours, _theirs, _ = clusters
    backend = KubernetesBackend(namespace="ml", deployment="prod", runtimes=BUILTIN_RUNTIMES, watch_seconds=1.0)
    identity = GroupIdentity(task_instance.dag_id, "train", task_instance.run_id, try_number=1)
    spec = GroupSpec.create(num_nodes=2, nproc_per_node=1, script="/opt/t.py", backend="kubernetes", runtime="cpu")
    handle = backend.launch(backend.plan(spec, identity, {}))
    ours.create_pods("ml", handle.job_name)
    ours.set_running("ml", handle.job_name)
    for n in (0, 1):
        pod = ours.pod("ml", handle.job_name, n)["metadata"]["name"]
        lines = [f"[node {n} rank {n}] " + ProgressRecord(rank=n, step=s, time=1.0 + s).to_line() for s in range(50)]
        ours.add_log(pod, *lines)
    forge(task_instance, "group", _kubernetes_handle(task_instance, relaunch=0))
    ours.calls.clear()
    client, headers = api
    for _ in range(3):
        doc = client.get(doc_path(task_instance), headers=headers("reader")).json()
    assert doc["group_id"] == handle.group_id and [r["state"] for r in doc["ranks"]] == ["running", "running"], doc
    assert [r["step"] for r in doc["ranks"]] == [49, 49]
    assert not [c for c in ours.calls if c.is_watch], "the view held a watch open"
    log_reads = [c for c in ours.calls if c.path.endswith("/log")]
    assert log_reads and all("limitBytes" in c.query for c in log_reads), [c.query for c in log_reads]


def test_the_view_reads_only_the_xcoms_it_shows(
    task_instance: DagResult, api: tuple[Any, Callable[[str], dict[str, str]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe: every poll deserialised every XCom of the DAG run (here 200 of 50 kB each)."""
    from airflow.models.xcom import XComModel

    for n in range(200):
        XComModel.set(
            f"big_{n}", "x" * 50_000, dag_id=task_instance.dag_id, task_id="train", run_id=task_instance.run_id
        )
    seen: list[str] = []
    original = XComModel.deserialize_value

    def counting(row: Any) -> Any:
        seen.append(row.key)
        return original(row)

    monkeypatch.setattr(XComModel, "deserialize_value", staticmethod(counting))
    client, headers = api
    for _ in range(2):
        assert client.get(doc_path(task_instance), headers=headers("reader")).status_code == 200
    assert not [k for k in seen if k.startswith("big_")], f"{len(seen)} XComs deserialised"


def test_a_task_not_started_yet_is_shown_pending_not_missing(
    task_instance: DagResult, api: tuple[Any, Callable[[str], dict[str, str]]]
) -> None:
    """Found on the real cluster: a user who opened the Training tab of a queued task (no try run
    yet: try_number 0) got 404 "try 0 of train does not exist"."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import update

    with create_session() as session:
        session.execute(
            update(TaskInstance)
            .where(TaskInstance.dag_id == task_instance.dag_id, TaskInstance.run_id == task_instance.run_id)
            .values(try_number=0, state="queued")
        )
    client, headers = api
    answer = client.get(doc_path(task_instance), headers=headers("reader"))
    assert answer.status_code == 200, answer.text
    doc = answer.json()
    assert (doc["ti_state"], doc["state"], doc["group_id"], doc["latest_try"]) == ("queued", "pending", None, 0), doc
    assert client.get(doc_path(task_instance) + "?try_number=2", headers=headers("reader")).status_code == 404


# -- finding 9: the view's permissions were too narrow, its docs routes open ---------------------------
def test_the_view_serves_no_docs_or_schema_without_auth(api: tuple[Any, Callable[[str], dict[str, str]]]) -> None:
    client, _headers = api
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        assert client.get(path).status_code == 404, path


def test_log_text_and_xcom_values_need_those_permissions(
    task_instance: DagResult, api: tuple[Any, Callable[[str], dict[str, str]]]
) -> None:
    """The probe: a user who may read the DAG's task instances, but not their logs or XComs, read
    the failure's log tail and the XCom links through the view."""
    handle = local_group(task_instance, failed_log=f"[node 0 rank 0] Traceback (most recent call last): {SECRET}\n")
    forge(task_instance, "group", handle)
    forge(task_instance, "mlflow_run_url", "http://localhost:5000/#/experiments/1/runs/abc")
    forge(task_instance, "resumed_from", {"uri": "file:///tmp/x/step-00000010", "step": 10})
    client, headers = api
    full = client.get(doc_path(task_instance), headers=headers("reader")).json()
    assert full["state"] == "failed" and SECRET in (full["failure"] or ""), full
    assert full["resumed_from"] and full["withheld"] == []
    limited = client.get(doc_path(task_instance), headers=headers(TI_ONLY))
    assert limited.status_code == 200
    assert SECRET not in limited.text, limited.text
    doc = limited.json()
    assert doc["state"] == "failed" and doc["failure"] is None and doc["withheld"] == ["task logs", "XCom"]
    assert doc["resumed_from"] is None and all(v is None for v in doc["links"].values())


# -- finding 4: links of any scheme -------------------------------------------------------------------
def test_links_of_any_scheme_or_host_never_reach_the_view_or_the_extra_links(
    task_instance: DagResult, api: tuple[Any, Callable[[str], dict[str, str]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe: ``javascript:`` in the XCom links reached the extra links and the view; for
    ``@task.torchrun`` the view took the final checkpoint (hence the Checkpoint link) from rank 0's
    own return value."""
    monkeypatch.setenv("AIRFLOW__TORCHRUN__MLFLOW_UI_URL", "http://mlflow.internal:5000")
    monkeypatch.setenv("AIRFLOW__TORCHRUN__CHECKPOINT_CONSOLE_URL", "https://console.internal/browse?p={key}")
    forge(task_instance, "mlflow_run_url", "javascript:fetch('/api/v2/variables').then(alert)")
    forge(task_instance, "checkpoint_url", "https://evil.example.com/phish")
    forge(task_instance, "model_version_url", "http://mlflow.internal:5000.evil.example.com/#/models/m")
    # @task.torchrun: rank 0 returned this; the training's own summary is under training_summary.
    forge(task_instance, "return_value", {"final_checkpoint": "javascript:alert(1)", "group_id": "x"})
    forge(task_instance, "training_summary", {"final_checkpoint": "s3://bucket/run/step-00000042", "group_id": "x"})
    client, headers = api
    doc = client.get(doc_path(task_instance), headers=headers("reader")).json()
    assert doc["final_checkpoint"] == "s3://bucket/run/step-00000042"
    assert doc["links"]["mlflow_run"] is None and doc["links"]["model_version"] is None, doc["links"]
    assert doc["links"]["checkpoint"] == "https://console.internal/browse?p=run/step-00000042"


def test_extra_links_show_only_http_links_under_the_configured_bases(
    run_dag: Callable[..., DagResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The extra links are computed in the task's own process once it ends (Airflow 3 stores them for
    the UI); a task of the DAG wrote ``javascript:`` and foreign hosts into the XComs they read."""
    monkeypatch.setenv("AIRFLOW__TORCHRUN__MLFLOW_UI_URL", "http://mlflow.internal:5000")
    result = run_dag(
        """
        @task(task_id="train")
        def train_task(ti=None):
            from airflow.models.taskinstancekey import TaskInstanceKey

            from airflow_torchrun.links import CheckpointLink, MlflowRunLink, ModelVersionLink

            key = TaskInstanceKey(ti.dag_id, ti.task_id, ti.run_id, ti.try_number, ti.map_index)
            links = [MlflowRunLink(), CheckpointLink(), ModelVersionLink()]
            out = {}
            for url in (
                "javascript:fetch('/api/v2/variables').then(alert)",
                "https://evil.example.com/phish",
                "http://mlflow.internal:5000.evil.example.com/#/x",
                "http://mlflow.internal:5000/#/experiments/1/runs/abc",
            ):
                for link in links:
                    ti.xcom_push(key=link.key, value=url)
                out[url] = [link.get_link(None, ti_key=key) for link in links]
            print("LINKS " + json.dumps(out), flush=True)

        train_task()
        """,
        imports="import json\nfrom airflow.sdk import task",
    )
    assert result.state == "success", result.log[-3000:]
    line = next(x for x in result.log.splitlines() if "LINKS " in x)
    links, _ = json.JSONDecoder().raw_decode(line.split("LINKS ", 1)[1])
    assert links["javascript:fetch('/api/v2/variables').then(alert)"] == ["", "", ""]
    assert links["https://evil.example.com/phish"] == ["", "", ""]
    assert links["http://mlflow.internal:5000.evil.example.com/#/x"] == ["", "", ""]
    run = "http://mlflow.internal:5000/#/experiments/1/runs/abc"
    assert links[run] == [run, "", run]  # MLflow links under the MLflow UI; the checkpoint's is the console's
