"""Approval before promotion: the shipped pipeline under ``airflow standalone`` with ``require_approval`` on.

The package's ``airflow standalone`` (``conftest.py``, after ``test_pipeline_ui.py``) serves the
repository's ``dags/``; MLflow's store is the state dir's SQLite, its registry emptied for these tests.
Three runs, each better trained than the last (1, 3, then 5 epochs on one node):

- run 1: the approval task waits (``awaiting_input``) with a Markdown body comparing the candidate with
  "champion: none yet"; approved through the HITL REST API -> ``champion`` is version 1, the task log
  says who approved, when, and the comment;
- run 2: proposed (it beats version 1); rejected through the REST API -> ``champion`` stays on version
  1, the promotion is skipped, the log says who rejected;
- run 3: approved by clicking in Chromium on the Required Actions page, which shows the comparison
  table -> ``champion`` is version 3. Screenshots in ``.state/artifacts/ui/``.

Slow: about 4 minutes on two cores (most of it the three pipeline runs).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest

from tests.pipeline_ui.conftest import DAG_ID, MLFLOW_UI_URL
from tests.pipeline_ui.test_pipeline_ui import (
    ARTIFACTS,
    CHROMIUM,
    CHROMIUM_ARGS,
    _login,
    _missing_browser,
    _not_blank,
)
from tests.standalone import Standalone, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "digits-mlp"
RUN_DEADLINE_S = 400.0


@pytest.fixture(scope="module")
def airflow(airflow: Standalone) -> Iterator[Standalone]:
    """The package's services with ``approve`` as the helpers' task, and a registry without the model:
    the versions the package's other runs registered (and their champion) are deleted first, so the
    story starts at "champion: none yet" and version 1. The pipeline is paused again afterwards,
    as the services were started."""
    client = _registry(airflow)
    if client is not None and client.search_registered_models(f"name = '{MODEL}'"):
        client.delete_registered_model(MODEL)
    airflow.unpause()
    yield airflow.for_dag(DAG_ID, "approve")
    airflow.ok("PATCH", f"/api/v2/dags/{DAG_ID}", {"is_paused": True})


def _conf(epochs: int) -> dict[str, Any]:
    # require_approval is left at its default (on): that is what is tested.
    return {"num_nodes": 1, "epochs": epochs, "quality_gate": {"accuracy": ">= 0.5"}}


def _hitl_path(run_id: str) -> str:
    return f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances/approve/-1/hitlDetails"


def _wait_for_approval_request(server: Standalone, run_id: str) -> dict[str, Any]:
    """The approval task waiting for a person, and its request as the REST API shows it."""
    state = server.wait_ti_state(run_id, {"awaiting_input", "skipped", "failed", "success"}, RUN_DEADLINE_S)
    assert state == "awaiting_input", f"approve is {state}, not waiting\n{server.task_log(run_id, task_id='approve')}"
    # Airflow 3.3.2 fails a task answered before the scheduler has processed the exit of the process
    # that parked it ("finished with state success, but the task instance's state attribute is
    # queued"; seen here with an answer 15 s after the park): a person is slower than that, a test
    # must wait for it.
    key = f"TaskInstanceKey(dag_id={DAG_ID!r}, task_id='approve', run_id={run_id!r}, try_number=1,"
    line = f"Received executor event with state success for task instance {key}"
    wait_for(f"the scheduler to process the park of {run_id}", lambda: line in server.output_text(), 120)
    return dict(server.ok("GET", _hitl_path(run_id)))


def _registry(server: Standalone) -> Any:
    """An MLflow client of the state dir's store; None while no task has made it."""
    from mlflow import MlflowClient

    path = server.state_dir / "mlflow" / "mlflow.db"
    return MlflowClient(f"sqlite:///{path}", registry_uri=f"sqlite:///{path}") if path.exists() else None


def _champion(server: Standalone) -> int | None:
    from mlflow.exceptions import MlflowException

    client = _registry(server)
    try:
        return None if client is None else int(client.get_model_version_by_alias(MODEL, "champion").version)
    except MlflowException:
        return None


def _xcom(server: Standalone, run_id: str, task_id: str, key: str) -> Any:
    path = f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}/xcomEntries/{key}"
    return server.ok("GET", path)["value"]


def _states(server: Standalone, run_id: str) -> dict[str, str]:
    tis = server.ok("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances")
    return {t["task_id"]: t["state"] for t in tis["task_instances"]}


