"""The pipeline DAG as a user drives it: ``airflow standalone``, its REST API and its web UI.

One ``airflow standalone`` (SQLite, LocalExecutor) serves the repository's ``dags/`` folder for the
package (``conftest.py``: the approval tests use it after this module), with the state dir (shards,
checkpoints, the MLflow store) in a temporary folder:

- REST: a trigger whose conf breaks a Param's bounds is refused (400, naming the Param) and
  creates no DAG run;
- REST: a valid trigger runs the whole pipeline to success through the planned failure of the
  first training try; the task instances, XComs and the "MLflow run" extra link tell the story;
- UI (headless Chromium driven by playwright): after logging in, the DAG's trigger form offers
  every Param with its default and bounds, and a value out of bounds is refused with the
  server's message, creating no run;
- UI and the plugin's API: a run triggered from the form with non-default Params, watched in the
  task instance's "Training" tab while it trains (every rank running, the step advancing) and
  after success (checkpoints, links); the same JSON over HTTP with the REST API's token, 401 and
  403 without a valid one. Screenshots go to ``.state/artifacts/ui/`` (``$UI_ARTIFACTS``),
  checked not blank.

The UI test needs ``/usr/bin/chromium`` (Debian's ``chromium``) and the ``playwright`` package;
without either it is skipped locally, and fails under CI (``CI`` set), which installs both.
Playwright never downloads a browser here. Slow (about a minute on two cores, most of it the
pipeline run): ``-m slow``.
"""

from __future__ import annotations

import importlib.util
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

import pytest

from tests.conftest import ROOT
from tests.pipeline_ui.conftest import DAG_ID, MLFLOW_UI_URL
from tests.standalone import Standalone, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
RUN_DEADLINE_S = 300.0
ARTIFACTS = Path(os.environ.get("UI_ARTIFACTS") or ROOT / ".state" / "artifacts" / "ui")
# The training view's run: long enough to be watched (3,300 steps checkpointed every 20; 100 epochs took 25 s here).
VIEW_EPOCHS = 150
# name -> (ARIA role of its field, default the form shows, (minimum, maximum) the field enforces or None)
PARAMS: dict[str, tuple[Literal["spinbutton", "combobox", "textbox", "checkbox"], str, tuple[str, str] | None]] = {
    "num_nodes": ("spinbutton", "2", ("1", "8")),
    "nproc_per_node": ("spinbutton", "1", ("1", "8")),
    "epochs": ("spinbutton", "5", ("1", "200")),
    "learning_rate": ("spinbutton", "0.003", None),  # exclusiveMinimum: the form leaves it to the server
    "backend": ("combobox", "local", None),
    "quality_gate": ("textbox", '"accuracy": ">= 0.9"', None),  # a JSON editor
    "fail_at_step": ("spinbutton", "0", None),
    "shards_uri": ("textbox", "", None),  # null: the shard task's default place
    "require_approval": ("checkbox", "", None),  # a switch, on
    "source_uri": ("textbox", "", None),  # null: scikit-learn's digits
}


@pytest.fixture(scope="module")
def planned_failure(airflow: Standalone) -> tuple[str, str]:
    """One run of the pipeline through its planned failure (rank 1 killed at step 30 in try 1, try 2
    resumes from step 20), with a gate two epochs pass (about 0.87 accuracy), so the run also shows
    the object Param arriving: its run id and end state. The REST test and the Training tab's test of
    the failed first try both read this run (each pipeline run costs about a minute and a half)."""
    airflow.unpause()
    run_id = airflow.trigger(
        {"epochs": 2, "fail_at_step": 30, "quality_gate": {"accuracy": ">= 0.5"}, "require_approval": False}
    )
    return run_id, airflow.wait_run_state(run_id, {"success", "failed"}, RUN_DEADLINE_S)


def _runs(server: Standalone) -> set[str]:
    """The ids of the DAG's runs."""
    return {r["dag_run_id"] for r in server.ok("GET", f"/api/v2/dags/{DAG_ID}/dagRuns?limit=1000")["dag_runs"]}


def _xcom(server: Standalone, run_id: str, task_id: str, key: str = "return_value") -> Any:
    path = f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id)}/taskInstances/{task_id}/xcomEntries/{key}"
    return server.ok("GET", path)["value"]


def _missing_browser() -> str | None:
    """Why the browser test cannot run here, or None."""
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing: apt-get install chromium chromium-driver (.ci/run does)"
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is missing: pip install -e '.[dev]' (PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1)"
    return None


