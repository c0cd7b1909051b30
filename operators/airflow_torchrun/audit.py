"""The resume audit: were the steps a resumed launch recomputed the steps an earlier launch reported? Pure.

A launch that resumes from step ``S`` recomputes the steps an earlier launch (of this try, or an
earlier try) had already reported past ``S`` (the goodput ledger's lost work). A faithful resume
computes them again bit for bit: the same weights, optimizer state, RNG streams and data order
give the same loss at every step. So the audit compares, rank by rank, the loss the ranks report
for each recomputed step (the progress records carry it as a hex float, bit-exact) with the one
reported before:

- ``exact``: every compared loss is bit-equal;
- ``close``: some differ, none by more than :data:`RTOL` relative (float rounding that went
  another way: DDP's gradient buckets in another order after a fresh start at world size 3 or
  more, a non-deterministic kernel; measured at world size 4: 1 ulp after 10 steps);
- ``diverged``: some loss differs by more (a replayed or skipped epoch, a data loader that
  restarted from zero, a lost optimizer state): the first such step, with both values;
- ``none``: nothing to compare (a fresh start, no earlier losses past ``S``, records off).

The first differing step (bits) is named in every case but ``exact``. One log line per resumed
launch; ``resume_audit="fail"`` fails the task on ``diverged`` (``"warn"``, the default, only
warns; ``"off"`` skips the audit). Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from airflow_torchrun.contract.progress import hex_to_float

# The relative deviation up to which a recomputed loss counts as ``close`` (rounding), not ``diverged``.
RTOL = 1e-3

# rank -> step -> the loss as float.hex()
Losses = Mapping[int, Mapping[int, str]]


class AuditMode(StrEnum):
    WARN = "warn"
    FAIL = "fail"
    OFF = "off"


class AuditStatus(StrEnum):
    EXACT = "exact"
    CLOSE = "close"
    DIVERGED = "diverged"
    NONE = "none"


@dataclass(frozen=True)
class StepDiff:
    """One step whose recomputed loss differs from the one reported before."""

    step: int
    rank: int
    before: float
    after: float

    @property
    def relative(self) -> float:
        scale = max(abs(self.before), abs(self.after))
        return abs(self.after - self.before) / scale if scale > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "rank": self.rank, "before": self.before, "after": self.after}

    @classmethod
    def from_dict(cls, data: Any) -> StepDiff | None:
        try:
            return cls(int(data["step"]), int(data["rank"]), float(data["before"]), float(data["after"]))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class ResumeAudit:
    status: AuditStatus
    resumed_step: int
    compared: int = 0  # (rank, step) pairs compared
    first_step: int | None = None  # the first and last recomputed step compared
    last_step: int | None = None
    ranks: tuple[int, ...] = ()
    first_difference: StepDiff | None = None  # the first step whose loss differs at all
    first_divergence: StepDiff | None = None  # the first step beyond RTOL (diverged only)
    max_relative: float = 0.0
    tolerance: float = RTOL
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "status": self.status.value,
            "resumed_step": self.resumed_step,
            "compared": self.compared,
            "steps": [self.first_step, self.last_step] if self.first_step is not None else None,
            "ranks": list(self.ranks),
            "max_relative": self.max_relative,
            "tolerance": self.tolerance,
        }
        if self.first_difference is not None:
            out["first_difference"] = self.first_difference.to_dict()
        if self.first_divergence is not None:
            out["first_divergence"] = self.first_divergence.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Any) -> ResumeAudit | None:
        """Inverse of :meth:`to_dict` (an audit carried through a deferral); None when it is not one."""
        try:
            steps = data.get("steps") or [None, None]
            return cls(
                status=AuditStatus(data["status"]),
                resumed_step=int(data["resumed_step"]),
                compared=int(data.get("compared") or 0),
                first_step=steps[0],
                last_step=steps[1],
                ranks=tuple(int(r) for r in data.get("ranks") or ()),
                first_difference=StepDiff.from_dict(data.get("first_difference")),
                first_divergence=StepDiff.from_dict(data.get("first_divergence")),
                max_relative=float(data.get("max_relative") or 0.0),
                tolerance=float(data.get("tolerance") or RTOL),
            )
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            return None

    def line(self) -> str:
        """The audit in one log line."""
        head = f"Resume audit (resumed from step {self.resumed_step}): {self.status.value}"
        if self.status is AuditStatus.NONE:
            return f"{head}: {'; '.join(self.notes) or 'no earlier losses past that step to compare'}"
        span = f"{self.compared} loss(es) of steps {self.first_step}-{self.last_step}, rank(s) {_ranks(self.ranks)}"
        if self.status is AuditStatus.EXACT:
            return f"{head}: {span} bit-identical to the ones reported before"
        diff = self.first_difference
        assert diff is not None  # close and diverged have one
        first = f"first difference at step {diff.step} (rank {diff.rank}): {diff.before!r} before, {diff.after!r} now"
        if self.status is AuditStatus.CLOSE:
            return (
                f"{head}: {span}; {first}; largest relative deviation {self.max_relative:.3g} "
                f"(within {self.tolerance:g}: rounding, not another computation)"
            )
        div = self.first_divergence
        assert div is not None
        return (
            f"{head}: {span}; diverged at step {div.step} (rank {div.rank}): {div.before!r} before, {div.after!r} "
            f"now ({div.relative:.3g} relative, beyond {self.tolerance:g}); {first}. The resumed run does not "
            "compute what the interrupted one did: is the data order (epoch, offset, sampler seed), the optimizer "
            "or the RNG state restored?"
        )


def _ranks(ranks: tuple[int, ...]) -> str:
    return ",".join(str(r) for r in ranks)


def audit(before: Losses, after: Losses, resumed_step: int, *, tolerance: float = RTOL) -> ResumeAudit:
    """Compare the losses ``after`` (the resumed launch's) of the steps past ``resumed_step`` with
    ``before`` (what earlier launches reported), rank by rank, for the steps both have."""
    if resumed_step <= 0:
        return ResumeAudit(AuditStatus.NONE, resumed_step, notes=("a fresh start, not a resume",))
    pairs: list[tuple[int, int, str, str]] = []  # (step, rank, before, after)
    for rank in sorted(set(before) & set(after)):
        mine, theirs = after[rank], before[rank]
        for step in sorted(set(mine) & set(theirs)):
            if step > resumed_step:
                pairs.append((step, rank, theirs[step], mine[step]))
    if not pairs:
        return ResumeAudit(AuditStatus.NONE, resumed_step)
    pairs.sort()
    first_diff: StepDiff | None = None
    first_div: StepDiff | None = None
    worst = 0.0
    for step, rank, old, new in pairs:
        if old == new:
            continue
        a, b = hex_to_float(old), hex_to_float(new)
        if a is None or b is None or a == b:  # two spellings of one value
            continue
        diff = StepDiff(step, rank, a, b)
        first_diff = first_diff or diff
        worst = max(worst, diff.relative)
        if first_div is None and diff.relative > tolerance:
            first_div = diff
    status = (
        AuditStatus.EXACT
        if first_diff is None
        else AuditStatus.DIVERGED
        if first_div is not None
        else AuditStatus.CLOSE
    )
    return ResumeAudit(
        status,
        resumed_step,
        compared=len(pairs),
        first_step=pairs[0][0],
        last_step=pairs[-1][0],
        ranks=tuple(sorted({rank for _, rank, _, _ in pairs})),
        first_difference=first_diff,
        first_divergence=first_div,
        max_relative=worst,
        tolerance=tolerance,
    )


def parse_mode(value: object, problems: list[str]) -> AuditMode:
    """``resume_audit`` as given: ``"warn"``, ``"fail"`` or ``"off"`` (anything else is a problem listed
    with the task's others)."""
    if isinstance(value, str) and value.strip().lower() in {m.value for m in AuditMode}:
        return AuditMode(value.strip().lower())
    problems.append(f"resume_audit must be 'warn', 'fail' or 'off', got {value!r}")
    return AuditMode.WARN
