"""The fault matrix against the real local backend: the example trainer on 2 nodes, a fault at a
random step, and what must hold afterwards.

For every trial: the task succeeds (recovered), the final weights equal an uninterrupted run's
(bit-identical), no process of any launch is alive, and no resume started from a step that was
not committed or did not verify. ``CHAOS_TRIALS`` trials per fault (``make chaos TRIALS=N``);
``CHAOS_SEED`` fixes the random steps and ranks. Each trial is recorded in the report
(``tests/chaos/conftest.py``) before it is judged, so a miss is counted, never hidden.

The checkpoint store's faults: moto's S3 server stopped for 20 s mid-training (checkpoints on
``s3://``; the ranks' save fails, the restart waits out the outage within ``preflight_budget``),
and the store out of space (a small tmpfs: the task must fail at once with a clear error, the last
committed checkpoint intact, nothing torn taken for good; "recovered" counts exactly that).

The tracking server (``mlflow server``, SQLite) stopped for 20 s mid-training: training goes on,
every step's loss reaches the run exactly once, the task succeeds.

The Airflow worker killed (kill -9 of the process running the task, ``dag.test()`` in a process of
its own): every process of the group is gone within the teardown grace, and the next run of the
task trains to the end ("recovered" counts both).

The Kubernetes API answering 5xx for 20 s (sync and deferred, against the fake API server) is in
``test_chaos_k8s.py``; the triggerer killed while the task is deferred (under ``airflow
standalone``) in ``test_chaos_triggerer.py``. Both record into the same matrix.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from airflow_torchrun.backends.local.procs import _environ, group_pids, rank_pid, stop_group
from airflow_torchrun.storage.checkpoints import CheckpointStore
from tests import s3_fixtures
from tests.chaos.conftest import FINAL, IMPORTS, STEP, trainer_task
from tests.chaos.matrix import SEED, Trial, record, trials
from tests.mlflow_server import MlflowServer

pytestmark = pytest.mark.slow

RESUMED = re.compile(r"resuming from (\S+)/step-0*(\d+) \(step \d+\)")


# -- the faults -----------------------------------------------------------------------------------
def _agent_pid(group_dir: Path, node_rank: int) -> int | None:
    """The node's torchrun agent, as its supervisor recorded it (the supervisor's own command line
    names ``torch.distributed.run`` too, so a search by command line can find the wrong process)."""
    try:
        return int(json.loads((group_dir / f"node-{node_rank}" / "supervisor.json").read_text())["agent_pid"])
    except (OSError, ValueError, KeyError):
        return None


def _signal(pid: int | None, sig: int) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def kill_rank(rng: random.Random) -> Callable[[str, Path], tuple[bool, str]]:
    rank = rng.randint(0, 1)
    return lambda group_id, _dir: (_signal(rank_pid(group_id, rank), signal.SIGKILL), f"rank {rank}")


def kill_agent(rng: random.Random) -> Callable[[str, Path], tuple[bool, str]]:
    node = rng.randint(0, 1)
    return lambda _group_id, group_dir: (_signal(_agent_pid(group_dir, node), signal.SIGKILL), f"agent of node {node}")


def stop_rank(rng: random.Random) -> Callable[[str, Path], tuple[bool, str]]:
    rank = rng.randint(0, 1)
    return lambda group_id, _dir: (_signal(rank_pid(group_id, rank), signal.SIGSTOP), f"rank {rank} SIGSTOPped")


def sigterm_group(_rng: random.Random) -> Callable[[str, Path], tuple[bool, str]]:
    def inject(group_id: str, _dir: Path) -> tuple[bool, str]:
        if not group_pids(group_id):
            return False, "no process found"
        threading.Thread(target=stop_group, args=(group_id,), kwargs={"grace": 10.0}, daemon=True).start()
        return True, "SIGTERM to every process"

    return inject


def kill_while_writing(_rng: random.Random) -> Callable[[str, Path], tuple[bool, str]]:
    """SIGKILL rank 0 while a checkpoint step directory exists without its commit marker."""

    def inject(group_id: str, _dir: Path) -> tuple[bool, str]:
        pid = rank_pid(group_id, 0)
        uri = _environ(pid).get(b"TRAIN_CHECKPOINT_URI", b"").decode() if pid else ""
        if not uri.startswith("file://"):
            return False, "no checkpoint location found"
        root = Path(uri.removeprefix("file://"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                steps = [p for p in root.iterdir() if p.name.startswith("step-")]
            except FileNotFoundError:
                steps = []
            for step in steps:
                if not (step / "COMMITTED").exists() and any(step.iterdir()):
                    _signal(pid, signal.SIGKILL)
                    torn = not (step / "COMMITTED").exists()
                    return torn, f"rank 0 killed writing {step.name}" + ("" if torn else " (it committed first)")
            time.sleep(0.0005)
        return False, "no checkpoint write caught in 60 s"

    return inject


def s3_outage(server: s3_fixtures.RestartableS3, seconds: float = 20.0) -> Callable[[random.Random], Any]:
    def make(_rng: random.Random) -> Callable[[str, Path], tuple[bool, str]]:
        def inject(_group_id: str, _dir: Path) -> tuple[bool, str]:
            server.stop()
            server.start_after(seconds)
            return True, f"S3 endpoint down for {seconds:g}s"

        return inject

    return make


# -- one trial --------------------------------------------------------------------------------
class Injector(threading.Thread):
    """Waits for the first new group to reach ``step``, then injects the fault once."""

    def __init__(self, state_dir: Path, step: int, inject: Callable[[str, Path], tuple[bool, str]]) -> None:
        super().__init__(daemon=True)
        self.state_dir, self.step, self.inject = state_dir, step, inject
        self.earlier = set((state_dir / "groups").glob("*"))
        self.group_id: str | None = None
        self.injected = False
        self.note = ""
        self.at: float | None = None
        self.last_done = 0

    def run(self) -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            for log in (self.state_dir / "groups").glob("*/node-0/node.log"):
                if log.parent.parent in self.earlier:
                    continue
                steps = [int(m[1]) for m in STEP.findall(log.read_text(errors="replace"))]
                if steps and max(steps) >= self.step:
                    self.group_id, self.last_done, self.at = log.parent.parent.name, max(steps), time.time()
                    self.injected, self.note = self.inject(self.group_id, log.parent.parent)
                    return
            time.sleep(0.02)
        self.note = f"the group never reached step {self.step}"


def _first_step_after(state_dir: Path, exclude: str | None, after: float) -> float | None:
    """When training progressed again: the first progress line after ``after`` in another group."""
    firsts = []
    for log in (state_dir / "groups").glob("*/node-0/node.log"):
        if log.parent.parent.name == exclude:
            continue
        for stamp, _step in STEP.findall(log.read_text(errors="replace")):
            at = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if at > after:
                firsts.append(at)
                break
    return min(firsts) - after if firsts else None


def run_trial(
    run_dag: Callable[..., Any],
    fault: str,
    make: Callable[[random.Random], Callable[[str, Path], tuple[bool, str]]],
    uninterrupted: str,
    trial: int,
    **task: object,
) -> Trial:
    rng = random.Random(f"{SEED}-{fault}-{trial}")
    state_dir = Path(os.environ["AIRFLOW__TORCHRUN__STATE_DIR"])
    injector = Injector(state_dir, rng.randint(8, 38), make(rng))
    injector.start()
    result = run_dag(trainer_task(**task), imports=IMPORTS)
    injector.join(5)
    launches = result.xcom("train", key="launches") or {}
    final = result.xcom("train", key="group") or {}
    groups = {injector.group_id, final.get("group_id"), *(h["group_id"] for h in launches.get("history", []))}
    left = sum(len(group_pids(g)) for g in groups if g)
    torn = 0
    resumed = []
    for root, step in RESUMED.findall(result.log):
        store = CheckpointStore(root, task.get("storage_options") or {})  # type: ignore[arg-type]
        resumed.append(int(step))
        if not store.is_committed(int(step)) or store.verify(int(step)):
            torn += 1
    lost = max(0, injector.last_done - max(resumed)) if resumed and injector.at else None
    found = FINAL.findall(result.node_logs("train"))
    identical = (found[-1][1] == uninterrupted) if result.state == "success" and found else None
    if result.state == "success" and not found:
        identical = False
    recovery = _first_step_after(state_dir, injector.group_id, injector.at) if injector.at else None
    note = f"seed {SEED}: step {injector.step} (seen {injector.last_done} when injected), {injector.note}"
    if result.state != "success":
        tail = [ln for ln in result.log.splitlines() if "Training group" in ln or "was torn down" in ln][-2:]
        note += " | " + " / ".join(line[:300] for line in tail)
    goodput = result.xcom("train", key="goodput") or {}
    ettr = (goodput.get("task") or {}).get("ettr")
    return record(
        Trial(
            fault,
            injector.injected,
            result.state == "success",
            identical,
            left,
            torn,
            recovery,
            note,
            lost,
            ettr if isinstance(ettr, int | float) else None,
        )
    )


FAULTS: dict[str, tuple[Callable[[random.Random], Callable[[str, Path], tuple[bool, str]]], dict[str, object]]] = {
    "kill -9 a rank (in-try restart)": (kill_rank, {"retries": 0, "max_restarts": 1}),
    "kill -9 a rank (Airflow retry)": (kill_rank, {"retries": 1}),
    "kill -9 a node's torchrun agent": (kill_agent, {"retries": 0, "max_restarts": 1}),
    "kill -9 a rank writing a checkpoint": (kill_while_writing, {"retries": 0, "max_restarts": 1}),
    "SIGSTOP a rank (hang)": (stop_rank, {"retries": 0, "max_restarts": 1, "progress_timeout": 20}),
    "SIGTERM the group (preemption)": (sigterm_group, {"retries": 0, "max_restarts": 1}),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault(run_dag: Callable[..., Any], uninterrupted: str, fault: str) -> None:
    make, task = FAULTS[fault]
    _judge(fault, [run_trial(run_dag, fault, make, uninterrupted, n, **task) for n in range(trials())])


@pytest.mark.fault("S3 endpoint down 20 s (in-try restart)")
def test_s3_down_for_20s_mid_training(run_dag: Callable[..., Any], uninterrupted: str) -> None:
    fault = "S3 endpoint down 20 s (in-try restart)"
    server = s3_fixtures.RestartableS3()
    server.start()
    try:
        results = []
        for n in range(trials()):
            bucket = server.s3.make_bucket()
            task = {
                "retries": 0,
                "max_restarts": 2,
                "checkpoint_uri": f"s3://{bucket}/ckpt",
                "storage_options": server.s3.storage_options(),
            }
            results.append(run_trial(run_dag, fault, s3_outage(server), uninterrupted, n, **task))
            if not server.running:
                server.start()
    finally:
        server.close()
    _judge(fault, results)


@pytest.mark.fault("checkpoint store out of space")
def test_checkpoint_store_out_of_space(run_dag: Callable[..., Any], tmp_path: Path) -> None:
    """A store that fills up: the task fails at once (no restart, no retry) saying the device is
    full, the newest committed step still verifies, and nothing is left running."""
    import subprocess

    fault = "checkpoint store out of space"
    mount = tmp_path / "small"
    mount.mkdir()
    # Room for two of the trainer's checkpoints (about 52 MB each with --hidden 2048), not a third.
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=120m", "tmpfs", str(mount)], check=False).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        for n in range(trials()):
            root = mount / f"ckpt-{n}"
            result = run_dag(trainer_task(retries=2, max_restarts=2, checkpoint_uri=f"file://{root}"), imports=IMPORTS)
            group = (result.xcom("train", key="group") or {}).get("group_id")
            store = CheckpointStore(f"file://{root}")
            committed = store.committed()
            intact = bool(committed) and store.verify(committed[-1].step) == []
            clear = "No space left on device" in result.log and "not retrying" in result.log.lower()
            once = result.try_number("train") == 1 and "relaunching" not in result.log
            ok = result.state == "failed" and clear and once and intact
            note = f"committed steps {[c.step for c in committed]}, clear error: {clear}, no relaunch: {once}"
            left = len(group_pids(group)) if group else 0
            # The failed try's ledger still says where its time went (no ETTR goal: it fails by design).
            ettr = ((result.xcom("train", key="goodput") or {}).get("task") or {}).get("ettr")
            ettr = ettr if isinstance(ettr, int | float) else None
            trial = record(Trial(fault, True, ok, None, left, 0, None, note, None, ettr))
            assert trial.recovered and trial.left_behind == 0, trial
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.fault("MLflow server down 20 s")
def test_mlflow_down_for_20s_mid_training(
    run_dag: Callable[..., Any], uninterrupted: str, mlflow_server: MlflowServer
) -> None:
    from mlflow.tracking import MlflowClient

    fault = "MLflow server down 20 s"
    server = mlflow_server
    server.start()
    # The session's server holds other tests' runs too: only the experiments made from now on count
    # (each DAG run_dag makes is new, and so is its experiment).
    since_ms = int(time.time() * 1000)
    restarts: list[threading.Thread] = []

    def outage(_rng: random.Random) -> Callable[[str, Path], tuple[bool, str]]:
        def inject(_group_id: str, _dir: Path) -> tuple[bool, str]:
            server.stop()
            restart = threading.Timer(20.0, server.start)
            restart.start()
            restarts.append(restart)
            return True, "MLflow server down for 20s"

        return inject

    try:
        task = {"retries": 0, "max_restarts": 1, "track": True, "mlflow_tracking_uri": server.uri}
        results = [run_trial(run_dag, fault, outage, uninterrupted, n, **task) for n in range(trials())]
        for restart in restarts:
            restart.join(90)
        # Every step's loss reached its run exactly once, through the outage.
        client = MlflowClient(server.uri)
        mine = [e.experiment_id for e in client.search_experiments() if e.creation_time >= since_ms]
        runs = client.search_runs(mine)
        histories = [[m.step for m in client.get_metric_history(r.info.run_id, "loss")] for r in runs]
        histories = [h for h in histories if h]
        assert len(histories) == len(results), histories
        for steps in histories:
            assert sorted(steps) == list(range(1, max(steps) + 1)), f"steps lost or logged twice: {sorted(steps)}"
    finally:
        server.stop()
    _judge(fault, results)


WORKER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("chaos_dag", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.dag.test()
"""


