"""The one row shape every benchmark reports, for ``bench/run.py`` (no parsing of printed text).

A row compares our number with an anchor measured in the same run (or a stated target):
``ratio`` is always ``ours / anchor_value``; ``unit`` tells which direction is better
(``s``: lower is better; ``MB/s`` and ``ETTR``: higher is better). ``ours`` and ``anchor_value`` are medians
when a benchmark gives :class:`Samples`; the row then also carries how many runs there were, the
min and max of each side and how many of the runs succeeded (a kill recovered, say). A side with
no successful run has the value ``None`` and a ``note`` saying why: a failed anchor is reported,
never dropped. A paired row (ours minus the anchor, run by run) gives the mean of the differences
with its 95% interval (``ci_low``/``ci_high``, :mod:`stats`) instead. Every row says how many
repeats it took (``repeats``).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FIELDS = ("measure", "ours", "anchor", "anchor_value", "ratio", "unit")
DETAIL = (
    "repeats",
    "ours_min",
    "ours_max",
    "anchor_min",
    "anchor_max",
    "ours_success",
    "anchor_success",
    "ci_low",
    "ci_high",
    "note",
)


@dataclass(frozen=True)
class Samples:
    """The measurements of one side; ``attempts`` counts the runs, successful or not."""

    values: list[float] = field(default_factory=list)
    attempts: int | None = None

    @property
    def tried(self) -> int:
        return len(self.values) if self.attempts is None else self.attempts

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    @property
    def success(self) -> str:
        return f"{len(self.values)}/{self.tried}"


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def row(
    measure: str,
    ours: float | Samples,
    anchor: str,
    anchor_value: float | Samples | None,
    unit: str,
    *,
    note: str = "",
    repeats: int | None = None,
    interval: tuple[float | None, float | None] | None = None,
) -> dict[str, Any]:
    """One row; ``repeats``: how many runs a single value (a max, a mean) came from; ``interval``:
    the 95% interval of ``ours`` (a mean of paired differences)."""
    ours_s = ours if isinstance(ours, Samples) else Samples([ours])
    anchor_s: Samples | None = None
    anchor_v: float | None
    if isinstance(anchor_value, Samples):
        anchor_s, anchor_v = anchor_value, anchor_value.median
    else:
        anchor_v = anchor_value
    ours_v = ours_s.median
    ratio = ours_v / anchor_v if ours_v is not None and anchor_v else None
    notes = [note] if note else []
    if ours_v is None:
        notes.append(f"ours: no successful run of {ours_s.tried}")
    if anchor_s is not None and anchor_v is None:
        notes.append(f"anchor: no successful run of {anchor_s.tried}")
    measured = isinstance(ours, Samples)
    return {
        "measure": measure,
        "ours": _r(ours_v),
        "anchor": anchor,
        "anchor_value": _r(anchor_v),
        "ratio": _r(ratio),
        "unit": unit,
        "repeats": ours_s.tried if measured else repeats,
        "ours_min": _r(min(ours_s.values)) if measured and ours_s.values else None,
        "ours_max": _r(max(ours_s.values)) if measured and ours_s.values else None,
        "anchor_min": _r(min(anchor_s.values)) if anchor_s and anchor_s.values else None,
        "anchor_max": _r(max(anchor_s.values)) if anchor_s and anchor_s.values else None,
        "ours_success": ours_s.success if measured else None,
        "anchor_success": anchor_s.success if anchor_s is not None else None,
        "ci_low": _r(interval[0]) if interval else None,
        "ci_high": _r(interval[1]) if interval else None,
        "note": "; ".join(notes),
    }


def failed_row(measure: str, ours: float | Samples, anchor: str, reason: str, unit: str) -> dict[str, Any]:
    """A row whose anchor could not be measured at all (not installed, crashed): says why."""
    return row(measure, ours, f"{anchor} (FAILED)", None, unit, note=f"anchor failed: {reason}")


def check(rows: object) -> list[dict[str, Any]]:
    """``rows`` as read back from JSON, or ValueError saying what is off."""
    if not isinstance(rows, list):
        raise ValueError(f"rows must be a list, got {type(rows).__name__}")
    for r in rows:
        if not isinstance(r, dict) or tuple(r)[: len(FIELDS)] != FIELDS or not set(r) <= {*FIELDS, *DETAIL}:
            fields = ", ".join(FIELDS)
            raise ValueError(f"a row must have exactly the fields {fields} (then any of the details), got {r!r}")
        if not isinstance(r["measure"], str) or not (
            isinstance(r["ours"], int | float) or (r["ours"] is None and r.get("note"))
        ):
            raise ValueError(f"row {r!r}: measure must be text and ours a number (or null with a note)")
    return rows


def write_json(path: str | Path | None, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` to ``path`` (``--json PATH``); nothing when no path was given."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(check(rows), indent=2))
