"""The backend contract: every question the operators, the run engine and the trigger ask a backend.

A backend decides *where* each node of a plan runs, never *what* it runs. It answers its own
questions, so that no code outside ``backends/`` tests a backend's name: at DAG parse time (class
methods: where a relative script is, what a task's spec and settings may not be there, the default
processes per node), and at run time (the plan, launch, looks, logs, the failure's story, teardown,
the ranks' storage access). Methods a backend has nothing to say for have no-op defaults here (a
local group is never preempted; a Kubernetes group has no earlier try to stop, it is re-attached),
so callers never probe with ``getattr``. ``Backend[H]`` is generic on its typed handle
(:mod:`airflow_torchrun.backends.handles`); :func:`backend_class`, :func:`backend_for_task` and
:func:`backend_from_handle` are the one registry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from airflow_torchrun.backends import DEFAULT_BACKEND, backend_class, backend_names
from airflow_torchrun.backends.handles import GroupHandle, KubernetesHandle, LocalHandle

if TYPE_CHECKING:
    import logging

    from airflow_torchrun.diagnosis import RankFailure
    from airflow_torchrun.naming import GroupIdentity
    from airflow_torchrun.spec import GroupSpec
    from airflow_torchrun.status import GroupStatus, NodeObservation, ProgressMark
    from airflow_torchrun.wiring import GroupPlan

H = TypeVar("H", bound=GroupHandle)

__all__ = [
    "DEFAULT_BACKEND",
    "Backend",
    "FailureReport",
    "GroupHandle",
    "KubernetesHandle",
    "LocalHandle",
    "Relaunch",
    "RelaunchKind",
    "backend_class",
    "backend_for_task",
    "backend_from_handle",
    "backend_names",
]


@dataclass(frozen=True)
class BackendOptions:
    """What a task tells its backend (each backend takes what it means: Kubernetes all of it)."""

    namespace: str | None = None
    kubernetes_conn_id: str | None = None
    all_ranks_logs: bool = False
    # The task's execution_timeout: the Job's own activeDeadlineSeconds.
    active_deadline_seconds: float | None = None


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


class Backend(Protocol[H]):
    """What the operators, the run engine and the trigger may ask of a backend."""

    name: ClassVar[str]
    # The interpreter every node runs torchrun with: this one locally, the image's elsewhere.
    python: ClassVar[str] = "python"
    # Whether every node sees the Airflow worker's files (shards and checkpoints may then stay on
    # local disk); False means they must be object storage every node reaches.
    shares_worker_files: ClassVar[bool] = False
    # Whether the nodes' logs stay readable after the teardown (local files), or go with the group
    # (a Kubernetes Job's pods): the engine reads the ranks' last records after, or before, it.
    logs_outlive_teardown: ClassVar[bool] = False

    # -- DAG parse time: class methods, no instance, no cluster --------------------------------
    @classmethod
    def for_task(cls, options: BackendOptions) -> Backend[H]:
        """The backend a task uses, from the operator's backend options."""
        ...

    @classmethod
    def from_handle(cls, handle: H) -> Backend[H]:
        """The backend that launched ``handle``, rebuilt in another process (trigger, retry)."""
        ...

    @classmethod
    def resolve_script(cls, script: str, dag_file: str | None) -> str:
        """Where a relative ``script=`` is (by default a path inside the image: left alone)."""
        return script

    @classmethod
    def default_nproc_per_node(cls, runtime: str | None, where: str) -> int:
        """Ranks per node when the task names none."""
        return 1

    @classmethod
    def spec_problems(cls, spec: GroupSpec) -> list[str]:
        """What this backend cannot run of a spec whose values are final (a script that is not there)."""
        return []

    @classmethod
    def task_problems(
        cls,
        *,
        checkpoint_uri: str | None,
        default_checkpoint_base: str | None,
        tracking_uri: str | None,
        options: BackendOptions | None = None,
    ) -> list[str]:
        """What of a task's storage, tracking and options this backend could not use (a local path
        that pods on other machines cannot share, a namespace Kubernetes refuses). ``checkpoint_uri``:
        the task's, when known; ``default_checkpoint_base``: the default root when the task gives none."""
        return []

    @classmethod
    def for_view(
        cls, identity: GroupIdentity, hint: Mapping[str, Any], *, log_read_limit: int
    ) -> tuple[H, Backend[H]] | str | None:
        """The group of ``identity``'s try as the API server's view may see it, and a backend that
        reads it without holding a request open; a string says why it is not shown, None that the
        try launched no group this backend can see.

        Where to look comes from this deployment's own configuration and the task instance's
        identity, never from ``hint`` (the group's handle as XCom has it, which others can write):
        of it only which relaunch and, where the group itself cannot say, bounded counts are used.
        """
        return None

    # -- run time ------------------------------------------------------------------------------
    def named(self, identity: GroupIdentity) -> GroupIdentity:
        """``identity`` as this backend names its groups (a group's id is ``named(identity).group_id``):
        the launches table of a view derives each launch's id from it."""
        return identity

    def plan(self, spec: GroupSpec, identity: GroupIdentity, extra_env: Mapping[str, str]) -> GroupPlan:
        """Pure: each node's command and env (the wiring's plan, with this backend's addresses)."""
        ...

    def launch(self, plan: GroupPlan, *, watch_caller: bool) -> H:
        """Start every node; raises ``GroupLaunchError`` (nothing left running) when it cannot."""
        ...

    def plan_gated(self, spec: GroupSpec, identity: GroupIdentity) -> GroupPlan | None:
        """A plan whose ranks start at once but hold before the script until :meth:`open_gate` hands
        them the rank contract's variables (a relaunch started while the group before it is torn down:
        its spawning and imports overlap the teardown). ``None`` (the default): this backend cannot
        hold ranks; the engine launches after the teardown."""
        return None

    def open_gate(self, handle: H, env: Mapping[str, str]) -> None:
        """Let the held ranks of a group launched from :meth:`plan_gated` run, with ``env`` (the rank
        contract's, as :func:`~airflow_torchrun.wiring.gate_env` leaves it) added to each one's
        environment. Only asked of a backend whose :meth:`plan_gated` gave a plan (none by default:
        nothing to open)."""
        return None

    def rank_storage_env(
        self, options: Mapping[str, Any], aws_conn_id: str | None, log: logging.Logger
    ) -> dict[str, str]:
        """The ranks' access to storage: the resolved s3fs ``options`` of ``aws_conn_id`` as their
        environment, as far as this backend may put credentials there."""
        ...

    def observe(self, handle: H) -> list[NodeObservation]:
        """One look at every node. May raise; the watch core decides what an error means."""
        ...

    async def observe_async(self, handle: H) -> list[NodeObservation]: ...

    def read_new_log_lines(self, handle: H) -> list[str]:
        """Lines of the group's logs not returned before (by this instance)."""
        ...

    def log_locations(self, handle: H) -> list[str]: ...

    def explain(self, handle: H, status: GroupStatus) -> FailureReport:
        """The failure message (first failing rank, reason, log tail) and whether a retry may help."""
        ...

    def teardown(self, handle: H) -> None:
        """Stop every process or pod of the group. Idempotent and total."""
        ...

    async def teardown_async(self, handle: H) -> None:
        await asyncio.to_thread(self.teardown, handle)

    def pause(self, handle: H, seconds: float) -> None:
        """Wait ``seconds`` before the watch's next look; a backend that can tell when the group
        changes (a node's process exited) returns as soon as it does."""
        time.sleep(seconds)

    async def pause_async(self, handle: H, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def find_existing(self, identity: GroupIdentity, spec: GroupSpec | None = None) -> H | None:
        """A live group of an earlier try of this task instance to attach to (none by default)."""
        return None

    def stop_earlier_tries(self, identity: GroupIdentity) -> list[str]:
        """Stop groups earlier tries of this task instance left running; their ids (none by default)."""
        return []

    def relaunch_reason(self, handle: H, status: GroupStatus) -> Relaunch | None:
        """Why this failed group may be launched again within the try without spending a retry."""
        return None

    def progress_mark(self, handle: H) -> ProgressMark | None:
        """What the backend sees of the ranks' output (changes whenever they wrote more);
        ``None``: this backend cannot tell."""
        return None

    async def progress_mark_async(self, handle: H) -> ProgressMark | None:
        return await asyncio.to_thread(self.progress_mark, handle)

    def read_progress_lines(self, handle: H) -> list[str]:
        """Lines of the ranks' logs written since the last call (by this instance) that may hold
        progress records; none by default (the group's state still shows, its steps do not)."""
        return []

    async def read_progress_lines_async(self, handle: H) -> list[str]:
        return await asyncio.to_thread(self.read_progress_lines, handle)

    def process_groups(self, handle: H) -> list[dict[str, Any]] | None:
        """What each rank's launcher recorded about the process group its script joined (see
        :mod:`airflow_torchrun.worker.launch`); ``None``: this backend cannot tell."""
        return None


def backend_for_task(name: str, options: BackendOptions) -> Backend[Any]:
    """The backend a task of ``backend=name`` uses, from its operator's backend options."""
    backend: Backend[Any] = backend_class(name).for_task(options)
    return backend


def backend_from_handle(handle: GroupHandle) -> Backend[Any]:
    """The backend that launched ``handle``, rebuilt from the handle alone (another process)."""
    backend: Backend[Any] = backend_class(handle.backend).from_handle(handle)
    return backend
