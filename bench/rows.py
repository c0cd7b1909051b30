"""The one row shape every benchmark reports, for ``bench/run.py`` (no parsing of printed text).

A row compares our number with an anchor measured in the same run (or a stated target):
``ratio`` is always ``ours / anchor_value``; ``unit`` tells which direction is better
(``s``: lower is better, ``MB/s``: higher is better).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FIELDS = ("measure", "ours", "anchor", "anchor_value", "ratio", "unit")


def row(measure: str, ours: float, anchor: str, anchor_value: float | None, unit: str) -> dict[str, Any]:
    ratio = ours / anchor_value if anchor_value else None
    return {
        "measure": measure,
        "ours": round(ours, 4),
        "anchor": anchor,
        "anchor_value": None if anchor_value is None else round(anchor_value, 4),
        "ratio": None if ratio is None else round(ratio, 4),
        "unit": unit,
    }


def check(rows: object) -> list[dict[str, Any]]:
    """``rows`` as read back from JSON, or ValueError saying what is off."""
    if not isinstance(rows, list):
        raise ValueError(f"rows must be a list, got {type(rows).__name__}")
    for r in rows:
        if not isinstance(r, dict) or tuple(r) != FIELDS:
            raise ValueError(f"a row must have exactly the fields {', '.join(FIELDS)}, got {r!r}")
        if not isinstance(r["ours"], int | float) or not isinstance(r["measure"], str):
            raise ValueError(f"row {r!r}: measure must be text and ours a number")
    return rows


def write_json(path: str | Path | None, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` to ``path`` (``--json PATH``); nothing when no path was given."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(check(rows), indent=2))
