"""The backend contract: every method the run engine and the trigger call, declared once.

A backend decides *where* each node of a plan runs, never *what* it runs. Methods a backend has
nothing to say for have no-op defaults here (a local group is never preempted; a Kubernetes
group has no earlier try to stop, it is re-attached), so callers never probe with ``getattr``.
Handles are typed per backend (:mod:`airflow_torchrun.backends.handles`); :func:`backend_for`
and :func:`backend_from_handle` are the one registry.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from airflow_torchrun.backends.handles import GroupHandle, KubernetesHandle, LocalHandle

if TYPE_CHECKING:
    from airflow_torchrun.diagnosis import RankFailure
    from airflow_torchrun.spec import GroupSpec
    from airflow_torchrun.status import GroupStatus, NodeObservation
    from airflow_torchrun.wiring import GroupIdentity, GroupPlan

__all__ = [
    "Backend",
    "FailureReport",
    "GroupHandle",
    "KubernetesHandle",
    "LocalHandle",
    "Relaunch",
    "RelaunchKind",
    "backend_for",
    "backend_from_handle",
]


@dataclass(frozen=True)
class FailureReport:
    message: str
    retryable: bool
    # The root cause's own exit code or signal, when the backend knows it (exit-code policies).
    exit_code: int | None = None
    signal: str | None = None
    collateral: bool = False  # the root cause only followed something else (a peer's death, a stop)
    headline: str = ""  # the root cause in one line ("rank 1 (node 1, local rank 0) was killed by ...")

    @classmethod
    def of(cls, message: str, retryable: bool, cause: RankFailure | None) -> FailureReport:
        """The report of a failure whose root cause the diagnosis found (``None``: not known)."""
        if cause is None:
            return cls(message=message, retryable=retryable)
        return cls(
            message=message,
            retryable=retryable,
            exit_code=cause.exit_code,
            signal=cause.signal,
            collateral=cause.collateral,
            headline=cause.headline(),
        )


class RelaunchKind(StrEnum):
    """Why a group that ended badly may be launched again within the same try, each with its own budget."""

    PORT_RACE = "port_race"  # local: another process took the rendezvous port first
    PREEMPTION = "preemption"  # kubernetes: preempted, evicted, node lost


@dataclass(frozen=True)
class Relaunch:
    kind: RelaunchKind
    why: str


class Backend(Protocol):
    """What the run engine and the trigger may ask of a backend."""

    name: ClassVar[str]

    @classmethod
    def from_handle(cls, handle: Any) -> Backend:
        """The backend that launched ``handle``, rebuilt in another process (trigger, retry)."""
        ...

    def plan(self, spec: GroupSpec, identity: GroupIdentity, extra_env: Mapping[str, str]) -> GroupPlan:
        """Pure: each node's command and env (the wiring's plan, with this backend's addresses)."""
        ...

    def launch(self, plan: GroupPlan, *, watch_caller: bool) -> GroupHandle:
        """Start every node; raises ``GroupLaunchError`` (nothing left running) when it cannot."""
        ...

    def observe(self, handle: Any) -> list[NodeObservation]:
        """One look at every node. May raise; the watch core decides what an error means."""
        ...

    async def observe_async(self, handle: Any) -> list[NodeObservation]: ...

    def read_new_log_lines(self, handle: Any) -> list[str]:
        """Lines of the group's logs not returned before (by this instance)."""
        ...

    def log_locations(self, handle: Any) -> list[str]: ...

    def explain(self, handle: Any, status: GroupStatus) -> FailureReport:
        """The failure message (first failing rank, reason, log tail) and whether a retry may help."""
        ...

    def teardown(self, handle: Any) -> None:
        """Stop every process or pod of the group. Idempotent and total."""
        ...

    async def teardown_async(self, handle: Any) -> None:
        await asyncio.to_thread(self.teardown, handle)

    def find_existing(self, identity: GroupIdentity, spec: GroupSpec | None = None) -> GroupHandle | None:
        """A live group of an earlier try of this task instance to attach to (none by default)."""
        return None

    def stop_earlier_tries(self, identity: GroupIdentity) -> list[str]:
        """Stop groups earlier tries of this task instance left running; their ids (none by default)."""
        return []

    def relaunch_reason(self, handle: Any, status: GroupStatus) -> Relaunch | None:
        """Why this failed group may be launched again within the try without spending a retry."""
        return None

    def progress_mark(self, handle: Any) -> object | None:
        """A value that changes whenever the group shows progress; ``None``: this backend cannot tell."""
        return None

    async def progress_mark_async(self, handle: Any) -> object | None:
        return await asyncio.to_thread(self.progress_mark, handle)

    def read_progress_lines(self, handle: Any) -> list[str]:
        """Lines of the ranks' logs written since the last call (by this instance) that may hold
        progress records; none by default (the group's state still shows, its steps do not)."""
        return []

    async def read_progress_lines_async(self, handle: Any) -> list[str]:
        return await asyncio.to_thread(self.read_progress_lines, handle)

    def process_groups(self, handle: Any) -> list[dict[str, Any]] | None:
        """What each rank's launcher recorded about the process group its script joined (see
        :mod:`airflow_torchrun.worker.launch`); ``None``: this backend cannot tell."""
        return None


# name -> (module, class): imported only when used, so parsing a DAG never loads a backend.
_REGISTRY = {
    "local": ("airflow_torchrun.backends.local", "LocalBackend"),
    "kubernetes": ("airflow_torchrun.backends.kubernetes", "KubernetesBackend"),
}


def _backend_class(name: str) -> Any:
    try:
        module, attr = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(_REGISTRY)}") from None
    return getattr(importlib.import_module(module), attr)


def backend_for(name: str, **options: Any) -> Backend:
    """A new backend by name with its constructor options."""
    backend: Backend = _backend_class(name)(**options)
    return backend


def backend_from_handle(handle: GroupHandle) -> Backend:
    """The backend that launched ``handle``, rebuilt from the handle alone (another process)."""
    backend: Backend = _backend_class(handle.backend).from_handle(handle)
    return backend
