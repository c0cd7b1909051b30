"""A try's books: what each launch's ranks reported, the resume audit, the goodput ledger, kept across tries.

The run engine closes a launch's account when the launch ended (before its teardown, while a
Kubernetes group's pod logs are still there): the ranks' progress records are read once, from the
start, bound to their rank by torchrun's line prefix, and reduced to a
:class:`~airflow_torchrun.goodput.LaunchAccount`. A launch that resumed from a step some earlier
launch had passed is audited (:mod:`airflow_torchrun.audit`) against the losses reported before:
by earlier launches of this try, and by earlier tries, whose accounts are kept in Airflow's task
state store (one key per try, written by the operator: nothing a rank writes, not the checkpoint
store the ranks can write to, decides what a later try believes).

The try's ledger (:func:`~airflow_torchrun.goodput.try_ledger`) and the task's (every try known)
are made when the try finishes and ends; the training contract publishes them (MLflow metrics, the
asset event) from :meth:`TryBooks.published`. Everything here is best effort: a book that cannot be
read or written is a warning, never a failed training.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_torchrun.audit import AuditMode, AuditStatus, ResumeAudit, audit
from airflow_torchrun.goodput import (
    LaunchAccount,
    TaskLedger,
    TryLedger,
    account_launch,
    publishable,
    task_ledger,
    try_ledger,
)

if TYPE_CHECKING:
    from airflow_torchrun.backends.handles import GroupHandle
    from airflow_torchrun.timeline import Timeline

log = logging.getLogger(__name__)

STATE_KEY = "airflow_torchrun.goodput.try-{try_number}"
# What one try keeps in the task state store of its losses (its lowest ranks, their latest steps):
# enough for a later try's audit, well under the store's 64 KB advice per value.
STORED_RANKS = 4
STORED_LOSSES = 256


def _trimmed(account: LaunchAccount) -> dict[str, Any]:
    data = account.to_dict()
    losses = {}
    for rank in sorted(account.losses)[:STORED_RANKS]:
        steps = sorted(account.losses[rank])[-STORED_LOSSES:]
        losses[str(rank)] = {str(s): account.losses[rank][s] for s in steps}
    data["losses"] = losses
    return data


@dataclass
class EarlierTry:
    """What an earlier try of this task left in the task state store."""

    ledger: TryLedger | None
    accounts: list[LaunchAccount]

    @classmethod
    def from_stored(cls, data: Any) -> EarlierTry | None:
        if not isinstance(data, dict):
            return None
        ledger = TryLedger.from_dict(data["ledger"]) if isinstance(data.get("ledger"), dict) else None
        raw = data.get("launches")
        accounts = [LaunchAccount.from_dict(a) for a in raw if isinstance(a, dict)] if isinstance(raw, list) else []
        return cls(ledger, accounts)


@dataclass
class TryBooks:
    """One try's books (see the module's docstring); the engine keeps them, a contract reads them."""

    try_number: int
    mode: AuditMode
    store: Any = None  # the task state store (None: no earlier tries known, nothing kept)
    started_at: float | None = None  # the task instance's start (epoch)
    accounts: dict[int, LaunchAccount] = field(default_factory=dict)
    audits: list[ResumeAudit] = field(default_factory=list)
    earlier: list[EarlierTry] | None = None
    ledger: TryLedger | None = None  # the latest ledger made (finish, end)
    task: TaskLedger | None = None

    # -- earlier tries ------------------------------------------------------------------------
    def _earlier(self) -> list[EarlierTry]:
        if self.earlier is None:
            self.earlier = []
            if self.store is not None:
                for n in range(1, self.try_number):
                    try:
                        found = EarlierTry.from_stored(self.store.get(STATE_KEY.format(try_number=n)))
                    except Exception as exc:  # the books are an account, never a reason to fail
                        log.warning("Could not read the goodput account of try %d: %s", n, exc)
                        continue
                    if found is not None:
                        self.earlier.append(found)
        return self.earlier

    def _before(self, launch: int) -> list[LaunchAccount]:
        """Every account before ``launch`` of this try, oldest first (earlier tries, then this one's)."""
        out = [a for t in self._earlier() for a in t.accounts]
        return out + [self.accounts[k] for k in sorted(self.accounts) if k < launch]

    # -- a launch ended -----------------------------------------------------------------------
    def close_launch(self, launch: int, lines: list[str]) -> ResumeAudit | None:
        """The launch's account from its ranks' log ``lines``; its resume audit when it resumed
        past a step reported before (None: no audit)."""
        from airflow_torchrun.contract.progress import parse_bound_records

        before = self._before(launch)
        reached = max((a.max_step for a in before if a.max_step is not None), default=None)
        account = account_launch(launch, parse_bound_records(lines), reached)
        self.accounts[launch] = account
        if self.mode is AuditMode.OFF or not account.start_step or reached is None or reached <= account.start_step:
            return None
        prior: dict[int, dict[int, str]] = {}
        for earlier in before:
            for rank, steps in earlier.losses.items():
                prior.setdefault(rank, {}).update(steps)
        result = audit(prior, account.losses, account.start_step)
        self.audits.append(result)
        return result

    def failures_observed(self, now: float) -> tuple[int, float]:
        """This lineage's failures so far: (failed launches, seconds of the launches before this one),
        earlier tries and this one's relaunches (every launch closed in this try was followed by another)."""
        failures, seconds = 0, 0.0
        for earlier in self._earlier():
            ledger = earlier.ledger
            if ledger is not None:
                failures += max(0, ledger.launches - (1 if ledger.outcome == "succeeded" else 0))
                seconds += ledger.wall
        failures += len(self.accounts)
        if self.started_at is not None:
            seconds += max(0.0, now - self.started_at)
        return failures, seconds

    def diverged(self) -> ResumeAudit | None:
        """The first audit of the try that said ``diverged``."""
        return next((a for a in self.audits if a.status is AuditStatus.DIVERGED), None)

    # -- the ledger ---------------------------------------------------------------------------
    def make_ledger(self, timeline: Timeline, now: float) -> dict[str, Any]:
        """The try's and the task's ledgers as of ``now`` (the XCom ``goodput`` value)."""
        self.ledger = try_ledger(
            timeline, self.accounts, try_number=self.try_number, now=now, started_at=self.started_at
        )
        earlier = [t.ledger for t in self._earlier() if t.ledger is not None]
        self.task = task_ledger([*earlier, self.ledger])
        return self.published()

    def published(self) -> dict[str, Any]:
        """The latest ledgers made (``{}`` before any), with the try's latest resume audit."""
        if self.ledger is None or self.task is None:
            return {}
        return publishable(self.ledger, self.task, self.audits[-1].to_dict() if self.audits else None)

    def keep(self) -> None:
        """This try's ledger and accounts into the task state store, for the tries after it."""
        if self.store is None or self.ledger is None:
            return
        value = {
            "ledger": self.ledger.to_dict(),
            "launches": [_trimmed(self.accounts[k]) for k in sorted(self.accounts)],
        }
        try:
            self.store.set(STATE_KEY.format(try_number=self.try_number), value)
        except Exception as exc:
            log.warning("Could not keep the goodput account of try %d: %s", self.try_number, exc)

    # -- through a deferral -------------------------------------------------------------------
    def carry(self) -> dict[str, Any]:
        """What a re-entry after deferral needs (this try's accounts and audits; earlier tries are
        read again from the store)."""
        return {
            "accounts": [self.accounts[k].to_dict() for k in sorted(self.accounts)],
            "audits": [a.to_dict() for a in self.audits],
        }

    def restore(self, data: Any) -> None:
        if not isinstance(data, dict):
            return
        for raw in data.get("accounts") or []:
            if isinstance(raw, dict):
                account = LaunchAccount.from_dict(raw)
                self.accounts[account.launch] = account
        for raw in data.get("audits") or []:
            restored = ResumeAudit.from_dict(raw) if isinstance(raw, dict) else None
            if restored is not None:
                self.audits.append(restored)


def read_launch_lines(handle: GroupHandle) -> list[str]:
    """Every progress line the launch's ranks printed, from the start (a backend of its own: the
    watch's has consumed them)."""
    from airflow_torchrun.backends.base import backend_from_handle

    return backend_from_handle(handle).read_progress_lines(handle)
