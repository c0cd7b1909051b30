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
data, when a ``StepTimer`` timing is given), ``loss`` and the wall ``time``; for the goodput ledger
and the resume audit also the window's start (``since``), its seconds of data wait (``data_s``) and
of checkpoint saves (``save_s``), and every step's loss bit-exactly (``losses``). ``ProgressLogger``
marks the training loop's start (an ``event: "start"`` record), and a window not yet printed is
printed when the process exits (so the furthest step a failed rank reached is known). The rank's log is the
one channel: the local backend's node logs and Kubernetes pod logs carry it alike, no server
needed. :func:`parse_records` reads them back from any text, robust to other output interleaved
on the same line and to lines cut short.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import time
from collections.abc import Callable

from airflow_torchrun.contract.progress import (
    DEFAULT_INTERVAL,
    EVENT_RENDEZVOUS,
    EVENT_START,
    INTERVAL_ENV,
    ProgressRecord,
    float_to_hex,
    records_enabled,
    thin_losses,
)


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
        self._since: float | None = None
        self.last_save_s: float | None = None  # the last save's blocking seconds (should_checkpoint reads it)
        self.save_total_s = 0.0  # every save's, since the process started
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
        self._save_s = 0.0
        self._losses: list[tuple[int, str]] = []

    def started(self, step: int) -> ProgressRecord | None:
        """The training loop starts after ``step`` (the step resumed from; 0 on a fresh start):
        prints an ``event: "start"`` record, and the first step is timed from now."""
        if not self.enabled:
            return None
        now = self._clock()
        self._last_step, self._last_step_at = step, now
        self._since = now
        record = ProgressRecord(rank=self.rank, step=step, time=round(now, 3), event=EVENT_START)
        self._emit(record.to_line())
        return record

    def saved(self, seconds: float) -> None:
        """A ``save_checkpoint`` blocked this rank for ``seconds``."""
        if seconds >= 0 and math.isfinite(seconds):
            self._save_s += seconds
            self.last_save_s = seconds
            self.save_total_s += seconds

    def flush(self) -> ProgressRecord | None:
        """Print the window not printed yet (steps since the last record), if any; at exit too."""
        if not self.enabled or self._last_step is None or self._last_step == self._emitted_step:
            return None
        if self._steps == 0 and self._timed_steps == 0 and not self._losses:
            return None
        return self._flush(self._last_step, self._clock())

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
            pair = (int(step), float_to_hex(loss))
            if self._losses and self._losses[-1][0] == step:
                self._losses[-1] = pair
            else:
                self._losses.append(pair)
        if self._since is None:
            self._since = now
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
            since=round(self._since, 3) if self._since is not None else None,
            data_s=round(self._timed_data, 6) if self._timed_steps else None,
            save_s=round(self._save_s, 6) if self._save_s else None,
            losses=thin_losses(self._losses),
        )
        self._emit(record.to_line())
        self._emitted_at, self._emitted_step = now, step
        self._since = now
        self._reset_window()
        return record


_RECORDER: ProgressRecorder | None = None


def recorder() -> ProgressRecorder:
    """The process's recorder (created on first use, from ``RANK`` and the interval variable)."""
    global _RECORDER
    if _RECORDER is None:
        _RECORDER = ProgressRecorder()
        atexit.register(_RECORDER.flush)
    return _RECORDER


def mark_rendezvous(rank: int) -> None:
    """The moment this rank's process group is ready, as an ``event: "rendezvous"`` record (the
    launchers call it when ``init_process_group`` returns; nothing when records are off)."""
    if records_enabled(os.environ.get(INTERVAL_ENV)):
        record = ProgressRecord(rank=rank, step=0, time=round(time.time(), 3), event=EVENT_RENDEZVOUS)
        print(record.to_line(), flush=True)


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
        self.records.started(start_step)

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