def _log(server: Standalone, run_id: str, task_id: str, try_number: int) -> str:
    path = f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id)}/taskInstances/{task_id}/logs/{try_number}"
    content = server.ok("GET", f"{path}?full_content=true")["content"]
    return "\n".join(str(line.get("event", line)) if isinstance(line, dict) else str(line) for line in content)


@pytest.mark.parametrize(
    ("conf", "param"),
    [({"num_nodes": 0}, "num_nodes"), ({"learning_rate": -1}, "learning_rate"), ({"backend": "slurm"}, "backend")],
)
def test_rest_trigger_out_of_bounds_is_refused_and_creates_no_run(
    airflow: Standalone, conf: dict[str, Any], param: str
) -> None:
    before = _runs(airflow)
    code, body = airflow.request("POST", f"/api/v2/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": conf})
    assert code == 400, f"expected 400 for conf {conf}, got {code}: {body}"
    assert f"Invalid input for param {param}" in str(body), body
    assert _runs(airflow) == before, "a refused trigger must create no DAG run"


def test_ui_trigger_form_offers_the_params_and_refuses_a_bad_value(
    airflow: Standalone, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = _missing_browser()
    if missing and os.environ.get("CI"):
        pytest.fail(f"CI must run the UI test: {missing}")
    if missing:
        pytest.skip(missing)
    monkeypatch.setenv("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=60_000)  # a loaded machine's first render took longer than the default 5 s

    declared = airflow.ok("GET", f"/api/v2/dags/{DAG_ID}/details")["params"]
    assert sorted(declared) == sorted(PARAMS), "the DAG declares other Params than this test checks"
    before = _runs(airflow)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1400})
            page.set_default_timeout(60_000)
            _login(page, airflow, f"/dags/{DAG_ID}")

            page.get_by_role("button", name="Trigger Dag").click()
            form = page.get_by_role("dialog")
            expect(form.get_by_role("heading", name=f"Trigger Dag - {DAG_ID}")).to_be_visible()
            expect(form.get_by_role("button", name="Run Parameters")).to_have_attribute("aria-expanded", "true")
            for name, (role, default, bounds) in PARAMS.items():
                # One labelled field per Param, with the Param's description under it.
                row = form.get_by_role("group").filter(has_text=declared[name]["description"])
                expect(row).to_have_count(1)
                expect(row).to_contain_text(name)
                if role == "spinbutton":
                    field = row.get_by_role("spinbutton", name=name)
                    expect(field).to_have_value(default)
                    if bounds is not None:
                        expect(field).to_have_attribute("aria-valuemin", bounds[0])
                        expect(field).to_have_attribute("aria-valuemax", bounds[1])
                elif role == "checkbox":
                    expect(row.get_by_role(role)).to_be_checked()
                else:
                    expect(row.get_by_role(role)).to_have_count(1)
                    expect(row).to_contain_text(default)
            page.screenshot(path=str(tmp_path / "trigger-form.png"))

            # Leave the DAG as it is whatever happens: the form unpauses it on trigger by default.
            form.get_by_text(f"Unpause {DAG_ID} on trigger").click()
            # The form clamps a number to its bounds when the field loses focus: 0 nodes becomes 1.
            nodes = form.get_by_role("spinbutton", name="num_nodes")
            nodes.fill("0")
            nodes.blur()
            expect(nodes).to_have_value("1")
            # It knows no exclusiveMinimum, so -1 reaches the server, which refuses it.
            form.get_by_role("spinbutton", name="learning_rate").fill("-1")
            form.get_by_role("button", name="Trigger", exact=True).click()
            expect(form.get_by_text("Invalid input for param learning_rate")).to_be_visible()
            page.screenshot(path=str(tmp_path / "trigger-refused.png"))
        finally:
            browser.close()
    print(f"screenshots: {tmp_path}")
    assert _runs(airflow) == before, "a trigger the server refused must create no DAG run"
    assert airflow.ok("GET", f"/api/v2/dags/{DAG_ID}")["is_paused"], "the form was told not to unpause the DAG"


