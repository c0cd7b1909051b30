"""The training view's JSON API and page: a FastAPI app the plugin mounts at ``/torchrun``.

- ``GET /torchrun/api/v1/dags/{dag_id}/dagRuns/{dag_run_id}/taskInstances/{task_id}`` (query
  ``map_index``, ``try_number``; default the latest try): the document of
  :func:`airflow_torchrun.ui.document.build_document`;
- ``GET /torchrun/view/{dag_id}/{dag_run_id}/{task_id}``: the page the task instance's
  "Training" tab shows (an Airflow external view); it polls the API while the group runs.

Both sit behind Airflow's own auth: the REST API's JWT (``Authorization: Bearer``, or the UI's
session cookie) and ``requires_access_dag("GET", TASK_INSTANCE)``, so no token gets 401 and a
user who cannot read the DAG's task instances gets 403. This module is the I/O edge: it reads the
task instance and its XComs from Airflow's database and looks at the group through its backend
(the same ``observe`` and progress records as the watch), checkpoints through the store.
"""

from __future__ import annotations

import html
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Annotated, Any

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import requires_access_dag
from fastapi import Depends, FastAPI, HTTPException, Query
from fastapi.responses import HTMLResponse
from sqlalchemy import select

from airflow_torchrun.backends.base import Backend, backend_from_handle
from airflow_torchrun.backends.handles import GroupHandle
from airflow_torchrun.progress import Alert, ProgressBoard, ProgressThresholds
from airflow_torchrun.status import GroupState, GroupStatus, NodeObservation, NodePhase, group_status
from airflow_torchrun.ui.document import CheckpointRow, build_document
from airflow_torchrun.worker.progress import parse_records

_FOLLOWED_MAX = 64
# Listing a checkpoint root reads every step's marker: at most this often per group while it runs
# (and once more after it ended), whatever the number of open views.
CHECKPOINTS_EVERY_S = 10.0
CanReadTaskInstances = Depends(requires_access_dag("GET", DagAccessEntity.TASK_INSTANCE))


@dataclass
class _Followed:
    """One group as this API server follows it: its backend keeps the log offsets, so each poll
    reads only what the ranks wrote since the last one."""

    backend: Backend
    board: ProgressBoard
    seen: list[Alert] = field(default_factory=list)
    status: GroupStatus | None = None  # once terminal, kept: the group will not change again
    failure: str | None = None
    checkpoints: list[CheckpointRow] = field(default_factory=list)
    checkpoints_at: float | None = None
    checkpoints_final: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def listed(self, uri: str | None, now: float) -> list[CheckpointRow]:
        """The checkpoints, listed anew when the last listing is old (or the group just ended)."""
        ended = self.status is not None and self.status.state.terminal
        fresh = self.checkpoints_at is not None and now - self.checkpoints_at < CHECKPOINTS_EVERY_S
        if self.checkpoints_final or (fresh and not ended):
            return self.checkpoints
        self.checkpoints = _checkpoints(uri)
        self.checkpoints_at, self.checkpoints_final = now, ended
        return self.checkpoints


_FOLLOWED: OrderedDict[str, _Followed] = OrderedDict()
_FOLLOWED_LOCK = threading.Lock()


