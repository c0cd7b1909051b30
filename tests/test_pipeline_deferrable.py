"""The shipped pipeline, deferrable, under a real scheduler and triggerer, several runs in a row.

With ``[operators] default_deferrable = True`` and ``[torchrun] defer_after = 0`` every group
(training of ~10 s, evaluation of ~5 s) defers at once: the worst case for Airflow 3.3.2's race,
where a trigger that fires within seconds re-queues the task before the scheduler has processed
the deferring process's exit, and the scheduler then fails the task ("finished with state success,
but the task instance's state attribute is queued"). Before the trigger waited out its settle time
this failed about 1 run in 3 at ``evaluate``. Every run must succeed, each task on its first try.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.standalone import RUN_DEADLINE_S, Standalone, start_standalone

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parent.parent
DAG_ID = "torchrun_pipeline"
RUNS = 3


@pytest.fixture(scope="module")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    root = tmp_path_factory.mktemp("pipeline-deferrable")
    extra = {"AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": "True", "AIRFLOW__TORCHRUN__DEFER_AFTER": "0"}
    with start_standalone(root, ROOT / "dags", DAG_ID, "train", extra_env=extra) as server:
        server.unpause()
        yield server


def test_deferrable_pipeline_succeeds_run_after_run(airflow: Standalone) -> None:
    conf = {"epochs": 1, "fail_at_step": 0, "quality_gate": {"accuracy": ">= 0.1"}}
    for n in range(RUNS):
        run_id = airflow.trigger(conf)
        state = airflow.wait_run_state(run_id, {"success", "failed"}, RUN_DEADLINE_S)
        tis = airflow.ok("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id)}/taskInstances")["task_instances"]
        states = {t["task_id"]: (t["state"], t["try_number"]) for t in tis}
        assert state == "success", f"run {n + 1} of {RUNS}: {states}\n{airflow.tail(120)}"
        assert all(s == ("success", 1) for s in states.values()), f"run {n + 1}: {states}"
        for task_id in ("train", "evaluate"):
            log = airflow.task_log(run_id, task_id=task_id)
            # Both group tasks really went through the triggerer, and came back through execute_complete.
            assert "deferring: the triggerer watches it" in log, (
                f"{task_id} of run {n + 1} did not defer:\n{log[-3000:]}"
            )
            assert "trigger reported succeeded" in log, log[-3000:]
    scheduler = airflow.output_text()
    assert "but the task instance's state attribute is queued" not in scheduler