def test_rest_trigger_runs_the_pipeline_through_a_planned_failure(
    airflow: Standalone, planned_failure: tuple[str, str]
) -> None:
    run_id, state = planned_failure
    run_path = f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id)}"
    tis = airflow.ok("GET", f"{run_path}/taskInstances")["task_instances"]
    states = {t["task_id"]: (t["state"], t["try_number"]) for t in tis}
    assert state == "success", f"{states}\n{airflow.task_log(run_id, task_id='train')[-4000:]}"
    # The promotion is approved unattended, or skipped when the candidate does not beat the champion.
    decided = {task: states.pop(task) for task in ("approve", "promote")}
    assert {st for st, _ in decided.values()} <= {"success", "skipped"}, decided
    assert states == {
        "export_dataset": ("success", 1),
        "shard": ("success", 1),
        "train": ("success", 2),  # rank 1 killed at step 30 on purpose in try 1
        "evaluate": ("success", 1),
        "register": ("success", 1),
    }
    tries = airflow.ok("GET", f"{run_path}/taskInstances/train/tries")["task_instances"]
    assert [(t["try_number"], t["state"]) for t in tries] == [(1, "failed"), (2, "success")]
    # What the UI's log view shows for each try, through the same endpoint.
    first, second = (_log(airflow, run_id, "train", n) for n in (1, 2))
    assert "rank 1" in first and "killed by signal SIGKILL" in first, first[-4000:]
    assert "resuming from file://" in second and "(step 20)" in second, second[-4000:]

    train = _xcom(airflow, run_id, "train")
    assert train["final_checkpoint"].startswith(train["checkpoint_uri"]), train
    assert train["mlflow_run_id"], train
    register = _xcom(airflow, run_id, "register")
    assert register["version"] >= 1 and "candidate" in register["aliases"], register
    assert register["run_id"] == train["mlflow_run_id"], register

    links = airflow.ok("GET", f"{run_path}/taskInstances/train/links")["extra_links"]
    link = links.get("MLflow run")
    assert link, f"no 'MLflow run' link on the train task: {links}"
    assert link.startswith(f"{MLFLOW_UI_URL}/#/experiments/"), link
    assert link.endswith(f"/runs/{train['mlflow_run_id']}"), link
    assert links.get("Checkpoint") is None, links  # file://: no link (only http(s) under the storage console)
    version_link = airflow.ok("GET", f"{run_path}/taskInstances/register/links")["extra_links"]
    assert version_link.get("Registered model version") == (
        f"{MLFLOW_UI_URL}/#/models/{register['name']}/versions/{register['version']}"
    ), version_link

    # Asset events carry what downstream DAGs need (they read it through inlet_events).
    events = airflow.ok("GET", "/api/v2/assets/events?limit=100")["asset_events"]
    mine = {e["source_task_id"]: e["extra"] for e in events if e.get("source_run_id") == run_id}
    assert mine["train"]["checkpoint_uri"] == train["final_checkpoint"], mine
    assert mine["train"]["step"] == int(train["final_checkpoint"].rsplit("step-", 1)[1]), mine
    assert "test_accuracy" in mine["train"]["metrics"], mine
    assert (mine["register"]["model_name"], mine["register"]["version"]) == (register["name"], register["version"])
    assert mine["register"]["aliases"] == register["aliases"], mine


def _login(page: Any, server: Standalone, path: str) -> None:
    page.goto(f"{server.base_url}{path}")
    # Not logged in: the simple auth manager's sign-in page, then back where we were going.
    page.get_by_label("Username").fill(server.username)
    page.get_by_label("Password").fill(server.password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"**{path}")


def _not_blank(path: Path) -> None:
    """A screenshot that shows something: many colours, not one flat page."""
    from PIL import Image

    with Image.open(path) as image:
        colours = image.convert("RGB").getcolors(maxcolors=1_000_000) or []
        width, height = image.size
    assert width > 100 and height > 100, f"{path}: {width}x{height}"
    top_share = max(count for count, _ in colours) / (width * height)
    assert len(colours) > 50 and top_share < 0.97, f"{path} looks blank: {len(colours)} colours, {top_share:.0%} one"


def _raw_status(server: Standalone, path: str, token: str | None) -> int:
    req = urllib.request.Request(f"{server.base_url}{path}")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _training(server: Standalone, run_id: str) -> dict[str, Any]:
    return dict(
        server.ok("GET", f"/torchrun/api/v1/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances/train")
    )


def _running_with_steps(server: Standalone, run_id: str) -> dict[str, Any] | None:
    code, doc = server.request(
        "GET", f"/torchrun/api/v1/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances/train"
    )
    if code != 200 or not isinstance(doc, dict):
        return None
    ranks = doc.get("ranks") or []
    running = doc.get("state") == "running" and ranks and all(r["state"] == "running" for r in ranks)
    return doc if running and all(r["step"] for r in ranks) else None


