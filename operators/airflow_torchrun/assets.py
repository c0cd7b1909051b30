"""Metadata on the asset events a task's outlets emit, so downstream DAGs read it from
``inlet_events`` (the checkpoint a training wrote, the model version a registration made)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def annotate_outlets(context: Mapping[str, Any], outlets: Iterable[object], extra: Mapping[str, Any], log: Any) -> None:
    """Add ``extra`` (JSON values) to the event of every asset among ``outlets``. Best effort: an
    event without metadata is still an event, so a failure here is only warned about."""
    events = context.get("outlet_events")
    if events is None:
        return
    for outlet in outlets:
        if type(outlet).__name__ not in ("Asset", "Dataset"):
            continue  # an AssetAlias or another kind of outlet: nothing to annotate
        try:
            events[outlet].extra.update(dict(extra))
        except Exception as exc:
            log.warning("Could not add metadata to the event of asset %s: %s", outlet, exc)
