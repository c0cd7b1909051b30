"""One node of a local group: ``python -m airflow_torchrun.backends.local_supervisor``.

The local backend starts one supervisor per node, each the leader of a new session. The
supervisor runs the node's torchrun agent and records on disk what a watcher in another process
needs (a deferrable trigger, a re-attaching worker): ``supervisor.json`` when it starts,
``rank-failed.json`` as soon as the agent reports a failed worker (the agent itself takes a second
or more to stop the node and exit), and ``exit.json`` when the agent is gone. It becomes a child
subreaper so that workers orphaned by a dying agent are re-parented to it and reaped, and on
SIGTERM, or when ``--watch-pid`` dies (the sync-mode Airflow task process), it stops every process
of its node. Imports stay light: no
torch, no Airflow.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from airflow_torchrun.backends.procs import pid_alive, stop_group
from airflow_torchrun.wiring import GROUP_ID_VAR, NODE_RANK_VAR

PR_SET_CHILD_SUBREAPER = 36
# What torch.distributed.elastic's agent logs the moment it sees a worker of its node fail
# (``failed (exitcode: -9) local_rank: 0 (pid: 7573) of binary: ...``); it then stops the node.
WORKER_FAILED = b"failed (exitcode: "
RANK_FAILED_FILE = "rank-failed.json"


class _FailureScan:
    """Watches the node's log, as it grows, for the agent's first report of a failed worker."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.carry = path, 0, b""

    def line(self) -> str | None:
        """The report's line, once it has been written; None before (and after an unreadable log)."""
        try:
            with open(self.path, "rb") as fp:
                fp.seek(self.offset)
                chunk = fp.read(1 << 20)
        except OSError:
            return None
        self.offset += len(chunk)
        text = self.carry + chunk
        at = text.find(WORKER_FAILED)
        if at < 0 or text.find(b"\n", at) < 0:  # wait for the whole line
            # Keep the line still being written: the report may be on it, or be starting.
            self.carry = text[text.rfind(b"\n", 0, at if at >= 0 else len(text)) + 1 :][-4096:]
            return None
        start = text.rfind(b"\n", 0, at) + 1
        return text[start : text.find(b"\n", at)].decode("utf-8", "replace")


def write_json(path: Path, data: dict[str, object]) -> None:
    """Atomic: a reader sees the whole file or none of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _become_subreaper() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: stragglers are still found by their marker


class _Reaper:
    """Reaps the node's dead descendants (orphans re-parented to this subreaper) without losing the
    agent's own status: ``waitpid(-1)`` may collect the agent too, and ``Popen.wait()`` would then
    report 0 for it (a torn-down node recorded as a success)."""

    def __init__(self, agent: subprocess.Popen[bytes] | None = None) -> None:
        self.agent = agent

    def __call__(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.agent is not None and pid == self.agent.pid and self.agent.returncode is None:
                self.agent.returncode = os.waitstatus_to_exitcode(status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node-dir", required=True, type=Path)
    parser.add_argument("--watch-pid", type=int, default=0, help="stop the node when this PID is gone")
    parser.add_argument("--grace", type=float, default=10.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    node_dir: Path = args.node_dir
    group_id = os.environ[GROUP_ID_VAR]
    node_rank = int(os.environ[NODE_RANK_VAR])

    stop_reason: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        stop_reason.append(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    _become_subreaper()

    started = time.time()
    with open(node_dir / "node.log", "ab", buffering=0) as log:
        agent = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    reap = _Reaper(agent)
    write_json(
        node_dir / "supervisor.json",
        {"pid": os.getpid(), "agent_pid": agent.pid, "started_at": started, "command": command},
    )

    watch_parent = args.watch_pid and args.watch_pid == os.getppid()
    scan: _FailureScan | None = _FailureScan(node_dir / "node.log")
    returncode: int | None = None
    while returncode is None:
        reported = scan.line() if scan is not None and not stop_reason else None
        if reported is not None:
            scan = None
            write_json(node_dir / RANK_FAILED_FILE, {"at": time.time(), "line": reported[-500:]})
        gone = (os.getppid() != args.watch_pid) if watch_parent else not pid_alive(args.watch_pid)
        if not stop_reason and args.watch_pid and gone:
            stop_reason.append(f"watched process {args.watch_pid} exited")
        if stop_reason:
            # torchrun forwards SIGTERM to its workers; stop_group also reaches the ones it
            # cannot (other sessions, orphans) and escalates to SIGKILL after the grace period.
            stop_group(group_id, node_rank=node_rank, grace=args.grace, reap=reap)
        try:
            returncode = agent.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            continue
    # The agent is gone; its workers normally went with it. Make sure, then record the outcome.
    leftovers = stop_group(group_id, node_rank=node_rank, grace=min(args.grace, 5.0), reap=reap)
    reap()
    write_json(
        node_dir / "exit.json",
        {
            "returncode": returncode,
            "signal": signal.Signals(-returncode).name if returncode < 0 else None,
            "started_at": started,
            "finished_at": time.time(),
            "stopped_by": stop_reason[0] if stop_reason else None,
            "killed_stragglers": leftovers,
        },
    )
    return 0 if returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