def test_ui_training_view_follows_a_run_from_the_form_to_success(airflow: Standalone) -> None:
    missing = _missing_browser()
    if missing and os.environ.get("CI"):
        pytest.fail(f"CI must run the UI test: {missing}")
    if missing:
        pytest.skip(missing)
    os.environ["PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD"] = "1"
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=60_000)  # a loaded machine's first render took longer than the default 5 s

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    before = _runs(airflow)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1200})
            page.set_default_timeout(60_000)
            _login(page, airflow, f"/dags/{DAG_ID}")
            page.get_by_role("button", name="Trigger Dag").click()
            form = page.get_by_role("dialog")
            form.get_by_role("spinbutton", name="epochs").fill(str(VIEW_EPOCHS))
            form.get_by_role("spinbutton", name="learning_rate").fill("0.004")
            # Unattended: no person approves the promotion in this test.
            approval = form.get_by_role("group").filter(has_text="Required actions").get_by_role("checkbox")
            form.locator("label", has=page.locator('input[name="element_require_approval"]')).click()  # the switch
            expect(approval).not_to_be_checked()
            form.get_by_role("button", name="Trigger", exact=True).click()
            expect(form).to_be_hidden()
            run_id = wait_for_new_run(airflow, before)
            conf = airflow.ok("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}")["conf"]
            assert conf["epochs"] == VIEW_EPOCHS and conf["learning_rate"] == 0.004, conf
            assert conf["require_approval"] is False, conf

            # The API over HTTP while it trains: every rank running, the step advancing.
            first = wait_for(f"run {run_id} training on every rank", lambda: _running_with_steps(airflow, run_id), 240)
            assert first["world_size"] == 2 and first["backend"] == "local" and first["ti_state"] == "running"
            assert first["progress"]["total_steps"] and first["progress"]["updated_at"], first["progress"]
            assert set(first["progress"]) >= {"step", "total_steps", "samples_per_s", "eta_s", "data_wait"}
            path = f"/torchrun/api/v1/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances/train"
            assert _raw_status(airflow, path, None) == 401
            assert _raw_status(airflow, path, "not-a-token") == 403

            view = f"/dags/{DAG_ID}/runs/{quote(run_id, safe='')}/tasks/train/plugin/torchrun-training"
            page.goto(f"{airflow.base_url}{view}")
            frame = page.frame_locator("iframe")
            expect(frame.locator("#group-state")).to_have_text("running")
            rows = frame.locator("#ranks tr[data-rank]")
            expect(rows).to_have_count(2)
            for i in range(2):
                expect(rows.nth(i)).to_contain_text("running")
            step = frame.locator('#ranks tr[data-rank="0"] td.step')
            expect(step).not_to_have_text("")
            seen = step.inner_text()
            expect(step).not_to_have_text(seen, timeout=30_000)  # the page refreshes itself
            expect(frame.locator("#progress-line")).to_contain_text(f"/{first['progress']['total_steps']} (")
            page.screenshot(path=str(ARTIFACTS / "training-running.png"))

            assert airflow.wait_run_state(run_id, {"success", "failed"}, RUN_DEADLINE_S) == "success"
            page.reload()
            frame = page.frame_locator("iframe")
            expect(frame.locator("#group-state")).to_have_text("succeeded")
            for i in range(2):
                expect(frame.locator("#ranks tr[data-rank]").nth(i)).to_contain_text("succeeded")
            expect(frame.locator("#checkpoints")).to_contain_text("committed")
            links = frame.locator("#links")
            for name in ("MLflow run", "Registered model version"):
                expect(links.get_by_role("link", name=name)).to_have_count(1)
            # A file:// checkpoint is no link (only http(s) under the configured console is); the
            # checkpoints table names it.
            expect(links.get_by_role("link", name="Checkpoint")).to_have_count(0)
            # The goodput ledger: one stacked bar for the try, productive time among its parts.
            bars = frame.locator("#goodput .goodput[data-try]")
            expect(bars).to_have_count(1)
            expect(bars.first.locator('[data-category="productive"]')).to_have_count(1)
            expect(frame.locator("#goodput")).to_contain_text("ETTR")
            page.screenshot(path=str(ARTIFACTS / "training-succeeded.png"))
        finally:
            browser.close()
    for shot in ("training-running.png", "training-succeeded.png"):
        _not_blank(ARTIFACTS / shot)

    done = _training(airflow, run_id)
    assert done["state"] == "succeeded" and done["ti_state"] == "success", done
    assert [r["state"] for r in done["ranks"]] == ["succeeded", "succeeded"]
    assert [r["exit_code"] for r in done["ranks"]] == [0, 0]
    total = done["progress"]["total_steps"]
    assert done["progress"]["step"] == total and total > first["progress"]["step"], done["progress"]
    committed = [c for c in done["checkpoints"] if c["committed"]]
    assert committed and committed[-1]["step"] == total and committed[-1]["size"] > 0, done["checkpoints"]
    assert done["links"]["mlflow_run"].startswith(MLFLOW_UI_URL), done["links"]
    # A file:// checkpoint is no link (XCom names it, and a link is only http(s) under the configured
    # storage console); the document still names the final checkpoint.
    assert done["links"]["checkpoint"] is None, done["links"]
    assert done["final_checkpoint"].startswith("file://") and done["final_checkpoint"].endswith(f"{total:08d}")
    register = _xcom(airflow, run_id, "register")
    assert done["links"]["model_version"] == (
        f"{MLFLOW_UI_URL}/#/models/{register['name']}/versions/{register['version']}"
    ), done["links"]
    assert done["failure"] is None and len(done["launches"]) == 1 and done["alerts"] == []


