"""A framework's own checkpoints under a task's checkpoint location (Airflow side: no torch).

A script that keeps its own checkpointing (``ModelCheckpoint(dirpath=...)``, Trainer's
``output_dir``, accelerate's ``save_state``) and is handed ``TRAIN_CHECKPOINT_DIR`` writes its
checkpoints beside the store's ``step-*`` directories. The operator looks for them before launch
so that, when the store has no committed step, the log and XCom ``resumed_from`` say what the
script will resume from, instead of "fresh start".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow_torchrun.storage.checkpoints import CheckpointStore

# How deep below the root to look: ``<root>/lightning/checkpoints/last.ckpt`` is 3 levels down.
MAX_DEPTH = 3
_LIGHTNING_STEP = re.compile(r"step=(\d+)")
_HF_DIR = re.compile(r"^checkpoint-(\d+)$")
_ACCELERATE_DIR = re.compile(r"^checkpoint_(\d+)$")
# The store's own entries: never a framework's.
_STORE_ENTRY = re.compile(r"^(step-\d+|results|LINEAGE)$")


@dataclass(frozen=True)
class FrameworkCheckpoint:
    framework: str  # "lightning", "transformers" or "accelerate"
    uri: str
    step: int | None
    modified: float

    def to_xcom(self) -> dict[str, Any]:
        return {"uri": self.uri, "step": self.step, "framework": self.framework}


def _modified(info: dict[str, Any]) -> float:
    for key in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(key)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
    return 0.0


def find_framework_checkpoint(store: CheckpointStore) -> FrameworkCheckpoint | None:
    """The most recently written framework checkpoint under ``store``'s root, or None."""
    fs, root = store.fs, store.location.path.rstrip("/")
    found: list[FrameworkCheckpoint] = []
    frontier = [(root, 0)]
    while frontier:
        path, depth = frontier.pop()
        try:
            entries = fs.ls(path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            full = str(entry["name"]).rstrip("/")
            name = full.rsplit("/", 1)[-1]
            if depth == 0 and _STORE_ENTRY.match(name):
                continue
            is_dir = entry.get("type") == "directory"
            uri = f"{store.uri}{full[len(root) :]}"
            hf, acc = _HF_DIR.match(name), _ACCELERATE_DIR.match(name)
            if not is_dir and name.endswith(".ckpt"):
                step = _LIGHTNING_STEP.search(name)
                found.append(
                    FrameworkCheckpoint("lightning", uri, int(step.group(1)) if step else None, _modified(entry))
                )
            elif is_dir and hf and fs.exists(f"{full}/trainer_state.json"):
                found.append(FrameworkCheckpoint("transformers", uri, int(hf.group(1)), _modified(entry)))
            elif is_dir and acc:
                found.append(FrameworkCheckpoint("accelerate", uri, int(acc.group(1)), _modified(entry)))
            elif is_dir and depth + 1 < MAX_DEPTH:
                frontier.append((full, depth + 1))
    if not found:
        return None
    # Newest file first; among a framework's numbered directories (same second), the highest step.
    return max(found, key=lambda c: (c.modified, c.step if c.step is not None else -1))
