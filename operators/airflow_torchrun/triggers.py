"""The deferrable half of ``DistributedTrainingOperator``: an async trigger that watches a group.

The trigger only watches (STYLE 4): it rebuilds the backend from the group's handle, observes
every node with the backend's async ``observe_async``, reduces what it sees with the same pure
:func:`airflow_torchrun.status.group_status` the sync operator uses, and fires exactly one
:class:`GroupEvent` when the group is done. It never stops a healthy group: a triggerer restart
re-creates the trigger from :meth:`GroupTrigger.serialize` and it simply watches again. Only a
user's action on the deferred task (mark failed, clear) reaches :meth:`GroupTrigger.on_kill`,
which tears the group down, as the operator's ``on_kill`` does in sync mode.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from enum import Enum, StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_torchrun.backends.base import GroupHandle, get_backend
from airflow_torchrun.spec import BACKENDS
from airflow_torchrun.status import GroupState, GroupStatus, NodeObservation, NodePhase, group_status

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from airflow_torchrun.backends.base import Backend

# Consecutive failed looks at the group before the trigger gives up with an ERROR event (a
# transient API or file-system hiccup should not fail a training run of many hours).
OBSERVE_ERRORS_TOLERATED = 3
HEARTBEAT_SECONDS = 600.0


class GroupEventStatus(StrEnum):
    """How a watched group ended, as far as the trigger could tell."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STARTUP_TIMEOUT = "startup_timeout"
    PROGRESS_TIMEOUT = "progress_timeout"  # no node's log grew for progress_timeout seconds
    TIMEOUT = "timeout"  # the task's execution_timeout (the watch's deadline) passed
    ERROR = "error"  # the trigger could not observe the group; its state is unknown

    @property
    def ok(self) -> bool:
        return self is GroupEventStatus.SUCCEEDED


_FROM_GROUP_STATE = {
    GroupState.SUCCEEDED: GroupEventStatus.SUCCEEDED,
    GroupState.FAILED: GroupEventStatus.FAILED,
    GroupState.STARTUP_TIMEOUT: GroupEventStatus.STARTUP_TIMEOUT,
}
_TO_GROUP_STATE = {
    **{event: state for state, event in _FROM_GROUP_STATE.items()},
    # No group state of their own: the group did not end well, the reason says how.
    GroupEventStatus.PROGRESS_TIMEOUT: GroupState.FAILED,
    GroupEventStatus.TIMEOUT: GroupState.FAILED,
    GroupEventStatus.ERROR: GroupState.FAILED,
}


@dataclass(frozen=True)
class GroupEvent:
    """The one event a :class:`GroupTrigger` fires. Its payload is derived from the fields.

    It carries the handle and what every node was last seen doing, so the operator's re-entry
    rebuilds its state from the event alone (:meth:`group_status`), not from memory or XCom.
    """

    status: GroupEventStatus
    group_id: str
    handle: GroupHandle
    failed_node: int | None = None
    reason: str = ""
    nodes: tuple[NodeObservation, ...] = field(default=())

    @property
    def node_exit_codes(self) -> list[int | None]:
        """Exit code of every node by node rank; ``None`` for a node still running or lost."""
        return [n.exit_code for n in self.nodes]

    @classmethod
    def from_status(cls, handle: GroupHandle, status: GroupStatus) -> GroupEvent:
        """The event for a terminal group status (raises ``ValueError`` for a running group)."""
        if not status.state.terminal:
            raise ValueError(f"group {handle.group_id} is still running; only a terminal status makes an event")
        return cls(
            status=_FROM_GROUP_STATE[status.state],
            group_id=handle.group_id,
            handle=handle,
            failed_node=status.failed_node,
            reason=status.reason,
            nodes=status.nodes,
        )

    def group_status(self) -> GroupStatus:
        """The group status the trigger saw; what ``Backend.explain`` takes for a failure."""
        return GroupStatus(_TO_GROUP_STATE[self.status], self.nodes, self.failed_node, self.reason)

    def to_payload(self) -> dict[str, Any]:
        """JSON-native dict (str, int, float, None, list, dict) for ``TriggerEvent``."""
        return _json_dict(asdict(self))

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
            data["status"] = GroupEventStatus(data["status"])
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

    @classmethod
    def create(
        cls,
        handle: Mapping[str, Any] | GroupHandle,
        poll_interval: object,
        progress_timeout: object,
        deadline: object = None,
    ) -> GroupWatch:
        """Validate raw arguments; every problem is reported at once."""
        problems = []
        parsed: GroupHandle | None = None
        if isinstance(handle, GroupHandle):
            parsed = handle
        else:
            try:
                parsed = GroupHandle.from_dict(handle)
            except (TypeError, AttributeError) as exc:
                problems.append(f"handle must be GroupHandle.to_dict() of a launched group ({exc}), got {handle!r}")
        if parsed is not None and parsed.backend not in BACKENDS:
            problems.append(f"handle names backend {parsed.backend!r}; known backends: {', '.join(BACKENDS)}")
        if isinstance(poll_interval, bool) or not isinstance(poll_interval, int | float) or poll_interval <= 0:
            problems.append(f"poll_interval must be a positive number of seconds, got {poll_interval!r}")
        if progress_timeout is not None and (
            isinstance(progress_timeout, bool) or not isinstance(progress_timeout, int | float) or progress_timeout <= 0
        ):
            problems.append(
                f"progress_timeout must be a positive number of seconds or None (no limit), got {progress_timeout!r}"
            )
        if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, int | float)):
            problems.append(f"deadline must be epoch seconds or None, got {deadline!r}")
        if problems or parsed is None:
            raise ValueError("GroupTrigger cannot watch this group:\n" + "\n".join(f"  - {p}" for p in problems))
        return cls(
            deadline=None if deadline is None else float(deadline),  # type: ignore[arg-type]
            handle=parsed,
            poll_interval=float(poll_interval),  # type: ignore[arg-type]
            progress_timeout=None if progress_timeout is None else float(progress_timeout),  # type: ignore[arg-type]
        )

    def kwargs(self) -> dict[str, Any]:
        """The trigger's keyword arguments, JSON-native (what Airflow stores for a deferred task)."""
        return _json_dict(asdict(self))


