"""What the ranks' progress records say about the group: one summary, starvation, stragglers. Pure.

The watch core (:mod:`airflow_torchrun.watch`) feeds a :class:`ProgressBoard` the records it
reads from the ranks' logs and logs :meth:`ProgressBoard.summary_line`; the training view's API
builds one from the logs too. Nothing here reads a clock or a file.

- **Starvation**: the median rank spends more than ``data_wait_threshold`` (default 30%) of its
  step time waiting for data, in ``sustain`` (default 3) consecutive rounds of records (a round:
  every rank reported once more).
- **Straggler**: one rank's mean step time (without waiting for peers, where the script marks
  that with ``StepTimer.peers()``: in synchronous training every rank's wall step time is the
  slowest one's) is above ``straggler_factor`` (default 1.3) times the
  median of the other ranks, in ``sustain`` consecutive records of that rank (two ranks at least).

A rank's first record is its warm-up (the first collectives connect the group) and is not judged.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from airflow_torchrun.contract.progress import ProgressRecord

DEFAULT_DATA_WAIT_THRESHOLD = 0.30
DEFAULT_STRAGGLER_FACTOR = 1.3
DEFAULT_SUSTAIN = 3

STARVATION = "data_starvation"
STRAGGLER = "straggler"

STARVATION_ADVICE = (
    "more DataLoader workers (num_workers), pin_memory=True, a larger prefetch_factor, "
    "persistent_workers=True, or faster (local, cached) storage for the dataset"
)


@dataclass(frozen=True)
class ProgressThresholds:
    data_wait_threshold: float = DEFAULT_DATA_WAIT_THRESHOLD
    straggler_factor: float = DEFAULT_STRAGGLER_FACTOR
    sustain: int = DEFAULT_SUSTAIN

    @classmethod
    def from_conf(cls) -> ProgressThresholds:
        """``[torchrun] data_wait_threshold`` and ``straggler_factor`` (reads Airflow's config: call it
        at the edge, where the watch is configured)."""
        from airflow_torchrun.compat import conf

        return cls(
            data_wait_threshold=conf.getfloat("torchrun", "data_wait_threshold", fallback=DEFAULT_DATA_WAIT_THRESHOLD),
            straggler_factor=conf.getfloat("torchrun", "straggler_factor", fallback=DEFAULT_STRAGGLER_FACTOR),
        )

    def __post_init__(self) -> None:
        if not 0 < self.data_wait_threshold < 1:
            raise ValueError(f"data_wait_threshold must be between 0 and 1, got {self.data_wait_threshold!r}")
        if self.straggler_factor <= 1:
            raise ValueError(f"straggler_factor must be above 1, got {self.straggler_factor!r}")
        if self.sustain < 1:
            raise ValueError(f"sustain must be at least 1, got {self.sustain!r}")


@dataclass(frozen=True)
class Alert:
    """A warning about the group's training (starvation, a straggler), as logged and served."""

    kind: str
    message: str
    rank: int | None = None
    node_rank: int | None = None
    value: float | None = None  # the data-wait fraction, or the rank's step time / median

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "message": self.message,
            "rank": self.rank,
            "node_rank": self.node_rank,
            "value": self.value,
        }


@dataclass(frozen=True)
class ProgressSummary:
    step: int
    total_steps: int | None
    samples_per_s: float | None
    eta_s: float | None
    data_wait: float | None
    updated_at: float
    slowest_rank: int | None = None
    slowest_ratio: float | None = None  # its step time / the median's

    def to_dict(self) -> dict[str, object]:
        return {
            "step": self.step,
            "total_steps": self.total_steps,
            "samples_per_s": self.samples_per_s,
            "eta_s": self.eta_s,
            "data_wait": self.data_wait,
            "updated_at": self.updated_at,
            "slowest_rank": self.slowest_rank,
            "slowest_ratio": self.slowest_ratio,
        }


