"""A Kubernetes group's logs: streaming new lines, failure tails, and progress marks, as flows.

The log endpoint has no offsets. Each read asks for ``timestamps=true`` from ``sinceTime`` (the
second of the last line seen, the API's resolution) and :class:`LogCursor` (pure) drops what was
already returned; lines within one nanosecond timestamp are told apart by counting them.

The flows yield request descriptions (:mod:`~airflow_torchrun.backends.kubernetes.api`) and are run by
the sync or async executor (:mod:`~airflow_torchrun.backends.kubernetes.client`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from airflow_torchrun.backends.handles import KubernetesHandle
from airflow_torchrun.backends.kubernetes import api
from airflow_torchrun.backends.kubernetes.api import ClusterApiError
from airflow_torchrun.backends.kubernetes.client import Flow
from airflow_torchrun.backends.kubernetes.observe import JobMemory, container_state, pods_flow
from airflow_torchrun.backends.kubernetes.render import CONTAINER

log = logging.getLogger(__name__)
LOG_TAIL_LINES = 200
# A bounded reader's first read of a log: its last lines only.
FIRST_READ_LINES = 2000

_STAMP = re.compile(r"^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?(Z|[+-]\d{2}:\d{2}) ?(.*)$")

Stamp = tuple[int, int]  # (epoch seconds, nanoseconds)


def split_stamp(line: str) -> tuple[Stamp | None, str]:
    """``"2026-11-30T10:00:01.5Z text"`` -> ((1795..., 500000000), "text")."""
    m = _STAMP.match(line)
    if m is None:
        return None, line
    whole, frac, zone, text = m.groups()
    seconds = int(datetime.fromisoformat(f"{whole}{'+00:00' if zone == 'Z' else zone}").timestamp())
    nanos = int((frac or "0").ljust(9, "0"))
    return (seconds, nanos), text


@dataclass
class LogCursor:
    """Where one container's log was read up to."""

    last: Stamp | None = None
    seen_at_last: int = 0

    def since_time(self) -> str | None:
        """The ``sinceTime`` for the next read (whole seconds, RFC 3339)."""
        if self.last is None:
            return None
        return datetime.fromtimestamp(self.last[0], tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def feed(self, text: str) -> list[str]:
        """The lines of a timestamped log read that were not returned before, without stamps."""
        out: list[str] = []
        repeats: dict[Stamp, int] = {}
        # Lines end at "\n" only, as the container runtime and torchrun's tee split them:
        # str.splitlines() also splits at U+2028, \x1c, \x85 ..., which let a rank start a line
        # carrying another rank's prefix inside one of its own.
        for piece in text.split("\n"):
            raw = piece.removesuffix("\r")
            if not raw:
                continue
            stamp, line = split_stamp(raw)
            if stamp is None:  # every line of a timestamps=true read has a stamp: not a line of the log
                continue
            if self.last is not None and stamp < self.last:
                continue
            if stamp == self.last:
                repeats[stamp] = repeats.get(stamp, 0) + 1
                if repeats[stamp] <= self.seen_at_last:
                    continue
                self.seen_at_last += 1
            else:
                self.last, self.seen_at_last = stamp, 1
                repeats[stamp] = 1
            out.append(line)
        return out


def new_lines_flow(handle: KubernetesHandle, state: JobMemory, *, all_ranks: bool) -> Flow[list[str]]:
    """New lines of node 0's log (every node's with ``all_ranks``), rank lines prefixed
    ``[node N rank R]`` by torchrun, the agent's own lines ``[node N agent]``."""
    out: list[str] = []
    pods = yield from pods_flow(handle, state)
    for node_rank, pod in sorted(pods.items()):
        if node_rank != 0 and not all_ranks:
            continue
        if not {"running", "terminated"} & set(container_state(pod, CONTAINER)):
            continue
        pod_name = pod["metadata"]["name"]
        cursor = state.cursors.setdefault(pod_name, LogCursor())
        text = yield api.pod_log(handle.namespace, pod_name, CONTAINER, since_time=cursor.since_time(), timestamps=True)
        if text is None:  # not started yet, or already gone
            continue
        for line in cursor.feed(text):
            out.append(line if line.startswith("[node ") else f"[node {node_rank} agent] {line}")
    return out


def progress_lines_flow(
    handle: KubernetesHandle, state: JobMemory, marker: str, *, limit_bytes: int | None = None
) -> Flow[list[str]]:
    """New lines of every node's log that carry ``marker`` (progress records), with cursors of
    their own, so the task log's stream (node 0's only, by default) is not disturbed.

    ``limit_bytes``: read at most that much of each log per call, and start a log never read before
    at its last :data:`FIRST_READ_LINES` lines (the view: a long run's whole log is never read into
    the API server's memory); a record cut at the limit is dropped."""
    out: list[str] = []
    pods = yield from pods_flow(handle, state)
    for _node_rank, pod in sorted(pods.items()):
        if not {"running", "terminated"} & set(container_state(pod, CONTAINER)):
            continue
        pod_name = pod["metadata"]["name"]
        cursor = state.cursors.setdefault(f"progress:{pod_name}", LogCursor())
        first = limit_bytes is not None and cursor.last is None
        text = yield api.pod_log(
            handle.namespace,
            pod_name,
            CONTAINER,
            since_time=cursor.since_time(),
            timestamps=True,
            tail_lines=FIRST_READ_LINES if first else None,
            limit_bytes=limit_bytes,
        )
        if text:
            out += [line for line in cursor.feed(text) if marker in line]
    return out


def tail_flow(handle: KubernetesHandle, state: JobMemory, node_rank: int, pod: Mapping[str, Any] | None) -> Flow[str]:
    """The last lines of a node's log (kept: a second call reads nothing). Best effort."""
    if node_rank in state.tails:
        return state.tails[node_rank]
    text = ""
    if pod is not None:
        try:
            text = (
                yield api.pod_log(handle.namespace, pod["metadata"]["name"], CONTAINER, tail_lines=LOG_TAIL_LINES)
            ) or ""
        except ClusterApiError as exc:
            log.debug("No log for node %d of %s: %s", node_rank, handle.group_id, exc)
        if not text:
            # terminationMessagePolicy FallbackToLogsOnError: the tail lives in the status.
            text = str((container_state(pod, CONTAINER).get("terminated") or {}).get("message") or "")
    state.tails[node_rank] = text
    return text


def progress_flow(handle: KubernetesHandle, state: JobMemory) -> Flow[tuple[tuple[int, str], ...] | None]:
    """Changes whenever a running node's log grows: the timestamp of each running pod's last log
    line (a hung collective logs nothing). ``None`` while no node runs: nothing to tell by."""
    pods = yield from pods_flow(handle, state)
    running = sorted((n, p["metadata"]["name"]) for n, p in pods.items() if "running" in container_state(p, CONTAINER))
    if not running:
        return None
    marks: list[tuple[int, str]] = []
    for node_rank, pod_name in running:
        text = yield api.pod_log(handle.namespace, pod_name, CONTAINER, tail_lines=1, timestamps=True)
        marks.append((node_rank, (text or "").split(" ", 1)[0]))
    return tuple(marks)
