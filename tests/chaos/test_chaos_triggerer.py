"""The triggerer killed (kill -9) while a deferred training task trains, and a new one started.

One ``airflow standalone`` (``tests/standalone.py``: api-server, scheduler, dag-processor,
triggerer, LocalExecutor on SQLite) is shared by the trials. The task is the chaos trainer of
``tests/chaos/conftest.py`` with ``deferrable=True`` and ``defer_after=0`` (local backend), and
``retries=1``, ``max_restarts=1``, so a group wrongly torn down or given up on would show as a second
group. Per trial: trigger a run over REST, wait until the task is deferred and the triggerer watches
its group, wait for a random training step, then SIGKILL the triggerer and all its processes (a
triggerer host dying; ``airflow standalone`` does not restart a dead component) and start a new
``airflow triggerer`` with the dead one's environment. What must hold afterwards:

- recovered: the task ended ``success`` in its first try, and the new triggerer ran its trigger
  (its own trigger log, named by its job id, says "Watching group");
- bit-identical: the final weights equal the uninterrupted run's;
- no second group: exactly one group directory was created for the run (a relaunch within the try
  or a retry would add one), and no rank log says it resumed;
- left behind: processes of the group, or of the killed triggerer, alive afterwards;
- recovery: the new triggerer started -> its trigger watches the group again. A new triggerer
  takes over a trigger only once the dead one's heartbeat is older than
  ``[triggerer] triggerer_health_check_threshold``, here 15 s (default 30) to keep the trial short;
  the note gives kill -> watch again too.
"""

from __future__ import annotations

import random
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_torchrun.backends.base import GroupHandle
from airflow_torchrun.backends.local.backend import LocalBackend
from airflow_torchrun.naming import GroupIdentity
from tests.chaos.conftest import ARGS, FINAL, STEP, TRAINER
from tests.chaos.matrix import SEED, Trial, record, trials
from tests.standalone import Standalone, Triggerers, alive, read_group, start_standalone, wait_for

pytestmark = [pytest.mark.slow]

FAULT = "kill -9 the triggerer while deferred"
DAG_ID = "chaos_triggerer"
TASK_ID = "train"
HEALTH_THRESHOLD_S = 15

DAG_FILE = textwrap.dedent(
    """
    import pendulum
    from datetime import timedelta
    from airflow.sdk import DAG
    from airflow_torchrun import DistributedTrainingOperator

    with DAG({dag_id!r}, schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False) as dag:
        DistributedTrainingOperator(
            task_id={task_id!r}, script={script!r}, num_nodes=2, nproc_per_node=1, script_args={args!r},
            retries=1, retry_delay=timedelta(0), max_restarts=1, teardown_grace=5, track=False,
            deferrable=True, defer_after=0, poll_interval=0.5,
        )
    """
)


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Standalone, Triggerers]]:
    root = tmp_path_factory.mktemp("chaos-triggerer")
    dags = root / "dags"
    dags.mkdir()
    source = DAG_FILE.format(dag_id=DAG_ID, task_id=TASK_ID, script=str(TRAINER), args=ARGS)
    (dags / f"{DAG_ID}.py").write_text(source)
    extra = {"AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": str(HEALTH_THRESHOLD_S)}
    with start_standalone(root, dags, DAG_ID, TASK_ID, extra_env=extra) as server:
        triggerers = Triggerers(server)
        try:
            server.unpause()
            yield server, triggerers
        finally:
            triggerers.stop()  # before standalone's own teardown checks that no group is left


def _trigger_logs(server: Standalone, run_id: str) -> dict[Path, str]:
    logs = (server.home / "logs").rglob("attempt=*.log.trigger.*.log")
    return {p: p.read_text(errors="replace") for p in logs if f"run_id={run_id}" in str(p)}


def _last_step(log: Path) -> int:
    try:
        steps = [int(m[1]) for m in STEP.findall(log.read_text(errors="replace"))]
    except FileNotFoundError:
        return 0
    return max(steps, default=0)


