"""Finding and stopping a group's processes by the marker every one of them inherits.

torchrun starts each exec'd worker in a session of its own, so killing an agent's process group does
not reach its workers, and a SIGKILLed agent leaves them running (seen with torchrun 2.13, even when
the agent's whole process group was SIGKILLed). Every process of a group carries
``AIRFLOW_TORCHRUN_GROUP_ID`` in its environment from exec on (a rank forked from its agent has the
agent's), so it can be found from /proc whatever became of its parent. PIDs are re-checked before
each signal.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable, Collection
from typing import NoReturn

from airflow_torchrun.contract.launch import GROUP_ID_VAR, NODE_RANK_VAR, RANKS_FILE_VAR

# How long a node's supervisor may outlive the SIGKILL of its node's other processes (stop_group's
# ``last``): it needs a poll (50 ms) to see its agent gone, and a moment to write exit.json.
LAST_GRACE_S = 2.0


# A process forked from a zygote shows its environment at the start of the zygote's room, the rest
# NULs (zygote.mark): a reader stops at them instead of reading the room through.
_ROOM_LEFT = b"\0" * 8


def _environ(pid: int) -> dict[bytes, bytes]:
    raw = b""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fp:
            while chunk := fp.read(16384):
                raw += chunk
                if _ROOM_LEFT in raw:
                    break
    except OSError:
        return {}
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs}


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first; ``pid`` may be
    ``"self"``), None when gone. The name is in parentheses and may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fp:
            return fp.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError):
        return None


def _is_zombie(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is None or fields[0] == "Z"


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child its parent has not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: it exists
    return not _is_zombie(pid)


def group_pids(group_id: str, node_rank: int | None = None, *, exclude: int | None = None) -> list[int]:
    """Live (non-zombie) processes of the group, or of one node of it."""
    want_group = group_id.encode()
    want_node = None if node_rank is None else str(node_rank).encode()
    me = os.getpid() if exclude is None else exclude
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        env = _environ(pid)
        if env.get(GROUP_ID_VAR.encode()) != want_group:
            continue
        if want_node is not None and env.get(NODE_RANK_VAR.encode()) != want_node:
            continue
        if not _is_zombie(pid):
            found.append(pid)
    return found


def groups_running(matches: Callable[[str], bool]) -> dict[str, list[int]]:
    """Live processes of every group whose id ``matches``, by group id (one scan of /proc)."""
    me = os.getpid()
    found: dict[str, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        group = _environ(int(name)).get(GROUP_ID_VAR.encode())
        if group is None:
            continue
        group_id = group.decode("utf-8", "replace")
        if matches(group_id) and not _is_zombie(int(name)):
            found.setdefault(group_id, []).append(int(name))
    return found


def ranks_of(pid: int, ranks_file: str | None = None) -> tuple[int, int] | None:
    """A worker's ``(RANK, LOCAL_RANK)``: from its environment when it was exec'd with them, else
    from its agent's record of the ranks it forked (``ranks_file``, or the one its environment
    names). None for a process that is no rank, or one not recorded yet."""
    env = _environ(pid)
    try:
        if b"RANK" in env:
            return int(env[b"RANK"]), int(env[b"LOCAL_RANK"])
    except (KeyError, ValueError):
        return None
    path = ranks_file or env.get(RANKS_FILE_VAR.encode(), b"").decode()
    return recorded_rank(pid, path) if path else None


def recorded_rank(pid: int, ranks_file: str) -> tuple[int, int] | None:
    """``(RANK, LOCAL_RANK)`` of a worker its agent forked, from the agent's record (also once the
    worker is gone)."""
    try:
        with open(ranks_file) as fp:
            rank, local_rank = json.load(fp)[str(pid)]
        return int(rank), int(local_rank)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def rank_pid(group_id: str, rank: int) -> int | None:
    """The live process of the group's rank ``rank``, if there is one."""
    for pid in group_pids(group_id):
        found = ranks_of(pid)
        if found is not None and found[0] == rank:
            return pid
    return None


def signal_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def until_one_exits(pids: Collection[int], seconds: float) -> None:
    """Sleep until one of ``pids`` exits (its pidfd readable), one is already gone, or ``seconds``:
    a process that leaves a moment after its signal is seen at once, not at the next poll."""
    fds: list[int] = []
    try:
        for pid in pids:
            try:
                fds.append(os.pidfd_open(pid))
            except ProcessLookupError:
                return
            except (AttributeError, OSError):  # no pidfds here (old kernel, out of descriptors): a plain sleep
                break
        if len(fds) < len(pids):
            time.sleep(seconds)
            return
        until_readable(fds, seconds)
    finally:
        for fd in fds:
            os.close(fd)


def until_readable(fds: Collection[int], seconds: float) -> None:
    """Sleep until one of ``fds`` (pidfds: readable once their process exited) is readable, or
    ``seconds``; with none, a plain sleep. The caller closes them."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    poller.poll(max(0, round(seconds * 1000)))


def stop_group(
    group_id: str,
    *,
    node_rank: int | None = None,
    grace: float = 10.0,
    exclude: int | None = None,
    reap: object = None,
    last: Collection[int] = (),
) -> list[int]:
    """SIGTERM every process of the group (or node), SIGKILL what is left after ``grace`` seconds.

    ``last``: processes (the nodes' supervisors) SIGKILLed only once the others are gone, or
    :data:`LAST_GRACE_S` after them: a supervisor records how its node ended (``exit.json``) once its
    agent is gone, and a SIGKILL at the same moment as its agent's would lose that record.
    Returns the PIDs that needed SIGKILL. Idempotent: with nothing running it returns at once.
    ``reap``, when given, is called while waiting so a parent can collect its dead children.
    """

    def left() -> list[int]:
        if callable(reap):
            reap()
        return group_pids(group_id, node_rank, exclude=exclude)

    def wait(seconds: float) -> list[int]:
        """What is still running once everything is gone, or after ``seconds``."""
        deadline = time.monotonic() + seconds
        pids = left()
        while pids and (remaining := deadline - time.monotonic()) > 0:
            until_one_exits(pids, min(0.05, remaining))
            pids = left()
        return pids

    pids = group_pids(group_id, node_rank, exclude=exclude)
    if not pids:
        return []
    signal_pids(pids, signal.SIGTERM)
    pids = wait(grace)
    if not pids:
        return []
    first = [p for p in pids if p not in last]
    signal_pids(first, signal.SIGKILL)
    killed = first
    if len(first) < len(pids):
        pids = wait(LAST_GRACE_S)
        signal_pids(pids, signal.SIGKILL)
        killed = killed + [p for p in pids if p not in killed]
    wait(5.0)
    return killed


def run_main(main: Callable[[list[str]], int | None], args: list[str]) -> int:
    """``main(args)``'s exit status as the interpreter makes a program's: its return value, a
    ``SystemExit``'s code, or 1 with the traceback on stderr for any other exception."""
    try:
        return int(main(args) or 0)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` once its output is flushed, without the interpreter's teardown
    and without atexit's functions (a process forked from a zygote must not run the zygote's). An
    exec'd supervisor took 8 ms to end through that teardown here, against 1 ms through this (medians
    of 15), and the watch's verdict waits for the supervisor to be gone. The ranks' and agents' twin,
    ``worker.launch.exit_now``, also flushes C's buffers; it is not imported here, where it would
    cost an exec'd supervisor 33 ms of imports."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
