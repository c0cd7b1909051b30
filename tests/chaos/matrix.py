"""The chaos matrix: every trial recorded, one report written when the session ends.

Trials are recorded in the process that runs them. Under pytest-xdist that is a worker: at its
session's end each worker hands its trials to the controller (``workeroutput``), and the
controller writes the one report and prints the table (``tests/conftest.py`` calls :func:`absorb`
and :func:`finish`). Without xdist the same process records and reports.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPORT_DIR = Path(os.environ.get("CHAOS_REPORT_DIR", ROOT / ".state" / "chaos"))
# One seed for the session's random steps and ranks (CHAOS_SEED replays a report). Under xdist the
# workers start at different seconds: the controller's seed reaches them through the environment.
SEED = int(os.environ.setdefault("CHAOS_SEED", str(int(time.time()))))
WORKER_OUTPUT_KEY = "chaos_trials"


def trials() -> int:
    return max(1, int(os.environ.get("CHAOS_TRIALS", "1")))


def wanted_faults() -> list[str]:
    return [w.strip().lower() for w in os.environ.get("CHAOS_FAULTS", "").split(",") if w.strip()]


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
    ettr: float | None = None  # the task's ETTR (goodput ledger: productive / wall over every try), if known


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
                    "median_ettr": round(statistics.median(ettrs), 3)
                    if (ettrs := [t.ettr for t in mine if t.ettr is not None])
                    else None,
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
            "median ETTR",
        ]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.rows():
            median = "-" if r["median_recovery_s"] is None else f"{r['median_recovery_s']:.2f}"
            cells = [r["fault"], r["trials"], r["injected"], r["recovered"], r["bit_identical"], r["left_behind"]]
            lost = "-" if r["max_steps_lost"] is None else r["max_steps_lost"]
            ettr = "-" if r["median_ettr"] is None else f"{r['median_ettr']:.3f}"
            lines.append("| " + " | ".join(str(c) for c in [*cells, r["torn_resumed"], lost, median, ettr]) + " |")
        notes = [f"- {r['fault']}: {n}" for r in self.rows() for n in r["notes"]]
        return "\n".join(lines + (["", *notes] if notes else [])) + "\n"


MATRIX = Matrix()


def record(trial: Trial) -> Trial:
    MATRIX.trials.append(trial)
    return trial


def absorb(workeroutput: dict[str, Any]) -> None:
    """Take the trials an xdist worker handed over (the controller's side)."""
    data = workeroutput.get(WORKER_OUTPUT_KEY)
    if data:
        MATRIX.trials.extend(Trial(**t) for t in json.loads(data))


def finish(config: pytest.Config) -> None:
    """At the session's end: a worker hands its trials over; the controller (or a run without
    xdist) writes the report."""
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput[WORKER_OUTPUT_KEY] = json.dumps([asdict(t) for t in MATRIX.trials])
        return
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


def summary(terminalreporter: pytest.TerminalReporter) -> None:
    if MATRIX.trials and getattr(terminalreporter.config, "workeroutput", None) is None:
        terminalreporter.write_sep("=", f"chaos matrix (written to {REPORT_DIR}/report.md)")
        terminalreporter.write(MATRIX.markdown())