def run_trial(server: Standalone, triggerers: Triggerers, uninterrupted: str, n: int) -> Trial:
    rng = random.Random(f"{SEED}-{FAULT}-{n}")
    target = rng.randint(5, 25)
    groups_dir = server.state_dir / "groups"
    before = set(groups_dir.glob("*"))
    run_id = server.trigger({})
    server.wait_deferred(run_id)
    server.wait_trigger_watching(run_id)
    group_id = GroupIdentity(DAG_ID, TASK_ID, run_id, 1).group_id
    location = groups_dir / group_id
    handle = GroupHandle.from_dict(wait_for(f"group {group_id}", lambda: read_group(location), 60))
    backend = LocalBackend(server.state_dir)
    node_log = location / "node-0" / "node.log"
    wait_for(f"training step {target}", lambda: _last_step(node_log) >= target, 180, interval=0.05)
    at_step = _last_step(node_log)
    old_logs = set(_trigger_logs(server, run_id))

    env, victims = triggerers.kill_current()
    killed_at = time.time()
    time.sleep(1.0)  # what a torn-down group would show by now
    training_on = bool(backend.running_pids(handle)) and _last_step(node_log) >= at_step
    new = triggerers.start(env, n)
    started_at = time.time()

    injected = not any(alive(p) for p in victims)

    def watching_again() -> bool:
        fresh = [text for path, text in _trigger_logs(server, run_id).items() if path not in old_logs]
        return any("Watching group" in text for text in fresh)

    resumed_at: float | None = None
    state = ""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and state not in ("success", "failed"):
        if resumed_at is None and watching_again():
            resumed_at = time.time()
        state = str(server.ti(run_id).get("state"))
        time.sleep(0.2)
    if resumed_at is None and watching_again():  # seen only at the end: no time to give
        resumed_at = float("nan")
    assert new.poll() is None, f"the new triggerer exited with {new.returncode}"
    wait_for(f"the group of {run_id} to stop", lambda: backend.running_pids(handle) == [], 30)
    ti = server.ti(run_id)
    created = sorted(p.name for p in set(groups_dir.glob("*")) - before)
    node_logs = "\n".join(p.read_text(errors="replace") for p in sorted(location.glob("node-*/node.log")))
    found = FINAL.findall(node_logs)
    success = state == "success" and ti.get("try_number") == 1
    identical = (found[-1][1] == uninterrupted) if success and found else (False if success else None)
    one_group = created == [group_id] and "resuming from" not in node_logs
    left = len(backend.running_pids(handle)) + sum(alive(p) for p in victims)
    recovered = success and resumed_at is not None and one_group and training_on
    note = (
        f"seed {SEED}: killed at step {at_step} (aimed at {target}); training went on: {training_on}; "
        f"groups created {created}; new triggerer "
        + (
            f"watched again {resumed_at - started_at:.1f}s after it started "
            f"({resumed_at - killed_at:.1f}s after the kill)"
            if resumed_at is not None
            else "never ran the trigger"
        )
    )
    if not success:
        note += f" | task {state}, try {ti.get('try_number')}: {server.task_log(run_id)[-300:]}"
    recovery = (resumed_at - started_at) if resumed_at is not None else None
    goodput = server.xcom(run_id, "goodput") or {}
    ettr = (goodput.get("task") or {}).get("ettr") if isinstance(goodput, dict) else None
    ettr = ettr if isinstance(ettr, int | float) else None
    return record(Trial(FAULT, injected, recovered, identical, left, 0, recovery, note, None, ettr))


@pytest.mark.fault(FAULT)
@pytest.mark.timeout(600 + 300 * trials())
def test_triggerer_killed_while_deferred(standalone: tuple[Standalone, Triggerers], uninterrupted: str) -> None:
    server, triggerers = standalone
    results = [run_trial(server, triggerers, uninterrupted, n) for n in range(trials())]
    for t in results:
        assert t.injected, t
        assert t.recovered, t
        assert t.bit_identical, t
        assert t.left_behind == 0, t
        # The ledger saw the deferred try through: its ETTR is known and below 1.
        assert t.ettr is not None and 0 < t.ettr < 1, t
