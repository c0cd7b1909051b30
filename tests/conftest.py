"""Shared fixtures: a throwaway Airflow (SQLite), a way to run a DAG through ``dag.test()``, moto's
S3 server and the example trainer's uninterrupted digest, each made once per session.

Airflow reads its configuration when first imported, so the environment is set here, at import
time of the test session, before any test module imports Airflow.

Under pytest-xdist (``make test``: ``-n``, ``--dist loadgroup``) each worker is a session of its
own: its own temporary Airflow home, state dir, SQLite DB and moto server (this module runs in
each worker), so tests on different workers share no state. Ports are taken free from the OS
everywhere. What must not be split between workers is in one group (``XDIST_GROUPS``, read by
:func:`pytest_xdist_make_scheduler`). ``make check`` adds ``--forbid-processes``
(``tests/process_guard.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography.fernet import Fernet

from airflow_torchrun.backends.local import zygote
from airflow_torchrun.backends.local.zygote import DIR_VAR as ZYGOTE_DIR_VAR
from tests import durations, process_guard
from tests.chaos import matrix
from tests.example_trainer import IMPORTS as TRAINER_IMPORTS
from tests.example_trainer import digest, train_task
from tests.mlflow_server import MlflowServer
from tests.ports import reserved_ports

# One moto server per session (each test makes its own bucket): bound here, for every module.
from tests.s3_fixtures import hung_server, moto_s3, restartable_s3, s3_env  # noqa: F401 - fixtures

ROOT = Path(__file__).resolve().parent.parent
_SESSION_DIR = Path(tempfile.mkdtemp(prefix="airflow-torchrun-tests-"))
# Each pytest process (every xdist worker too) has one; it goes when the process ends (hundreds of
# them, kept, once filled this machine's disk). AIRFLOW_TORCHRUN_KEEP_TEST_DIRS=1 keeps it to look at.
if not os.environ.get("AIRFLOW_TORCHRUN_KEEP_TEST_DIRS"):
    atexit.register(shutil.rmtree, _SESSION_DIR, ignore_errors=True)
AIRFLOW_HOME = _SESSION_DIR / "airflow"
DAGS_FOLDER = _SESSION_DIR / "dags"
STATE_DIR = _SESSION_DIR / "torchrun"
for _d in (AIRFLOW_HOME, DAGS_FOLDER, STATE_DIR):
    _d.mkdir(parents=True, exist_ok=True)

# The local nodes' zygotes (airflow_torchrun.backends.local.zygote): one directory for the whole run,
# made by the first pytest process (xdist's controller; its workers inherit it), emptied at its end.
if not os.environ.get(ZYGOTE_DIR_VAR):
    os.environ[ZYGOTE_DIR_VAR] = tempfile.mkdtemp(prefix="airflow-torchrun-zygotes-")
    _ZYGOTES_OWNED = Path(os.environ[ZYGOTE_DIR_VAR])
else:
    _ZYGOTES_OWNED = None

os.environ.update(
    {
        "AIRFLOW_HOME": str(AIRFLOW_HOME),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS_FOLDER),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__TORCHRUN__STATE_DIR": str(STATE_DIR),
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        # One fernet key for every process of the session. Without it this process (config loaded while
        # the home had no airflow.cfg) has none, and reads back as ciphertext the Variables that an
        # `airflow` command run meanwhile (which writes airflow.cfg with a new key) encrypted.
        "AIRFLOW__CORE__FERNET_KEY": Fernet.generate_key().decode(),
        # Tests start many small groups on 2 cores: keep torch from oversubscribing.
        "OMP_NUM_THREADS": "1",
    }
)

TINY_DDP = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(f"rank={rank} world={world} WORLD_SIZE={os.environ['WORLD_SIZE']} "
          f"LOCAL_RANK={os.environ['LOCAL_RANK']} GROUP_RANK={os.environ['GROUP_RANK']} "
          f"sum={int(t.item())}", flush=True)
    fail_rank = int(os.environ.get("FAIL_RANK", "-1"))
    fail_step = int(os.environ.get("FAIL_STEP", "2"))
    steps = int(os.environ.get("STEPS", "4"))
    for step in range(steps):
        if rank == fail_rank and step == fail_step:
            print(f"rank {rank} failing at step {step}", flush=True)
            if os.environ.get("FAIL_MODE") == "kill":
                os.kill(os.getpid(), 9)
            sys.exit(7)
        x = torch.ones(1)
        dist.all_reduce(x)
        time.sleep(float(os.environ.get("STEP_SECONDS", "0.05")))
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)
    """
)