def _followed(handle: GroupHandle) -> _Followed:
    with _FOLLOWED_LOCK:
        entry = _FOLLOWED.get(handle.group_id)
        if entry is None:
            nproc = max(1, handle.world_size // max(1, handle.num_nodes))
            entry = _Followed(backend_from_handle(handle), ProgressBoard(nproc, ProgressThresholds.from_conf()))
            _FOLLOWED[handle.group_id] = entry
            while len(_FOLLOWED) > _FOLLOWED_MAX:
                _FOLLOWED.popitem(last=False)
        _FOLLOWED.move_to_end(handle.group_id)
        return entry


def look(handle: GroupHandle, now: float | None = None, *, succeeded: bool = False) -> _Followed:
    """One look at the group: its nodes, new progress records, and the failure once it failed.

    ``succeeded``: the task instance succeeded with this group. Its nodes are then shown as
    succeeded without looking: a Kubernetes group's Job is deleted once it is done, and looking
    would find its pods gone (a vanished group, not a finished one).
    """
    entry = _followed(handle)
    with entry.lock:
        if succeeded and (entry.status is None or entry.status.state is not GroupState.SUCCEEDED):
            try:  # what the ranks reported (their logs outlive a local group; pods' may not)
                for record in parse_records(entry.backend.read_progress_lines(handle)):
                    raised, _cleared = entry.board.add([record])
                    entry.seen += raised
            except Exception:  # the group's end is known; its steps are a bonus
                pass
            nodes = [
                NodeObservation(node_rank=n, phase=NodePhase.SUCCEEDED, exit_code=0) for n in range(handle.num_nodes)
            ]
            entry.status = group_status(
                nodes, launched_at=handle.launched_at, now=now or time.time(), startup_timeout=handle.startup_timeout
            )
            entry.failure = None
        if entry.status is None or not entry.status.state.terminal:
            nodes = entry.backend.observe(handle)
            entry.status = group_status(
                nodes,
                launched_at=handle.launched_at,
                now=now or time.time(),
                startup_timeout=handle.startup_timeout,
            )
            for record in parse_records(entry.backend.read_progress_lines(handle)):
                raised, _cleared = entry.board.add([record])
                entry.seen += raised
            if entry.status.state in (GroupState.FAILED, GroupState.STARTUP_TIMEOUT):
                try:
                    entry.failure = entry.backend.explain(handle, entry.status).message
                except Exception as exc:  # the view still shows the rest
                    entry.failure = f"{entry.status.reason} (the full diagnosis could not be read: {exc})"
        return entry


# -- Airflow's database --------------------------------------------------------------------------
def _task_instance(session: Any, dag_id: str, run_id: str, task_id: str, map_index: int) -> Any:
    from airflow.models.taskinstance import TaskInstance

    return session.scalar(
        select(TaskInstance).where(
            TaskInstance.dag_id == dag_id,
            TaskInstance.run_id == run_id,
            TaskInstance.task_id == task_id,
            TaskInstance.map_index == map_index,
        )
    )


def _xcoms(session: Any, dag_id: str, run_id: str, task_id: str | None, map_index: int | None) -> dict[str, Any]:
    from airflow.models.xcom import XComModel

    rows = session.scalars(XComModel.get_many(run_id=run_id, dag_ids=dag_id, task_ids=task_id, map_indexes=map_index))
    out: dict[str, Any] = {}
    for row in rows:
        try:
            out.setdefault(row.key, XComModel.deserialize_value(row))
        except Exception:  # one unreadable XCom must not hide the training
            continue
    return out


def _handle_of_try(dag_id: str, run_id: str, task_id: str, map_index: int, try_number: int) -> GroupHandle | None:
    """An earlier try's group (its XComs are gone): the local backend keeps its handle on disk."""
    from airflow_torchrun.state import state_dir
    from airflow_torchrun.wiring import GroupIdentity

    identity = GroupIdentity(dag_id, task_id, run_id, try_number=try_number, map_index=map_index)
    found = None
    for relaunch in range(8):
        path = state_dir() / "groups" / replace(identity, relaunch=relaunch).group_id / "group.json"
        try:
            found = GroupHandle.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError):
            break
    return found


def _launches(handle: GroupHandle, identity: dict[str, Any], counts: Any) -> list[dict[str, Any]]:
    from airflow_torchrun.wiring import GroupIdentity

    base = GroupIdentity(**identity)
    rows = [
        {"relaunch": r, "group_id": replace(base, relaunch=r).group_id, "current": r == handle.relaunch}
        for r in range(handle.relaunch + 1)
    ]
    if isinstance(counts, dict):
        for row in rows:
            row["counts"] = None
        rows[-1]["counts"] = {k: int(v) for k, v in counts.items() if isinstance(v, int)}
        # Why each launch was replaced (the engine's relaunch history: kind, reason, time).
        history = counts.get("history")
        for row, entry in zip(rows, history if isinstance(history, list) else [], strict=False):
            if isinstance(entry, dict):
                row["ended_by"] = {k: entry.get(k) for k in ("kind", "why", "at")}
    return rows


def _checkpoints(uri: str | None) -> list[CheckpointRow]:
    """Every step directory under ``uri``: committed or torn, size, time (best effort)."""
    if not uri:
        return []
    from airflow_torchrun.checkpoint import CheckpointStore

    store = CheckpointStore(uri)
    rows = []
    # The store's listing of step directories, committed or torn: what the view is for.
    for step in store._step_dirs():
        committed = store.is_committed(step)
        when = None
        if committed:
            try:
                when = float(store.read_marker(step).get("committed_at") or 0.0) or None
            except Exception:
                when = None
        files = store.list_files(step)
        rows.append(CheckpointRow(step, store.step_uri(step), committed, sum(files.values()) if files else 0, when))
    return rows


