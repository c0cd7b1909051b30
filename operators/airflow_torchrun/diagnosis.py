"""Why a group failed: from torchrun's own reports to one message naming the first failure.

Inputs are what torchrun leaves behind: each agent's ``ChildFailedError`` summary (rank, exit
code, signal of every failed local rank) and each rank's error file (written by ``@record`` or by
:mod:`airflow_torchrun.worker.launch`: message and traceback). When one rank dies the others fail
too (lost peers, torchrun's SIGTERM); those are *collateral* and are listed after the root cause,
grouped, never mistaken for it. Pure: callers read the files.
"""

from __future__ import annotations

import json
import re
import signal as _signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from airflow_torchrun.contract import STOPPED_TO_SAVE_EXIT_CODE

_BLOCK = re.compile(
    r"time\s*:\s*(?P<time>\S+)\s*\n"
    r"\s*host\s*:\s*(?P<host>[^\n]*)\n"
    r"\s*rank\s*:\s*(?P<rank>-?\d+)\s*\(local_rank:\s*(?P<local_rank>\d+)\)\s*\n"
    r"\s*exitcode\s*:\s*(?P<exit>-?\d+)[^\n]*\n"
    r"\s*error_file\s*:\s*(?P<error_file>[^\n]*)\n"
)
# Errors a rank raises because *another* rank went away.
_COLLATERAL = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|DistNetworkError|"
    r"DistBackendError|recvBytes|Socket Timeout|Connection refused|NCCL communicator was aborted|"
    r"ProcessGroupNCCL.*(?:watchdog|abort)|remote worker crash",
    re.IGNORECASE,
)
# Errors a retry cannot fix: the script itself is broken.
_PERMANENT = re.compile(r"^(ModuleNotFoundError|ImportError|SyntaxError|IndentationError|NameError)\b")
TAIL_LINES = 20
_SYSTEM_EXIT = re.compile(r"^SystemExit: (-?\d+)$")
# Peer addresses differ from rank to rank; drop them so identical failures group together.
_ADDRESS = re.compile(r"\[?\d{1,3}(?:\.\d{1,3}){3}\]?(?::\d+)?")


@dataclass(frozen=True)
class RankFailure:
    node_rank: int
    rank: int | None
    local_rank: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    time: float | None = None
    message: str | None = None
    traceback: str | None = None

    @property
    def collateral(self) -> bool:
        if self.signal == "SIGTERM" or self.exit_code == STOPPED_TO_SAVE_EXIT_CODE:
            return True  # torchrun or teardown stopping a healthy rank (that may have saved first)
        return bool(self.message and _COLLATERAL.search(self.message))

    @property
    def retryable(self) -> bool:
        return not (self.message and _PERMANENT.match(self.message))

    def headline(self) -> str:
        where = f"rank {self.rank}" if self.rank is not None else "the agent"
        local = f", local rank {self.local_rank}" if self.local_rank is not None else ""
        if self.signal:
            how = f"was killed by signal {self.signal}"
        elif self.exit_code == STOPPED_TO_SAVE_EXIT_CODE:
            how = f"stopped to save a checkpoint (exit code {self.exit_code}): it was asked to stop"
        elif self.exit_code is not None:
            how = f"exited with code {self.exit_code}"
        else:
            how = "failed"
        return f"{where} (node {self.node_rank}{local}) {how}"


def _signal_name(exit_code: int) -> str | None:
    if exit_code >= 0:
        return None
    try:
        return _signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


def parse_agent_report(node_rank: int, log_text: str) -> list[RankFailure]:
    """The failed ranks listed in a torchrun agent's ``ChildFailedError`` summary."""
    failures = {}
    for m in _BLOCK.finditer(log_text):
        exit_code = int(m["exit"])
        try:
            when = datetime.strptime(m["time"], "%Y-%m-%d_%H:%M:%S").timestamp()
        except ValueError:
            when = None
        failure = RankFailure(
            node_rank=node_rank,
            rank=int(m["rank"]),
            local_rank=int(m["local_rank"]),
            exit_code=exit_code,
            signal=_signal_name(exit_code),
            time=when,
        )
        failures[failure.rank] = failure
    return list(failures.values())