def wait_for_new_run(server: Standalone, before: set[str]) -> str:
    new = wait_for("the run the form triggered", lambda: _runs(server) - before, 60)
    assert len(new) == 1, new
    return str(next(iter(new)))


def _earlier_try_frame_checks(frame: Any, expect: Any, doc: dict[str, Any]) -> None:
    """Every section of the failed first try's view, as a user reads it."""
    expect(frame.locator("#group-state")).to_have_text("failed")
    expect(frame.locator("#ti-state")).to_have_text("failed")  # it was empty: no state for an earlier try
    expect(frame.locator("#tries")).to_contain_text("try 1")
    reached = doc["progress"]["reached"]
    # The try committed step 20 before rank 1 died at 30; it read "step 1/N (1%)".
    expect(frame.locator("#progress-line")).to_contain_text(f"reached step {reached}/{doc['progress']['total_steps']}")
    expect(frame.locator("#progress-line")).not_to_contain_text("slowest rank")  # from warm-up records alone
    expect(frame.locator("#progress-bar")).to_have_class("bar failed")
    expect(frame.locator('#checkpoints tr[data-step="20"]')).to_contain_text("try 1 (this try)")
    expect(frame.locator('#checkpoints tr[data-step="20"]')).to_contain_text("committed")
    expect(frame.locator("#links").get_by_role("link", name="MLflow run")).to_have_count(1)  # it said "none"
    failure = frame.locator("#failure")
    expect(failure).to_contain_text("rank 1")
    expect(failure).to_contain_text("SIGKILL")
    expect(failure).not_to_contain_text("@torchrun-progress")  # a raw progress record in the log tail
    for rank in (0, 1):
        expect(frame.locator(f'#ranks tr[data-rank="{rank}"]')).to_contain_text("1")  # its step
    expect(frame.locator("#loss-chart polyline")).to_have_count(2)  # one line per rank
    expect(frame.locator("#throughput-chart polyline")).to_have_count(2)