def collect(
    session: Any, dag_id: str, dag_run_id: str, task_id: str, map_index: int, try_number: int | None
) -> dict[str, Any]:
    from airflow_torchrun.links import checkpoint_url

    ti = _task_instance(session, dag_id, dag_run_id, task_id, map_index)
    if ti is None:
        raise HTTPException(404, f"no task instance {dag_id}/{dag_run_id}/{task_id} (map_index {map_index})")
    current = int(ti.try_number or 0)
    wanted = current if try_number is None else try_number
    if wanted < 1 or wanted > max(current, 1):
        raise HTTPException(404, f"try {wanted} of {task_id} does not exist (latest: {current})")
    xcoms = _xcoms(session, dag_id, dag_run_id, task_id, map_index) if wanted == current else {}
    handle: GroupHandle | None = None
    if isinstance(xcoms.get("group"), dict):
        handle = GroupHandle.from_dict(xcoms["group"])
    elif wanted != current:
        handle = _handle_of_try(dag_id, dag_run_id, task_id, map_index, wanted)
    ids = {
        "dag_id": dag_id,
        "dag_run_id": dag_run_id,
        "task_id": task_id,
        "map_index": map_index,
        "try_number": wanted,
        "latest_try": current,
        "ti_state": str(getattr(ti.state, "value", ti.state)) if wanted == current else None,
        "updated_at": time.time(),
    }
    returned = xcoms.get("return_value")
    summary: dict[str, Any] = returned if isinstance(returned, dict) else {}
    uri = xcoms.get("checkpoint_uri") or summary.get("checkpoint_uri")
    run_links = _xcoms(session, dag_id, dag_run_id, None, None) if wanted == current else {}
    final = summary.get("final_checkpoint")
    where = final or uri
    links = {
        "mlflow_run": xcoms.get("mlflow_run_url"),
        "checkpoint": checkpoint_url(str(where)) if where else None,
        "model_version": run_links.get("model_version_url"),
    }
    extra = {
        "checkpoint_uri": uri,
        "final_checkpoint": final,
        "resumed_from": xcoms.get("resumed_from"),
        "mlflow_run_id": xcoms.get("mlflow_run_id"),
    }
    if handle is None:
        return build_document(ids=ids, handle=None, status=None, board=None, links=links, extra=extra)
    # The summary names this very group: it is the one that succeeded.
    succeeded = ids["ti_state"] == "success" and summary.get("group_id") == handle.group_id
    entry = look(handle, succeeded=succeeded)
    identity = {
        "dag_id": dag_id,
        "task_id": task_id,
        "run_id": dag_run_id,
        "try_number": wanted,
        "map_index": map_index,
    }
    try:
        with entry.lock:
            checkpoints = entry.listed(uri, time.time())
    except Exception as exc:  # storage away: the rest of the view still helps
        checkpoints = []
        extra["checkpoints_error"] = str(exc)
    return build_document(
        ids=ids,
        handle=handle,
        status=entry.status,
        board=entry.board,
        alerts_seen=entry.seen,
        failure=entry.failure,
        checkpoints=checkpoints,
        links=links,
        launches=_launches(handle, identity, xcoms.get("launches")),
        extra=extra,
    )


# -- the app -------------------------------------------------------------------------------------
def _map_index(raw: str | None) -> int:
    """``-1`` for an unmapped task; the UI leaves ``{MAP_INDEX}`` unreplaced there."""
    try:
        return int(raw) if raw not in (None, "") else -1
    except ValueError:
        return -1


def create_app() -> FastAPI:
    app = FastAPI(
        title="airflow-torchrun",
        description="Training groups of DistributedTrainingOperator tasks: state, progress, checkpoints.",
    )

    @app.get("/api/v1/dags/{dag_id}/dagRuns/{dag_run_id}/taskInstances/{task_id}", dependencies=[CanReadTaskInstances])
    def training(
        dag_id: str,
        dag_run_id: str,
        task_id: str,
        session: SessionDep,
        map_index: Annotated[str | None, Query()] = None,
        try_number: Annotated[int | None, Query()] = None,
    ) -> dict[str, Any]:
        return collect(session, dag_id, dag_run_id, task_id, _map_index(map_index), try_number)

    @app.get("/view/{dag_id}/{dag_run_id}/{task_id}", response_class=HTMLResponse, dependencies=[CanReadTaskInstances])
    def view(dag_id: str, dag_run_id: str, task_id: str, map_index: str | None = None) -> HTMLResponse:
        page = resources.files("airflow_torchrun.ui").joinpath("view.html").read_text()
        ids = json.dumps(
            {"dag_id": dag_id, "dag_run_id": dag_run_id, "task_id": task_id, "map_index": _map_index(map_index)}
        )
        return HTMLResponse(page.replace("__IDS__", html.escape(ids, quote=True)))

    return app


app = create_app()
