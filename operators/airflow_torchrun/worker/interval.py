"""An automatic checkpoint interval: Young/Daly, from the measured save cost and the MTBF.

Checkpointing every ``tau`` seconds with a save that blocks for ``C`` seconds and failures every
``M`` seconds on average loses about ``C / tau`` of the time to saving and ``tau / 2M`` to
recomputing after failures; ``tau = sqrt(2 C M)`` (Young 1974; Daly 2006 to first order)
minimises the sum. ::

    from airflow_torchrun.worker import save_checkpoint, should_checkpoint

    for step in range(start + 1, total + 1):
        ...
        if should_checkpoint(step):
            save_checkpoint(state(), step)

Call it on every rank at every step (it agrees across ranks without a collective per step):

- ``C``: the last save's blocking time on this rank (``save_checkpoint`` records it), the largest
  over the ranks; until a first save is measured, the first save comes ``warmup_steps`` steps
  (default 10) into the launch;
- ``M``: ``TRAIN_CHECKPOINT_MTBF`` (the operator's ``mtbf``) when set; else this lineage's failures
  seen so far (``TRAIN_FAILURES_OBSERVED``: failed launches over the time of the launches before
  this one, plus this launch's time): ``time / failures``, or, before any failure, the time so far
  (a lower bound, so the interval grows while nothing fails);
- the step time: this rank's wall time per step without its saves, the largest over the ranks.

After each save (the next call, on every rank at the same step), the ranks agree on ``C`` and the
step time with one all-reduce, so every rank picks the same next step. Rank 0 logs the interval
and why whenever it changes: ``Checkpoint interval: every 37 steps (4.2s): Young/Daly
sqrt(2 x 0.12s save x 74s MTBF (1 failure in 74s of this task's training))``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from airflow_torchrun import contract
from airflow_torchrun.worker.progress import ProgressRecorder, recorder

log = logging.getLogger(__name__)

DEFAULT_WARMUP_STEPS = 10


@dataclass(frozen=True)
class Mtbf:
    seconds: float
    why: str


def mtbf_from_env(elapsed: float) -> Mtbf:
    """The MTBF this launch plans with (see the module's docstring); ``elapsed``: this launch's seconds so far."""
    raw = os.environ.get(contract.CHECKPOINT_MTBF, "").strip()
    if raw:
        try:
            value = float(raw)
            if value > 0 and math.isfinite(value):
                return Mtbf(value, "the task's mtbf")
        except ValueError:
            log.warning("%s=%r is not a number of seconds; using the observed failures", contract.CHECKPOINT_MTBF, raw)
    failures, seconds = 0, 0.0
    observed = os.environ.get(contract.FAILURES_OBSERVED, "").strip()
    if observed:
        try:
            data = json.loads(observed)
            failures, seconds = int(data.get("failures") or 0), float(data.get("seconds") or 0.0)
        except (ValueError, TypeError, AttributeError):
            failures, seconds = 0, 0.0
    total = max(1.0, seconds + max(0.0, elapsed))
    if failures <= 0:
        return Mtbf(total, f"no failure yet in {total:.0f}s of this task's training: that time as a lower bound")
    return Mtbf(total / failures, f"{failures} failure(s) in {total:.0f}s of this task's training")


def young_daly(save_seconds: float, mtbf_seconds: float) -> float:
    """The interval in seconds: ``sqrt(2 x save cost x MTBF)``."""
    return math.sqrt(2.0 * max(0.0, save_seconds) * max(0.0, mtbf_seconds))


class CheckpointInterval:
    """The decision behind :func:`should_checkpoint` (one per process; see the module's docstring)."""

    def __init__(
        self,
        *,
        warmup_steps: int = DEFAULT_WARMUP_STEPS,
        min_steps: int = 1,
        max_steps: int | None = None,
        records: ProgressRecorder | None = None,
        clock: Callable[[], float] = time.monotonic,
        agree: Callable[[list[float]], list[float]] | None = None,
        rank: int | None = None,
    ) -> None:
        if warmup_steps < 1 or min_steps < 1 or (max_steps is not None and max_steps < min_steps):
            raise ValueError("should_checkpoint needs warmup_steps >= 1 and 1 <= min_steps <= max_steps")
        self.warmup_steps, self.min_steps, self.max_steps = warmup_steps, min_steps, max_steps
        self.records = records if records is not None else recorder()
        self._clock = clock
        self._agree = agree or _all_reduce_max
        self.rank = int(os.environ.get("RANK", "0") or 0) if rank is None else rank
        self._started: float | None = None
        self._first_step: int | None = None
        self._last_step: int | None = None
        self._saved_step: int | None = None  # the step the last "yes" was for
        self._saves_before = 0.0  # the recorder's save seconds when this launch's first step began
        self.next_step: int | None = None
        self.interval_steps: int | None = None
        self.reason: str = ""

    def __call__(self, step: int) -> bool:
        now = self._clock()
        if self._started is None:
            self._started, self._first_step = now, step - 1
            self._saves_before = self.records.save_total_s
            self.next_step = step - 1 + self.warmup_steps
        if self._saved_step is not None and step > self._saved_step:
            self._replan(step, now)
        self._last_step = step
        assert self.next_step is not None
        if step >= self.next_step:
            self._saved_step = step
            self.next_step = step + (self.interval_steps or self.warmup_steps)  # until replanned
            return True
        return False

    def _replan(self, step: int, now: float) -> None:
        """The call after a save: measure, agree with the other ranks, pick the next save step."""
        saved_at = self._saved_step
        assert saved_at is not None and self._started is not None and self._first_step is not None
        self._saved_step = None
        cost = self.records.last_save_s if self.records.last_save_s is not None else 0.0
        saving = self.records.save_total_s - self._saves_before
        steps = max(1, step - 1 - self._first_step)
        step_seconds = max(1e-9, (now - self._started - saving) / steps)
        cost, step_seconds = self._agree([cost, step_seconds])
        mtbf = mtbf_from_env(now - self._started)
        tau = young_daly(cost, mtbf.seconds)
        interval = max(self.min_steps, round(tau / step_seconds)) if step_seconds > 0 else self.min_steps
        if self.max_steps is not None:
            interval = min(interval, self.max_steps)
        self.next_step = saved_at + interval
        changed = self.interval_steps is None or abs(interval - self.interval_steps) > 0.1 * self.interval_steps
        self.interval_steps = interval
        self.reason = (
            f"every {interval} step(s) ({interval * step_seconds:.3g}s at {step_seconds:.3g}s/step): Young/Daly "
            f"sqrt(2 x {cost:.3g}s save x {mtbf.seconds:.0f}s MTBF ({mtbf.why})) = {tau:.3g}s"
        )
        if changed and self.rank == 0:
            log.info("Checkpoint interval: %s", self.reason)


def _all_reduce_max(values: list[float]) -> list[float]:
    """The largest of each value over the ranks (the values unchanged outside a process group)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(v) for v in tensor.tolist()]


_INTERVAL: CheckpointInterval | None = None


def should_checkpoint(step: int, **options: int) -> bool:
    """Whether to save a checkpoint at ``step`` (every rank gets the same answer); see the module's
    docstring. ``options`` (``warmup_steps``, ``min_steps``, ``max_steps``) take effect on the
    first call."""
    global _INTERVAL
    if _INTERVAL is None:
        _INTERVAL = CheckpointInterval(**options)  # type: ignore[arg-type]
    return _INTERVAL(step)