def _slowest(times: dict[int, float]) -> tuple[int, float, float, float] | None:
    """``(rank, its time, the other ranks' median, ratio)`` of the slowest rank (two ranks at least).

    Against the *other* ranks: with two ranks the median of all would be their mean, and no rank
    could ever be more than twice it."""
    if len(times) < 2:
        return None
    rank, slowest = max(times.items(), key=lambda item: (item[1], -item[0]))
    median = statistics.median(t for r, t in times.items() if r != rank)
    if median <= 0:
        return None
    return rank, slowest, median, slowest / median


def _duration(seconds: float) -> str:
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m" if minutes >= 10 else f"{minutes}m{secs:02d}s"
    return f"{secs}s"


@dataclass
class ProgressBoard:
    """The latest record of every rank, and which alerts hold."""

    nproc_per_node: int = 1
    thresholds: ProgressThresholds = field(default_factory=ProgressThresholds)
    latest: dict[int, ProgressRecord] = field(default_factory=dict)
    alerts: dict[str, Alert] = field(default_factory=dict)  # active ones, by kind (+ rank)
    _held: dict[str, int] = field(default_factory=dict)  # consecutive rounds (records) a condition held
    _counts: dict[int, int] = field(default_factory=dict)  # records seen per rank
    _round: int = 0

    @property
    def seen(self) -> bool:
        return bool(self.latest)

    def mark(self) -> tuple[tuple[int, int], ...]:
        """Changes whenever a rank reports a new step: the watch's progress evidence."""
        return tuple(sorted((rank, record.step) for rank, record in self.latest.items()))

    def add(self, records: Iterable[ProgressRecord]) -> tuple[list[Alert], list[Alert]]:
        """Take new records; returns ``(alerts raised, alerts cleared)`` by this look. Event records
        (a rank's rendezvous, its loop's start) are moments, not windows of steps: not taken."""
        fresh: set[int] = set()
        for record in records:
            if not record.window:
                continue
            known = self.latest.get(record.rank)
            if known is None or (record.step, record.time) > (known.step, known.time):
                self.latest[record.rank] = record
                self._counts[record.rank] = self._counts.get(record.rank, 0) + 1
                fresh.add(record.rank)
        if not fresh:
            return [], []
        return self._evaluate(fresh)

    def _judged(self) -> dict[int, ProgressRecord]:
        """Ranks past their warm-up record."""
        return {rank: r for rank, r in self.latest.items() if self._counts.get(rank, 0) >= 2}

    # -- decisions ------------------------------------------------------------------------------
    def _evaluate(self, fresh: set[int]) -> tuple[list[Alert], list[Alert]]:
        new_round = min(self._counts.values())
        advanced = {STARVATION} if new_round > self._round else set()
        self._round = new_round
        advanced |= {f"{STRAGGLER}:{rank}" for rank in fresh}
        now_holding: dict[str, Alert] = {}
        starving = self._starvation()
        if starving is not None:
            now_holding[STARVATION] = starving
        straggler = self._straggler()
        if straggler is not None:
            now_holding[f"{STRAGGLER}:{straggler.rank}"] = straggler
        raised: list[Alert] = []
        for key, alert in now_holding.items():
            if key in advanced or key not in self._held:
                self._held[key] = self._held.get(key, 0) + 1
            if key not in self.alerts and self._held[key] >= self.thresholds.sustain:
                raised.append(alert)
            if key in self.alerts or self._held[key] >= self.thresholds.sustain:
                self.alerts[key] = alert
        cleared = [self.alerts.pop(key) for key in list(self.alerts) if key not in now_holding]
        for key in list(self._held):
            if key not in now_holding:
                del self._held[key]
        return raised, cleared

    def _starvation(self) -> Alert | None:
        waits = [r.data_wait for r in self._judged().values() if r.data_wait is not None]
        if not waits:
            return None
        median = statistics.median(waits)
        limit = self.thresholds.data_wait_threshold
        if median <= limit:
            return None
        return Alert(
            STARVATION,
            f"data starvation: the ranks wait for data {median:.0%} of each step (median over "
            f"{len(waits)} rank(s); threshold {limit:.0%}): adding GPUs will not help until the input "
            f"pipeline keeps up. Try {STARVATION_ADVICE}",
            value=round(median, 4),
        )

    def _times(self, *, judged_only: bool = True) -> dict[int, float]:
        """Each rank's step time without waiting for peers where known (in synchronous training
        the wall step time is the same on every rank), else its wall step time."""
        judged = self._judged() if judged_only else self.latest
        own = {rank: r.own_time for rank, r in judged.items() if r.own_time}
        if len(own) >= 2:
            return own
        return {rank: r.step_time for rank, r in judged.items() if r.step_time}

    def _straggler(self) -> Alert | None:
        found = _slowest(self._times())
        if found is None:
            return None
        rank, slowest, median, ratio = found
        factor = self.thresholds.straggler_factor
        if ratio <= factor:
            return None
        node = rank // max(1, self.nproc_per_node)
        return Alert(
            STRAGGLER,
            f"straggler: rank {rank} on node {node} takes {ratio:.1f}x the other ranks' median step time "
            f"({slowest:.3f}s vs {median:.3f}s; factor {factor:g}) and every step of the group waits for it. "
            "Check that node's load and CPU/GPU throttling, and whether its data shard is larger",
            rank=rank,
            node_rank=node,
            value=round(ratio, 3),
        )

    # -- what people read -----------------------------------------------------------------------
    def summary(self) -> ProgressSummary | None:
        if not self.latest:
            return None
        records = list(self.latest.values())
        step = min(r.step for r in records)
        totals = [r.total_steps for r in records if r.total_steps]
        total = max(totals) if totals else None
        rates = [r.samples_per_s for r in records if r.samples_per_s]
        walls = [r.step_time for r in records if r.step_time]
        # Past their warm-up record only: a rank's first window holds its share of connecting the
        # group, which made a rank "263.5x the median" from its first step alone.
        times = self._times()
        waits = [r.data_wait for r in records if r.data_wait is not None]
        eta = None
        if total is not None and walls:
            eta = max(0.0, (total - step) * max(walls))
        slowest_rank = slowest_ratio = None
        found = _slowest(times)
        if found is not None:
            slowest_rank, slowest_ratio = found[0], round(found[3], 3)
        return ProgressSummary(
            step=step,
            total_steps=total,
            samples_per_s=round(min(rates), 2) if rates else None,
            eta_s=round(eta, 1) if eta is not None else None,
            data_wait=round(statistics.median(waits), 4) if waits else None,
            updated_at=max(r.time for r in records),
            slowest_rank=slowest_rank,
            slowest_ratio=slowest_ratio,
        )

    def summary_line(self) -> str | None:
        """``step 1200/5000 (24%) | 3,400 samples/s | ETA 14m | data wait 12% | slowest rank 3 (1.4x median step)``."""
        s = self.summary()
        return None if s is None else format_summary(s)


