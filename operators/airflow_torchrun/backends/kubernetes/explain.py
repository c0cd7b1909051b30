"""Pure: why a Kubernetes group failed or could not start, as the task's error message.

The backend reads the pods and the failed pods' log tails; this module only words them: the
platform's reason (OOMKilled, Preempted, ErrImagePull...), torchrun's own report of the failed
rank when the log has it (:mod:`airflow_torchrun.diagnosis`), the tail of the failing pod's log,
and what to change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from airflow_torchrun import diagnosis
from airflow_torchrun.backends.base import FailureReport
from airflow_torchrun.backends.kubernetes.render import GROUP_LABEL
from airflow_torchrun.status import GroupStatus, NodeObservation, NodePhase, Outcome, describe_node

# Log tails read at most per failure: in a large group every rank fails once one does.
MAX_TAILS = 16

_PULL = "The image cannot be pulled: check the runtime's image (name, tag, digest) and image_pull_secrets."
# What to change, by the platform's reason.
HINTS = (
    ("ErrImagePull", _PULL),
    ("ImagePullBackOff", _PULL),
    ("InvalidImageName", "The runtime's image is not a valid image reference."),
    ("CreateContainerConfigError", "A Secret or ConfigMap the pod needs is missing (the runtime's env_from_secrets?)."),
    ("StartError", "The container's command could not start: is python on the image's PATH?"),
    ("OOMKilled", "A rank ran out of memory: raise the runtime's memory or use less per rank (batch size, workers)."),
    ("ResourceLimitExceeded", "The pod used more than its limit (ephemeral storage?): raise the runtime's limits."),
)


def nodes_to_read(status: GroupStatus) -> list[int]:
    """The nodes whose log tails the explanation may use: the failed ones, earliest first."""
    if status.state is Outcome.STARTUP_TIMEOUT:
        return []
    failed = [n for n in status.nodes if n.phase in (NodePhase.FAILED, NodePhase.LOST) and n.stopped_by is None]
    failed.sort(key=lambda n: (n.finished_at if n.finished_at is not None else float("inf"), n.node_rank))
    ranks = [n.node_rank for n in failed[:MAX_TAILS]]
    if status.failed_node is not None and status.failed_node not in ranks:
        ranks.append(status.failed_node)
    return ranks


def explain_failure(
    group_id: str,
    status: GroupStatus,
    *,
    namespace: str,
    job_name: str,
    pods: Mapping[int, Mapping[str, Any]],
    logs: Mapping[int, str],
) -> FailureReport:
    """The task's error for a failed or never-started group; ``logs`` maps node rank to log tail."""
    if status.state is Outcome.STARTUP_TIMEOUT:
        return _startup_timeout(group_id, status, namespace=namespace, job_name=job_name, pods=pods)
    failed = [n for n in status.nodes if n.phase in (NodePhase.FAILED, NodePhase.LOST)]
    reported: list[diagnosis.RankFailure] = []
    for node_rank, text in sorted(logs.items()):
        reported += diagnosis.parse_agent_report(node_rank, text)
    failures = diagnosis.merge(reported, [])
    cause = diagnosis.root_cause(failures)
    # The node to show: the platform's reason names it (OOMKilled, Preempted...), else torchrun's
    # report of the first real failure, else the first node that failed.
    first = next((n for n in status.nodes if n.node_rank == status.failed_node), None)
    if first is not None and first.reason:
        node = first.node_rank
    elif cause is not None:
        node = cause.node_rank
    else:
        node = status.failed_node or 0
    rank = cause.rank if cause is not None and cause.node_rank == node else None
    tail = diagnosis.rank_lines(logs.get(node, ""), node, rank)
    pod = pods.get(node)
    where = f"pod {namespace}/{pod['metadata']['name']}" if pod else f"node {node} of Job {namespace}/{job_name}"
    message = diagnosis.failure_message(group_id, failures, node_headline=status.reason, log_tail=tail, log_path=where)
    head, _, rest = message.partition("\n")
    platform = platform_reasons([n for n in failed if n.reason and n.stopped_by is None], head)
    hints = sorted({hint for n in failed for prefix, hint in HINTS if (n.reason or "").startswith(prefix)})
    if platform or hints:
        extra = (["Kubernetes reports: " + "; ".join(platform)] if platform else []) + hints
        message = "\n".join([head, *extra, *([rest] if rest else [])])
    retryable = all(n.retryable for n in failed) and (cause.retryable if cause else True)
    return FailureReport.of(message, retryable, cause)


def _startup_timeout(
    group_id: str, status: GroupStatus, *, namespace: str, job_name: str, pods: Mapping[int, Mapping[str, Any]]
) -> FailureReport:
    lines = [f"Training group {group_id} could not start: {status.reason}."]
    for n in status.nodes:
        if n.phase is NodePhase.PENDING:
            pod = pods.get(n.node_rank)
            where = f"pod {pod['metadata']['name']}" if pod else "no pod"
            lines.append(f"  node {n.node_rank} ({where}): {n.reason or 'pending'}")
    lines.append(
        f"Job {namespace}/{job_name} is deleted. Check the cluster's free capacity and quotas "
        f"(`kubectl describe pod -n {namespace} -l {GROUP_LABEL}={job_name}`), or raise startup_timeout."
    )
    return FailureReport(message="\n".join(lines), retryable=all(n.retryable for n in status.nodes))


def platform_reasons(nodes: Sequence[NodeObservation], headline: str) -> list[str]:
    """The platform's view of the failed nodes, nodes with the same outcome grouped
    ("nodes 0,1 ..."), leaving out a single node the headline already describes."""
    groups: dict[tuple[int | None, str | None, str | None], list[NodeObservation]] = {}
    for n in nodes:
        groups.setdefault((n.exit_code, n.signal, n.reason), []).append(n)
    out = []
    for members in groups.values():
        first = members[0]
        text = describe_node(first)
        if len(members) == 1:
            if text not in headline:
                out.append(text)
        else:
            ranks = ",".join(str(m.node_rank) for m in members)
            out.append(f"nodes {ranks}" + text[len(f"node {first.node_rank}") :])
    return out
