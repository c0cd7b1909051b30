"""The one watch core: observations (and observation errors) in, decisions out. Pure.

The sync operator and the async trigger drive the same :class:`Watch` with a few-line loop
(:func:`watch_sync` here, ``GroupTrigger.run`` in :mod:`airflow_torchrun.triggers`), so both
modes keep waiting, time out, tolerate a flaky API and give up identically. Nothing here does
I/O or reads a clock: every call takes ``now`` (epoch seconds).

Decisions:
- the group is terminal (succeeded, failed, could not start within ``startup_timeout``);
- ``deadline`` (the task's ``execution_timeout``) passed while it still runs;
- no progress for ``progress_timeout`` seconds: no rank reported a new step in its progress
  records and the backend's ``progress_mark`` (log growth) did not change either: the group
  looks hung (before its first sign of life, ``startup_timeout`` applies instead);
- looking at the group failed: a transient error (API 5xx, 429, a timeout, a connection reset)
  is tolerated until looks have failed for ``error_budget`` seconds in a row; a permanent one
  (403, a malformed answer or status file) gives up at once. Giving up never claims the group
  failed: the verdict says its state is unknown.

Progress records (:mod:`airflow_torchrun.worker.progress`) fed to :meth:`Watch.observed` go to a
:class:`~airflow_torchrun.progress.ProgressBoard`: a summary line every ``progress_every`` seconds
(``step 1200/5000 (24%) | 3,400 samples/s | ETA 14m | data wait 12% | slowest rank 3 (1.4x median
step)``), and a warning when data starvation or a straggler sets in (and a line when it ends).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from airflow_torchrun.errors import is_transient
from airflow_torchrun.progress import ProgressBoard, ProgressThresholds
from airflow_torchrun.status import GroupState, GroupStatus, NodeObservation, group_status

if TYPE_CHECKING:
    from airflow_torchrun.backends.base import Backend
    from airflow_torchrun.backends.handles import GroupHandle
    from airflow_torchrun.worker.progress import ProgressRecord

DEFAULT_ERROR_BUDGET = 300.0
# Longest pause between two looks while looks keep failing (see Watch.pause).
BACKOFF_CAP = 2.0
DEFAULT_HEARTBEAT = 60.0
DEFAULT_PROGRESS_EVERY = 30.0
# How often a run of failed looks is reported while it lasts (the first one always is).
ERROR_REPORT_EVERY = 30.0


class Outcome(StrEnum):
    """How a watch ended."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STARTUP_TIMEOUT = "startup_timeout"
    PROGRESS_TIMEOUT = "progress_timeout"  # no progress for progress_timeout seconds
    TIMEOUT = "timeout"  # the task's execution_timeout (the watch's deadline) passed
    ERROR = "error"  # the group could not be observed; its state is unknown

    @property
    def ok(self) -> bool:
        return self is Outcome.SUCCEEDED


_FROM_STATE = {
    GroupState.SUCCEEDED: Outcome.SUCCEEDED,
    GroupState.FAILED: Outcome.FAILED,
    GroupState.STARTUP_TIMEOUT: Outcome.STARTUP_TIMEOUT,
}


@dataclass(frozen=True)
class Verdict:
    """A terminal decision, with what every node was last seen doing."""

    outcome: Outcome
    reason: str = ""
    nodes: tuple[NodeObservation, ...] = ()
    failed_node: int | None = None
    transient: bool = True  # for ERROR: whether a retry may see the group again

    def group_status(self) -> GroupStatus:
        """As a group status, for ``Backend.explain`` (outcomes other than the group's own are failures)."""
        state = {
            Outcome.SUCCEEDED: GroupState.SUCCEEDED,
            Outcome.STARTUP_TIMEOUT: GroupState.STARTUP_TIMEOUT,
        }.get(self.outcome, GroupState.FAILED)
        return GroupStatus(state, self.nodes, self.failed_node, self.reason)