def parse_error_file(text: str) -> tuple[int | None, str | None, str | None, float | None]:
    """(rank, message, traceback, time) from a torchrun error file; Nones where absent."""
    try:
        data = json.loads(text)
        msg = data["message"]
    except (ValueError, KeyError, TypeError):
        return None, None, None, None
    if isinstance(msg, str):
        return None, msg, None, None
    extra = msg.get("extraInfo", {}) if isinstance(msg, dict) else {}
    rank_s = str(extra.get("rank", ""))
    when_s = extra.get("airflow_torchrun_time") or extra.get("timestamp")
    try:
        when = float(when_s) if when_s else None
    except ValueError:
        when = None
    return (
        int(rank_s) if rank_s.lstrip("-").isdigit() else None,
        msg.get("message") if isinstance(msg, dict) else None,
        extra.get("py_callstack"),
        when,
    )


def merge(reported: Iterable[RankFailure], error_files: Iterable[tuple[int, str]]) -> list[RankFailure]:
    """Join the agents' per-rank reports with the ranks' own error files (``(node_rank, text)``)."""
    by_rank: dict[tuple[int, int | None], RankFailure] = {(f.node_rank, f.rank): f for f in reported}
    for node_rank, text in error_files:
        rank, message, tb, when = parse_error_file(text)
        key = (node_rank, rank)
        base = by_rank.get(key, RankFailure(node_rank=node_rank, rank=rank))
        merged = replace(base, message=message, traceback=tb, time=when or base.time)
        exited = _SYSTEM_EXIT.match(message or "")
        if exited:
            # The rank chose its exit code; a C++ destructor aborting on the way out (SIGABRT with
            # a live process group) must not hide it.
            merged = replace(merged, exit_code=int(exited.group(1)), signal=None)
        by_rank[key] = merged
    return list(by_rank.values())


def root_cause(failures: Sequence[RankFailure]) -> RankFailure | None:
    """The first real failure: non-collateral before collateral, then the earliest."""
    if not failures:
        return None
    return min(failures, key=lambda f: (f.collateral, f.time if f.time is not None else float("inf")))


def rank_lines(log_text: str, node_rank: int, rank: int | None, limit: int = TAIL_LINES) -> list[str]:
    """The last lines one rank printed (torchrun prefixes each with ``[node N rank R]``)."""
    lines = log_text.splitlines()
    if rank is not None:
        prefix = f"[node {node_rank} rank {rank}]"
        mine = [line for line in lines if line.startswith(prefix)]
        if mine:
            lines = mine
    return lines[-limit:]


def _group_others(failures: Sequence[RankFailure]) -> list[str]:
    groups: dict[str, list[RankFailure]] = {}
    for f in failures:
        what = f.signal or (f"exit code {f.exit_code}" if f.exit_code is not None else "failed")
        detail = _ADDRESS.sub("<addr>", f.message.splitlines()[0])[:160] if f.message else ""
        groups.setdefault(f"{what}{': ' + detail if detail else ''}", []).append(f)
    out = []
    for what, members in groups.items():
        ranks = ",".join(str(m.rank) for m in sorted(members, key=lambda m: (m.rank is None, m.rank or 0)))
        out.append(f"ranks {ranks}: {what}" if len(members) > 1 else f"rank {ranks}: {what}")
    return out


def failure_message(
    group_id: str,
    failures: Sequence[RankFailure],
    *,
    node_headline: str,
    log_tail: Sequence[str],
    log_path: str,
) -> str:
    """The task's error: the first failure, its traceback and log tail, then the cascade."""
    cause = root_cause(failures)
    parts = []
    if cause is None:
        parts.append(f"Training group {group_id} failed: {node_headline}.")
    else:
        parts.append(f"Training group {group_id} failed: {cause.headline()}.")
        if cause.message:
            parts.append(f"  {cause.message}")
        if cause.traceback:
            tb = cause.traceback.rstrip().splitlines()[-TAIL_LINES:]
            parts.append("First failure's traceback (last lines):")
            parts.extend(f"  {line}" for line in tb)
        if cause.signal == "SIGKILL":
            parts.append(
                "  SIGKILL usually means the kernel's OOM killer or an operator killed the process; "
                "check memory use per rank."
            )
        others = [f for f in failures if f is not cause]
        if others:
            parts.append("Then, as a consequence: " + "; ".join(_group_others(others)))
    if log_tail:
        parts.append(f"Last lines of the failing rank's log ({log_path}):")
        parts.extend(f"  {line}" for line in log_tail)
    return "\n".join(parts)