def test_rest_approve_moves_the_champion_and_a_reject_leaves_it(airflow: Standalone) -> None:
    first = airflow.trigger(_conf(1))
    request = _wait_for_approval_request(airflow, first)
    assert request["subject"] == f"Promote {MODEL} version 1 to champion?", request
    assert request["options"] == ["Approve", "Reject"] and not request["response_received"], request
    body = request["body"]
    assert "| metric | candidate: version 1 | champion: none yet |" in body, body
    assert "| **accuracy** (gate) |" in body and "**Quality gate:** accuracy >= 0.5" in body, body
    assert f"({MLFLOW_UI_URL}/#/experiments/" in body, body  # the training run's link
    assert _champion(airflow) is None, "nothing may move before the approval"

    answer = {"chosen_options": ["Approve"], "params_input": {"comment": "first model"}}
    decided = airflow.ok("PATCH", _hitl_path(first), answer)
    assert decided["responded_by"]["name"] == airflow.username, decided
    assert airflow.wait_run_state(first, {"success", "failed"}, RUN_DEADLINE_S) == "success"
    assert _states(airflow, first)["promote"] == "success"
    assert _champion(airflow) == 1
    log = airflow.task_log(first, task_id="approve")
    assert f"Approved by {airflow.username} (id " in log and "version 1 of digits-mlp moves to champion" in log, log
    assert "(comment: first model)" in log, log

    second = airflow.trigger(_conf(3))
    request = _wait_for_approval_request(airflow, second)
    body = request["body"]
    assert "| metric | candidate: version 2 | champion: version 1 |" in body, body
    assert "**Proposal:** promote: accuracy " in body and "vs champion version 1's" in body, body
    answer = {"chosen_options": ["Reject"], "params_input": {"comment": "not today"}}
    airflow.ok("PATCH", _hitl_path(second), answer)
    assert airflow.wait_run_state(second, {"success", "failed"}, RUN_DEADLINE_S) == "success"
    states = _states(airflow, second)
    assert (states["register"], states["approve"], states["promote"]) == ("success", "success", "skipped"), states
    assert _champion(airflow) == 1, "a rejection must leave the champion where it was"
    log = airflow.task_log(second, task_id="approve")
    assert f"Rejected by {airflow.username} (id " in log and "champion stays on version 1" in log, log
    assert "the promotion is skipped (comment: not today)" in log, log
    # A second answer to the same request is refused.
    code, _ = airflow.request("PATCH", _hitl_path(second), {"chosen_options": ["Approve"], "params_input": {}})
    assert code == 409
    # The decisions, for downstream tasks: who, when, the comment.
    decisions = [_xcom(airflow, run, "approve", "decision") for run in (first, second)]
    assert [d["approved"] for d in decisions] == [True, False], decisions
    assert all(d["asked"] and d["by"]["name"] == airflow.username and d["at"] for d in decisions), decisions
    assert [d["comment"] for d in decisions] == ["first model", "not today"], decisions


def test_chromium_approves_on_the_required_actions_page(airflow: Standalone) -> None:
    missing = _missing_browser()
    if missing and os.environ.get("CI"):
        pytest.fail(f"CI must run the UI test: {missing}")
    if missing:
        pytest.skip(missing)
    os.environ["PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD"] = "1"
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=60_000)  # a loaded machine renders the page slower than the default 5 s
    before = _champion(airflow)
    run_id = airflow.trigger(_conf(5))
    request = _wait_for_approval_request(airflow, run_id)
    version = int(request["subject"].split(" version ", 1)[1].split(" ", 1)[0])
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shots = [ARTIFACTS / "approval-required-action.png", ARTIFACTS / "approval-approved.png"]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1300})
            page.set_default_timeout(60_000)
            path = f"/dags/{DAG_ID}/runs/{quote(run_id, safe='')}/tasks/approve/required_actions"
            _login(page, airflow, path)
            expect(page.get_by_text(f"Promote {MODEL} version {version} to champion?").first).to_be_visible()
            # The Markdown table, rendered: the candidate's and the champion's columns.
            expect(page.get_by_role("columnheader", name=f"candidate: version {version}")).to_be_visible()
            # Run alone (-k), the registry has no champion yet.
            champion = f"champion: version {before}" if before is not None else "champion: none yet"
            expect(page.get_by_role("columnheader", name=champion)).to_be_visible()
            page.screenshot(path=str(shots[0]), full_page=True)
            page.get_by_role("button", name="Approve").click()
            assert airflow.wait_run_state(run_id, {"success", "failed"}, RUN_DEADLINE_S) == "success"
            page.reload()
            # The screenshot waits for the reloaded page to show the recorded answer: one taken at once
            # was a white page under load.
            expect(page.get_by_text("Response received at ").first).to_contain_text(f"from {airflow.username}")
            expect(page.get_by_text(f"Promote {MODEL} version {version} to champion?").first).to_be_visible()
            page.screenshot(path=str(shots[1]), full_page=True)
        finally:
            browser.close()
    for shot in shots:
        _not_blank(shot)
    assert _champion(airflow) == version
    assert _states(airflow, run_id)["promote"] == "success"
    assert f"Approved by {airflow.username} (id " in airflow.task_log(run_id, task_id="approve")
