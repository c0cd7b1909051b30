"""Why a group failed: from torchrun's own reports to one message naming the first failure.

Inputs are what torchrun leaves behind: each agent's ``ChildFailedError`` summary (rank, exit
code, signal of every failed local rank) and each rank's error file (written by ``@record`` or by
:mod:`airflow_torchrun.worker.launch`: message and traceback). When one rank dies the others fail
too (lost peers, torchrun's SIGTERM); those are *collateral* and are listed after the root cause,
grouped, never mistaken for it. Ranks that failed with an error of their own (two ranks raising the
same ``AssertionError``) are failures, listed as such, never called collateral. A retry cannot fix
a script that failed while importing its modules (whatever the exception) or that refused its
command line (exit code 2 with the parser's ``error:`` line, which then leads the message).
Pure: callers read the files.
"""

from __future__ import annotations

import json
import re
import signal as _signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from airflow_torchrun.contract import STOPPED_TO_SAVE_EXIT_CODE
from airflow_torchrun.contract.progress import MARKER as PROGRESS_MARKER

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
# A full disk or quota: the same write fails again on a retry until someone frees space.
_NO_SPACE = re.compile(r"\[Errno (?:28|122)\]|No space left on device|Disk quota exceeded")
TAIL_LINES = 20
# One line of detail per group of ranks; longer ones end at a sentence or word boundary.
DETAIL_LIMIT = 300
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
    # From the launcher's error file: "import" when a module-level import of the script raised.
    phase: str | None = None
    # The command-line parser's ``error:`` line, when the rank exited with code 2 after printing it.
    usage_error: str | None = None

    @property
    def collateral(self) -> bool:
        if self.signal == "SIGTERM" or self.exit_code == STOPPED_TO_SAVE_EXIT_CODE:
            return True  # torchrun or teardown stopping a healthy rank (that may have saved first)
        return bool(self.message and _COLLATERAL.search(self.message))

    @property
    def retryable(self) -> bool:
        if self.phase == "import" or self.usage_error:
            return False
        return not (self.message and _PERMANENT.match(self.message)) and not self.out_of_space

    @property
    def out_of_space(self) -> bool:
        """A full disk anywhere in the failure (torch.save's ENOSPC surfaces as a RuntimeError raised
        while handling it, so the traceback is searched too)."""
        return any(_NO_SPACE.search(text) for text in (self.message, self.traceback) if text)

    @property
    def own_error(self) -> bool:
        """Failed with an error of its own (an exception or exit it recorded), not a peer's."""
        return not self.collateral and (self.message is not None or self.usage_error is not None)

    def headline(self) -> str:
        where = f"rank {self.rank}" if self.rank is not None else "the agent"
        local = f", local rank {self.local_rank}" if self.local_rank is not None else ""
        if self.signal:
            how = f"was killed by signal {self.signal}"
        elif self.exit_code == STOPPED_TO_SAVE_EXIT_CODE:
            how = f"stopped to save a checkpoint (exit code {self.exit_code}): it was asked to stop"
        elif self.usage_error:
            how = f"exited with code {self.exit_code}, a command-line error: {self.usage_error}"
        elif self.exit_code is not None:
            how = f"exited with code {self.exit_code}"
        else:
            how = "failed"
        if self.phase == "import":
            how += " while the script imported its modules"
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


def agent_lines(log_text: str) -> str:
    """The lines of a node's log that its torchrun agent wrote itself: every rank line carries the
    ``[node N rank R]`` prefix (torchrun's tee adds it per line), so a rank cannot forge these."""
    return "\n".join(line for line in log_text.splitlines() if not line.startswith("[node ")) + "\n"


