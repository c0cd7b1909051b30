"""The chaos matrix's report: one row per fault, written when the session ends.

``make chaos`` (``TRIALS=N``) runs ``tests/chaos`` alone and writes ``.state/chaos/report.md`` and
``report.json``; ``make test`` runs the same faults with ``CHAOS_TRIALS`` (default 1) and writes the
same report. Each trial is recorded by :func:`record` whatever its outcome, so a miss shows in the
report (and fails its test) rather than disappearing.

``CHAOS_FAULTS`` (``make chaos FAULTS=...``) runs only the faults whose name contains one of its
comma-separated parts (case-insensitive), e.g. ``FAULTS="kill -9 a"`` for the random kills: each
chaos test names its fault(s) with ``@pytest.mark.fault(name, ...)`` (a test parametrized by
``fault`` is named by its parameter). A filter that matches no fault is an error, not an empty
report. ``CHAOS_SEED`` fixes the random steps and ranks; the report gives the seed it ran with.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

from tests.conftest import make_runner

ROOT = Path(__file__).resolve().parents[2]
REPORT_DIR = Path(os.environ.get("CHAOS_REPORT_DIR", ROOT / ".state" / "chaos"))
# One seed for the session's random steps and ranks (CHAOS_SEED replays a report).
SEED = int(os.environ.get("CHAOS_SEED", str(int(time.time()))))

# The trainer every training fault runs, and how its logs are read.
TRAINER = ROOT / "images" / "trainer" / "train.py"
# 2 epochs of digits on 2 nodes (about 46 steps), a checkpoint every 10 steps, a progress line
# every step; a wider hidden layer makes each checkpoint write long enough to be caught in it.
ARGS = ["--epochs", "2", "--batch-size", "32", "--checkpoint-every", "10", "--log-every", "1", "--hidden", "2048"]
FINAL = re.compile(r"FINAL step=(\d+) weights_sha256=([0-9a-f]{64})")
# torchrun's --tee prefixes each line ("[default0]:"): no anchor.
STEP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank0 train INFO step (\d+)/\d+")
IMPORTS = "from datetime import timedelta"


def trainer_task(**kwargs: object) -> str:
    """The training task's source (inside ``with DAG(...)``), with the trial's arguments."""
    args = ", ".join(f"{k}={v!r}" for k, v in {"track": False, **kwargs}.items())
    return f"""
    DistributedTrainingOperator(
        task_id="train", script={str(TRAINER)!r}, num_nodes=2, nproc_per_node=1,
        script_args={ARGS!r}, retry_delay=timedelta(0), teardown_grace=5, {args}
    )
    """


@pytest.fixture(scope="session")
def uninterrupted(airflow_db: Path, request: pytest.FixtureRequest) -> str:
    """The final weights' digest of the trainer run once without a fault (once per session)."""
    run, cleanup = make_runner(None)
    request.addfinalizer(cleanup)
    result = run(trainer_task(retries=0), imports=IMPORTS)
    assert result.state == "success", result.node_logs("train")[-4000:]
    found = FINAL.findall(result.node_logs("train"))
    assert found
    return str(found[-1][1])


def trials() -> int:
    return max(1, int(os.environ.get("CHAOS_TRIALS", "1")))


def wanted_faults() -> list[str]:
    return [w.strip().lower() for w in os.environ.get("CHAOS_FAULTS", "").split(",") if w.strip()]


def fault_names(item: pytest.Item) -> list[str]:
    """The faults a chaos test runs: its ``fault`` marker(s), or its ``fault`` parameter."""
    names = [str(n) for m in item.iter_markers("fault") for n in m.args]
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "fault" in callspec.params:
        names.append(str(callspec.params["fault"]))
    return names


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fault(*names): the chaos fault(s) a test runs (CHAOS_FAULTS selects by them)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        # A chaos test runs trials() trials in a row: the suite's 300 s per test scales with them.
        if here in Path(str(item.path)).parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(300 * trials()))
    wanted = wanted_faults()
    if not wanted:
        return
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        if here not in Path(str(item.path)).parents:
            keep.append(item)
            continue
        names = [n.lower() for n in fault_names(item)]
        (keep if any(w in n for w in wanted for n in names) else drop).append(item)
    if not any(here in Path(str(i.path)).parents for i in keep):
        known = sorted({n for i in items if here in Path(str(i.path)).parents for n in fault_names(i)})
        raise pytest.UsageError(f"CHAOS_FAULTS={os.environ['CHAOS_FAULTS']!r} matches no chaos fault; faults: {known}")
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