@dataclass(frozen=True)
class Note:
    """Something the driver should log: one line per change of state, never one per look."""

    level: int
    message: str


@dataclass(frozen=True)
class Step:
    verdict: Verdict | None = None
    notes: tuple[Note, ...] = ()


@dataclass(frozen=True)
class WatchConfig:
    poll_interval: float = 1.0
    progress_timeout: float | None = None
    deadline: float | None = None  # epoch seconds
    error_budget: float = DEFAULT_ERROR_BUDGET
    heartbeat: float = DEFAULT_HEARTBEAT
    progress_every: float = DEFAULT_PROGRESS_EVERY  # seconds between two progress summary lines
    thresholds: ProgressThresholds = field(default_factory=ProgressThresholds)


@dataclass
class Watch:
    """The state machine of one watch of one group (a triggerer restart starts a new one)."""

    group_id: str
    launched_at: float
    startup_timeout: float
    config: WatchConfig
    started_at: float
    _phases: tuple[str, ...] = ()
    _failing_since: float | None = None
    _failed_looks: int = 0
    _last_error_report: float = 0.0
    _mark: object | None = None
    _progress_at: float = 0.0
    _told_no_progress: bool = False
    _alive: bool = False  # the progress mark changed since the first look
    _heartbeat_at: float = 0.0
    _nodes: tuple[NodeObservation, ...] = field(default=())
    board: ProgressBoard = field(default_factory=ProgressBoard)
    _summary_at: float | None = None
    _summary: str | None = None

    @classmethod
    def of(cls, handle: GroupHandle, config: WatchConfig, now: float) -> Watch:
        return cls(
            group_id=handle.group_id,
            launched_at=handle.launched_at,
            startup_timeout=handle.startup_timeout,
            config=config,
            started_at=now,
            _progress_at=now,
            _heartbeat_at=now,
            board=ProgressBoard(
                nproc_per_node=max(1, handle.world_size // max(1, handle.num_nodes)), thresholds=config.thresholds
            ),
        )

    # -- inputs -------------------------------------------------------------------------------
    def observed(
        self,
        nodes: list[NodeObservation],
        mark: object | None,
        now: float,
        records: Sequence[ProgressRecord] = (),
    ) -> Step:
        """One successful look: ``nodes`` as seen, ``mark`` the backend's progress mark (or None),
        ``records`` the progress records the ranks wrote since the last look."""
        notes: list[Note] = []
        self._progressed(records, now, notes)
        if self._failing_since is not None:
            notes.append(
                Note(
                    logging.INFO,
                    f"Group {self.group_id}: observing again after {self._failed_looks} failed look(s) "
                    f"over {now - self._failing_since:.0f}s",
                )
            )
            self._failing_since, self._failed_looks = None, 0
        status = group_status(nodes, launched_at=self.launched_at, now=now, startup_timeout=self.startup_timeout)
        self._nodes = status.nodes
        phases = tuple(n.phase.value for n in status.nodes)
        if phases != self._phases:
            self._phases = phases
            notes.append(Note(logging.INFO, f"Group {self.group_id} nodes: {', '.join(phases)}"))
        if status.state.terminal:
            if status.state is not GroupState.SUCCEEDED:
                notes.append(Note(logging.ERROR, f"Group {self.group_id} {status.state.value}: {status.reason}"))
            return Step(
                Verdict(_FROM_STATE[status.state], status.reason, status.nodes, status.failed_node), tuple(notes)
            )
        # A new step in the records, or output (log growth): either is progress. Steps alone would
        # call a long phase between or after steps (an evaluation, the final upload) a hang and tear
        # a healthy group down, again on every retry.
        evidence = (
            (self.board.mark(), mark)
            if self.board.seen and mark is not None
            else (self.board.mark() if self.board.seen else mark)
        )
        verdict = self._deadline(now) or self._progress(evidence, now, notes)
        if verdict is None and now - self._heartbeat_at >= self.config.heartbeat:
            self._heartbeat_at = now
            notes.append(
                Note(logging.INFO, f"Group {self.group_id} still running, {now - self.launched_at:.0f}s since launch")
            )
        return Step(verdict, tuple(notes))

    def pause(self) -> float:
        """Seconds until the next look: ``poll_interval``, doubled for every look in a row that
        failed, up to :data:`BACKOFF_CAP` (an API server in trouble is not hammered by every task)."""
        base = self.config.poll_interval
        if not self._failed_looks:
            return base
        return max(base, min(BACKOFF_CAP, base * 2.0**self._failed_looks))

    def failed(self, exc: BaseException, now: float) -> Step:
        """One look that raised ``exc``."""
        transient = is_transient(exc)
        if self._failing_since is None:
            self._failing_since = now
            self._last_error_report = 0.0
        self._failed_looks += 1
        spent = now - self._failing_since
        kind = "transient" if transient else "permanent"
        if not transient or spent >= self.config.error_budget:
            why = (
                f"looking at the group failed for {spent:.0f}s ({self._failed_looks} look(s)), past its "
                f"observe_error_budget of {self.config.error_budget:g}s; last error: {exc}"
                if transient
                else f"looking at the group failed with a permanent error: {exc}"
            )
            return Step(
                Verdict(Outcome.ERROR, f"{why}; the group's state is unknown", self._nodes, transient=transient),
                (Note(logging.ERROR, f"Group {self.group_id}: {why}"),),
            )
        notes: tuple[Note, ...] = ()
        if self._failed_looks == 1 or now - self._last_error_report >= ERROR_REPORT_EVERY:
            self._last_error_report = now
            notes = (
                Note(
                    logging.WARNING,
                    f"Group {self.group_id}: could not look at the group ({kind}, {self._failed_looks} failed "
                    f"look(s) over {spent:.0f}s of a {self.config.error_budget:g}s budget): {exc}; the group "
                    "keeps running",
                ),
            )
        return Step(self._deadline(now), notes)

    # -- decisions ----------------------------------------------------------------------------
    def _progressed(self, records: Sequence[ProgressRecord], now: float, notes: list[Note]) -> None:
        # One record at a time, in time order: a batch (a first look at a long log, a triggerer
        # restart) is judged as the stream it was, not by its last records alone.
        raised, cleared = [], []
        for record in sorted(records, key=lambda r: r.time):
            up, down = self.board.add([record])
            raised += up
            cleared += down
        for alert in raised:
            notes.append(Note(logging.WARNING, f"Group {self.group_id}: {alert.message}"))
        for alert in cleared:
            notes.append(Note(logging.INFO, f"Group {self.group_id}: {alert.kind.replace('_', ' ')} is over"))
        if not records or not self.board.seen:
            return
        if self._summary_at is None or now - self._summary_at >= self.config.progress_every:
            line = self.board.summary_line()
            if line and line != self._summary:
                self._summary_at, self._summary = now, line
                notes.append(Note(logging.INFO, f"Group {self.group_id}: {line}"))

    def _deadline(self, now: float) -> Verdict | None:
        if self.config.deadline is not None and now >= self.config.deadline:
            return Verdict(
                Outcome.TIMEOUT, "the task's execution_timeout passed while the group was still running", self._nodes
            )
        return None

    def _progress(self, mark: object | None, now: float, notes: list[Note]) -> Verdict | None:
        limit = self.config.progress_timeout
        if limit is None:
            return None
        if mark is None:
            # This backend cannot tell (yet): never call a group hung on no evidence.
            if not self._told_no_progress:
                self._told_no_progress = True
                notes.append(
                    Note(
                        logging.WARNING,
                        f"Group {self.group_id}: its backend cannot tell progress; progress_timeout={limit:g}s "
                        "is not enforced until it can",
                    )
                )
            self._progress_at = now
            return None
        if mark != self._mark:
            # A sign of life is output, not a change: a node's log appearing empty is none.
            self._alive = self._alive or shows_output(mark)
            self._mark, self._progress_at = mark, now
            return None
        # Before its first sign of life a group is starting (interpreter, imports, data, rendezvous),
        # not hung: it gets startup_timeout for that, so a slow start is never torn down as a hang.
        allowed = limit if self._alive or self.board.seen else max(limit, self.startup_timeout)
        if now - self._progress_at >= allowed:
            since = "its last progress" if self._alive or self.board.seen else "launch, with no output at all"
            reason = (
                f"no progress for {now - self._progress_at:.0f}s since {since} (progress_timeout={limit:g}s"
                f"{'' if allowed == limit else f', startup_timeout={self.startup_timeout:g}s before any output'}): "
                "no rank logged or reported a step; the group looks hung (a stuck collective, a stopped rank, a "
                "deadlock)"
            )
            return Verdict(Outcome.PROGRESS_TIMEOUT, reason, self._nodes)
        return None


def shows_output(mark: object) -> bool:
    """Whether a backend's progress mark already shows output: a log size above 0 (local, one per
    node), a last log line's timestamp (Kubernetes, ``(node_rank, timestamp)`` per running node),
    a step (progress records)."""
    if isinstance(mark, tuple) and len(mark) == 2 and isinstance(mark[0], int) and isinstance(mark[1], str):
        return bool(mark[1])
    if isinstance(mark, tuple | list):
        return any(shows_output(part) for part in mark)
    if isinstance(mark, bool) or mark is None:
        return bool(mark)
    if isinstance(mark, int | float):
        return mark > 0
    return bool(mark)


def watch_sync(
    backend: Backend,
    handle: GroupHandle,
    watch: Watch,
    *,
    emit: Callable[[Note], None],
    after_look: Callable[[], None] = lambda: None,
    until: float | None = None,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> Verdict | None:
    """Drive ``watch`` until a verdict, or until ``until`` (epoch) passes first (then ``None``)."""
    while True:
        try:
            nodes = backend.observe(handle)
        except Exception as exc:
            step = watch.failed(exc, clock())
        else:
            mark = None
            if watch.config.progress_timeout is not None:
                try:
                    mark = backend.progress_mark(handle)
                except Exception as exc:  # no evidence of a hang: never a reason to give up on the group
                    emit(Note(logging.WARNING, f"Group {handle.group_id}: could not tell its progress: {exc}"))
            step = watch.observed(nodes, mark, clock(), read_records(backend, handle, emit))
        # First: after_look raises when the task was killed meanwhile, and what this look saw then
        # (a deleted Job, stopped ranks) is the kill's doing, not worth a line of its own.
        after_look()
        for note in step.notes:
            emit(note)
        if step.verdict is not None:
            return step.verdict
        if until is not None and clock() >= until:
            return None
        sleep(watch.pause())


def read_records(backend: Backend, handle: GroupHandle, emit: Callable[[Note], None]) -> list[ProgressRecord]:
    """The progress records the ranks wrote since the last call; a failed read is only warned about."""
    from airflow_torchrun.worker.progress import parse_records

    try:
        return parse_records(backend.read_progress_lines(handle))
    except Exception as exc:  # never a reason to give up on the group
        emit(Note(logging.WARNING, f"Group {handle.group_id}: could not read its progress records: {exc}"))
        return []


async def read_records_async(
    backend: Backend, handle: GroupHandle, emit: Callable[[Note], None]
) -> list[ProgressRecord]:
    """:func:`read_records` for the trigger (the backend's async client)."""
    from airflow_torchrun.worker.progress import parse_records

    try:
        return parse_records(await backend.read_progress_lines_async(handle))
    except Exception as exc:  # never a reason to give up on the group
        emit(Note(logging.WARNING, f"Group {handle.group_id}: could not read its progress records: {exc}"))
        return []
