"""The chaos matrix's report: one row per fault, written when the session ends.

``make chaos`` (``TRIALS=N``) runs ``tests/chaos`` alone and writes ``.state/chaos/report.md`` and
``report.json``; ``make test`` runs the same faults with ``CHAOS_TRIALS`` (default 1) and writes the
same report. Each trial is recorded by :func:`record` whatever its outcome, so a miss shows in the
report (and fails its test) rather than disappearing.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPORT_DIR = Path(os.environ.get("CHAOS_REPORT_DIR", ROOT / ".state" / "chaos"))


def trials() -> int:
    return max(1, int(os.environ.get("CHAOS_TRIALS", "1")))


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
        f"# Chaos matrix ({trials()} trial(s) per fault, local backend, real gloo ranks)\n\n"
        "recovered: the task succeeded; bit-identical: final weights equal an uninterrupted run's; "
        "left behind: processes of any launch alive afterwards; torn resumed: resumes from a step "
        "not committed or not verifying; steps lost: completed steps seen before the fault that the "
        "relaunch did not resume past; recovery: fault -> the next launch's first training step.\n\n"
        + MATRIX.markdown()
    )
    (REPORT_DIR / "report.md").write_text(text)
    (REPORT_DIR / "report.json").write_text(
        json.dumps({"rows": MATRIX.rows(), "trials": [asdict(t) for t in MATRIX.trials]}, indent=2)
    )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if MATRIX.trials:
        terminalreporter.write_sep("=", f"chaos matrix (written to {REPORT_DIR}/report.md)")
        terminalreporter.write(MATRIX.markdown())
