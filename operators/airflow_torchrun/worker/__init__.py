"""Helpers used inside the ranks. Never imports Airflow.

``from airflow_torchrun.worker import save_checkpoint, load_checkpoint`` is the public entry point;
the names are resolved lazily so that ``python -m airflow_torchrun.worker.launch`` does not pay
for importing torch before the user's script does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "save_checkpoint": "airflow_torchrun.worker.checkpoint",
    "load_checkpoint": "airflow_torchrun.worker.checkpoint",
    "resume_step": "airflow_torchrun.worker.checkpoint",
    "resume_from": "airflow_torchrun.worker.checkpoint",
    "wait_for_checkpoint": "airflow_torchrun.worker.checkpoint",
    "save_if_stopping": "airflow_torchrun.worker.checkpoint",
    "stop_requested": "airflow_torchrun.worker.checkpoint",
    "ProgressLogger": "airflow_torchrun.worker.progress",
    "prime_ddp_buckets": "airflow_torchrun.worker.ddp",
    "should_checkpoint": "airflow_torchrun.worker.interval",
    "ShardLoader": "airflow_torchrun.worker.shards",
}

if TYPE_CHECKING:
    from airflow_torchrun.worker.checkpoint import (
        load_checkpoint,
        resume_from,
        resume_step,
        save_checkpoint,
        save_if_stopping,
        stop_requested,
        wait_for_checkpoint,
    )
    from airflow_torchrun.worker.ddp import prime_ddp_buckets
    from airflow_torchrun.worker.interval import should_checkpoint
    from airflow_torchrun.worker.progress import ProgressLogger
    from airflow_torchrun.worker.shards import ShardLoader

__all__ = [
    "ProgressLogger",
    "ShardLoader",
    "load_checkpoint",
    "prime_ddp_buckets",
    "resume_from",
    "resume_step",
    "save_checkpoint",
    "save_if_stopping",
    "should_checkpoint",
    "stop_requested",
    "wait_for_checkpoint",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'airflow_torchrun.worker' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
