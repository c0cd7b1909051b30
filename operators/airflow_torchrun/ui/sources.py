"""What the training view reads, and where it takes it from: never a path, a connection or an identity from XCom.

XCom is data others can write: any task of the DAG, any user the REST API lets edit XComs, and for
``@task.torchrun`` rank 0's own return value. The API server is not a place where DAG code runs, so
what it reads is re-derived here from the task instance's identity and this deployment's own
configuration:

- **local groups**: the group directory is ``<[torchrun] state_dir>/groups/<group id>``, the id derived
  from the task instance (dag, task, run, map index, try; every relaunch of the try found by a
  listing); its ``group.json`` gives the counts, never the directory;
- **Kubernetes groups**: the configured connection (``[torchrun] kubernetes_conn_id``), the configured
  namespace (or one listed in ``[torchrun] kubernetes_view_namespaces``), this deployment's identity,
  and the Job of the derived name, whose own metadata gives the counts;
- **checkpoints**: the task's rendered ``checkpoint_uri`` (what the DAG set, as the worker rendered
  it), else the per-run default under ``[torchrun] checkpoint_base``.

From XCom the view takes only what it shows: the group's backend name (one of the known ones),
which relaunch it is, numbers (bounded), and links (checked against the configured bases).
Each backend finds its own groups (``Backend.for_view``); every count that sizes a loop is bounded
(:mod:`airflow_torchrun.backends.handles`' bounds), and the document shows at most
:data:`MAX_RANK_ROWS` ranks.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from airflow_torchrun.backends.base import Backend
from airflow_torchrun.backends.handles import GroupHandle
from airflow_torchrun.naming import GroupIdentity

log = logging.getLogger(__name__)

# Ranks the document lists one by one; the rest are counted (``ranks_shown``).
MAX_RANK_ROWS = 1024
# What one progress read of the view takes of each log (the first read: the log's end).
LOG_READ_LIMIT = 1 << 20
# The XComs one look reads, and how long it reuses them (every open view polls every 3 s).
XCOM_KEYS = (
    "group",
    "return_value",
    "training_summary",
    "launches",
    "resumed_from",
    "mlflow_run_id",
    "mlflow_run_url",
    "goodput",
    "group_end",
)
XCOM_TTL_S = 5.0
# Largest XCom value (JSON characters) the view deserialises; a bigger one is left out.
MAX_XCOM_CHARS = 1 << 20


@dataclass(frozen=True)
class TaskKey:
    dag_id: str
    run_id: str
    task_id: str
    map_index: int
    try_number: int

    def identity(self, relaunch: int = 0) -> GroupIdentity:
        return GroupIdentity(
            self.dag_id,
            self.task_id,
            self.run_id,
            try_number=self.try_number,
            map_index=self.map_index,
            relaunch=relaunch,
        )


def _config(key: str) -> str | None:
    from airflow_torchrun.compat import conf

    return conf.get("torchrun", key, fallback=None) or None


def find_group(key: TaskKey, xcom_handle: object) -> tuple[GroupHandle, Backend[Any]] | str | None:
    """The try's group as this API server may see it (the backend the handle names, among the known
    ones; the deployment's default backend without one); None when it launched none it can see."""
    from airflow_torchrun.backends import DEFAULT_BACKEND, backend_class, backend_names

    hint: dict[str, Any] = dict(xcom_handle) if isinstance(xcom_handle, dict) else {}
    named = hint.get("backend")
    name = named if isinstance(named, str) and named in backend_names() else None
    if name is None:
        name = _config("default_backend") or DEFAULT_BACKEND
        if name not in backend_names():
            return None
    found: tuple[GroupHandle, Backend[Any]] | str | None = backend_class(name).for_view(
        key.identity(), hint, log_read_limit=LOG_READ_LIMIT
    )
    return found


# -- checkpoints ----------------------------------------------------------------------------------
def checkpoint_root(session: Any, key: TaskKey) -> str | None:
    """Where the task keeps its checkpoints: its rendered ``checkpoint_uri``, else the per-run default."""
    from airflow.models.renderedtifields import RenderedTaskInstanceFields as RTIF

    from airflow_torchrun.naming import lineage_path
    from airflow_torchrun.operators.training import checkpoint_base

    rendered = session.scalar(
        select(RTIF.rendered_fields).where(
            RTIF.dag_id == key.dag_id,
            RTIF.run_id == key.run_id,
            RTIF.task_id == key.task_id,
            RTIF.map_index == key.map_index,
        )
    )
    if isinstance(rendered, dict):
        if "checkpoint_uri" not in rendered:
            return None  # not a training task (evaluation, sharding): nothing of its own to list
        uri = rendered.get("checkpoint_uri")
        if isinstance(uri, str) and uri.strip() and uri != "None":
            return uri
    return f"{checkpoint_base().rstrip('/')}/{lineage_path(key.dag_id, key.run_id, key.task_id, key.map_index)}"


# -- XCom -----------------------------------------------------------------------------------------
_XCOM_CACHE: dict[tuple[Any, ...], tuple[float, dict[str, Any]]] = {}
_XCOM_LOCK = threading.Lock()
_XCOM_CACHE_MAX = 256


def task_xcoms(session: Any, key: TaskKey) -> dict[str, Any]:
    """The few XComs of the task instance the view shows (:data:`XCOM_KEYS`), each at most
    :data:`MAX_XCOM_CHARS` long, read at most every :data:`XCOM_TTL_S` seconds."""
    cache_key = (key.dag_id, key.run_id, key.task_id, key.map_index)
    now = time.monotonic()
    with _XCOM_LOCK:
        cached = _XCOM_CACHE.get(cache_key)
        if cached is not None and now - cached[0] < XCOM_TTL_S:
            return cached[1]
    values = _read_xcoms(session, key.dag_id, key.run_id, key.task_id, key.map_index, XCOM_KEYS)
    with _XCOM_LOCK:
        _XCOM_CACHE[cache_key] = (now, values)
        while len(_XCOM_CACHE) > _XCOM_CACHE_MAX:
            _XCOM_CACHE.pop(next(iter(_XCOM_CACHE)))
    return values


def run_xcom(session: Any, dag_id: str, run_id: str, key: str) -> Any:
    """One XCom key of the run (any task), e.g. the registered model's link; None when there is none."""
    values = _read_xcoms(session, dag_id, run_id, None, None, (key,))
    return values.get(key)


def _read_xcoms(
    session: Any, dag_id: str, run_id: str, task_id: str | None, map_index: int | None, keys: tuple[str, ...]
) -> dict[str, Any]:
    from airflow.models.xcom import XComModel

    out: dict[str, Any] = {}
    for name in keys:
        query = XComModel.get_many(run_id=run_id, key=name, dag_ids=dag_id, task_ids=task_id, map_indexes=map_index)
        row = session.scalars(query.limit(1)).first()
        if row is None:
            continue
        try:
            if len(json.dumps(row.value, default=str)) > MAX_XCOM_CHARS:
                log.warning("XCom %s of %s/%s is too large for the training view; left out", name, dag_id, run_id)
                continue
            out[name] = XComModel.deserialize_value(row)
        except Exception:  # one unreadable XCom must not hide the training
            continue
    return out


def clear_caches() -> None:
    """Forget cached XComs and Jobs (tests)."""
    with _XCOM_LOCK:
        _XCOM_CACHE.clear()
    from airflow_torchrun.backends.kubernetes.backend import _VIEWED_JOBS

    _VIEWED_JOBS.clear()