@pytest.mark.fault("kill -9 the Airflow worker")
def test_the_airflow_worker_killed_mid_training(run_dag: Callable[..., Any], airflow_db: Path) -> None:
    import subprocess
    import sys
    import uuid

    from tests.conftest import DAGS_FOLDER

    fault = "kill -9 the Airflow worker"
    state_dir = Path(os.environ["AIRFLOW__TORCHRUN__STATE_DIR"])
    for n in range(trials()):
        rng = random.Random(f"{SEED}-{fault}-{n}")
        dag_id = f"chaos_worker_{uuid.uuid4().hex[:8]}"
        path = DAGS_FOLDER / f"{dag_id}.py"
        path.write_text(
            "import pendulum\nfrom datetime import timedelta\nfrom airflow.sdk import DAG\n"
            "from airflow_torchrun import DistributedTrainingOperator\n"
            f"with DAG({dag_id!r}, schedule=None, start_date=pendulum.datetime(2026, 1, 1)) as dag:\n"
            + trainer_task(retries=0)
        )
        worker: dict[str, subprocess.Popen[bytes]] = {}

        def kill_worker(_group_id: str, _dir: Path, worker: dict[str, Any] = worker) -> tuple[bool, str]:
            return _signal(worker["proc"].pid, signal.SIGKILL), "the task's process"

        injector = Injector(state_dir, rng.randint(8, 38), kill_worker)
        command = [sys.executable, "-c", WORKER, str(path)]
        worker["proc"] = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        injector.start()
        worker["proc"].wait(timeout=300)
        injector.join(5)
        deadline = time.monotonic() + 30  # the supervisors notice the caller is gone, then teardown_grace
        while injector.group_id and group_pids(injector.group_id) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = len(group_pids(injector.group_id)) if injector.group_id else 0
        gone_after = (time.time() - injector.at) if injector.at else None
        path.unlink(missing_ok=True)
        # The task runs again (the next run of it, in this process): it trains to the end.
        again = run_dag(trainer_task(retries=0), imports=IMPORTS)
        ok = injector.injected and worker["proc"].returncode == -signal.SIGKILL and again.state == "success"
        note = f"seed {SEED}: step {injector.step}, {injector.note}; group gone {gone_after or 0:.1f}s after the kill"
        trial = record(Trial(fault, injector.injected, ok, None, left, 0, None, note))
        assert trial.recovered and trial.left_behind == 0, trial


def _judge(fault: str, results: list[Trial]) -> None:
    for t in results:
        assert t.injected, t
        assert t.recovered, t
        assert t.bit_identical, t
        assert t.left_behind == 0, t
        assert t.torn_resumed == 0, t
        # The goodput ledger accounts for the fault: the task's ETTR is known and below 1.
        assert t.ettr is not None and 0 < t.ettr < 1, t
        if fault.startswith("SIGTERM"):  # saved at the next step boundary: no completed step lost
            assert t.steps_lost == 0, t