def format_summary(s: ProgressSummary, *, reached: int | None = None) -> str:
    """The summary line; ``reached``: the group ended, at that step (no ETA: nothing is left to wait for)."""
    step = s.step if reached is None else reached
    head = "reached step" if reached is not None else "step"
    total = s.total_steps
    parts = [f"{head} {step}/{total} ({100 * step / total:.0f}%)" if total else f"{head} {step}"]
    if s.samples_per_s is not None:
        parts.append(f"{s.samples_per_s:,.0f} samples/s")
    if s.eta_s is not None and reached is None:
        parts.append(f"ETA {_duration(s.eta_s)}")
    if s.data_wait is not None:
        parts.append(f"data wait {s.data_wait:.0%}")
    if s.slowest_rank is not None and s.slowest_ratio is not None:
        parts.append(f"slowest rank {s.slowest_rank} ({s.slowest_ratio:.1f}x median step)")
    return " | ".join(parts)


def replay(
    records: Iterable[ProgressRecord], *, nproc_per_node: int = 1, thresholds: ProgressThresholds | None = None
) -> tuple[ProgressBoard, list[Alert]]:
    """A board fed ``records`` one at a time, in time order, and every alert raised on the way
    (what a watch of the whole run would have warned about)."""
    board = ProgressBoard(nproc_per_node=nproc_per_node, thresholds=thresholds or ProgressThresholds())
    history: list[Alert] = []
    for record in sorted(records, key=lambda r: r.time):
        raised, _cleared = board.add([record])
        history += raised
    return board, history
