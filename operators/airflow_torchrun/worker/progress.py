"""Progress lines for rank 0: step/total, metrics, throughput and ETA. No torch, no Airflow.

::

    progress = ProgressLogger(total_steps=460, start_step=resume_step(), samples_per_step=64)
    for step in ...:
        ...
        progress.update(step, loss=loss.item())

logs every ``every`` steps on rank 0 only, e.g.
``step 120/460 (26%) loss=0.3412 | 5120 samples/s | elapsed 0:00:03 | ETA 0:00:08``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable


def _clock(seconds: float) -> str:
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class ProgressLogger:
    """Throughput and ETA of the steps run by *this* process (a resumed run counts from its start).

    :param total_steps: the step training ends at.
    :param start_step: the step this run resumed from (0 on a fresh start).
    :param every: log one line every this many steps (and at the last step).
    :param samples_per_step: global batch size; adds samples/s to each line.
    :param logger: where lines go; by default printed (flushed) so they show without logging setup.
    :param rank: only rank 0 logs; default ``RANK`` from the environment.
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
        self._clock = clock
        self._started = clock()
        self._last_time = self._started
        self._last_step = start_step

    def update(self, step: int, **metrics: float) -> str | None:
        """Record that ``step`` is done; return the line when one is logged (rank 0 only)."""
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