def from_exit_statuses(node_rank: int, outcomes: Iterable[Mapping[str, Any]]) -> list[RankFailure]:
    """The failed ranks among a node's workers as the kernel reported their ends (the local
    supervisor's ``workers.json``): exit code or signal, rank and local rank, time."""
    failures = []
    for o in outcomes:
        code, rank = o.get("exit_code"), o.get("rank")
        if not isinstance(code, int) or isinstance(code, bool) or code == 0 or not isinstance(rank, int):
            continue
        local = o.get("local_rank")
        when = o.get("at")
        failures.append(
            RankFailure(
                node_rank=node_rank,
                rank=rank,
                local_rank=local if isinstance(local, int) else None,
                exit_code=code,
                signal=_signal_name(code),
                time=float(when) if isinstance(when, int | float) else None,
            )
        )
    return failures


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


def _launcher_facts(text: str) -> tuple[str | None, str | None]:
    """(phase, usage_error) that :mod:`airflow_torchrun.worker.launch` adds to an error file."""
    try:
        extra = json.loads(text)["message"]["extraInfo"]
    except (ValueError, KeyError, TypeError):
        return None, None
    if not isinstance(extra, dict):
        return None, None
    phase, usage = extra.get("phase"), extra.get("usage_error")
    return (str(phase) if phase else None, str(usage) if usage else None)


def merge(reported: Iterable[RankFailure], error_files: Iterable[tuple[int, str]]) -> list[RankFailure]:
    """Join the agents' per-rank reports with the ranks' own error files (``(node_rank, text)``)."""
    by_rank: dict[tuple[int, int | None], RankFailure] = {(f.node_rank, f.rank): f for f in reported}
    for node_rank, text in error_files:
        rank, message, tb, when = parse_error_file(text)
        phase, usage = _launcher_facts(text)
        key = (node_rank, rank)
        base = by_rank.get(key, RankFailure(node_rank=node_rank, rank=rank))
        merged = replace(base, message=message, traceback=tb, time=when or base.time, phase=phase, usage_error=usage)
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


def retryable(failures: Sequence[RankFailure]) -> bool:
    """Whether a retry may help: no rank that failed on its own failed in a way a retry repeats."""
    cause = root_cause(failures)
    own = [f for f in failures if f is cause or f.own_error]
    return all(f.retryable for f in own)