@pytest.fixture(autouse=True)
def _no_progress_window_left() -> Iterator[None]:
    """A test that reports steps in this process (RunLogger, ProgressLogger) leaves the process's
    progress recorder behind, and its atexit hook printed the window at pytest's exit: forget it."""
    yield
    progress = sys.modules.get("airflow_torchrun.worker.progress")
    left = getattr(progress, "_RECORDER", None)
    if left is not None:
        atexit.unregister(left.flush)
        progress._RECORDER = None  # type: ignore[union-attr]


@pytest.fixture(scope="session")
def tiny_script() -> Path:
    path = _SESSION_DIR / "scripts" / "tiny_ddp.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(TINY_DDP)
    return path


@pytest.fixture(scope="session")
def airflow_db() -> Path:
    """A migrated SQLite metadata DB for the session (about 6 s)."""
    subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"],
        check=True,
        capture_output=True,
        env=os.environ.copy(),
    )
    return AIRFLOW_HOME


@dataclass
class DagResult:
    state: str
    task_states: dict[str, str]
    log: str
    run_id: str
    dag_id: str

    def node_logs(self, task_id: str) -> str:
        """Every node log of the task's last group (what its ranks printed)."""
        handle = self.xcom(task_id, key="group") or {}
        group_dir = Path(handle.get("group_dir", "/nonexistent"))
        return "\n".join(p.read_text() for p in sorted(group_dir.glob("node-*/node.log")))

    def try_number(self, task_id: str) -> int:
        """The try the task instance ended on."""
        from airflow.models.taskinstance import TaskInstance
        from airflow.utils.session import create_session
        from sqlalchemy import select

        with create_session() as session:
            ti = session.scalars(
                select(TaskInstance).where(
                    TaskInstance.dag_id == self.dag_id,
                    TaskInstance.run_id == self.run_id,
                    TaskInstance.task_id == task_id,
                )
            ).one()
            return int(ti.try_number)

    def xcom(self, task_id: str, key: str = "return_value") -> Any:
        from airflow.models.xcom import XComModel
        from airflow.utils.session import create_session

        with create_session() as session:
            row = session.scalars(
                XComModel.get_many(run_id=self.run_id, key=key, task_ids=task_id, dag_ids=self.dag_id)
            ).first()
            return None if row is None else XComModel.deserialize_value(row)


def make_runner(capfd: pytest.CaptureFixture[str] | None) -> tuple[Callable[..., DagResult], Callable[[], None]]:
    """A DAG runner and its cleanup: write a DAG file into the dags folder, import it, ``dag.test()`` it.

    ``body`` is the code inside ``with DAG(...) as dag:``; the DAG id is made unique per call. With
    ``capfd`` the result carries everything printed (the task log); without, ``log`` is empty.
    """
    written: list[Path] = []

    def run(body: str, *, imports: str = "", run_conf: dict[str, Any] | None = None, **dag_kwargs: Any) -> DagResult:
        dag_id = f"t_{uuid.uuid4().hex[:10]}"
        kwargs = ", ".join(f"{k}={v!r}" for k, v in dag_kwargs.items())
        source = (
            "import pendulum\n"
            "from airflow.sdk import DAG\n"
            "from airflow_torchrun import DistributedTrainingOperator\n"
            f"{imports}\n"
            f"with DAG({dag_id!r}, schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False"
            f"{', ' + kwargs if kwargs else ''}) as dag:\n" + textwrap.indent(textwrap.dedent(body), "    ")
        )
        path = DAGS_FOLDER / f"{dag_id}.py"
        path.write_text(source)
        written.append(path)
        spec = importlib.util.spec_from_file_location(dag_id, path)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if capfd is not None:
            capfd.readouterr()
        dr = module.dag.test(run_conf=run_conf)
        out, err = capfd.readouterr() if capfd is not None else ("", "")
        sys.stdout.write(out[-20000:])
        tis = {ti.task_id: _state(ti.state) for ti in dr.get_task_instances()}
        return DagResult(state=_state(dr.state), task_states=tis, log=out + err, run_id=dr.run_id, dag_id=dag_id)

    def cleanup() -> None:
        for path in written:
            path.unlink(missing_ok=True)

    return run, cleanup


