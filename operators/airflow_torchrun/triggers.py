"""The deferrable half of the run engine: an async trigger that watches a group.

The trigger only watches (STYLE 4): it rebuilds the backend from the group's typed handle and
drives the same pure watch core (:mod:`airflow_torchrun.watch`) the sync operator drives, with
the backend's async ``observe_async``; so a flaky API, a hang or a deadline are decided exactly
as in sync mode. It fires one :class:`GroupEvent` when the group is done, and never earlier than
``not_before`` (a few seconds after the deferral, so the task's first process has been reported
finished before the trigger re-queues it). It never stops a healthy group: a triggerer restart
re-creates the trigger from :meth:`GroupTrigger.serialize` and it simply watches again. Only a
user's action on the deferred task (mark failed, clear) reaches :meth:`GroupTrigger.on_kill`,
which tears the group down, as the operator's ``on_kill`` does in sync mode.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from enum import Enum
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_torchrun.backends.base import backend_from_handle
from airflow_torchrun.backends.handles import GroupHandle
from airflow_torchrun.progress import ProgressThresholds
from airflow_torchrun.status import GroupStatus, NodeObservation, NodePhase, Outcome
from airflow_torchrun.watch import DEFAULT_ERROR_BUDGET, Note, Verdict, Watch, WatchConfig, watch_async


@dataclass(frozen=True)
class GroupEvent:
    """The one event a :class:`GroupTrigger` fires. Its payload is derived from the fields.

    It carries the handle, what every node was last seen doing and ``carry`` (what the operator
    handed the trigger when it deferred: the try's launches so far, its rank contract's state), so
    the operator's re-entry rebuilds its state from the event alone, not from memory or XCom.
    """

    status: Outcome
    group_id: str
    handle: GroupHandle
    failed_node: int | None = None
    reason: str = ""
    nodes: tuple[NodeObservation, ...] = field(default=())
    transient: bool = True  # for ERROR: whether a retry may see the group again
    carry: Mapping[str, Any] = field(default_factory=dict)
    seen: Mapping[str, Any] = field(default_factory=dict)  # what the trigger's watch saw first (timeline)

    @property
    def node_exit_codes(self) -> list[int | None]:
        """Exit code of every node by node rank; ``None`` for a node still running or lost."""
        return [n.exit_code for n in self.nodes]

    @classmethod
    def from_verdict(
        cls,
        handle: GroupHandle,
        verdict: Verdict,
        carry: Mapping[str, Any] | None = None,
        seen: Mapping[str, Any] | None = None,
    ) -> GroupEvent:
        return cls(
            status=verdict.outcome,
            group_id=handle.group_id,
            handle=handle,
            failed_node=verdict.failed_node,
            reason=verdict.reason,
            nodes=verdict.nodes,
            transient=verdict.transient,
            carry=dict(carry or {}),
            seen=dict(seen or {}),
        )

    @classmethod
    def from_status(cls, handle: GroupHandle, status: GroupStatus) -> GroupEvent:
        """The event for a terminal group status (raises ``ValueError`` for a running group)."""
        if not status.state.terminal:
            raise ValueError(f"group {handle.group_id} is still running; only a terminal status makes an event")
        return cls.from_verdict(
            handle, Verdict(Outcome(status.state.value), status.reason, status.nodes, status.failed_node)
        )

    def verdict(self) -> Verdict:
        """The watch's verdict, as the operator's re-entry continues from it."""
        return Verdict(self.status, self.reason, self.nodes, self.failed_node, self.transient)

    def group_status(self) -> GroupStatus:
        """The group status the trigger saw; what ``Backend.explain`` takes for a failure."""
        return self.verdict().group_status()

    def to_payload(self) -> dict[str, Any]:
        """JSON-native dict (str, int, float, None, list, dict) for ``TriggerEvent``."""
        data = asdict(self)
        data["handle"] = self.handle.to_dict()
        return _json_dict(data)

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> GroupEvent:
        """Inverse of :meth:`to_payload`; a payload of another shape raises ``ValueError``."""
        if not isinstance(payload, Mapping):
            raise ValueError(f"a GroupEvent payload is a dict, got {type(payload).__name__}: {payload!r}")
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing, unknown = required - payload.keys(), payload.keys() - names
        if missing or unknown:
            raise ValueError(
                f"not a GroupEvent payload (missing {sorted(missing)}, unknown {sorted(unknown)}): {payload!r}; "
                "was the task deferred by another version of airflow-torchrun?"
            )
        try:
            data = dict(payload)
            data["status"] = Outcome(data["status"])
            if not Outcome(data["status"]).terminal:
                raise ValueError("a group event's status is terminal")
            data["carry"] = dict(data.get("carry") or {})
            data["seen"] = dict(data.get("seen") or {})
            data["handle"] = GroupHandle.from_dict(data["handle"])
            data["nodes"] = tuple(
                NodeObservation(**{**node, "phase": NodePhase(node["phase"])}) for node in data.get("nodes", ())
            )
            return cls(**data)
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"malformed GroupEvent payload ({exc}): {payload!r}") from exc


def _json_dict(data: Mapping[str, Any]) -> dict[str, Any]:
    return {str(k): _jsonable(v) for k, v in data.items()}


def _jsonable(value: object) -> object:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


@dataclass(frozen=True)
class GroupWatch:
    """What a :class:`GroupTrigger` needs; ``serialize()`` is derived from it, so it cannot drift."""

    handle: GroupHandle
    poll_interval: float = 1.0
    progress_timeout: float | None = None
    deadline: float | None = None  # epoch seconds: the task's execution_timeout
    error_budget: float = DEFAULT_ERROR_BUDGET
    not_before: float | None = None  # epoch seconds: the earliest moment to fire
    carry: Mapping[str, Any] = field(default_factory=dict)  # handed back in the event, untouched

    @classmethod
    def create(cls, handle: Mapping[str, Any] | GroupHandle, **raw: object) -> GroupWatch:
        """Validate raw arguments; every problem is reported at once."""
        problems = []
        parsed: GroupHandle | None = None
        if isinstance(handle, GroupHandle):
            parsed = handle
        else:
            try:
                parsed = GroupHandle.from_dict(handle)
            except ValueError as exc:
                problems.append(f"handle must be GroupHandle.to_dict() of a launched group: {exc}")
        values: dict[str, float | None] = {}
        carry = raw.pop("carry", None) or {}
        if not isinstance(carry, Mapping):
            problems.append(f"carry must be a dict (JSON) for the re-entry, got {type(carry).__name__}")
            carry = {}
        for f in fields(cls):
            if f.name in ("handle", "carry"):
                continue
            value = raw.get(f.name, f.default)
            optional = f.default is None
            if value is None and optional:
                values[f.name] = None
            elif isinstance(value, bool) or not isinstance(value, int | float):
                problems.append(f"{f.name} must be a number{' or None' if optional else ''}, got {value!r}")
            elif f.name in ("poll_interval", "progress_timeout") and value <= 0:
                problems.append(f"{f.name} must be a positive number of seconds, got {value!r}")
            else:
                values[f.name] = float(value)
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            problems.append(f"unknown arguments {sorted(unknown)}")
        if problems or parsed is None:
            raise ValueError("GroupTrigger cannot watch this group:\n" + "\n".join(f"  - {p}" for p in problems))
        return cls(handle=parsed, carry=dict(carry), **values)  # type: ignore[arg-type]

    def kwargs(self) -> dict[str, Any]:
        """The trigger's keyword arguments, JSON-native (what Airflow stores for a deferred task)."""
        data = asdict(self)
        data["handle"] = self.handle.to_dict()
        return _json_dict(data)

    def config(self) -> WatchConfig:
        return WatchConfig(
            poll_interval=self.poll_interval,
            progress_timeout=self.progress_timeout,
            deadline=self.deadline,
            error_budget=self.error_budget,
            thresholds=ProgressThresholds.from_conf(),  # the triggerer reads the same [torchrun] config
        )


