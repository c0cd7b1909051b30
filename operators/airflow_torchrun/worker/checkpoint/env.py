"""The rank's side of the checkpoint contract: what the operator put in its environment."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from airflow_torchrun import contract
from airflow_torchrun.errors import StorageError
from airflow_torchrun.storage.aws import STORAGE_OPTIONS_ENV
from airflow_torchrun.storage.checkpoints import CheckpointStore
from airflow_torchrun.storage.lineage import ref_from_uri

log = logging.getLogger(__name__)


ENV_CHECKPOINT_URI = contract.CHECKPOINT_URI

ENV_RESUME_FROM = contract.RESUME_FROM

ENV_KEEP_LAST = contract.CHECKPOINT_KEEP_LAST

ENV_STORAGE_OPTIONS = STORAGE_OPTIONS_ENV

ENV_LINEAGE = contract.CHECKPOINT_LINEAGE

ENV_TRUST_SHARDED = contract.CHECKPOINT_TRUST_SHARDED

DEFAULT_KEEP_LAST = 3


# -- environment ------------------------------------------------------------------------------
def resume_from() -> str | None:
    """``TRAIN_RESUME_FROM``, or None on a fresh start."""
    value = os.environ.get(ENV_RESUME_FROM, "").strip()
    return value or None


def resume_step(uri: str | None = None) -> int:
    """The step of the checkpoint resumed from (``uri`` or ``TRAIN_RESUME_FROM``); 0 on a fresh start.

    Read from the step directory's name: no I/O, so it is safe to call before the process group exists.
    """
    uri = uri or resume_from()
    return ref_from_uri(uri).step if uri else 0


def checkpoint_root(uri: str | None) -> str:
    root = uri or os.environ.get(ENV_CHECKPOINT_URI, "").strip()
    if not root:
        raise StorageError(
            f"save_checkpoint needs a location: {ENV_CHECKPOINT_URI} is not set (the operator sets it) and no uri= "
            "was given; pass uri='file:///path' or uri='s3://bucket/prefix' when running outside Airflow"
        )
    return root


def keep_last_of(value: int | None) -> int:
    if value is None:
        raw = os.environ.get(ENV_KEEP_LAST, "").strip()
        if not raw:
            return DEFAULT_KEEP_LAST
        try:
            value = int(raw)
        except ValueError:
            raise StorageError(
                f"{ENV_KEEP_LAST}={raw!r} is not a whole number; set it to 0 (keep all) or more"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise StorageError(f"keep_last must be a whole number >= 0 (0 keeps every committed checkpoint), got {value!r}")
    return value


def storage_options() -> dict[str, Any]:
    raw = os.environ.get(ENV_STORAGE_OPTIONS, "").strip()
    if not raw:
        return {}
    try:
        options = json.loads(raw)
    except ValueError as exc:
        raise StorageError(f"{ENV_STORAGE_OPTIONS} is not valid JSON: {exc}") from exc
    if not isinstance(options, dict):
        raise StorageError(f"{ENV_STORAGE_OPTIONS} must be a JSON object of s3fs options, got {type(options).__name__}")
    return options


def store_for(root: str) -> CheckpointStore:
    return CheckpointStore(root, storage_options())


def lineage_env() -> dict[str, Any] | None:
    raw = os.environ.get(ENV_LINEAGE, "").strip()
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        log.warning("%s is not valid JSON; checkpoints will record no lineage", ENV_LINEAGE)
        return None
    return data if isinstance(data, dict) else None


def writer() -> dict[str, Any]:
    """Who commits: the try, the group (torchrun's run id), the host and process."""
    lineage = lineage_env() or {}
    return {
        "try_number": lineage.get("try_number"),
        "group_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        "host": os.uname().nodename,
        "pid": os.getpid(),
    }