def clip(text: str, limit: int = DETAIL_LIMIT) -> str:
    """``text`` whole when short; else up to the last sentence end (or word) before ``limit``."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    end = max(head.rfind(". "), head.rfind("; "), head.rfind(": "))
    if end >= limit // 3:
        return head[: end + 1] + " [...]"
    space = head.rfind(" ")
    return (head[:space] if space > 0 else head) + " [...]"


def traceback_tail(tb: str, limit: int = TAIL_LINES) -> list[str]:
    """The last ``limit`` lines of a traceback, moved back to start on a frame's ``File`` line
    (never on a source or ``^^^^`` marker line)."""
    lines = tb.rstrip().splitlines()
    start = max(0, len(lines) - limit)
    while start > 0 and not lines[start].lstrip().startswith(("File ", "Traceback ")):
        start -= 1
    return lines[start:]


def rank_lines(log_text: str, node_rank: int, rank: int | None, limit: int = TAIL_LINES) -> list[str]:
    """The last lines one rank printed (torchrun prefixes each with ``[node N rank R]``), without its
    progress records (``@torchrun-progress {...}``: data for the watch and the view, not for people)."""
    lines = [line for line in log_text.splitlines() if PROGRESS_MARKER.strip() not in line]
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
        said = f.usage_error or (f.message.splitlines()[0] if f.message else "")
        detail = clip(_ADDRESS.sub("<addr>", said)) if said else ""
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
        if cause.usage_error:
            parts.append("  The script refused its arguments (script_args); a retry would too.")
        elif cause.message:
            parts.append(f"  {cause.message}")
        if cause.phase == "import":
            parts.append(
                "  It failed before any of its own code ran (an import raised), so a retry would fail the same way."
            )
        if cause.traceback and not cause.usage_error:
            parts.append("First failure's traceback (last lines):")
            parts.extend(f"  {line}" for line in traceback_tail(cause.traceback))
        if cause.out_of_space:
            parts.append(
                "  A disk it writes to is full (the checkpoint store, or the script's own output): free space, "
                "lower keep_last, or point checkpoint_uri at larger storage; the last committed checkpoint is kept."
            )
        if cause.signal == "SIGKILL":
            parts.append(
                "  SIGKILL usually means the kernel's OOM killer or an operator killed the process; "
                "check memory use per rank."
            )
        own = [f for f in failures if f is not cause and f.own_error]
        others = [f for f in failures if f is not cause and not f.own_error]
        if own:
            parts.append("Also failed on their own: " + "; ".join(_group_others(own)))
        if others:
            parts.append("Then, as a consequence: " + "; ".join(_group_others(others)))
    if log_tail:
        parts.append(f"Last lines of the failing rank's log ({log_path}):")
        parts.extend(f"  {line}" for line in log_tail)
    return "\n".join(parts)


class AgentTracebackFolder:
    """Folds a torchrun agent's own traceback (Python frames of torchrun, ending in
    ``ChildFailedError``) into one line of the task log; the node's log on disk keeps it whole.

    Fed the agent's lines as they are read (a traceback may span two reads); a rank's lines never
    pass through here.
    """

    def __init__(self, where: str = "") -> None:
        self.where = where
        self._held: list[str] | None = None

    def feed(self, line: str) -> list[str]:
        """The lines to show for ``line``: none while a traceback is being held, one when it ends."""
        if self._held is None:
            if line.strip() == "Traceback (most recent call last):":
                self._held = [line]
                return []
            return [line]
        if line[:1].isspace() or not line.strip():
            self._held.append(line)
            return []
        held, self._held = self._held, None
        where = f" in full in {self.where}" if self.where else " in full in the node's log"
        return [f"{line.strip()}  (torchrun agent's traceback of {len(held)} lines folded;{where})"]


# What makes each framework's ranks join one group on CPU; quoted when they did not.
PROCESS_GROUP_FIXES = (
    "Hugging Face Trainer on CPU: pass --use_cpu (TrainingArguments(use_cpu=True)); "
    "accelerate on CPU: ACCELERATE_USE_CPU=1 (env={'ACCELERATE_USE_CPU': '1'}); "
    "a plain script: call torch.distributed.init_process_group() (it reads torchrun's variables)"
)


def process_group_problem(records: Sequence[Mapping[str, Any]] | None, world_size: int) -> str | None:
    """Why the ranks did not form one group of ``world_size`` (None: they did, or nobody can tell).

    ``records`` are the launchers' per-rank notes (``joined``, ``world_size``, ``collectives``: the
    default group's sequence number when the script ended or destroyed it); ``None`` when the
    backend cannot see them (Kubernetes, ``command=``): then nothing is claimed either way.
    """
    if not records or world_size <= 1:
        return None
    alone = [r for r in records if not r.get("joined")]
    wrong = [r for r in records if r.get("joined") and r.get("world_size") != world_size]
    unused = [r for r in records if r.get("joined") and r.get("world_size") == world_size and r.get("collectives") == 0]
    if not alone and not wrong and not unused:
        return None

    def ranks(rs: Sequence[Mapping[str, Any]]) -> str:
        return ",".join(sorted((str(r.get("rank_env", "?")) for r in rs), key=lambda x: (len(x), x)))

    what = []
    if alone:
        what.append(f"rank(s) {ranks(alone)} never joined a process group")
    if wrong:
        sizes = sorted({int(r.get("world_size") or 0) for r in wrong})
        what.append(f"rank(s) {ranks(wrong)} joined one of world size {'/'.join(map(str, sizes))}")
    if unused:
        what.append(f"rank(s) {ranks(unused)} joined it but never communicated through it (no collective ran)")
    return (
        f"every node exited 0, but the ranks did not form one process group of world size {world_size}: "
        f"{'; '.join(what)}. Each rank most likely trained on its own, as an independent copy. "
        f"Known fixes: {PROCESS_GROUP_FIXES}"
    )
