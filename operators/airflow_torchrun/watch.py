"""The one watch: a pure core that turns observations into decisions, one flow, two thin executors.

:class:`Watch` is the state machine: observations (and observation errors) in, decisions out; it
does no I/O and reads no clock (every call takes ``now``). :func:`watch_flow` is the whole watch
loop written once, as a generator that yields what to do next (:class:`Look` at the group,
:class:`Pause`, or a :class:`Note` to log) and receives what a look saw. Two executors of a few
lines drive it: :func:`watch_sync` in the worker (the operator's sync mode, and the first
``defer_after`` seconds of a deferrable task) and :func:`watch_async` in the triggerer, which looks
through the backend's async client. So both modes keep waiting, time out, tolerate a flaky API
and give up identically: the executors only do what the flow asks. Both pause through the backend
(``Backend.pause``), which may end a pause early: the local backend wakes when a node's supervisor
exits, so a finished group is seen at once rather than up to ``poll_interval`` later.

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

Progress records (:mod:`airflow_torchrun.contract.progress`) fed to :meth:`Watch.observed` go to a
:class:`~airflow_torchrun.progress.ProgressBoard`: a summary line every ``progress_every`` seconds
(``step 1200/5000 (24%) | 3,400 samples/s | ETA 14m | data wait 12% | slowest rank 3 (1.4x median
step)``), and a warning when data starvation or a straggler sets in (and a line when it ends).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from airflow_torchrun.contract.progress import ProgressRecord, parse_records
from airflow_torchrun.errors import is_transient
from airflow_torchrun.progress import ProgressBoard, ProgressThresholds
from airflow_torchrun.status import GroupStatus, NodeObservation, NodePhase, Outcome, ProgressMark, group_status

if TYPE_CHECKING:
    from airflow_torchrun.backends.base import Backend
    from airflow_torchrun.backends.handles import GroupHandle

T = TypeVar("T")

DEFAULT_ERROR_BUDGET = 300.0
# Longest pause between two looks while looks keep failing (see Watch.pause).
BACKOFF_CAP = 2.0
DEFAULT_HEARTBEAT = 60.0
DEFAULT_PROGRESS_EVERY = 30.0
# How often a run of failed looks is reported while it lasts (the first one always is).
ERROR_REPORT_EVERY = 30.0


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
        state = self.outcome if self.outcome in (Outcome.SUCCEEDED, Outcome.STARTUP_TIMEOUT) else Outcome.FAILED
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
    _waiting: tuple[tuple[int, str], ...] = ()
    _failing_since: float | None = None
    _failed_looks: int = 0
    _last_error_report: float = 0.0
    _mark: tuple[object, ...] | None = None
    _progress_at: float = 0.0
    _told_no_progress: bool = False
    _alive: bool = False  # the progress mark changed since the first look
    _heartbeat_at: float = 0.0
    _nodes: tuple[NodeObservation, ...] = field(default=())
    board: ProgressBoard = field(default_factory=ProgressBoard)
    _summary_at: float | None = None
    _summary: str | None = None
    # What this watch saw first (for the try's timeline): any rank's output (looked at), its
    # first progress record (the rank's own time and step).
    first_output_at: float | None = None
    first_step_at: float | None = None
    first_step: int | None = None
    running_at: float | None = None  # every node past pending (the end of admission)

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
        mark: ProgressMark | None,
        now: float,
        records: Sequence[ProgressRecord] = (),
    ) -> Step:
        """One successful look: ``nodes`` as seen, ``mark`` the backend's progress mark (or None),
        ``records`` the progress records the ranks wrote since the last look."""
        notes: list[Note] = []
        self._firsts(mark, records, now)
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
        if self.running_at is None and status.nodes and all(n.phase is not NodePhase.PENDING for n in status.nodes):
            self.running_at = now
        phases = tuple(n.phase.value for n in status.nodes)
        if phases != self._phases:
            self._phases = phases
            notes.append(Note(logging.INFO, f"Group {self.group_id} nodes: {', '.join(phases)}"))
        waiting = tuple((n.node_rank, n.reason) for n in status.nodes if n.phase is NodePhase.PENDING and n.reason)
        if waiting != self._waiting:
            # Why pending nodes wait (Kueue's admission message, the scheduler's, an image pull):
            # what a user looking at a group that does not start needs, before any timeout.
            self._waiting = waiting
            if waiting:
                notes.append(Note(logging.INFO, f"Group {self.group_id} waiting: {_grouped(waiting)}"))
        if status.state.terminal:
            if status.state is not Outcome.SUCCEEDED:
                notes.append(Note(logging.ERROR, f"Group {self.group_id} {status.state.value}: {status.reason}"))
            return Step(Verdict(status.state, status.reason, status.nodes, status.failed_node), tuple(notes))
        # A new step in the records, or output (log growth): either is progress. Steps alone would
        # call a long phase between or after steps (an evaluation, the final upload) a hang and tear
        # a healthy group down, again on every retry.
        verdict = self._deadline(now) or self._progress(self._evidence(mark), now, notes)
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
    def _firsts(self, mark: ProgressMark | None, records: Sequence[ProgressRecord], now: float) -> None:
        if self.first_output_at is None and ((mark is not None and mark.output) or records):
            self.first_output_at = now
        windows = [r for r in records if r.window]  # an event record (rendezvous, loop start) is no step
        if self.first_step_at is None and windows:
            first = min(windows, key=lambda r: r.time)
            self.first_step_at, self.first_step = first.time, first.step

    def seen(self) -> dict[str, float | int]:
        """What this watch saw first, for the try's timeline (the event carries it from the triggerer)."""
        out: dict[str, float | int] = {}
        for name in ("first_output_at", "first_step_at", "first_step", "running_at"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

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

    def _evidence(self, mark: ProgressMark | None) -> ProgressMark | None:
        """The ranks' steps (progress records) and the backend's mark together: a new step or new
        output is progress."""
        if not self.board.seen:
            return mark
        steps = self.board.mark()
        return ProgressMark((steps,), True) if mark is None else ProgressMark((steps, mark.token), True)

    def _progress(self, mark: ProgressMark | None, now: float, notes: list[Note]) -> Verdict | None:
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
        if mark.token != self._mark:
            # A sign of life is output, not a change: a node's log appearing empty is none.
            self._alive = self._alive or mark.output
            self._mark, self._progress_at = mark.token, now
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


def _grouped(reasons: Sequence[tuple[int, str]]) -> str:
    """``node 0: A; nodes 1,2: B``: the nodes waiting for one reason named once."""
    by_reason: dict[str, list[int]] = {}
    for rank, reason in reasons:
        by_reason.setdefault(reason, []).append(rank)
    return "; ".join(
        f"node{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}: {reason}"
        for reason, ranks in by_reason.items()
    )


# -- the watch loop, once, and its two executors ---------------------------------------------------
@dataclass(frozen=True)
class Look:
    """Look at the group: its nodes, new progress records and (``mark``) the backend's progress mark."""

    mark: bool


@dataclass(frozen=True)
class Pause:
    seconds: float


@dataclass(frozen=True)
class Seen:
    """What one look saw; ``error``: the look at the nodes failed (a mark or records that could not
    be read are only warned about in ``notes``: never evidence of anything)."""

    nodes: list[NodeObservation] = field(default_factory=list)
    error: BaseException | None = None
    mark: ProgressMark | None = None
    records: list[ProgressRecord] = field(default_factory=list)
    notes: tuple[Note, ...] = ()


WatchStep = Look | Pause | Note
WatchFlow = Generator[WatchStep, "Seen | None", "Verdict | None"]


def watch_flow(watch: Watch, *, clock: Callable[[], float], until: float | None = None) -> WatchFlow:
    """The watch loop: look, decide, pause, until a verdict; ``None`` when ``until`` (epoch) passed first."""
    while True:
        seen = yield Look(mark=watch.config.progress_timeout is not None)
        assert seen is not None  # an executor answers every Look
        now = clock()
        step = watch.failed(seen.error, now) if seen.error else watch.observed(seen.nodes, seen.mark, now, seen.records)
        yield from (*seen.notes, *step.notes)
        if step.verdict is not None:
            return step.verdict
        if until is not None and clock() >= until:
            return None
        yield Pause(watch.pause())


def look(backend: Backend[Any], handle: Any, *, mark: bool) -> Seen:
    """One look at the group through the backend's sync client (the worker; the training view)."""
    try:
        nodes = backend.observe(handle)
    except Exception as exc:
        return Seen(error=exc)
    notes: list[Note] = []
    progress = _quietly(lambda: backend.progress_mark(handle), handle, "tell its progress", notes) if mark else None
    lines = _quietly(lambda: backend.read_progress_lines(handle), handle, "read its progress", notes)
    return Seen(nodes=nodes, mark=progress, records=parse_records(lines or []), notes=tuple(notes))


async def look_async(backend: Backend[Any], handle: Any, *, mark: bool) -> Seen:
    """:func:`look` through the backend's async client (the triggerer: no thread, no sync client)."""
    try:
        nodes = await backend.observe_async(handle)
    except Exception as exc:
        return Seen(error=exc)
    notes: list[Note] = []
    progress = (
        await _quietly_async(backend.progress_mark_async(handle), handle, "tell its progress", notes) if mark else None
    )
    lines = await _quietly_async(backend.read_progress_lines_async(handle), handle, "read its progress", notes)
    return Seen(nodes=nodes, mark=progress, records=parse_records(lines or []), notes=tuple(notes))


def watch_sync(
    backend: Backend[Any],
    handle: Any,
    watch: Watch,
    *,
    emit: Callable[[Note], None],
    after_look: Callable[[], None] = lambda: None,
    until: float | None = None,
    clock: Callable[[], float] = time.time,
) -> Verdict | None:
    """Drive :func:`watch_flow` in this process. ``after_look`` runs after every look, before its
    notes: it raises when the task was killed meanwhile (what that look saw is the kill's doing).
    Pauses are the backend's (:meth:`~airflow_torchrun.backends.base.Backend.pause`: cut short when
    the group changes)."""
    flow, reply = watch_flow(watch, clock=clock, until=until), None
    while True:
        try:
            step = flow.send(reply)
        except StopIteration as stop:
            return stop.value
        reply = None
        if isinstance(step, Look):
            reply = look(backend, handle, mark=step.mark)
            after_look()
        elif isinstance(step, Pause):
            backend.pause(handle, step.seconds)
        else:
            emit(step)


async def watch_async(
    backend: Backend[Any],
    handle: Any,
    watch: Watch,
    *,
    emit: Callable[[Note], None],
    clock: Callable[[], float] = time.time,
) -> Verdict:
    """Drive :func:`watch_flow` in the triggerer (no ``until``: it watches to the end)."""
    flow, reply = watch_flow(watch, clock=clock), None
    while True:
        try:
            step = flow.send(reply)
        except StopIteration as stop:
            assert stop.value is not None  # no ``until``: the flow ends only with a verdict
            return stop.value
        reply = None
        if isinstance(step, Look):
            reply = await look_async(backend, handle, mark=step.mark)
        elif isinstance(step, Pause):
            await backend.pause_async(handle, step.seconds)
        else:
            emit(step)


def _quietly(call: Callable[[], T], handle: Any, what: str, notes: list[Note]) -> T | None:
    try:
        return call()
    except Exception as exc:  # never a reason to give up on the group
        notes.append(Note(logging.WARNING, f"Group {handle.group_id}: could not {what}: {exc}"))
        return None


async def _quietly_async(call: Awaitable[T], handle: Any, what: str, notes: list[Note]) -> T | None:
    try:
        return await call
    except Exception as exc:  # never a reason to give up on the group
        notes.append(Note(logging.WARNING, f"Group {handle.group_id}: could not {what}: {exc}"))
        return None
