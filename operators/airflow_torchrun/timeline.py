"""A try's own timeline: what the engine did and saw, and when. Pure.

The run engine marks each moment of a try once it happened (wall-clock epoch seconds): the try's
start, the rank contract resolved (storage, resume point, tracking: the preflight), each launch,
the first output and the first step of its ranks as the watch saw them, the group's end, its
teardown, each relaunch decision (a relaunch started during that teardown: its gate opened, or the
launch withdrawn), the finish. It travels with the try (pushed to XCom ``timeline``
at every state change, and through a deferral inside the trigger's event), so the goodput ledger,
the per-phase timings of ``make bench`` and the training view read one account of where the time
went. Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

XCOM_TIMELINE = "timeline"


class Mark(StrEnum):
    """What happened. Per launch (``launch`` >= 0) unless said otherwise."""

    TRY_STARTED = "try_started"  # the try began running: the operator's execute() (not per launch)
    PREPARED = "prepared"  # its spec rendered and checked, its rank contract and engine made (not per launch)
    CONTRACT_STARTED = "contract_started"  # resolving the rank contract: storage, resume point, tracking
    CONTRACT_READY = "contract_ready"
    LAUNCH_STARTED = "launch_started"  # asking the backend to start every node
    LAUNCHED = "launched"  # every node was started (processes spawned, Job and Service created)
    # A relaunch started during the teardown of the launch before it (detail ``held``): its ranks
    # hold before the script until the gate opens, once that launch is gone and the resume point read;
    # or it is withdrawn (torn down unopened: no relaunch after all, or the try stopped).
    GATE_OPENED = "gate_opened"
    WITHDRAWN = "withdrawn"  # detail: why
    ATTACHED = "attached"  # an earlier try's group was attached to instead of launched
    RUNNING = "running"  # the watch first saw every node past pending (Kubernetes: pods admitted, scheduled)
    FIRST_OUTPUT = "first_output"  # the watch first saw any rank's output
    # The ranks' own account, read from the backend once the launch ended (the ranks' own clocks;
    # absent where the backend cannot tell, or for a ``command=`` group, which runs no launcher of ours):
    RANKS_STARTED = "ranks_started"  # the last rank's interpreter began running the script (imports next)
    RENDEZVOUS = "rendezvous"  # the last rank's init_process_group returned: the process group stood
    FIRST_STEP = "first_step"  # the first progress record (its own time, as the rank wrote it)
    DEFERRED = "deferred"  # handed to the triggerer
    EXITED = "exited"  # the group ended on its nodes, as the backend recorded it: the last node's exit
    # for a success, the first failed node's end otherwise (detail: outcome); ENDED follows it
    ENDED = "ended"  # the watch's verdict (detail: outcome)
    TEARDOWN_STARTED = "teardown_started"
    TEARDOWN_DONE = "teardown_done"
    RELAUNCH = "relaunch"  # decided to launch again within the try (detail: kind, why)
    FINISH_STARTED = "finish_started"  # the rank contract's finish (final checkpoint, publishing)
    TRY_ENDED = "try_ended"  # detail: outcome (not per launch)


@dataclass(frozen=True)
class Event:
    mark: Mark
    at: float
    launch: int = -1  # the launch within the try (0 for the first); -1 for the try itself
    detail: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mark": self.mark.value, "at": self.at, "launch": self.launch}
        if self.detail:
            out["detail"] = dict(self.detail)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Event:
        return cls(
            mark=Mark(data["mark"]),
            at=float(data["at"]),
            launch=int(data.get("launch", -1)),
            detail=dict(data.get("detail") or {}),
        )


@dataclass
class Timeline:
    """A try's events in the order they were marked."""

    events: list[Event] = field(default_factory=list)

    def mark(self, mark: Mark, at: float, launch: int = -1, **detail: Any) -> Event:
        event = Event(mark, float(at), launch, detail)
        self.events.append(event)
        return event

    def mark_once(self, mark: Mark, at: float, launch: int = -1, **detail: Any) -> Event | None:
        """Mark only the first time (a watch that restarts in the triggerer sees the first output again)."""
        if self.first(mark, launch) is not None:
            return None
        return self.mark(mark, at, launch, **detail)

    def first(self, mark: Mark, launch: int | None = None) -> Event | None:
        for event in self.events:
            if event.mark is mark and (launch is None or event.launch == launch):
                return event
        return None

    def last(self, mark: Mark, launch: int | None = None) -> Event | None:
        found = None
        for event in self.events:
            if event.mark is mark and (launch is None or event.launch == launch):
                found = event
        return found

    def launches(self) -> list[int]:
        """The launches that ran: every launch marked, less those withdrawn before their gate opened."""
        withdrawn = {e.launch for e in self.events if e.mark is Mark.WITHDRAWN}
        return sorted({e.launch for e in self.events if e.launch >= 0} - withdrawn)

    def between(self, start: Mark, end: Mark, launch: int | None = None) -> float | None:
        """Seconds from the first ``start`` to the first ``end`` after it (of one launch); None if either is missing."""
        first = self.first(start, launch)
        if first is None:
            return None
        for event in self.events:
            if event.mark is end and (launch is None or event.launch == launch) and event.at >= first.at:
                return event.at - first.at
        return None

    def to_list(self) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self.events]

    @classmethod
    def from_list(cls, data: Any) -> Timeline:
        """Inverse of :meth:`to_list`; anything that is not an event list gives an empty timeline
        (a payload of another version: the timeline is an account, never a decision)."""
        if not isinstance(data, list):
            return cls()
        events = []
        for item in data:
            try:
                events.append(Event.from_dict(item))
            except (KeyError, TypeError, ValueError):
                continue
        return cls(events)
