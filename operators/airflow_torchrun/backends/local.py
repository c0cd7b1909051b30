"""The embedded default: every node is a torchrun agent process on this machine, on loopback.

Layout of one group (one try of one task) under the state directory::

    groups/<group_id>/group.json                 the handle
    groups/<group_id>/node-<n>/node.log          the agent's and its ranks' output, prefixed
    groups/<group_id>/node-<n>/supervisor.json   written when the node starts (pids)
    groups/<group_id>/node-<n>/supervisor.log    the supervisor's own output
    groups/<group_id>/node-<n>/agent-error.json  torchrun's error file of the agent, if it failed
    groups/<group_id>/node-<n>/exit.json         written when the node is gone (code, signal)
    groups/<group_id>/node-<n>/torchrun/...      torchrun's per-rank logs and error files

Everything a watcher needs is on disk, so another process (a trigger) can follow the group.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from airflow_torchrun import diagnosis
from airflow_torchrun.backends.base import Backend, FailureReport, Relaunch, RelaunchKind
from airflow_torchrun.backends.handles import LocalHandle
from airflow_torchrun.backends.local_supervisor import RANK_FAILED_FILE
from airflow_torchrun.backends.procs import group_pids, pid_alive, signal_pids, stop_group
from airflow_torchrun.errors import GroupLaunchError
from airflow_torchrun.spec import DEFAULT_TEARDOWN_GRACE, GroupSpec
from airflow_torchrun.state import state_dir as default_state_dir
from airflow_torchrun.status import GroupStatus, NodeObservation, NodePhase
from airflow_torchrun.wiring import GroupIdentity, GroupPlan, plan

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A port free right now. Another process may still take it before node 0 binds it; the
    operator relaunches on a fresh port when node 0 reports EADDRINUSE."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


class LocalBackend(Backend):
    name = "local"

    def __init__(self, state_dir: str | os.PathLike[str] | None = None) -> None:
        self.state_dir = Path(state_dir) if state_dir else default_state_dir()
        self._log_offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self._progress_reader = _LineReader()
        self._folders: dict[Path, diagnosis.AgentTracebackFolder] = {}

    @classmethod
    def from_handle(cls, handle: LocalHandle) -> LocalBackend:
        # <state_dir>/groups/<group_id>
        return cls(state_dir=Path(handle.group_dir).parent.parent)

    # -- planning ---------------------------------------------------------------------------
    def plan(self, spec: GroupSpec, identity: GroupIdentity, extra_env: Mapping[str, str]) -> GroupPlan:
        group_dir = self.state_dir / "groups" / identity.group_id
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return plan(
            spec,
            identity,
            master_addr=LOOPBACK,
            master_port=spec.rdzv_port or free_port(),
            python=sys.executable,
            log_dir=str(group_dir / "node-{node_rank}" / "torchrun"),
            # every node shares this machine's cores
            cpus_per_node=(cpus or 1) / spec.num_nodes,
            extra_env=extra_env,
        )

    # -- launching --------------------------------------------------------------------------
    def launch(self, plan: GroupPlan, *, watch_caller: bool = True) -> LocalHandle:
        group_dir = self.state_dir / "groups" / plan.group_id
        if group_dir.exists() and any(group_dir.iterdir()):
            # A previous launch of this very try: keep its logs, never overwrite them.
            stale = group_dir.with_name(f"{group_dir.name}.{int(time.time() * 1000)}")
            group_dir.rename(stale)
        handle = LocalHandle(
            group_id=plan.group_id,
            num_nodes=len(plan.nodes),
            world_size=plan.spec.world_size,
            launched_at=time.time(),
            startup_timeout=plan.spec.startup_timeout,
            teardown_grace=plan.spec.teardown_grace,
            relaunch=plan.identity.relaunch,
            group_dir=str(group_dir),
            master_port=plan.master_port,
        )
        started: list[subprocess.Popen[bytes]] = []
        try:
            for node in plan.nodes:
                node_dir = group_dir / f"node-{node.node_rank}"
                node_dir.mkdir(parents=True)
                env = {**os.environ, **node.env, "TORCHELASTIC_ERROR_FILE": str(node_dir / "agent-error.json")}
                argv = [
                    sys.executable,
                    "-m",
                    "airflow_torchrun.backends.local_supervisor",
                    f"--node-dir={node_dir}",
                    f"--grace={plan.spec.teardown_grace}",
                ]
                if watch_caller:
                    argv.append(f"--watch-pid={os.getpid()}")
                proc = subprocess.Popen(
                    [*argv, "--", *node.argv],
                    env=env,
                    cwd=os.getcwd(),
                    start_new_session=True,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=open(node_dir / "supervisor.log", "wb"),  # noqa: SIM115 - owned by the child
                )
                started.append(proc)
            (group_dir / "group.json").write_text(json.dumps(handle.to_dict(), indent=2))
        except OSError as exc:
            self.teardown(handle)
            # Out of processes, memory or file descriptors for a moment: a later launch may work.
            busy = exc.errno in (errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE)
            raise GroupLaunchError(
                f"could not start group {plan.group_id} in {group_dir}: {exc}", transient=busy
            ) from exc
        return handle

    # -- watching ---------------------------------------------------------------------------
    def observe(self, handle: LocalHandle) -> list[NodeObservation]:
        return [self._observe_node(handle, n) for n in range(handle.num_nodes)]

    async def observe_async(self, handle: LocalHandle) -> list[NodeObservation]:
        # Reading a few small files; run off the event loop all the same.
        return await asyncio.to_thread(self.observe, handle)

    def _observe_node(self, handle: LocalHandle, node_rank: int) -> NodeObservation:
        node_dir = Path(handle.group_dir) / f"node-{node_rank}"
        exit_info = _read_json(node_dir / "exit.json")
        if exit_info is not None:
            code = int(exit_info["returncode"])
            stopped_by = exit_info.get("stopped_by")
            # Stopped while it ran (a teardown, a SIGTERM to the group): not a success, whatever the
            # agent's exit code (a stopped group must never pass for a finished one).
            done = code == 0 and not stopped_by
            return NodeObservation(
                node_rank=node_rank,
                phase=NodePhase.SUCCEEDED if done else NodePhase.FAILED,
                exit_code=code,
                signal=exit_info.get("signal"),
                started_at=exit_info.get("started_at"),
                finished_at=exit_info.get("finished_at"),
                reason=None if done or code != 0 else f"stopped ({stopped_by}) before it finished",
                stopped_by=stopped_by,
            )
        sup = _read_json(node_dir / "supervisor.json")
        if sup is None:
            return NodeObservation(node_rank=node_rank, phase=NodePhase.PENDING)
        if not pid_alive(int(sup["pid"])):
            # The supervisor may have written exit.json between our two reads.
            if (node_dir / "exit.json").exists():
                return self._observe_node(handle, node_rank)
            return NodeObservation(
                node_rank=node_rank,
                phase=NodePhase.LOST,
                started_at=sup.get("started_at"),
                finished_at=time.time(),
                reason=f"its supervisor (pid {sup['pid']}) died without recording an outcome",
            )
        failed = _read_json(node_dir / RANK_FAILED_FILE)
        if failed is not None:
            # The agent saw a worker fail and is stopping the node: a failed node from now on, a
            # second or more before exit.json, so the rest of the group is stopped that much sooner.
            return NodeObservation(
                node_rank=node_rank,
                phase=NodePhase.FAILED,
                started_at=sup.get("started_at"),
                finished_at=failed.get("at"),
                reason=f"{_worker_failure(str(failed.get('line', '')))}; its torchrun agent is stopping the node",
            )
        return NodeObservation(node_rank=node_rank, phase=NodePhase.RUNNING, started_at=sup.get("started_at"))

    # -- logs -------------------------------------------------------------------------------
    def log_locations(self, handle: LocalHandle) -> list[str]:
        return [str(Path(handle.group_dir) / f"node-{n}" / "node.log") for n in range(handle.num_nodes)]

    def read_new_log_lines(self, handle: LocalHandle) -> list[str]:
        """Complete lines written since the last call, node by node; agent lines get a prefix."""
        out: list[str] = []
        for node_rank, path_s in enumerate(self.log_locations(handle)):
            path = Path(path_s)
            try:
                with open(path, "rb") as fp:
                    fp.seek(self._log_offsets.get(path, 0))
                    chunk = fp.read()
            except FileNotFoundError:
                continue
            self._log_offsets[path] = self._log_offsets.get(path, 0) + len(chunk)
            data = self._partial.pop(path, b"") + chunk
            *lines, rest = data.split(b"\n")
            if rest:
                self._partial[path] = rest
            folder = self._folders.setdefault(path, diagnosis.AgentTracebackFolder(str(path)))
            for raw in lines:
                line = raw.decode("utf-8", "replace").rstrip("\r")
                if line.startswith("[node "):
                    out.append(line)
                    continue
                out.extend(f"[node {node_rank} agent] {shown}" for shown in folder.feed(line))
        return out

    # -- failure ----------------------------------------------------------------------------
    def explain(self, handle: LocalHandle, status: GroupStatus) -> FailureReport:
        group_dir = Path(handle.group_dir)
        reported: list[diagnosis.RankFailure] = []
        error_files: list[tuple[int, str]] = []
        logs: dict[int, str] = {}
        for n in range(handle.num_nodes):
            node_dir = group_dir / f"node-{n}"
            logs[n] = _read_text(node_dir / "node.log")
            reported += diagnosis.parse_agent_report(n, logs[n])
            for err in sorted((node_dir / "torchrun").glob("*/attempt_*/*/error.json")):
                error_files.append((n, _read_text(err)))
        failures = diagnosis.merge(reported, error_files)
        cause = diagnosis.root_cause(failures)
        node = cause.node_rank if cause else (status.failed_node or 0)
        tail = diagnosis.rank_lines(logs.get(node, ""), node, cause.rank if cause else None)
        message = diagnosis.failure_message(
            handle.group_id,
            failures,
            node_headline=status.reason,
            log_tail=tail,
            log_path=str(group_dir / f"node-{node}" / "node.log"),
        )
        if status.state.value == "startup_timeout":
            message = f"Training group {handle.group_id} could not start: {status.reason}.\n{message}"
        return FailureReport.of(message, diagnosis.retryable(failures), cause)

    def process_groups(self, handle: LocalHandle) -> list[dict[str, Any]] | None:
        """The launchers' ``process_group.json`` files beside torchrun's per-rank error files."""
        records: list[dict[str, Any]] = []
        for n in range(handle.num_nodes):
            for path in sorted(
                (Path(handle.group_dir) / f"node-{n}" / "torchrun").glob("*/attempt_*/*/process_group.json")
            ):
                try:
                    data = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                if isinstance(data, dict):
                    records.append({**data, "node_rank": n})
        return records or None

    def relaunch_reason(self, handle: LocalHandle, status: GroupStatus) -> Relaunch | None:
        """Node 0 lost the race for the rendezvous port: :func:`free_port` found it free, then
        another process bound it before node 0's agent did. torchrun reports it only in words
        (its agent error file, else the node's log), so this is where those words are read."""
        node0 = Path(handle.group_dir) / "node-0"
        said = _read_text(node0 / "agent-error.json") or _read_text(node0 / "node.log")
        if "EADDRINUSE" in said or "Address already in use" in said:
            return Relaunch(
                RelaunchKind.PORT_RACE, f"its rendezvous port {handle.master_port} was taken by another process"
            )
        return None

    def read_progress_lines(self, handle: LocalHandle) -> list[str]:
        """Complete lines of the nodes' logs, since the last call, that carry a progress record."""
        from airflow_torchrun.worker.progress import MARKER

        out: list[str] = []
        for path in self.log_locations(handle):
            out += [line for line in self._progress_reader.read(Path(path)) if MARKER in line]
        return out

    def progress_mark(self, handle: LocalHandle) -> object | None:
        """The sizes of the nodes' logs: every rank's output lands there."""
        out = []
        for path in self.log_locations(handle):
            try:
                out.append(os.stat(path).st_size)
            except FileNotFoundError:
                out.append(-1)
        return tuple(out)

    # -- teardown ---------------------------------------------------------------------------
    def teardown(self, handle: LocalHandle) -> None:
        """Stop every process of the group: SIGTERM, then SIGKILL after the grace period.

        Idempotent and total: supervisors, agents and workers (whatever their session or parent)
        are found by the group's marker.
        """
        group_id, grace = handle.group_id, handle.teardown_grace
        failing = [n for n in range(handle.num_nodes) if self._agent_stopping(handle, n)]
        if failing:
            # Those agents are already stopping their nodes: let them end on their own (what they
            # print last names the failed rank) while every other node is stopped at once.
            deadline = time.monotonic() + grace
            for n in range(handle.num_nodes):
                if n not in failing:
                    signal_pids(group_pids(group_id, n), signal.SIGTERM)
            while time.monotonic() < deadline and any(group_pids(group_id, n) for n in failing):
                time.sleep(0.05)
            grace = max(0.0, deadline - time.monotonic())
        stop_group(group_id, grace=grace)

    @staticmethod
    def _agent_stopping(handle: LocalHandle, node_rank: int) -> bool:
        node_dir = Path(handle.group_dir) / f"node-{node_rank}"
        return (node_dir / RANK_FAILED_FILE).exists() and not (node_dir / "exit.json").exists()

    def stop_earlier_tries(self, identity: GroupIdentity) -> list[str]:
        """Stop groups that earlier tries of this task instance left running (a deferred task
        failed by the scheduler never re-enters to tear its group down). Returns their ids."""
        stopped = []
        for try_number in range(1, identity.try_number):
            for relaunch in range(0, 8):
                group_id = replace(identity, try_number=try_number, relaunch=relaunch).group_id
                if group_pids(group_id):
                    recorded = _read_json(self.state_dir / "groups" / group_id / "group.json") or {}
                    stop_group(group_id, grace=float(recorded.get("teardown_grace", DEFAULT_TEARDOWN_GRACE)))
                    stopped.append(group_id)
        return stopped

    def running_pids(self, handle: LocalHandle) -> list[int]:
        return group_pids(handle.group_id)


class _LineReader:
    """Complete lines appended to files since the last read (a line still being written waits)."""

    def __init__(self) -> None:
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}

    def read(self, path: Path) -> list[str]:
        try:
            with open(path, "rb") as fp:
                fp.seek(self._offsets.get(path, 0))
                chunk = fp.read()
        except FileNotFoundError:
            return []
        self._offsets[path] = self._offsets.get(path, 0) + len(chunk)
        *lines, rest = (self._partial.pop(path, b"") + chunk).split(b"\n")
        if rest:
            self._partial[path] = rest
        return [raw.decode("utf-8", "replace") for raw in lines]


_AGENT_REPORT = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def _worker_failure(line: str) -> str:
    """``local rank 0 was killed by SIGKILL`` from the agent's report line (``a rank failed`` if unclear)."""
    m = _AGENT_REPORT.search(line)
    if m is None:
        return "a rank failed"
    code, local_rank = int(m[1]), m[2]
    if code < 0:
        try:
            return f"local rank {local_rank} was killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"local rank {local_rank} exited with code {code}"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
