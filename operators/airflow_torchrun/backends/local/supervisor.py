"""One node of a local group: ``python -m airflow_torchrun.backends.local.supervisor``.

The local backend starts one supervisor per node, each the leader of a new session. The
supervisor runs the node's torchrun agent and records on disk what a watcher in another process
needs (a deferrable trigger, a re-attaching worker): ``supervisor.json`` when it starts,
``workers.json`` with the outcome of every worker (rank) of the agent as each one ends,
``rank-failed.json`` as soon as one of them ended badly (the agent itself takes a second or more
to stop the node and exit), and ``exit.json`` when the agent is gone.

A worker's outcome is its exit status, read from the kernel: the supervisor holds a pidfd of each
of the agent's children, which becomes readable the moment the child dies, and reads the status
from ``/proc/<pid>/stat`` while the child is a zombie (the agent reaps it at its next monitor tick,
0.1 s later), or, once the agent reaped it, from the pidfd itself (``PIDFD_GET_INFO`` with
``PIDFD_INFO_EXIT``, Linux 6.15+): on a loaded machine the supervisor is often later than that tick.
Never from log text: the ranks' output shares the node's log, and a rank that printed
the agent's words for a dead worker once tore a healthy group down. A status the supervisor could
not read (an older kernel, and too late) leaves the decision to the agent's own exit. It becomes a child
subreaper so that workers orphaned by a dying agent are re-parented to it and reaped, and on
SIGTERM, or when ``--watch-pid`` dies (the sync-mode Airflow task process), it stops every process
of its node. Imports stay light: no
torch, no Airflow (one forked from a zygote has torch in memory already, and forks its agent).
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from airflow_torchrun.backends.local.procs import (
    exit_now,
    pid_alive,
    ranks_of,
    recorded_rank,
    run_main,
    stat_fields,
    stop_group,
)
from airflow_torchrun.contract.launch import GROUP_ID_VAR, NODE_RANK_VAR, RANKS_FILE, RANKS_FILE_VAR

if TYPE_CHECKING:
    from airflow_torchrun.backends.local.zygote import ForkedAgent

# A supervisor forked from a zygote has this module in memory; an exec'd one needs none of it (its
# imports, 15 to 20 ms, would come before its agent starts).
ZYGOTE_MODULE = "airflow_torchrun.backends.local.zygote"

PR_SET_CHILD_SUBREAPER = 36
# linux/pidfd.h: PIDFD_GET_INFO is _IOWR(0xFF, 11, struct pidfd_info); its first version is 64 bytes,
# the mask first and the exit's wait status (valid once the process was reaped) last.
_PIDFD_INFO_SIZE = 64
PIDFD_GET_INFO = (3 << 30) | (_PIDFD_INFO_SIZE << 16) | (0xFF << 8) | 11
PIDFD_INFO_EXIT = 1 << 3
RANK_FAILED_FILE = "rank-failed.json"
WORKERS_FILE = "workers.json"


class _Worker:
    """One of the agent's children. Not a dataclass: an exec'd supervisor would import dataclasses
    (and inspect, 14 ms) before its agent starts."""

    __slots__ = ("fd", "local_rank", "pid", "rank", "started")

    def __init__(self, pid: int, started: str, fd: int | None) -> None:
        self.pid = pid
        self.started = started  # /proc/<pid>/stat's start time: the same pid later is another process
        self.fd = fd  # a pidfd (readable once the process died), where the kernel has them
        self.rank: int | None = None
        self.local_rank: int | None = None


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; ``signal 37`` for a signal Python has no name for (SIGRTMIN+3, say)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def reaped_status(pidfd: int) -> int | None:
    """The wait status of a process its parent already reaped, kept by the kernel for its pidfd;
    None while it has not been reaped, or where the kernel is older than 6.15."""
    info = bytearray(struct.pack("=Q", PIDFD_INFO_EXIT) + bytes(_PIDFD_INFO_SIZE - 8))
    try:
        fcntl.ioctl(pidfd, PIDFD_GET_INFO, info)
    except OSError:
        return None
    (mask,) = struct.unpack_from("=Q", info, 0)
    return struct.unpack_from("=i", info, _PIDFD_INFO_SIZE - 4)[0] if mask & PIDFD_INFO_EXIT else None


class _WorkerWatch:
    """The agent's workers, each watched through a pidfd; what each one ended with."""

    # stat fields after the name: state is 0, starttime is field 22 (index 19), exit_code field 52 (49)
    _STATE, _START, _EXIT = 0, 19, 49

    def __init__(self, agent_pid: int, ranks_file: str | None = None) -> None:
        self.agent_pid = agent_pid
        self.ranks_file = ranks_file  # the agent's record of the ranks it forked
        self.workers: dict[int, _Worker] = {}
        self.outcomes: list[dict[str, object]] = []
        self.ended_ones: set[tuple[int, str]] = set()  # (pid, start time): a zombie is seen again until reaped

    def _children(self) -> list[int]:
        pids: list[int] = []
        try:
            tasks = os.listdir(f"/proc/{self.agent_pid}/task")
        except OSError:
            return pids
        for tid in tasks:
            try:
                with open(f"/proc/{self.agent_pid}/task/{tid}/children") as fp:
                    pids += [int(p) for p in fp.read().split()]
            except (OSError, ValueError):
                continue
        return pids

    def discover(self) -> None:
        for pid in self._children():
            if pid in self.workers:
                continue
            fields = stat_fields(pid)
            if fields is None or (pid, fields[self._START]) in self.ended_ones:
                continue  # gone (and reaped) before it was seen, the agent's exit tells; or recorded
            # A zombie is a worker that died before it was seen (a forked rank can fail within
            # milliseconds): its exit status is still there to read.
            try:
                fd: int | None = os.pidfd_open(pid)
            except (AttributeError, OSError):
                fd = None  # no pidfds here: the worker is polled instead
            self.workers[pid] = _Worker(pid, fields[self._START], fd)
        for worker in self.workers.values():
            self._name(worker)

    def _name(self, worker: _Worker) -> None:
        if worker.rank is None:
            worker.rank, worker.local_rank = ranks_of(worker.pid, self.ranks_file) or (None, None)

    def backfill(self) -> bool:
        """Name the outcomes of forked ranks that ended before their agent recorded which pid is which
        rank (a script that fails at once); True when one got its name."""
        named = False
        for outcome in self.outcomes:
            if outcome["rank"] is None and self.ranks_file:
                found = recorded_rank(int(str(outcome["pid"])), self.ranks_file)
                if found is not None:
                    outcome["rank"], outcome["local_rank"] = found
                    named = True
        return named

    def fds(self) -> list[int]:
        return [w.fd for w in self.workers.values() if w.fd is not None]

    def ended(self, readable: Sequence[int]) -> list[dict[str, object]]:
        """The outcomes of workers that died since the last call (their pidfd readable, or, without
        pidfds, found dead): exit code or signal from the kernel; ``None`` for a status missed."""
        done = []
        for worker in list(self.workers.values()):
            if worker.fd is not None and worker.fd not in readable:
                continue
            fields = stat_fields(worker.pid)
            alive = fields is not None and fields[self._START] == worker.started
            if alive and fields is not None and fields[self._STATE] != "Z":
                continue
            self._name(worker)  # a forked rank that died at once: its agent's record may be newer
            outcome: dict[str, object] = {
                "pid": worker.pid,
                "rank": worker.rank,
                "local_rank": worker.local_rank,
                "at": time.time(),
                "exit_code": None,
                "signal": None,
            }
            status: int | None = None
            if alive and fields is not None:  # a zombie: its wait status, as waitpid would return it
                status = int(fields[self._EXIT])
            elif worker.fd is not None:  # already reaped by the agent
                status = reaped_status(worker.fd)
            if status is not None:
                if os.WIFSIGNALED(status):
                    outcome["signal"] = signal_name(os.WTERMSIG(status))
                    outcome["exit_code"] = -os.WTERMSIG(status)
                else:
                    outcome["exit_code"] = os.WEXITSTATUS(status)
            done.append(outcome)
            self.close(worker)
        self.outcomes += done
        return done

    def close(self, worker: _Worker) -> None:
        if worker.fd is not None:
            os.close(worker.fd)
        self.ended_ones.add((worker.pid, worker.started))
        del self.workers[worker.pid]


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

    def __init__(self, agent: subprocess.Popen[bytes] | ForkedAgent | None = None) -> None:
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
    ranks_file = str(node_dir / RANKS_FILE)
    env = {**os.environ, RANKS_FILE_VAR: ranks_file}
    with open(node_dir / "node.log", "ab", buffering=0) as log:
        # Forked when this supervisor was forked from a zygote (torch in memory already), else exec'd.
        zygote = sys.modules.get(ZYGOTE_MODULE)
        forked: ForkedAgent | None = zygote.fork_agent(command, log, env) if zygote else None
        agent: subprocess.Popen[bytes] | ForkedAgent = forked or subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
    reap = _Reaper(agent)
    write_json(
        node_dir / "supervisor.json",
        {"pid": os.getpid(), "agent_pid": agent.pid, "started_at": started, "command": command},
    )

    watch_parent = args.watch_pid and args.watch_pid == os.getppid()
    workers = _WorkerWatch(agent.pid, ranks_file)
    failed_reported: dict[str, object] | None = None
    returncode: int | None = None
    try:  # the agent's own death wakes the loop too
        agent_fds = [os.pidfd_open(agent.pid)]
    except (AttributeError, OSError):
        agent_fds = []
    while returncode is None:
        workers.discover()
        fds = workers.fds() + agent_fds
        readable: list[int] = select.select(fds, [], [], 0.05)[0] if fds else []
        if not fds:
            time.sleep(0.05)
        ended = workers.ended(readable)
        named = workers.backfill()
        if ended or named:
            write_json(node_dir / WORKERS_FILE, {"workers": workers.outcomes})
        bad = [o for o in ended if o["exit_code"] != 0 and o["exit_code"] is not None]
        if bad and not failed_reported and not stop_reason:
            failed_reported = bad[0]
            write_json(node_dir / RANK_FAILED_FILE, failed_reported)
        elif named and failed_reported and failed_reported["rank"] is not None:
            write_json(node_dir / RANK_FAILED_FILE, failed_reported)
        gone = (os.getppid() != args.watch_pid) if watch_parent else not pid_alive(args.watch_pid)
        if not stop_reason and args.watch_pid and gone:
            stop_reason.append(f"watched process {args.watch_pid} exited")
        if stop_reason:
            # torchrun forwards SIGTERM to its workers; stop_group also reaches the ones it
            # cannot (other sessions, orphans) and escalates to SIGKILL after the grace period.
            stop_group(group_id, node_rank=node_rank, grace=args.grace, reap=reap)
        returncode = agent.poll()
    for fd in agent_fds:
        os.close(fd)
    # The agent is gone; its workers normally went with it. Make sure, then record the outcome.
    leftovers = stop_group(group_id, node_rank=node_rank, grace=min(args.grace, 5.0), reap=reap)
    reap()
    for worker in list(workers.workers.values()):
        workers.close(worker)
    write_json(
        node_dir / "exit.json",
        {
            "returncode": returncode,
            "signal": signal_name(-returncode) if returncode < 0 else None,
            "started_at": started,
            "finished_at": time.time(),
            "stopped_by": stop_reason[0] if stop_reason else None,
            "killed_stragglers": leftovers,
        },
    )
    return 0 if returncode == 0 else 1


if __name__ == "__main__":  # exec'd: the outcome is on disk, nothing is left to run
    exit_now(run_main(main, sys.argv[1:]))