def _state(state: object) -> str:
    return str(getattr(state, "value", state))


@pytest.fixture
def run_dag(airflow_db: Path, capfd: pytest.CaptureFixture[str]) -> Iterator[Callable[..., DagResult]]:
    """Run a DAG through ``dag.test()``; see :func:`make_runner`."""
    run, cleanup = make_runner(capfd)
    yield run
    cleanup()


def unique_run(name: str) -> str:
    """A run id for a local group that no test running beside this one launches: a group's processes
    are found by the group id in their environment (``procs.group_pids``), so two tests that launch
    one id at once tear down each other's processes (a rehearsal's ``test_zygote`` did)."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


def group_processes(group_id: str) -> list[int]:
    from airflow_torchrun.backends.local.procs import group_pids

    return group_pids(group_id)


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, compute: Callable[[Path], Any]) -> Any:
    """``compute(folder)`` once for the whole run, its (JSON) result shared by every xdist worker.

    For a costly result that is the same wherever it is computed (the digest of a deterministic
    training run, checkpoints the tests only copy): the first worker to ask computes it under a
    file lock in the run's shared temporary folder, with ``folder`` (there) for files it keeps;
    the others wait for it and read it. A failure is not kept: the next worker to ask tries again
    (and fails on its own).
    """
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    result = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if result.exists():
            return json.loads(result.read_text())
        folder = shared / name
        shutil.rmtree(folder, ignore_errors=True)  # what a failed attempt left
        folder.mkdir()
        value = compute(folder)
        result.write_text(json.dumps(value))
        return value


@pytest.fixture(scope="session")
def uninterrupted(airflow_db: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The digest of the example trainer's job run without a failure (``tests/example_trainer.py``),
    once per run: the resume and restart tests compare against it. (tests/chaos has its own, for
    its wider model.)"""

    def run_once(_folder: Path) -> str:
        run, cleanup = make_runner(None)
        try:
            result = run(train_task([], retries=0), imports=TRAINER_IMPORTS)
        finally:
            cleanup()
        assert result.state == "success", result.node_logs("train")[-4000:]
        assert result.xcom("train", key="resumed_from") is None  # a fresh start
        return digest(result.node_logs("train"))

    return str(once_per_run(tmp_path_factory, "example-trainer-uninterrupted-digest", run_once))