def backend_for_handle(handle: GroupHandle) -> Backend:
    """The backend that launched ``handle``, rebuilt in another process (triggerer, retry).

    Local: the state directory is the handle's ``<state_dir>/groups/<group_id>`` location, two
    levels up. Kubernetes: the namespace and how to reach the cluster travel in the handle.
    """
    options: dict[str, Any] = {}
    if handle.backend == "local":
        options["state_dir"] = Path(handle.location).parent.parent
    elif handle.backend == "kubernetes":
        from airflow_torchrun.backends.kubernetes import KubernetesBackend

        options = KubernetesBackend.options_from_handle(handle)
    return get_backend(handle.backend, **options)


class GroupTrigger(BaseTrigger):
    """Watch a launched training group until it ends; fire one :class:`GroupEvent`.

    :param handle: ``GroupHandle.to_dict()`` of the launched group.
    :param poll_interval: Seconds between two looks at the group.
    :param progress_timeout: Fire ``progress_timeout`` when no node's log has grown for this many
        seconds while the group runs (a hung collective). ``None``: no limit. The clock restarts
        when the trigger does (a triggerer restart grants a fresh window).
    :param deadline: Epoch seconds (the task's ``execution_timeout``): fire ``timeout`` when the
        group is still running then, so the operator tears it down. Survives triggerer restarts.
    """

    def __init__(
        self,
        handle: Mapping[str, Any] | GroupHandle,
        poll_interval: float = 1.0,
        progress_timeout: float | None = None,
        deadline: float | None = None,
    ) -> None:
        super().__init__()
        self.watch = GroupWatch.create(handle, poll_interval, progress_timeout, deadline)

    @property
    def handle(self) -> GroupHandle:
        return self.watch.handle

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", self.watch.kwargs()

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Poll the group; yield one event when it is terminal, then stop."""
        event = await self._watch()
        if event.status.ok:
            self.log.info("Group %s succeeded; node exit codes %s", event.group_id, event.node_exit_codes)
        else:
            self.log.error("Group %s ended with %s: %s", event.group_id, event.status.value, event.reason)
        yield TriggerEvent(event.to_payload())

    async def _watch(self) -> GroupEvent:
        handle, watch = self.handle, self.watch
        try:
            # Importing a backend module is file I/O: keep it off the event loop too.
            backend = await asyncio.to_thread(backend_for_handle, handle)
        except Exception as exc:
            return self._error(f"could not rebuild backend {handle.backend!r} for the group: {exc}")
        probe = _progress_probe(backend, handle) if watch.progress_timeout is not None else None
        if watch.progress_timeout is not None and probe is None:
            self.log.warning(
                "Group %s: backend %s cannot tell progress; progress_timeout=%s is not enforced",
                handle.group_id,
                handle.backend,
                watch.progress_timeout,
            )
        self.log.info(
            "Watching group %s (%d node(s), backend %s) every %.2fs",
            handle.group_id,
            handle.num_nodes,
            handle.backend,
            watch.poll_interval,
        )
        errors = 0
        last_phases: tuple[str, ...] = ()
        last_progress, last_mark = time.monotonic(), None
        last_heartbeat = time.monotonic()
        while True:
            try:
                nodes = await backend.observe_async(handle)
                errors = 0
            except Exception as exc:
                errors += 1
                self.log.warning(
                    "Group %s: observing failed (%d/%d): %s", handle.group_id, errors, OBSERVE_ERRORS_TOLERATED, exc
                )
                if errors >= OBSERVE_ERRORS_TOLERATED:
                    return self._error(f"could not observe the group {errors} times in a row; last error: {exc}")
                await asyncio.sleep(watch.poll_interval)
                continue
            status = group_status(
                nodes, launched_at=handle.launched_at, now=time.time(), startup_timeout=handle.startup_timeout
            )
            phases = tuple(n.phase.value for n in status.nodes)
            if phases != last_phases:
                self.log.info("Group %s nodes: %s", handle.group_id, ", ".join(phases))
                last_phases = phases
            if status.state.terminal:
                return GroupEvent.from_status(handle, status)
            if watch.deadline is not None and time.time() >= watch.deadline:
                return GroupEvent(
                    status=GroupEventStatus.TIMEOUT,
                    group_id=handle.group_id,
                    handle=handle,
                    reason="the task's execution_timeout passed while the group was still running",
                    nodes=status.nodes,
                )
            now = time.monotonic()
            if probe is not None and watch.progress_timeout is not None:
                try:
                    mark = await probe()
                except OSError as exc:
                    self.log.warning("Group %s: could not read progress: %s", handle.group_id, exc)
                    mark = last_mark
                if mark != last_mark:
                    last_progress, last_mark = now, mark
                elif now - last_progress >= watch.progress_timeout:
                    return GroupEvent(
                        status=GroupEventStatus.PROGRESS_TIMEOUT,
                        group_id=handle.group_id,
                        handle=handle,
                        reason=(
                            f"no node's log grew for {now - last_progress:.0f}s "
                            f"(progress_timeout={watch.progress_timeout:g}s); the group looks hung"
                        ),
                        nodes=status.nodes,
                    )
            if now - last_heartbeat >= HEARTBEAT_SECONDS:
                last_heartbeat = now
                self.log.info(
                    "Group %s still running, %.0fs since launch", handle.group_id, time.time() - handle.launched_at
                )
            await asyncio.sleep(watch.poll_interval)

    def _error(self, reason: str) -> GroupEvent:
        return GroupEvent(
            status=GroupEventStatus.ERROR, group_id=self.handle.group_id, handle=self.handle, reason=reason
        )

    async def on_kill(self) -> None:
        """The user acted on the deferred task (mark failed, clear): stop the whole group.

        Airflow calls this only for a user's action, never on a triggerer restart or when the
        trigger fires; teardown is idempotent and runs in a thread (it waits out the grace period).
        """
        handle = self.handle
        self.log.info("Tearing down group %s (task killed while deferred)", handle.group_id)
        backend = await asyncio.to_thread(backend_for_handle, handle)
        await asyncio.to_thread(backend.teardown, handle)


def _progress_probe(backend: Backend, handle: GroupHandle) -> Callable[[], Awaitable[object]] | None:
    """An async function whose result changes whenever the group shows progress, if the backend can tell.

    A backend may offer ``async progress_mark(handle)``; the local backend's logs are files, whose
    sizes serve.
    """
    own = getattr(backend, "progress_mark", None)
    if callable(own):

        async def backend_mark() -> object:
            return await own(handle)

        return backend_mark
    if handle.backend == "local":
        paths = backend.log_locations(handle)

        async def log_sizes() -> object:
            return await asyncio.to_thread(_sizes, paths)

        return log_sizes
    return None


def _sizes(paths: Sequence[str]) -> tuple[int, ...]:
    out = []
    for path in paths:
        try:
            out.append(os.stat(path).st_size)
        except FileNotFoundError:
            out.append(-1)
    return tuple(out)
