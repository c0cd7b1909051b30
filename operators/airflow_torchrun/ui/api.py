"""The training view's JSON API and page: a FastAPI app the plugin mounts at ``/torchrun``.

- ``GET /torchrun/api/v1/dags/{dag_id}/dagRuns/{dag_run_id}/taskInstances/{task_id}`` (query
  ``map_index``, ``try_number``; default the latest try): the document of
  :func:`airflow_torchrun.ui.document.build_document`;
- ``GET /torchrun/view/{dag_id}/{dag_run_id}/{task_id}``: the page the task instance's
  "Training" tab shows (an Airflow external view); it polls the API while the group runs.

Both sit behind Airflow's own auth: the REST API's JWT (``Authorization: Bearer``, or the UI's
session cookie) and ``requires_access_dag("GET", TASK_INSTANCE)``, so no token gets 401 and a
user who cannot read the DAG's task instances gets 403. What comes from the ranks' logs (the
failure's log tail, progress, warnings) needs the DAG's task-log permission too, what comes from
XCom (links, the summary, launches) its XCom permission; without one, those parts are withheld
(``withheld`` says which). The app serves no OpenAPI or docs pages.

This module is the I/O edge: it reads the task instance and a few of its XComs from Airflow's
database and looks at the group through its backend (the same ``observe`` and progress records as
the watch), checkpoints through the store. Where the group and its checkpoints are is re-derived
from the task instance and this deployment's configuration (:mod:`airflow_torchrun.ui.sources`),
never taken from XCom; one look per group at most every :data:`LOOK_EVERY_S` seconds, whatever the
number of open views, and no look holds a request open (no pod watch, bounded log reads).
"""

from __future__ import annotations

import html
import json
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Annotated, Any

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import GetUserDep, requires_access_dag
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse
from sqlalchemy import select

from airflow_torchrun.backends.base import Backend
from airflow_torchrun.backends.handles import MAX_RELAUNCH, GroupHandle, bounded_int
from airflow_torchrun.contract.progress import ProgressRecord, parse_records
from airflow_torchrun.progress import Alert, ProgressBoard, ProgressThresholds
from airflow_torchrun.status import GroupStatus, NodeObservation, NodePhase, Outcome, group_status
from airflow_torchrun.ui.document import CheckpointRow, build_document, downsample
from airflow_torchrun.ui.sources import MAX_RANK_ROWS, TaskKey, find_group

_FOLLOWED_MAX = 64
# Records kept per rank for the charts; past it the history is thinned to half (memory stays bounded).
_HISTORY_MAX = 4000
# Listing a checkpoint root reads every step's marker: at most this often per group while it runs
# (and once more after it ended), whatever the number of open views.
CHECKPOINTS_EVERY_S = 10.0
# One look at a group (its nodes, new progress records) at most this often, whatever the number of
# open views: each poll of each view would otherwise be requests to the cluster or reads of logs.
LOOK_EVERY_S = 2.0
CanReadTaskInstances = Depends(requires_access_dag("GET", DagAccessEntity.TASK_INSTANCE))


@dataclass(frozen=True)
class Access:
    """What the caller may read beyond the task instance: its logs, its XComs."""

    logs: bool
    xcom: bool


def _access(request: Request, user: GetUserDep) -> Access:
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.models.dag import DagModel

    dag_id = request.path_params.get("dag_id")
    details = DagDetails(id=dag_id, team_name=DagModel.get_team_name(dag_id) if dag_id else None)

    def may(entity: DagAccessEntity) -> bool:
        return bool(
            get_auth_manager().is_authorized_dag(method="GET", access_entity=entity, details=details, user=user)
        )

    return Access(logs=may(DagAccessEntity.TASK_LOGS), xcom=may(DagAccessEntity.XCOM))