@pytest.mark.timeout(1500)
def test_ui_training_view_tells_the_truth_about_a_failed_first_try(
    airflow: Standalone, planned_failure: tuple[str, str]
) -> None:
    missing = _missing_browser()
    if missing and os.environ.get("CI"):
        pytest.fail(f"CI must run the UI test: {missing}")
    if missing:
        pytest.skip(missing)
    os.environ["PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD"] = "1"
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=60_000)  # a loaded machine's first render took longer than the default 5 s

    run_id, state = planned_failure
    assert state == "success"
    api = f"/torchrun/api/v1/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances/train"
    first = airflow.ok("GET", f"{api}?try_number=1")
    assert (first["try_number"], first["latest_try"], first["ti_state"]) == (1, 2, "failed"), first
    assert first["progress"]["reached"] >= 20, first["progress"]
    mine = [c for c in first["checkpoints"] if c["try_number"] == 1 and c["committed"]]
    assert [c["step"] for c in mine] == [20], first["checkpoints"]
    assert first["links"]["mlflow_run"].startswith(MLFLOW_UI_URL), first["links"]
    assert "@torchrun-progress" not in first["failure"], first["failure"]
    latest = airflow.ok("GET", api)
    assert latest["ti_state"] == "success" and latest["progress"]["reached"] == latest["progress"]["total_steps"]
    audit = latest["goodput"]["resume_audit"]  # try 2 resumed from step 20 and recomputed 21-29
    assert (audit["status"], audit["resumed_step"], audit["steps"]) == ("exact", 20, [21, 29]), audit
    assert {s["rank"] for s in latest["series"]} == {0, 1} and all(len(s["points"]) >= 2 for s in latest["series"])

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    names = ("training-try1-failed.png", "training-try2-succeeded.png", "training-small-loss.png")
    shots = [ARTIFACTS / n for n in names]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1600})
            page.set_default_timeout(60_000)
            view = f"/dags/{DAG_ID}/runs/{quote(run_id, safe='')}/tasks/train/plugin/torchrun-training"
            _login(page, airflow, view)
            frame = page.frame_locator("iframe")
            expect(frame.locator("#group-state")).to_have_text("succeeded")
            frame.locator('#tries a[data-try="1"]').click()  # the earlier try, as a user gets there
            _earlier_try_frame_checks(frame, expect, first)
            page.screenshot(path=str(shots[0]), full_page=True)

            frame.locator('#tries a[data-try="2"]').click()
            expect(frame.locator("#ti-state")).to_have_text("success")
            bar = frame.locator("#progress-bar > div")
            expect(bar).to_have_css("background-color", "rgb(56, 161, 105)")  # green at 100%: it was red
            expect(bar).to_have_attribute("style", "width:100.0%")
            audit_line = frame.locator("#resume-audit")
            expect(audit_line).to_have_attribute("data-status", "exact")
            expect(audit_line).to_contain_text("from step 20")
            expect(audit_line).to_contain_text("steps 21-29")
            page.screenshot(path=str(shots[1]), full_page=True)

            # A finished run's small loss: the same page on a document whose loss is 3.1e-05.
            small = {**latest, "ranks": [{**r, "loss": 3.1e-05} for r in latest["ranks"]]}
            page.route("**/torchrun/api/v1/**", lambda route: route.fulfill(json=small))
            page.reload()
            frame = page.frame_locator("iframe")
            for rank in (0, 1):
                expect(frame.locator(f'#ranks tr[data-rank="{rank}"] td.loss')).to_have_text("3.1e-5")  # it read "0"
            page.screenshot(path=str(shots[2]), full_page=True)
        finally:
            browser.close()
    for shot in shots:
        _not_blank(shot)


def test_the_sweep_under_standalone_one_view_row_per_map_index(airflow: Standalone) -> None:
    """torchrun_sweep (two rates) scheduled for real: both instances train, each one's Training tab
    lists both by their map_index_template names, and the best is registered."""
    sweep = "torchrun_sweep"
    airflow.unpause(sweep)
    run = airflow.ok(
        "POST",
        f"/api/v2/dags/{sweep}/dagRuns",
        {"logical_date": None, "conf": {"learning_rates": [0.001, 0.01], "epochs": 1}},
    )
    run_id = run["dag_run_id"]
    path = f"/api/v2/dags/{sweep}/dagRuns/{quote(run_id, safe='')}"

    def ended() -> str | None:
        state = airflow.ok("GET", path)["state"]
        return state if state in ("success", "failed") else None

    assert wait_for(f"{sweep} run {run_id}", ended, RUN_DEADLINE_S * 2, interval=2.0) == "success"
    tis = airflow.ok("GET", f"{path}/taskInstances")["task_instances"]
    names = sorted((t["map_index"], t["rendered_map_index"]) for t in tis if t["task_id"] == "train")
    assert names == [(0, "lr=0.001"), (1, "lr=0.01")], names
    api = f"/torchrun/api/v1/dags/{sweep}/dagRuns/{quote(run_id, safe='')}/taskInstances/train"
    for index in (0, 1):
        doc = airflow.ok("GET", f"{api}?map_index={index}")
        assert doc["map_index"] == index and doc["state"] == "succeeded", doc
        assert [(m["map_index"], m["name"]) for m in doc["map_instances"]] == names
        assert doc["checkpoint_uri"].endswith(f"/train~map{index}"), doc["checkpoint_uri"]
    assert {t["task_id"]: t["state"] for t in tis if t["map_index"] == -1}["register_best"] == "success"