@dataclass
class Trial:
    fault: str
    injected: bool  # the fault was delivered as described (else the trial says why not)
    recovered: bool  # the task ended in success
    bit_identical: bool | None  # final weights == the uninterrupted run's (None: training did not complete)
    left_behind: int  # processes of any launch still alive afterwards
    torn_resumed: int  # resumes from a step that was not committed or did not verify
    recovery_s: float | None  # fault -> training progressing again
    note: str = ""
    steps_lost: int | None = None  # completed steps (as last seen) behind the step the relaunch resumed from


@dataclass
class Matrix:
    trials: list[Trial] = field(default_factory=list)

    def rows(self) -> list[dict[str, object]]:
        out = []
        for fault in dict.fromkeys(t.fault for t in self.trials):
            mine = [t for t in self.trials if t.fault == fault]
            times = [t.recovery_s for t in mine if t.recovery_s is not None]
            completed = [t for t in mine if t.bit_identical is not None]
            out.append(
                {
                    "fault": fault,
                    "trials": len(mine),
                    "injected": sum(t.injected for t in mine),
                    "recovered": sum(t.recovered for t in mine),
                    "bit_identical": f"{sum(bool(t.bit_identical) for t in completed)}/{len(completed)}",
                    "left_behind": sum(t.left_behind for t in mine),
                    "torn_resumed": sum(t.torn_resumed for t in mine),
                    "median_recovery_s": round(statistics.median(times), 2) if times else None,
                    "max_steps_lost": max((t.steps_lost for t in mine if t.steps_lost is not None), default=None),
                    "notes": sorted({t.note for t in mine if t.note}),
                }
            )
        return out

    def markdown(self) -> str:
        head = [
            "fault",
            "trials",
            "injected",
            "recovered",
            "bit-identical",
            "left behind",
            "torn resumed",
            "max steps lost",
            "median recovery s",
        ]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.rows():
            median = "-" if r["median_recovery_s"] is None else f"{r['median_recovery_s']:.2f}"
            cells = [r["fault"], r["trials"], r["injected"], r["recovered"], r["bit_identical"], r["left_behind"]]
            lost = "-" if r["max_steps_lost"] is None else r["max_steps_lost"]
            lines.append("| " + " | ".join(str(c) for c in [*cells, r["torn_resumed"], lost, median]) + " |")
        notes = [f"- {r['fault']}: {n}" for r in self.rows() for n in r["notes"]]
        return "\n".join(lines + (["", *notes] if notes else [])) + "\n"


MATRIX = Matrix()


def record(trial: Trial) -> Trial:
    MATRIX.trials.append(trial)
    return trial


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not MATRIX.trials:
        return
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    text = (
        f"# Chaos matrix ({trials()} trial(s) per fault; local backend with real gloo ranks, Kubernetes "
        "rows against the fake API server)\n\n"
        f"Seed {SEED} (replay: `CHAOS_SEED={SEED} make chaos TRIALS={trials()}"
        + (f" FAULTS={os.environ.get('CHAOS_FAULTS', '')!r}" if wanted_faults() else "")
        + "`; trial n of a fault draws its step and rank from the seed, the fault and n).\n\n"
        "recovered: the task succeeded; bit-identical: final weights equal an uninterrupted run's; "
        "left behind: processes of any launch alive afterwards; torn resumed: resumes from a step "
        "not committed or not verifying; steps lost: completed steps seen before the fault that the "
        "relaunch did not resume past; recovery: fault -> the next launch's first training step.\n\n"
        + MATRIX.markdown()
    )
    (REPORT_DIR / "report.md").write_text(text)
    (REPORT_DIR / "report.json").write_text(
        json.dumps(
            {
                "seed": SEED,
                "trials_per_fault": trials(),
                "faults_filter": wanted_faults(),
                "rows": MATRIX.rows(),
                "trials": [asdict(t) for t in MATRIX.trials],
            },
            indent=2,
        )
    )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if MATRIX.trials:
        terminalreporter.write_sep("=", f"chaos matrix (written to {REPORT_DIR}/report.md)")
        terminalreporter.write(MATRIX.markdown())
