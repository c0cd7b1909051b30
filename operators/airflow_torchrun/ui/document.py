"""The training view's JSON document, from what was observed of one try's group. Pure.

:func:`build_document` takes the group's handle, its nodes as observed, the progress board fed
from the ranks' records, the failure report, the checkpoints and links, and returns what
``GET /torchrun/api/v1/dags/{dag_id}/dagRuns/{dag_run_id}/taskInstances/{task_id}`` serves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from airflow_torchrun.backends.handles import GroupHandle
from airflow_torchrun.contract.progress import ProgressRecord
from airflow_torchrun.progress import Alert, ProgressBoard, format_summary
from airflow_torchrun.status import GroupStatus, NodeObservation, NodePhase

RANK_STATES = ("pending", "running", "succeeded", "failed", "stopped")
#: Points per rank in the chart's series: enough for a curve, bounded whatever the run's length.
SERIES_POINTS = 300


@dataclass(frozen=True)
class CheckpointRow:
    step: int
    uri: str
    committed: bool
    size: int | None = None  # bytes, every file of the step
    time: float | None = None  # epoch: committed at (or last written, for a torn one)
    try_number: int | None = None  # the try that committed it (its marker's writer); None: torn or unknown

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "uri": self.uri,
            "committed": self.committed,
            "size": self.size,
            "time": self.time,
            "try_number": self.try_number,
        }


def downsample(records: Sequence[ProgressRecord], limit: int = SERIES_POINTS) -> list[ProgressRecord]:
    """At most ``limit`` records, evenly spread by position, the first and the last always kept."""
    if len(records) <= limit:
        return list(records)
    picked = {round(i * (len(records) - 1) / (limit - 1)) for i in range(limit)}
    return [records[i] for i in sorted(picked)]


def series(history: Mapping[int, Sequence[ProgressRecord]]) -> list[dict[str, Any]]:
    """Each rank's ``[step, loss, samples_per_s]`` over the try, for the view's charts."""
    out = []
    for rank in sorted(history):
        ordered = sorted(history[rank], key=lambda r: (r.step, r.time))
        points = [[r.step, r.loss, r.samples_per_s] for r in downsample(ordered)]
        out.append({"rank": rank, "points": points})
    return out


def rank_state(node: NodeObservation | None) -> str:
    """One of pending|running|succeeded|failed|stopped for every rank of ``node``."""
    if node is None or node.phase is NodePhase.PENDING:
        return "pending"
    if node.phase is NodePhase.RUNNING:
        return "running"
    if node.phase is NodePhase.SUCCEEDED:
        return "succeeded"
    if node.stopped_by:
        return "stopped"
    return "failed"


def build_document(
    *,
    ids: Mapping[str, Any],
    handle: GroupHandle | None,
    status: GroupStatus | None,
    board: ProgressBoard | None,
    alerts_seen: Sequence[Alert] = (),
    failure: str | None = None,
    checkpoints: Sequence[CheckpointRow] = (),
    links: Mapping[str, str | None] | None = None,
    launches: Sequence[Mapping[str, Any]] = (),
    extra: Mapping[str, Any] | None = None,
    max_rows: int | None = None,
    history: Mapping[int, Sequence[ProgressRecord]] | None = None,
) -> dict[str, Any]:
    """The document; ``handle`` None: the try has launched no group (yet). ``max_rows``: list at
    most that many ranks one by one (``ranks_shown`` says how many were).

    Once the group ended, ``progress.reached`` is how far the try got: the furthest step a rank
    reported or the try's own last committed checkpoint, whichever is further (records come every
    few seconds, so a try that fails between two says less than its checkpoints do).
    """
    doc: dict[str, Any] = {
        **ids,
        "group_id": None,
        "state": "pending",
        "backend": None,
        "world_size": None,
        "num_nodes": None,
        "nproc_per_node": None,
        "launches": list(launches),
        "ranks": [],
        "progress": None,
        "alerts": [],
        "alerts_seen": [a.to_dict() for a in alerts_seen],
        "failure": failure,
        "checkpoints": [c.to_dict() for c in checkpoints],
        "links": dict(links or {}),
        "series": series({r: h for r, h in (history or {}).items() if max_rows is None or r < max_rows}),
        **(extra or {}),
    }
    if handle is None:
        return doc
    nproc = max(1, handle.world_size // max(1, handle.num_nodes))
    nodes = {n.node_rank: n for n in (status.nodes if status else ())}
    ranks = []
    shown = handle.world_size if max_rows is None else min(handle.world_size, max_rows)
    for rank in range(shown):
        node_rank, local_rank = divmod(rank, nproc)
        node = nodes.get(node_rank)
        record = board.latest.get(rank) if board else None
        ranks.append(
            {
                "rank": rank,
                "node_rank": node_rank,
                "local_rank": local_rank,
                "state": rank_state(node),
                "exit_code": node.exit_code if node else None,
                "signal": node.signal if node else None,
                "reason": node.reason if node else None,
                "step": record.step if record else None,
                "samples_per_s": record.samples_per_s if record else None,
                "step_time": record.step_time if record else None,
                "data_wait": record.data_wait if record else None,
                "loss": record.loss if record else None,
            }
        )
    summary = board.summary() if board else None
    progress = summary.to_dict() if summary else None
    line = board.summary_line() if board else None
    ended = status is not None and status.state.terminal
    mine = [c.step for c in checkpoints if c.committed and c.try_number == ids.get("try_number")]
    if ended and summary is None and mine:
        # No rank's report is left (a Kubernetes group's logs go with its pods): its checkpoints tell.
        reached = max(mine)
        progress = {"step": reached, "reached": reached, "total_steps": None, "eta_s": None}
        line = f"reached step {reached}: this try's last committed checkpoint (its ranks' reports are gone)"
    if ended and summary is not None:
        furthest = max(r.step for r in board.latest.values()) if board else summary.step
        reached = max([furthest, *mine])
        assert progress is not None
        progress.update({"reached": reached, "eta_s": None})
        line = format_summary(summary, reached=reached)
        if reached > furthest:
            line += f" | this try's last committed checkpoint; its ranks last reported step {furthest}"
    doc.update(
        {
            "group_id": handle.group_id,
            "state": status.state.value if status else "pending",
            "backend": handle.backend,
            "world_size": handle.world_size,
            "num_nodes": handle.num_nodes,
            "nproc_per_node": nproc,
            "launched_at": handle.launched_at,
            "ranks": ranks,
            "ranks_shown": shown,
            "progress": progress,
            "progress_line": line,
            "alerts": [a.to_dict() for a in board.alerts.values()] if board else [],
        }
    )
    return doc