@pytest.fixture(scope="session")
def mlflow_store_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow SQLite store (tracking and registry tables), made once per run: MLflow
    migrates a new SQLite store table by table, which took 10 to 30 s per test here."""

    def make(folder: Path) -> str:
        from mlflow import MlflowClient

        uri = f"sqlite:///{folder / 'mlflow.db'}"
        client = MlflowClient(uri, registry_uri=uri)
        client.search_experiments()
        client.search_registered_models()
        return str(folder / "mlflow.db")

    return Path(once_per_run(tmp_path_factory, "mlflow-store-template", make))


@pytest.fixture
def mlflow_sqlite_uri(mlflow_store_template: Path, tmp_path: Path) -> str:
    """A real MLflow SQLite store of this test's own (``tmp_path/mlflow.db``): a copy of the empty,
    already migrated one, so each test starts from nothing without paying for the migrations."""
    path = tmp_path / "mlflow.db"
    shutil.copyfile(mlflow_store_template, path)
    return f"sqlite:///{path}"


@pytest.fixture
def reserve_port() -> Iterator[Callable[[], int]]:
    """Ports for this test's own servers (its torchrun's store, say), each held until the test ends:
    no later bind to port 0 is handed one meanwhile (:class:`tests.ports.ReservedPort`)."""
    with contextlib.ExitStack() as held:
        yield lambda: held.enter_context(reserved_ports(1))[0]


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One real ``mlflow server`` for the session. A test that stops it (the fault it injects)
    may leave it down: each user calls :meth:`MlflowServer.start` first (a no-op while it runs)."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    try:
        server.start()
        yield server
    finally:
        server.close()


# -- how the session runs: the fast loop, xdist groups, the chaos report ---------------------------

# Modules whose tests share a costly module-scoped fixture (one `airflow standalone`, started for the
# first test and stopped after the last; one run of the pipeline), so they run on one xdist worker,
# in file order: spread, each worker made it again (test_pipeline's run of the pipeline through its
# failure took 146 s on one worker and 127 s on the other). Everything else is spread test by test:
# a module fixture that is cheap (an Airflow home) is then made once per worker, a costly result is
# shared by all workers (once_per_run).
XDIST_GROUPS = {
    "test_deferrable_standalone.py": "standalone-deferrable",
    "test_pipeline.py": "pipeline-cli",
    "test_openlineage.py": "pipeline-openlineage",
}
# Directories whose tests share a costly package- or session-scoped fixture, so they run on one worker
# and never in make check (`slow`): the e2e suite's Kubernetes cluster (one cluster, never two at
# once), the `airflow standalone` of the pipeline's UI and approval tests (tests/pipeline_ui).
XDIST_DIRECTORY_GROUPS = {"e2e_k8s": "e2e-k8s", "pipeline_ui": "standalone-pipeline"}
# Fixtures that start a process (airflow db migrate, mlflow server, a training group): a test that
# uses one is `slow` whatever its own marks say (make check's guard would fail it otherwise).
PROCESS_FIXTURES = {"airflow_db", "mlflow_server", "uninterrupted", "crashed_run"}


def pytest_addoption(parser: pytest.Parser) -> None:
    process_guard.addoption(parser)


def pytest_configure(config: pytest.Config) -> None:
    process_guard.configure(config)


def xdist_group_of(nodeid: str) -> str | None:
    """The xdist group of a test, from its node id (the controller sees nothing else)."""
    path = nodeid.split("::", 1)[0]
    for directory, name in XDIST_DIRECTORY_GROUPS.items():
        if path.startswith(f"tests/{directory}/"):
            return name
    return XDIST_GROUPS.get(path.rsplit("/", 1)[-1])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` with the groups above. xdist's own loadgroup appends the group to the
    node id, which pytest 9 no longer lets a plugin change (``nodeid`` is derived), so tests of one
    group were spread like any others; this scheduler reads the group from the node id's path."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    estimates = durations.load()

    class GroupScheduling(LoadScopeScheduling):
        """Costliest first (``tests/durations.py``): the work units (a test, or a group's tests) go out
        longest first, each to the first worker that has room, so the workers finish close together.
        In collection order a 3-minute test near the end of the alphabet started last."""

        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid) or nodeid

        def _assign_work_unit(self, node: Any) -> None:
            if not self.ordered:
                self.ordered = True
                cost = {
                    scope: sum(estimates.get(n, durations.DEFAULT_S) for n in nodeids)
                    for scope, nodeids in self.workqueue.items()
                }
                for scope in sorted(cost, key=lambda s: -cost[s]):  # stable: collection order among equals
                    self.workqueue.move_to_end(scope)
            super()._assign_work_unit(node)

    return GroupScheduling(config, log)


# First: before -m selects by the `slow` marks.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        path = Path(str(item.path))
        in_cluster_directory = any(here / d in path.parents for d in XDIST_DIRECTORY_GROUPS)
        starts_processes = in_cluster_directory or PROCESS_FIXTURES & set(getattr(item, "fixturenames", ()))
        if starts_processes and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """xdist's controller: a worker finished; keep the chaos trials it ran."""
    matrix.absorb(getattr(node, "workeroutput", {}))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    matrix.finish(session.config)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's zygotes end with it (the process that made their directory: xdist's controller)."""
    if _ZYGOTES_OWNED is not None:
        zygote.stop_all(_ZYGOTES_OWNED)
        shutil.rmtree(_ZYGOTES_OWNED, ignore_errors=True)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    matrix.summary(terminalreporter)