class GroupTrigger(BaseTrigger):
    """Watch a launched training group until it ends; fire one :class:`GroupEvent`.

    :param handle: ``GroupHandle.to_dict()`` of the launched group.
    :param poll_interval: Seconds between two looks at the group.
    :param progress_timeout: Fire ``progress_timeout`` when the group shows no progress for this
        many seconds while it runs (a hung collective). ``None``: no limit. The clock restarts
        when the trigger does (a triggerer restart grants a fresh window).
    :param deadline: Epoch seconds (the task's ``execution_timeout``): fire ``timeout`` when the
        group is still running then, so the operator tears it down. Survives triggerer restarts.
    :param error_budget: Seconds of failed looks in a row (transient API or file trouble) before
        the trigger gives up with ``error``; a permanent error gives up at once.
    :param not_before: Epoch seconds before which no event fires (a group that ended sooner is
        reported then).
    :param carry: JSON the operator needs again on re-entry (the try's launches, its rank contract's
        state); handed back untouched in the event.
    """

    def __init__(self, handle: Mapping[str, Any] | GroupHandle, **kwargs: object) -> None:
        super().__init__()
        self.watch = GroupWatch.create(handle, **kwargs)

    @property
    def handle(self) -> GroupHandle:
        return self.watch.handle

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", self.watch.kwargs()

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Drive the watch core; yield one event when it decides, then stop."""
        event = await self._watch()
        wait = (self.watch.not_before or 0.0) - time.time()
        if wait > 0:
            await asyncio.sleep(wait)
        if event.status.ok:
            self.log.info("Group %s succeeded; node exit codes %s", event.group_id, event.node_exit_codes)
        else:
            self.log.error("Group %s ended with %s: %s", event.group_id, event.status.value, event.reason)
        yield TriggerEvent(event.to_payload())

    async def _watch(self) -> GroupEvent:
        handle, spec = self.handle, self.watch
        try:
            # Importing a backend module is file I/O: keep it off the event loop too.
            backend = await asyncio.to_thread(backend_from_handle, handle)
        except Exception as exc:
            return GroupEvent(
                status=Outcome.ERROR,
                group_id=handle.group_id,
                handle=handle,
                reason=f"could not rebuild backend {handle.backend!r} for the group: {exc}",
                carry=spec.carry,
            )
        self.log.info(
            "Watching group %s (%d node(s), backend %s) every %.2fs",
            handle.group_id,
            handle.num_nodes,
            handle.backend,
            spec.poll_interval,
        )
        watch = Watch.of(handle, spec.config(), time.time())
        verdict = await watch_async(backend, handle, watch, emit=self._note)
        if verdict.outcome in (Outcome.TIMEOUT, Outcome.PROGRESS_TIMEOUT):
            # Decided: stop it now, not when a worker slot frees for the re-entry (which may never
            # come if the task is marked failed meanwhile). Idempotent.
            try:
                await backend.teardown_async(handle)
            except Exception as exc:
                self.log.warning("Group %s: teardown failed, the re-entry tries again: %s", handle.group_id, exc)
        return GroupEvent.from_verdict(handle, verdict, spec.carry, watch.seen())

    def _note(self, note: Note) -> None:
        self.log.log(note.level, "%s", note.message)

    async def on_kill(self) -> None:
        """The user acted on the deferred task (mark failed, clear): stop the whole group.

        Airflow calls this only for a user's action, never on a triggerer restart or when the
        trigger fires; teardown is idempotent.
        """
        handle = self.handle
        self.log.info("Tearing down group %s (task killed while deferred)", handle.group_id)
        backend = await asyncio.to_thread(backend_from_handle, handle)
        await backend.teardown_async(handle)
