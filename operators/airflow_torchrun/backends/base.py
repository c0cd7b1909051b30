"""The one small interface every backend implements, and the handle that names a running group."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from airflow_torchrun.spec import GroupSpec
from airflow_torchrun.status import GroupStatus, NodeObservation
from airflow_torchrun.wiring import GroupIdentity, GroupPlan


@dataclass(frozen=True)
class GroupHandle:
    """Enough to find a launched group again from any process: pushed to XCom at once."""

    backend: str
    group_id: str
    num_nodes: int
    launched_at: float
    location: str  # local: the group's state directory; kubernetes: the namespace
    startup_timeout: float
    teardown_grace: float
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["extra"] = dict(self.extra)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GroupHandle:
        return cls(**{**data, "extra": dict(data.get("extra") or {})})


@dataclass(frozen=True)
class FailureReport:
    message: str
    retryable: bool


class Backend(Protocol):
    """Decides *where* each node of a plan runs; never *what* it runs."""

    name: str

    def plan(self, spec: GroupSpec, identity: GroupIdentity, extra_env: Mapping[str, str]) -> GroupPlan: ...

    def launch(self, plan: GroupPlan, *, watch_caller: bool) -> GroupHandle: ...

    def observe(self, handle: GroupHandle) -> list[NodeObservation]: ...

    async def observe_async(self, handle: GroupHandle) -> list[NodeObservation]: ...

    def read_new_log_lines(self, handle: GroupHandle) -> list[str]: ...

    def explain(self, handle: GroupHandle, status: GroupStatus) -> FailureReport: ...

    def log_locations(self, handle: GroupHandle) -> list[str]: ...

    def teardown(self, handle: GroupHandle) -> None: ...


def get_backend(name: str, **options: Any) -> Backend:
    """Backends are imported only when used, so parsing a DAG never loads them."""
    if name == "local":
        from airflow_torchrun.backends.local import LocalBackend

        return LocalBackend(**options)
    if name == "kubernetes":
        from airflow_torchrun.backends.kubernetes import KubernetesBackend  # type: ignore[import-not-found]

        return KubernetesBackend(**options)  # type: ignore[no-any-return]
    raise ValueError(f"unknown backend {name!r}")
