"""The goodput ledger: where a try's (and a task's) wall time went, and its ETTR. Pure.

Built from two accounts: the engine's own :class:`~airflow_torchrun.timeline.Timeline` of the try
(launches, first output, the verdict, teardown, relaunches, the finish) and, per launch, a
:class:`LaunchAccount` made from the ranks' progress records (read once the launch ended, bound to
their rank by torchrun's line prefix: :func:`~airflow_torchrun.contract.progress.parse_bound_records`).
Every second of the try, from the task instance's start to its end, lands in exactly one category,
so the categories sum to the wall time:

=================== ==========================================================================
``admission``       launched until every node runs (a Kubernetes group's pods pending: Kueue, the scheduler)
``launching``       the task's start (and each relaunch's) to the first output of a rank: preflight
                    (storage, resume point, MLflow), spawning the agents, the interpreter and imports
``rendezvous``      first output to the process group ready (the launcher's ``rendezvous`` record)
``setup``           to the training loop's start: data, model, the checkpoint loaded (``ProgressLogger``'s
                    ``start`` record, or the first window of steps); all of a failed launch that died
                    before its loop started, when the script uses the helpers (another launch printed
                    windows or a ``start`` record)
``productive``      steps past the furthest step reached before, less the two below
``data_wait``       time the steps waited for data (``StepTimer``'s data phase)
``checkpoint_stall`` time ranks blocked in ``save_checkpoint``
``lost_work``       steps recomputed after a failure (from the resumed step to the furthest step
                    reached before), and the time a failed launch ran past its last record
``restart_gap``     a failed group's teardown, the relaunch (within the try) or the retry (between tries);
                    for a relaunch started during the teardown, until its gate opened (its ranks' spawning
                    and imports overlapped the teardown; the ledger counts that time once, here)
``tail``            after the last step: the final save, uploads, the script's evaluation, the exit, the
                    operator's finish (final checkpoint, MLflow, the asset event)
``training``        only for a launch whose ranks printed no window of steps (a script that uses no
                    helper): its time from first output (or rendezvous) to its end, not told apart further
=================== ==========================================================================

ETTR (effective training time ratio) = ``productive / wall``; ``None`` when some launch is coarse
(``training`` holds productive time the ledger cannot tell apart). The reference rank for the steps
is the lowest rank that printed windows of steps (in synchronous training every rank steps together).

**The shape published** (XCom ``goodput``, also read by the Training tab to draw one stacked bar per
try; the checkpoint asset event's extra holds ``task``)::

    {"version": 1,
     "categories": ["admission", "launching", ...],         # the drawing order, every category
     "try": {"try": 2, "start": <epoch>, "end": <epoch>, "wall_s": 48.2, "outcome": "succeeded",
             "categories": {"launching": 6.2, "productive": 34.4, ...},   # category -> seconds
             "ettr": 0.713, "coarse": false, "lost_steps": 9, "launches": 1},
     "tries": [<try 1>, <try 2>],                            # every try known, in order (this one last)
     "task": {"wall_s": 95.1, "categories": {...}, "ettr": 0.52, "lost_steps": 9, "tries": 2},
     "resume_audit": {"status": "exact", ...} | null}        # :mod:`airflow_torchrun.audit`

A category with no time is still listed (0.0). Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from airflow_torchrun.contract.progress import EVENT_RENDEZVOUS, EVENT_START, ProgressRecord
from airflow_torchrun.timeline import Mark, Timeline

XCOM_GOODPUT = "goodput"
VERSION = 1

ADMISSION = "admission"
LAUNCHING = "launching"
RENDEZVOUS = "rendezvous"
SETUP = "setup"
PRODUCTIVE = "productive"
DATA_WAIT = "data_wait"
CHECKPOINT_STALL = "checkpoint_stall"
LOST_WORK = "lost_work"
RESTART_GAP = "restart_gap"
TAIL = "tail"
TRAINING = "training"
CATEGORIES = (
    ADMISSION,
    LAUNCHING,
    RENDEZVOUS,
    SETUP,
    PRODUCTIVE,
    DATA_WAIT,
    CHECKPOINT_STALL,
    LOST_WORK,
    RESTART_GAP,
    TAIL,
    TRAINING,
)
STEPPING = (PRODUCTIVE, DATA_WAIT, CHECKPOINT_STALL, LOST_WORK)

# Losses kept per rank and launch (the latest steps): what a later launch's resume audit compares.
KEPT_LOSSES = 1024


def _empty() -> dict[str, float]:
    return dict.fromkeys(CATEGORIES, 0.0)


# -- one launch, from its ranks' records ------------------------------------------------------------
@dataclass
class LaunchAccount:
    """What one launch's ranks reported, reduced to what the ledger and the audit need (JSON-able)."""

    launch: int
    rendezvous_at: float | None = None  # the last rank's rendezvous: the group is ready
    stepping_from: float | None = None  # the training loop's start (or its first window's)
    start_step: int | None = None  # the step the loop started after (the resume point; 0: fresh)
    last_at: float | None = None  # the reference rank's last window
    max_step: int | None = None  # the furthest step any rank reported
    stepping: dict[str, float] = field(default_factory=dict)  # STEPPING category -> seconds
    lost_steps: int = 0
    losses: dict[int, dict[int, str]] = field(default_factory=dict)  # rank -> step -> hex

    @property
    def fine(self) -> bool:
        """Whether the ranks printed windows of steps (else the launch's ledger is coarse)."""
        return self.last_at is not None and self.stepping_from is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "launch": self.launch,
            "rendezvous_at": self.rendezvous_at,
            "stepping_from": self.stepping_from,
            "start_step": self.start_step,
            "last_at": self.last_at,
            "max_step": self.max_step,
            "stepping": dict(self.stepping),
            "lost_steps": self.lost_steps,
            "losses": {str(r): {str(s): h for s, h in steps.items()} for r, steps in self.losses.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LaunchAccount:
        def number(name: str) -> float | None:
            value = data.get(name)
            return float(value) if isinstance(value, int | float) else None

        def whole(name: str) -> int | None:
            value = data.get(name)
            return int(value) if isinstance(value, int) else None

        losses: dict[int, dict[int, str]] = {}
        raw = data.get("losses")
        if isinstance(raw, Mapping):
            for rank, steps in raw.items():
                if isinstance(steps, Mapping) and str(rank).isdigit():
                    losses[int(rank)] = {
                        int(s): str(h) for s, h in steps.items() if str(s).isdigit() and isinstance(h, str)
                    }
        stepping = data.get("stepping")
        return cls(
            launch=int(data.get("launch", 0)),
            rendezvous_at=number("rendezvous_at"),
            stepping_from=number("stepping_from"),
            start_step=whole("start_step"),
            last_at=number("last_at"),
            max_step=whole("max_step"),
            stepping={
                str(k): float(v)
                for k, v in (stepping.items() if isinstance(stepping, Mapping) else ())
                if k in STEPPING and isinstance(v, int | float)
            },
            lost_steps=int(data.get("lost_steps") or 0),
            losses=losses,
        )


def account_launch(launch: int, records: Iterable[ProgressRecord], reached_before: int | None) -> LaunchAccount:
    """One launch's account from its ranks' (bound) records; ``reached_before``: the furthest step
    any earlier launch of the task reported (None: none did), which splits lost work from new."""
    by_rank: dict[int, list[ProgressRecord]] = {}
    for record in records:
        by_rank.setdefault(record.rank, []).append(record)
    account = LaunchAccount(launch)
    rendezvous = [r.time for rs in by_rank.values() for r in rs if r.event == EVENT_RENDEZVOUS]
    account.rendezvous_at = max(rendezvous) if rendezvous else None
    steps = [r.step for rs in by_rank.values() for r in rs if r.window]
    account.max_step = max(steps) if steps else None
    for rank, rs in by_rank.items():
        kept: dict[int, str] = {}
        for record in sorted(rs, key=lambda r: r.time):
            kept.update(record.losses)
        if kept:
            latest = sorted(kept)[-KEPT_LOSSES:]
            account.losses[rank] = {s: kept[s] for s in latest}
    windows_of = {rank: [r for r in rs if r.window] for rank, rs in by_rank.items()}
    reference = min((rank for rank, ws in windows_of.items() if ws), default=None)
    if reference is None:  # no window of steps: at most the loop's start (a launch killed before its first window)
        starts = sorted((r for rs in by_rank.values() for r in rs if r.event == EVENT_START), key=lambda r: r.rank)
        if starts:
            account.stepping_from, account.start_step = starts[0].time, starts[0].step
        return account
    own = sorted(by_rank[reference], key=lambda r: r.time)
    starts = [r for r in own if r.event == EVENT_START]
    windows = sorted(windows_of[reference], key=lambda r: r.time)
    start = starts[0] if starts else None
    first = windows[0]
    if start is not None:
        account.stepping_from, account.start_step = start.time, start.step
    else:
        account.stepping_from = first.since if first.since is not None else first.time
        account.start_step = min(s for s, _ in first.losses) - 1 if first.losses else None
    account.last_at = windows[-1].time
    account.stepping = _split_windows(windows, account.stepping_from, account.start_step, reached_before)
    if reached_before is not None and account.start_step is not None and account.max_step is not None:
        account.lost_steps = max(0, min(reached_before, account.max_step) - account.start_step)
    return account


def _split_windows(
    windows: Sequence[ProgressRecord], since: float, start_step: int | None, reached_before: int | None
) -> dict[str, float]:
    """The stepping time of one rank's windows: productive, data wait, checkpoint stall, lost work."""
    out = dict.fromkeys(STEPPING, 0.0)
    prev_at, prev_step = since, start_step
    for w in windows:  # one rank's windows are back to back: each began where the previous one ended
        duration = max(0.0, w.time - prev_at)
        data, save = max(0.0, w.data_s or 0.0), max(0.0, w.save_s or 0.0)
        if data + save > duration > 0:  # a rank's own timings a little past its wall clock
            data, save = data * duration / (data + save), save * duration / (data + save)
        elif duration == 0:
            data = save = 0.0
        work = duration - data - save
        lost = 0.0
        if reached_before is not None:
            low = prev_step if prev_step is not None else w.step - 1
            if w.step <= reached_before:
                lost = 1.0
            elif low < reached_before and w.step > low:
                lost = (reached_before - low) / (w.step - low)
        out[DATA_WAIT] += data
        out[CHECKPOINT_STALL] += save
        out[LOST_WORK] += lost * work
        out[PRODUCTIVE] += (1.0 - lost) * work
        prev_at, prev_step = w.time, w.step
    return out


# -- one try -----------------------------------------------------------------------------------------
@dataclass
class TryLedger:
    try_number: int
    start: float
    end: float
    categories: dict[str, float]
    outcome: str  # succeeded | failed | running
    coarse: bool = False
    lost_steps: int = 0
    launches: int = 0

    @property
    def wall(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def ettr(self) -> float | None:
        if self.coarse or self.wall <= 0:
            return None
        return self.categories.get(PRODUCTIVE, 0.0) / self.wall

    def to_dict(self) -> dict[str, Any]:
        ettr = self.ettr
        return {
            "try": self.try_number,
            "start": round(self.start, 3),
            "end": round(self.end, 3),
            "wall_s": round(self.wall, 3),
            "outcome": self.outcome,
            "categories": {k: round(self.categories.get(k, 0.0), 3) for k in CATEGORIES},
            "ettr": round(ettr, 4) if ettr is not None else None,
            "coarse": self.coarse,
            "lost_steps": self.lost_steps,
            "launches": self.launches,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TryLedger | None:
        """A ledger read back (an earlier try's); None when it is not one."""
        try:
            raw = data["categories"]
            categories = _empty()
            for key in CATEGORIES:
                value = raw.get(key, 0.0) if isinstance(raw, Mapping) else 0.0
                categories[key] = float(value) if isinstance(value, int | float) else 0.0
            return cls(
                try_number=int(data["try"]),
                start=float(data["start"]),
                end=float(data["end"]),
                categories=categories,
                outcome=str(data.get("outcome") or ""),
                coarse=bool(data.get("coarse", False)),
                lost_steps=int(data.get("lost_steps") or 0),
                launches=int(data.get("launches") or 0),
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


class _Cursor:
    """Walks a try's time forward, putting every span into one category (a mark earlier than the
    cursor, a rank's clock a little off, adds nothing: spans never overlap or run backwards)."""

    def __init__(self, start: float, categories: dict[str, float]) -> None:
        self.at, self.categories = start, categories

    def to(self, category: str, when: float | None, limit: float) -> None:
        if when is None:
            return
        when = min(max(when, self.at), limit)
        self.categories[category] += when - self.at
        self.at = when


def _earliest(*times: float | None) -> float | None:
    known = [t for t in times if t is not None]
    return min(known) if known else None


def try_ledger(
    timeline: Timeline,
    accounts: Mapping[int, LaunchAccount],
    *,
    try_number: int,
    now: float,
    started_at: float | None = None,
) -> TryLedger:
    """The try's ledger: ``timeline`` (its marks), ``accounts`` (launch -> its ranks' account),
    ``started_at`` (the task instance's start, before the operator's first mark), ``now`` (the end
    when the timeline has no ``try_ended`` yet)."""
    first = timeline.first(Mark.TRY_STARTED)
    begin = min(x for x in (started_at, first.at if first else None, now) if x is not None)
    ended = timeline.last(Mark.TRY_ENDED)
    end = max(begin, ended.at if ended is not None else now)
    categories = _empty()
    cursor = _Cursor(begin, categories)
    launches = timeline.launches()
    coarse, lost_steps, outcome = False, 0, "running"
    # The script uses the helpers when some launch of the try printed a window or the loop's start: a
    # launch that printed neither then died before its loop, not in steps the ledger cannot see.
    helped = any(a.fine or a.stepping_from is not None for a in accounts.values())
    for index, launch in enumerate(launches):
        stop = timeline.first(Mark.ENDED, launch)
        limit = stop.at if stop is not None else end
        if index > 0:
            # A relaunch started during the teardown before it ran nothing of the script's until its
            # gate opened: the gap lasts until then (its spawning and imports hidden in the teardown).
            opened = (
                timeline.first(Mark.GATE_OPENED, launch)
                or timeline.first(Mark.CONTRACT_STARTED, launch)
                or timeline.first(Mark.LAUNCH_STARTED, launch)
            )
            cursor.to(RESTART_GAP, opened.at if opened else None, limit)
        launched = timeline.first(Mark.LAUNCHED, launch) or timeline.first(Mark.ATTACHED, launch)
        cursor.to(LAUNCHING, launched.at if launched else None, limit)
        account = accounts.get(launch)
        # What the watch saw first can come late (a triggerer that restarted looks for the first time
        # long after): the ranks' own records say when they ran at the latest.
        ranks_ran = _earliest(
            *(m.at if (m := timeline.first(k, launch)) else None for k in (Mark.RANKS_STARTED, Mark.RENDEZVOUS)),
            *((account.rendezvous_at, account.stepping_from) if account is not None else ()),
        )
        running = timeline.first(Mark.RUNNING, launch)
        cursor.to(ADMISSION, _earliest(running.at, ranks_ran) if running else None, limit)
        output = timeline.first(Mark.FIRST_OUTPUT, launch)
        cursor.to(LAUNCHING, _earliest(output.at, ranks_ran) if output else None, limit)
        succeeded = stop is not None and stop.detail.get("outcome") == "succeeded"
        if account is not None and account.fine:
            cursor.to(RENDEZVOUS, account.rendezvous_at, limit)
            cursor.to(SETUP, account.stepping_from, limit)
            begin_steps = cursor.at
            cursor.to(PRODUCTIVE, account.last_at, limit)  # provisional: split below
            span = cursor.at - begin_steps
            categories[PRODUCTIVE] -= span
            total = sum(account.stepping.get(k, 0.0) for k in STEPPING)
            for key in STEPPING:
                share = account.stepping.get(key, 0.0) / total if total > 0 else (1.0 if key == PRODUCTIVE else 0.0)
                categories[key] += span * share
            cursor.to(TAIL if succeeded else LOST_WORK, limit, limit)
            lost_steps += account.lost_steps
        elif stop is not None and helped:
            # A launch with no window of steps. Failed (killed in its setup, or before its first window):
            # setup until its loop started, and whatever its loop computed was never reported: lost.
            # Succeeded: it had no step left to do (resumed from the last step's checkpoint; a step
            # done would have been printed before the exit), so after its loop's start, the tail.
            cursor.to(RENDEZVOUS, account.rendezvous_at if account is not None else None, limit)
            loop = account.stepping_from if account is not None else None
            cursor.to(SETUP, limit if loop is None else loop, limit)
            cursor.to(TAIL if succeeded else LOST_WORK, limit, limit)
        else:
            coarse = True
            cursor.to(RENDEZVOUS, account.rendezvous_at if account is not None else None, limit)
            cursor.to(TRAINING, limit, limit)
        if stop is not None:
            outcome = "succeeded" if succeeded else "failed"
    cursor.to(TAIL if outcome == "succeeded" else RESTART_GAP if launches else LAUNCHING, end, end)
    return TryLedger(
        try_number=try_number,
        start=begin,
        end=end,
        categories=categories,
        outcome=outcome if ended is None else str(ended.detail.get("outcome") or outcome),
        coarse=coarse,
        lost_steps=lost_steps,
        launches=len(launches),
    )


# -- the task (every try) ----------------------------------------------------------------------------
@dataclass
class TaskLedger:
    tries: list[TryLedger]
    categories: dict[str, float]
    start: float
    end: float

    @property
    def wall(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def ettr(self) -> float | None:
        if any(t.coarse for t in self.tries) or self.wall <= 0:
            return None
        return self.categories.get(PRODUCTIVE, 0.0) / self.wall

    def to_dict(self) -> dict[str, Any]:
        ettr = self.ettr
        return {
            "wall_s": round(self.wall, 3),
            "categories": {k: round(self.categories.get(k, 0.0), 3) for k in CATEGORIES},
            "ettr": round(ettr, 4) if ettr is not None else None,
            "lost_steps": sum(t.lost_steps for t in self.tries),
            "tries": len(self.tries),
        }


def task_ledger(tries: Iterable[TryLedger]) -> TaskLedger:
    """Every try's ledger added up; the time between two tries (Airflow's retry delay, scheduling)
    is a restart gap. Tries are taken in their order; one try twice (a try number read back from
    the store and the running one) counts once, the later copy."""
    latest: dict[int, TryLedger] = {}
    for ledger in tries:
        latest[ledger.try_number] = ledger
    ordered = [latest[n] for n in sorted(latest)]
    categories = _empty()
    previous: TryLedger | None = None
    for ledger in ordered:
        for key, value in ledger.categories.items():
            categories[key] = categories.get(key, 0.0) + value
        if previous is not None:
            categories[RESTART_GAP] += max(0.0, ledger.start - previous.end)
        previous = ledger
    start = ordered[0].start if ordered else 0.0
    end = max((t.end for t in ordered), default=start)
    return TaskLedger(ordered, categories, start, end)


def publishable(this: TryLedger, task: TaskLedger, audit: Mapping[str, Any] | None) -> dict[str, Any]:
    """The XCom ``goodput`` value (see the module's docstring)."""
    return {
        "version": VERSION,
        "categories": list(CATEGORIES),
        "try": this.to_dict(),
        "tries": [t.to_dict() for t in task.tries],
        "task": task.to_dict(),
        "resume_audit": dict(audit) if audit else None,
    }


def _seconds(value: float) -> str:
    return f"{value:.1f}s" if value < 600 else f"{value / 60:.1f}min"


def summary_line(this: TryLedger, task: TaskLedger) -> str:
    """The task log's summary: ETTR and where the try's time went (largest first), and the task's."""

    def ratio(value: float | None) -> str:
        return f"{100 * value:.1f}%" if value is not None else "n/a (no step records)"

    parts = [
        f"{key.replace('_', ' ')} {_seconds(value)}" + (f" ({this.lost_steps} steps)" if key == LOST_WORK else "")
        for key, value in sorted(this.categories.items(), key=lambda kv: -kv[1])
        if value >= 0.05 or (key == LOST_WORK and this.lost_steps)
    ]
    line = f"Goodput of try {this.try_number}: ETTR {ratio(this.ettr)} of {_seconds(this.wall)}: {', '.join(parts)}"
    if len(task.tries) > 1:
        line += (
            f"; the task ({len(task.tries)} tries): ETTR {ratio(task.ettr)} of {_seconds(task.wall)}, "
            f"lost work {_seconds(task.categories[LOST_WORK])}, restart gaps {_seconds(task.categories[RESTART_GAP])}"
        )
    return line


def mlflow_metrics(this: TryLedger, task: TaskLedger) -> dict[str, float]:
    """The ledger as MLflow metrics: ``goodput_<category>_s`` and ``goodput_ettr`` of the task
    (every try so far), ``goodput_try_ettr`` and ``goodput_try_wall_s`` of this try."""
    out = {f"goodput_{key}_s": round(value, 3) for key, value in task.categories.items()}
    out["goodput_wall_s"] = round(task.wall, 3)
    out["goodput_lost_steps"] = float(sum(t.lost_steps for t in task.tries))
    if task.ettr is not None:
        out["goodput_ettr"] = round(task.ettr, 4)
    if this.ettr is not None:
        out["goodput_try_ettr"] = round(this.ettr, 4)
    out["goodput_try_wall_s"] = round(this.wall, 3)
    return out
