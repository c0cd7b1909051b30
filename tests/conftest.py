"""Shared fixtures: a throwaway Airflow (SQLite) and a way to run a DAG through ``dag.test()``.

Airflow reads its configuration when first imported, so the environment is set here, at import
time of the test session, before any test module imports Airflow.
"""

from __future__ import annotations

import importlib.util
import os
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

ROOT = Path(__file__).resolve().parent.parent
_SESSION_DIR = Path(tempfile.mkdtemp(prefix="airflow-torchrun-tests-"))
AIRFLOW_HOME = _SESSION_DIR / "airflow"
DAGS_FOLDER = _SESSION_DIR / "dags"
STATE_DIR = _SESSION_DIR / "torchrun"
for _d in (AIRFLOW_HOME, DAGS_FOLDER, STATE_DIR):
    _d.mkdir(parents=True, exist_ok=True)

os.environ.update(
    {
        "AIRFLOW_HOME": str(AIRFLOW_HOME),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS_FOLDER),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__TORCHRUN__STATE_DIR": str(STATE_DIR),
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
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


def group_processes(group_id: str) -> list[int]:
    from airflow_torchrun.backends.procs import group_pids

    return group_pids(group_id)