AccessDep = Annotated[Access, Depends(_access)]


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
    looked_at: float | None = None  # monotonic: the last look at the group
    history: dict[int, list[ProgressRecord]] = field(default_factory=dict)  # every rank's records, for the charts
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, records: list[ProgressRecord]) -> None:
        """New records: onto the board (alerts) and into the history (charts)."""
        for record in records:
            if len(self.history) >= MAX_RANK_ROWS and record.rank not in self.history:
                continue  # the charts' ranks are bounded as the table's are
            raised, _cleared = self.board.add([record])
            self.seen += raised
            mine = self.history.setdefault(record.rank, [])
            mine.append(record)
            if len(mine) > _HISTORY_MAX:
                self.history[record.rank] = downsample(mine, _HISTORY_MAX // 2)

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


def _followed(handle: GroupHandle, backend: Backend) -> _Followed:
    with _FOLLOWED_LOCK:
        entry = _FOLLOWED.get(handle.group_id)
        if entry is None:
            nproc = max(1, handle.world_size // max(1, handle.num_nodes))
            entry = _Followed(backend, ProgressBoard(nproc, ProgressThresholds.from_conf()))
            _FOLLOWED[handle.group_id] = entry
            while len(_FOLLOWED) > _FOLLOWED_MAX:
                _FOLLOWED.popitem(last=False)
        _FOLLOWED.move_to_end(handle.group_id)
        return entry


def recorded_end(raw: object, handle: GroupHandle) -> tuple[list[NodeObservation], str | None] | None:
    """How the try concluded ``handle``'s group (XCom ``group_end``, the engine's record): its nodes
    and the failure's story, bounded; None when the record is not this group's or not of that shape.
    Display only (the record is XCom, which others can write): it decides nothing."""
    if not isinstance(raw, dict) or raw.get("group_id") != handle.group_id or not isinstance(raw.get("nodes"), list):
        return None
    phases = {p.value for p in NodePhase}

    def text(value: object, limit: int) -> str | None:
        return value[:limit] if isinstance(value, str) else None

    nodes: dict[int, NodeObservation] = {}
    for node in raw["nodes"][: handle.num_nodes]:
        if not isinstance(node, dict) or node.get("phase") not in phases:
            return None
        rank = bounded_int(node.get("node_rank"), low=0, high=handle.num_nodes - 1)
        if rank is None:
            return None
        nodes[rank] = NodeObservation(
            node_rank=rank,
            phase=NodePhase(node["phase"]),
            exit_code=bounded_int(node.get("exit_code"), low=-(2**31), high=2**31),
            signal=text(node.get("signal"), 40),
            reason=text(node.get("reason"), 500),
            stopped_by=text(node.get("stopped_by"), 40),
        )
    return [nodes[r] for r in sorted(nodes)], text(raw.get("failure"), 20_000)


def look(
    handle: GroupHandle,
    backend: Backend,
    now: float | None = None,
    *,
    succeeded: bool = False,
    ended: object = None,
) -> _Followed:
    """One look at the group: its nodes, new progress records, and the failure once it failed;
    the last look's when it is younger than :data:`LOOK_EVERY_S`.

    ``succeeded``: the task instance succeeded with this group. Its nodes are then shown as
    succeeded without looking: a Kubernetes group's Job is deleted once it is done, and looking
    would find its pods gone (a vanished group, not a finished one). ``ended``: the try's record
    of how the group ended (:func:`recorded_end`); where the group's logs go with its teardown
    (Kubernetes), that record is what is shown of an ended group, not the deleted Job.
    """
    entry = _followed(handle, backend)
    record = None if backend.logs_outlive_teardown else recorded_end(ended, handle)
    with entry.lock:
        if record is not None and (entry.status is None or not entry.status.state.terminal):
            nodes, failure = record
            try:  # what the ranks reported before the end, where the logs can still be read
                entry.take(parse_records(entry.backend.read_progress_lines(handle)))
            except Exception:
                pass
            entry.status = group_status(
                nodes, launched_at=handle.launched_at, now=now or time.time(), startup_timeout=handle.startup_timeout
            )
            entry.failure = failure
            entry.looked_at = time.monotonic()
            return entry
        fresh = entry.looked_at is not None and time.monotonic() - entry.looked_at < LOOK_EVERY_S
        if fresh and not (succeeded and (entry.status is None or entry.status.state is not Outcome.SUCCEEDED)):
            return entry
        entry.looked_at = time.monotonic()
        if succeeded and (entry.status is None or entry.status.state is not Outcome.SUCCEEDED):
            try:  # what the ranks reported (their logs outlive a local group; pods' may not)
                entry.take(parse_records(entry.backend.read_progress_lines(handle)))
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
            entry.take(parse_records(entry.backend.read_progress_lines(handle)))
            if entry.status.state in (Outcome.FAILED, Outcome.STARTUP_TIMEOUT):
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


def _try_state(session: Any, ti: Any, try_number: int) -> str | None:
    """The state a try ended in: the task instance's for its latest try, the history's for earlier ones."""
    if try_number >= int(ti.try_number or 0):  # the latest, or the first of a task not started yet
        return str(getattr(ti.state, "value", ti.state)) if ti.state is not None else None
    from airflow.models.taskinstancehistory import TaskInstanceHistory as TIH

    state = session.scalar(
        select(TIH.state).where(
            TIH.dag_id == ti.dag_id,
            TIH.run_id == ti.run_id,
            TIH.task_id == ti.task_id,
            TIH.map_index == ti.map_index,
            TIH.try_number == try_number,
        )
    )
    return None if state is None else str(getattr(state, "value", state))


def _map_instances(session: Any, dag_id: str, run_id: str, task_id: str) -> list[dict[str, Any]]:
    """Every mapped instance of the task in the run (a sweep): index, name, state, try."""
    from airflow.models.taskinstance import TaskInstance

    rows = session.scalars(
        select(TaskInstance)
        .where(
            TaskInstance.dag_id == dag_id,
            TaskInstance.run_id == run_id,
            TaskInstance.task_id == task_id,
            TaskInstance.map_index >= 0,
        )
        .order_by(TaskInstance.map_index)
    )
    return [
        {
            "map_index": int(t.map_index),
            "name": t.rendered_map_index,
            "state": str(getattr(t.state, "value", t.state)) if t.state is not None else None,
            "try_number": int(t.try_number or 0),
        }
        for t in rows
    ]


def _number(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _goodput_view(value: object) -> dict[str, Any] | None:
    """The goodput ledger's XCom as the view draws it: one bar per try (seconds by category, in the
    ledger's order), each try's and the task's ETTR. Only the known categories and numbers pass
    (whoever may write XCom writes this too: it is shown, never acted on)."""
    from airflow_torchrun.goodput import CATEGORIES

    if not isinstance(value, dict):
        return None

    def account(raw: object) -> dict[str, Any] | None:
        if not isinstance(raw, dict):
            return None
        categories = raw.get("categories")
        seconds = {
            name: v
            for name in CATEGORIES
            if isinstance(categories, dict) and (v := _number(categories.get(name))) is not None and v >= 0
        }
        ettr = _number(raw.get("ettr"))
        number = raw.get("try")
        outcome = raw.get("outcome")
        return {
            "try": number if isinstance(number, int) and not isinstance(number, bool) else None,
            "outcome": outcome if isinstance(outcome, str) and len(outcome) <= 40 else None,
            "wall_s": _number(raw.get("wall_s")),
            "ettr": ettr if ettr is not None and 0 <= ettr <= 1 else None,
            "lost_steps": raw.get("lost_steps") if isinstance(raw.get("lost_steps"), int) else None,
            "seconds": seconds,
        }

    tries = value.get("tries")
    shown = [a for a in map(account, tries[:64] if isinstance(tries, list) else []) if a is not None]
    if not shown and (this := account(value.get("try"))) is not None:
        shown = [this]
    if not shown:
        return None
    return {
        "categories": list(CATEGORIES),
        "tries": shown,
        "task": account(value.get("task")),
        "resume_audit": _audit_view(value.get("resume_audit")),
    }


DIFF_KEYS = ("step", "rank", "before", "after")


def _audit_view(value: object) -> dict[str, Any] | None:
    """The resume audit (:mod:`airflow_torchrun.audit`) as the view tells it: its status, the steps
    compared and the first differing step. Only a known status and numbers pass."""
    from airflow_torchrun.audit import AuditStatus

    if not isinstance(value, dict) or value.get("status") not in {s.value for s in AuditStatus}:
        return None

    def whole(raw: object) -> int | None:
        return raw if isinstance(raw, int) and not isinstance(raw, bool) else None

    def step_diff(raw: object) -> dict[str, Any] | None:
        if not isinstance(raw, dict) or whole(raw.get("step")) is None:
            return None
        return {k: (whole(raw.get(k)) if k in ("step", "rank") else _number(raw.get(k))) for k in DIFF_KEYS}

    steps = value.get("steps")
    first, last = (whole(steps[0]), whole(steps[1])) if isinstance(steps, list) and len(steps) == 2 else (None, None)
    return {
        "status": value["status"],
        "resumed_step": whole(value.get("resumed_step")),
        "compared": whole(value.get("compared")),
        "steps": [first, last] if first is not None and last is not None else None,
        "max_relative": _number(value.get("max_relative")),
        "tolerance": _number(value.get("tolerance")),
        "first_difference": step_diff(value.get("first_difference")),
        "first_divergence": step_diff(value.get("first_divergence")),
    }


def _launches(
    handle: GroupHandle, backend: Backend[Any], identity: dict[str, Any], counts: Any
) -> list[dict[str, Any]]:
    from airflow_torchrun.naming import GroupIdentity

    base = backend.named(GroupIdentity(**identity))
    last = min(handle.relaunch, MAX_RELAUNCH)
    rows = [
        {"relaunch": r, "group_id": replace(base, relaunch=r).group_id, "current": r == handle.relaunch}
        for r in range(last + 1)
    ]
    if isinstance(counts, dict):
        for row in rows:
            row["counts"] = None
        rows[-1]["counts"] = {
            str(k)[:40]: v for k, v in list(counts.items())[:20] if bounded_int(v, low=0, high=10**9) is not None
        }
        # Why each launch was replaced (the engine's relaunch history: kind, reason, time).
        history = counts.get("history")
        for row, entry in zip(rows, history if isinstance(history, list) else [], strict=False):
            if isinstance(entry, dict):  # XCom: short strings and a time only
                kind, why, at = entry.get("kind"), entry.get("why"), entry.get("at")
                row["ended_by"] = {
                    "kind": kind[:40] if isinstance(kind, str) else None,
                    "why": why[:300] if isinstance(why, str) else None,
                    "at": at if isinstance(at, int | float) and not isinstance(at, bool) else None,
                }
    return rows


def _checkpoints(uri: str | None) -> list[CheckpointRow]:
    """Every step directory under ``uri``: committed or torn, size, time (best effort)."""
    if not uri:
        return []
    from airflow_torchrun.storage.checkpoints import CheckpointStore

    store = CheckpointStore(uri)
    rows = []
    # The store's listing of step directories, committed or torn: what the view is for.
    for step in store._step_dirs():
        committed = store.is_committed(step)
        when = writer_try = None
        if committed:
            try:
                marker = store.read_marker(step)
                when = float(marker.get("committed_at") or 0.0) or None
                tried = (marker.get("writer") or {}).get("try_number")
                writer_try = tried if isinstance(tried, int) and not isinstance(tried, bool) else None
            except Exception:
                when = None
        files = store.list_files(step)
        size = sum(files.values()) if files else 0
        rows.append(CheckpointRow(step, store.step_uri(step), committed, size, when, writer_try))
    return rows


def collect(
    session: Any,
    dag_id: str,
    dag_run_id: str,
    task_id: str,
    map_index: int,
    try_number: int | None,
    access: Access = Access(logs=True, xcom=True),
) -> dict[str, Any]:
    from airflow_torchrun.links import checkpoint_url, console_bases, mlflow_bases, safe_link
    from airflow_torchrun.ui.sources import checkpoint_root, run_xcom, task_xcoms

    ti = _task_instance(session, dag_id, dag_run_id, task_id, map_index)
    if ti is None:
        raise HTTPException(404, f"no task instance {dag_id}/{dag_run_id}/{task_id} (map_index {map_index})")
    current = int(ti.try_number or 0)
    # A task not started yet (try 0) is shown as its first try, pending.
    wanted = max(current, 1) if try_number is None else try_number
    if wanted < 1 or wanted > max(current, 1):
        raise HTTPException(404, f"try {wanted} of {task_id} does not exist (latest: {current})")
    key = TaskKey(dag_id, dag_run_id, task_id, map_index, wanted)
    # The task instance's XComs are its latest try's. What every try shares (the MLflow run, the
    # model) comes from them for an earlier try too; what one try did (its group, launches, result)
    # only for the latest. Without the XCom permission none of it is read, not even as a hint.
    latest = task_xcoms(session, key) if access.xcom else {}
    xcoms = latest if wanted == current else {}
    try:
        found = find_group(key, xcoms.get("group"))
    except Exception as exc:  # the cluster away, a namespace not readable: the rest of the view still helps
        found = f"the group could not be looked up: {exc}"
    ids = {
        "dag_id": dag_id,
        "dag_run_id": dag_run_id,
        "task_id": task_id,
        "map_index": map_index,
        "map_name": ti.rendered_map_index if map_index >= 0 else None,
        "try_number": wanted,
        "latest_try": current,
        "ti_state": _try_state(session, ti, wanted),
        "updated_at": time.time(),
    }
    # @task.torchrun: the return value is rank 0's own; the training's summary has a key of its own.
    summary_value = xcoms.get("training_summary", xcoms.get("return_value"))
    summary: dict[str, Any] = summary_value if isinstance(summary_value, dict) else {}
    uri = checkpoint_root(session, key)
    final = summary.get("final_checkpoint") if isinstance(summary.get("final_checkpoint"), str) else None
    where = final or uri
    try:
        checkpoint_link = safe_link(checkpoint_url(str(where)), console_bases()) if where else None
    except Exception:  # e.g. a [torchrun] checkpoint_console_url with an unknown {placeholder}
        checkpoint_link = None
    links = {
        "mlflow_run": safe_link(latest.get("mlflow_run_url"), mlflow_bases()),
        "checkpoint": checkpoint_link,
        "model_version": safe_link(run_xcom(session, dag_id, dag_run_id, "model_version_url"), mlflow_bases())
        if access.xcom
        else None,
    }
    extra: dict[str, Any] = {
        "checkpoint_uri": uri,
        "final_checkpoint": final,
        "resumed_from": xcoms.get("resumed_from"),
        "mlflow_run_id": latest.get("mlflow_run_id") if isinstance(latest.get("mlflow_run_id"), str) else None,
        "withheld": [what for what, allowed in (("task logs", access.logs), ("XCom", access.xcom)) if not allowed],
        "goodput": _goodput_view(xcoms.get("goodput")),
        "map_instances": _map_instances(session, dag_id, dag_run_id, task_id) if map_index >= 0 else [],
    }
    if not access.xcom:
        links = {name: None for name in links}
        extra.update(final_checkpoint=None, resumed_from=None, mlflow_run_id=None, goodput=None)
    if isinstance(found, str):
        extra["group_not_shown"] = found
        found = None
    if found is None:
        return build_document(ids=ids, handle=None, status=None, board=None, links=links, extra=extra)
    handle, backend = found
    # The summary names this very group: it is the one that succeeded.
    succeeded = ids["ti_state"] == "success" and summary.get("group_id") == handle.group_id
    entry = look(handle, backend, succeeded=succeeded, ended=xcoms.get("group_end"))
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
    with entry.lock:
        history = {rank: list(records) for rank, records in entry.history.items()}
    return build_document(
        ids=ids,
        handle=handle,
        status=entry.status,
        board=entry.board if access.logs else None,
        alerts_seen=entry.seen if access.logs else (),
        failure=entry.failure if access.logs else None,
        checkpoints=checkpoints,
        links=links,
        launches=_launches(handle, backend, identity, xcoms.get("launches") if access.xcom else None),
        extra=extra,
        max_rows=MAX_RANK_ROWS,
        history=history if access.logs else None,
    )


# -- the app -------------------------------------------------------------------------------------
def _map_index(raw: str | None) -> int:
    """``-1`` for an unmapped task; the UI leaves ``{MAP_INDEX}`` unreplaced there."""
    try:
        return int(raw) if raw not in (None, "") else -1
    except ValueError:
        return -1


def create_app() -> FastAPI:
    # No docs_url, redoc_url or openapi_url: they would answer without Airflow's auth.
    app = FastAPI(
        title="airflow-torchrun",
        description="Training groups of DistributedTrainingOperator tasks: state, progress, checkpoints.",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )

    @app.get("/api/v1/dags/{dag_id}/dagRuns/{dag_run_id}/taskInstances/{task_id}", dependencies=[CanReadTaskInstances])
    def training(
        dag_id: str,
        dag_run_id: str,
        task_id: str,
        session: SessionDep,
        access: AccessDep,
        map_index: Annotated[str | None, Query()] = None,
        try_number: Annotated[int | None, Query()] = None,
    ) -> dict[str, Any]:
        return collect(session, dag_id, dag_run_id, task_id, _map_index(map_index), try_number, access)

    @app.get("/view/{dag_id}/{dag_run_id}/{task_id}", response_class=HTMLResponse, dependencies=[CanReadTaskInstances])
    def view(dag_id: str, dag_run_id: str, task_id: str, map_index: str | None = None) -> HTMLResponse:
        page = resources.files("airflow_torchrun.ui").joinpath("view.html").read_text()
        ids = json.dumps(
            {"dag_id": dag_id, "dag_run_id": dag_run_id, "task_id": task_id, "map_index": _map_index(map_index)}
        )
        return HTMLResponse(page.replace("__IDS__", html.escape(ids, quote=True)))

    return app


app = create_app()
