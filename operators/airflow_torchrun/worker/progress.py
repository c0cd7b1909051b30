"""Progress from the ranks: a line for people (rank 0) and a record for machines (every rank).

No torch, no Airflow. ::

    progress = ProgressLogger(total_steps=460, start_step=resume_step(), samples_per_step=64)
    for step in ...:
        ...
        progress.update(step, loss=loss.item())

logs every ``every`` steps on rank 0 only, e.g.
``step 120/460 (26%) loss=0.3412 | 5120 samples/s | elapsed 0:00:03 | ETA 0:00:08``.

**Progress records.** Every rank that uses a helper (``ProgressLogger.update``,
``RunLogger.log_step``) also prints, at most every ``AIRFLOW_TORCHRUN_PROGRESS_INTERVAL`` seconds
(default 2; ``0`` turns records off) and at the last step, one line to its stdout::

    @torchrun-progress {"rank": 1, "step": 120, "total_steps": 460, "samples_per_s": 5120.0, ...}

with the window's mean ``step_time`` (s; ``own_time`` without the time spent in
``StepTimer.peers()`` waiting for the other ranks), ``data_wait`` (fraction of the step spent waiting for
data, when a ``StepTimer`` timing is given), ``loss`` and the wall ``time``. The rank's log is the
one channel: the local backend's node logs and Kubernetes pod logs carry it alike, no server
needed. :func:`parse_records` reads them back from any text, robust to other output interleaved
on the same line and to lines cut short.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass

MARKER = "@torchrun-progress "
INTERVAL_ENV = "AIRFLOW_TORCHRUN_PROGRESS_INTERVAL"
DEFAULT_INTERVAL = 2.0
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ProgressRecord:
    """One rank's progress over the last window of steps."""

    rank: int
    step: int
    time: float  # epoch seconds, when it was written
    total_steps: int | None = None
    samples_per_s: float | None = None  # the group's samples per second as this rank sees it
    step_time: float | None = None  # mean seconds per step over the window (wall time)
    own_time: float | None = None  # the same without waiting for peers (``StepTimer.peers()``)
    data_wait: float | None = None  # fraction of the window's step time spent waiting for data
    loss: float | None = None

    def to_line(self) -> str:
        data = {k: v for k, v in asdict(self).items() if v is not None}
        return MARKER + json.dumps(data, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_dict(cls, data: object) -> ProgressRecord | None:
        """A record from decoded JSON, or ``None`` when it is not one (never raises)."""
        if not isinstance(data, dict):
            return None
        try:
            rank, step, stamp = data["rank"], data["step"], data["time"]
            if not (_is_int(rank) and _is_int(step) and _is_number(stamp)) or rank < 0 or step < 0:
                return None
            numbers = {name: data.get(name) for name in ("samples_per_s", "step_time", "own_time", "data_wait", "loss")}
            fields = {
                name: float(v) if isinstance(v, int | float) and _is_number(v) else None for name, v in numbers.items()
            }
            total = data.get("total_steps")
            return cls(
                rank=int(rank),
                step=int(step),
                time=float(stamp),
                total_steps=total if isinstance(total, int) and _is_int(total) and total > 0 else None,
                **fields,
            )
        except (KeyError, TypeError, ValueError):
            return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def parse_line(line: str) -> list[ProgressRecord]:
    """Every record in one line of text. Other output before, between or after records (two
    ranks' writes interleaved on one line) is ignored, as is a record cut short."""
    out: list[ProgressRecord] = []
    start = line.find(MARKER)
    while start >= 0:
        at = start + len(MARKER)
        try:
            data, _end = _DECODER.raw_decode(line, at)
        except ValueError:
            data = None
        record = ProgressRecord.from_dict(data)
        if record is not None:
            out.append(record)
        start = line.find(MARKER, at)
    return out


def parse_records(lines: Iterable[str]) -> list[ProgressRecord]:
    """Every record in ``lines``, in order."""
    return [record for line in lines for record in parse_line(line)]


class RecordStream:
    """Records from text that arrives in chunks (a log read while it is written): a line is
    parsed only once its newline came, so a record split across two reads is read whole."""

    def __init__(self) -> None:
        self._rest = ""

    def feed(self, chunk: str) -> list[ProgressRecord]:
        data = self._rest + chunk
        *lines, self._rest = data.split("\n")
        return parse_records(lines)


def _interval() -> float:
    raw = os.environ.get(INTERVAL_ENV, "")
    try:
        return max(0.0, float(raw)) if raw else DEFAULT_INTERVAL
    except ValueError:
        return DEFAULT_INTERVAL


class ProgressRecorder:
    """This process's progress records; the helpers feed it, it prints one record per window.

    Several helpers may report the same step (``ProgressLogger.update`` then
    ``RunLogger.log_step``): a step counts once, each report adds what it knows.
    """

    def __init__(
        self,
        *,
        rank: int | None = None,
        interval: float | None = None,
        emit: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.rank = int(os.environ.get("RANK", "0") or 0) if rank is None else rank
        self.interval = _interval() if interval is None else interval
        self._emit = emit or (lambda line: print(line, flush=True))
        self._clock = clock
        self.total_steps: int | None = None
        self.samples_per_step: float | None = None
        self._last_step: int | None = None
        self._last_step_at: float | None = None
        self._emitted_at: float | None = None
        self._emitted_step: int | None = None
        self._reset_window()

    def _reset_window(self) -> None:
        self._steps = 0
        self._clock_time = 0.0
        self._timed_steps = 0
        self._timed_total = 0.0
        self._timed_data = 0.0
        self._timed_peers = 0.0
        self._peer_steps = 0
        self._loss: float | None = None

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def note(
        self,
        step: int,
        *,
        total_steps: int | None = None,
        samples: float | None = None,
        loss: float | None = None,
        step_seconds: float | None = None,
        data_seconds: float | None = None,
        peer_seconds: float | None = None,
    ) -> ProgressRecord | None:
        """Step ``step`` is done (or more is known of it); returns the record when one is printed."""
        if not self.enabled:
            return None
        now = self._clock()
        if total_steps:
            self.total_steps = int(total_steps)
        if samples:
            self.samples_per_step = float(samples)
        if loss is not None and math.isfinite(loss):
            self._loss = float(loss)
        if step != self._last_step:
            if self._last_step_at is not None and self._last_step is not None and step > self._last_step:
                self._steps += step - self._last_step
                self._clock_time += now - self._last_step_at
            self._last_step, self._last_step_at = step, now
        if step_seconds is not None and step_seconds > 0:
            self._timed_steps += 1
            self._timed_total += step_seconds
            self._timed_data += max(0.0, min(data_seconds or 0.0, step_seconds))
            if peer_seconds is not None:
                self._timed_peers += max(0.0, min(peer_seconds, step_seconds))
                self._peer_steps += 1
        final = self.total_steps is not None and step >= self.total_steps and step != self._emitted_step
        due = self._emitted_at is None or now - self._emitted_at >= self.interval
        if not (due or final) or (self._steps == 0 and self._timed_steps == 0 and not final):
            return None
        return self._flush(step, now)

    def _flush(self, step: int, now: float) -> ProgressRecord:
        step_time = None
        if self._timed_steps:
            step_time = self._timed_total / self._timed_steps
        elif self._steps:
            step_time = self._clock_time / self._steps
        record = ProgressRecord(
            rank=self.rank,
            step=step,
            time=round(now, 3),
            total_steps=self.total_steps,
            samples_per_s=round(self.samples_per_step / step_time, 2) if self.samples_per_step and step_time else None,
            step_time=round(step_time, 6) if step_time else None,
            own_time=round((self._timed_total - self._timed_peers) / self._timed_steps, 6)
            if self._timed_steps and self._peer_steps and self._timed_peers > 0
            else None,
            data_wait=round(self._timed_data / self._timed_total, 4) if self._timed_total > 0 else None,
            loss=self._loss,
        )
        self._emit(record.to_line())
        self._emitted_at, self._emitted_step = now, step
        self._reset_window()
        return record


_RECORDER: ProgressRecorder | None = None


def recorder() -> ProgressRecorder:
    """The process's recorder (created on first use, from ``RANK`` and the interval variable)."""
    global _RECORDER
    if _RECORDER is None:
        _RECORDER = ProgressRecorder()
    return _RECORDER


def _clock(seconds: float) -> str:
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class ProgressLogger:
    """Throughput and ETA of the steps run by *this* process (a resumed run counts from its start).

    Rank 0 logs a line every ``every`` steps; every rank feeds the progress records.

    :param total_steps: the step training ends at.
    :param start_step: the step this run resumed from (0 on a fresh start).
    :param every: log one line every this many steps (and at the last step).
    :param samples_per_step: global batch size; adds samples/s to each line and record.
    :param logger: where lines go; by default printed (flushed) so they show without logging setup.
    :param rank: only rank 0 logs; default ``RANK`` from the environment.
    :param records: the recorder records go to; default the process's (``None`` there: none).
    """

    def __init__(
        self,
        total_steps: int,
        *,
        start_step: int = 0,
        every: int = 10,
        samples_per_step: int | None = None,
        logger: logging.Logger | None = None,
        rank: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        records: ProgressRecorder | None = None,
    ) -> None:
        if total_steps < 1 or every < 1 or start_step < 0:
            raise ValueError(
                f"ProgressLogger needs total_steps >= 1, every >= 1, start_step >= 0; "
                f"got {total_steps}, {every}, {start_step}"
            )
        self.total_steps = total_steps
        self.start_step = start_step
        self.every = every
        self.samples_per_step = samples_per_step
        self.logger = logger
        self.rank = int(os.environ.get("RANK", "0") or 0) if rank is None else rank
        self.records = records if records is not None else recorder()
        self._clock = clock
        self._started = clock()
        self._last_time = self._started
        self._last_step = start_step

    def update(self, step: int, **metrics: float) -> str | None:
        """Record that ``step`` is done; return the line when one is logged (rank 0 only)."""
        loss = metrics.get("loss")
        self.records.note(
            step,
            total_steps=self.total_steps,
            samples=self.samples_per_step,
            loss=float(loss) if loss is not None else None,
        )
        if self.rank != 0 or (step % self.every and step != self.total_steps):
            return None
        now = self._clock()
        done = step - self.start_step
        elapsed = now - self._started
        window_steps = step - self._last_step
        window_time = now - self._last_time
        self._last_step, self._last_time = step, now
        parts = [f"step {step}/{self.total_steps} ({100.0 * step / self.total_steps:.0f}%)"]
        if metrics:
            parts[0] += " " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items())
        if self.samples_per_step and window_time > 0:
            parts.append(f"{self.samples_per_step * window_steps / window_time:.0f} samples/s")
        parts.append(f"elapsed {_clock(elapsed)}")
        if done > 0 and elapsed > 0:
            parts.append(f"ETA {_clock((self.total_steps - step) * elapsed / done)}")
        line = " | ".join(parts)
        if self.logger is not None:
            self.logger.info("%s", line)
        else:
            print(line, flush=True)
        return line


def iter_records(text: str) -> Iterator[ProgressRecord]:
    """Records in a whole text (a log file's content)."""
    yield from parse_records(text.splitlines())
