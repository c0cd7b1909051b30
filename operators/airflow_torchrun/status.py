"""Pure status logic: what every node was observed doing -> one group status.

Shared by the operator's wait loop and the deferrable trigger, for every backend; no I/O here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class NodePhase(StrEnum):
    PENDING = "pending"  # launched, not yet running (pod unscheduled, supervisor not up yet)
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    LOST = "lost"  # its watcher vanished without recording an outcome


@dataclass(frozen=True)
class NodeObservation:
    node_rank: int
    phase: NodePhase
    exit_code: int | None = None
    signal: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    # Why, where the platform says (OOMKilled, Evicted, ImagePullBackOff, Unschedulable, ...)
    reason: str | None = None
    retryable: bool = True
    stopped_by: str | None = None  # the node was stopped on purpose (teardown, kill)


class Outcome(StrEnum):
    """Where a group stands, or how watching it ended: one enum for the group's status, the watch's
    verdict and the trigger's event. :func:`group_status` gives the first four; the watch adds the rest."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STARTUP_TIMEOUT = "startup_timeout"
    PROGRESS_TIMEOUT = "progress_timeout"  # no progress for progress_timeout seconds
    TIMEOUT = "timeout"  # the task's execution_timeout (the watch's deadline) passed
    ERROR = "error"  # the group could not be observed; its state is unknown

    @property
    def terminal(self) -> bool:
        return self is not Outcome.RUNNING

    @property
    def ok(self) -> bool:
        return self is Outcome.SUCCEEDED


@dataclass(frozen=True)
class ProgressMark:
    """What a backend sees of its ranks' output, to tell a hang from progress: ``token`` changes
    whenever they wrote more (a log's size, a pod's last log line's time), ``output`` says whether
    they wrote anything at all yet (before that a group is starting, not hung)."""

    token: tuple[object, ...]
    output: bool


@dataclass(frozen=True)
class GroupStatus:
    state: Outcome
    nodes: tuple[NodeObservation, ...] = field(default=())
    failed_node: int | None = None
    reason: str = ""

    @property
    def exit_codes(self) -> list[int | None]:
        return [n.exit_code for n in self.nodes]


def group_status(
    nodes: Sequence[NodeObservation], *, launched_at: float, now: float, startup_timeout: float
) -> GroupStatus:
    """Reduce per-node observations to the group's state.

    Any failed or lost node fails the group (the first to finish is named); every node succeeded
    means success; a node still pending past ``startup_timeout`` means the group cannot start as a
    whole.
    """
    nodes = tuple(sorted(nodes, key=lambda n: n.node_rank))
    failed = [n for n in nodes if n.phase in (NodePhase.FAILED, NodePhase.LOST)]
    if failed:
        first = min(failed, key=lambda n: (n.stopped_by is not None, n.finished_at or now, n.node_rank))
        return GroupStatus(Outcome.FAILED, nodes, first.node_rank, describe_node(first))
    if nodes and all(n.phase is NodePhase.SUCCEEDED for n in nodes):
        return GroupStatus(Outcome.SUCCEEDED, nodes)
    pending = [n for n in nodes if n.phase is NodePhase.PENDING]
    if pending and now - launched_at > startup_timeout:
        names = ", ".join(str(n.node_rank) for n in pending)
        reasons = sorted({n.reason for n in pending if n.reason})
        why = f" ({'; '.join(reasons)})" if reasons else ""
        return GroupStatus(
            Outcome.STARTUP_TIMEOUT,
            nodes,
            pending[0].node_rank,
            f"node(s) {names} did not start within startup_timeout={startup_timeout:g}s{why}",
        )
    return GroupStatus(Outcome.RUNNING, nodes)


def describe_node(node: NodeObservation) -> str:
    if node.phase is NodePhase.LOST:
        return f"node {node.node_rank} was lost: {node.reason or 'its supervisor vanished without an outcome'}"
    if node.signal:
        how = f"was killed by {node.signal}"
    elif node.exit_code is not None:
        how = f"exited with code {node.exit_code}"
    else:
        how = "failed"
    why = f" ({node.reason})" if node.reason else ""
    return f"node {node.node_rank} {how}{why}"
