"""Typed handles: enough to find a launched group again from any process; pushed to XCom at once.

One class per backend, each with the fields that backend means (no field that is a directory for
one backend and a namespace for another). ``to_dict()`` names the backend; ``GroupHandle.from_dict``
returns the right class. Pure dataclasses: importing this module loads no backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar


@dataclass(frozen=True, kw_only=True)
class GroupHandle:
    """What every backend's handle has."""

    backend: ClassVar[str] = ""
    group_id: str
    num_nodes: int
    world_size: int
    launched_at: float
    startup_timeout: float
    teardown_grace: float
    # Launches of this try before this one (a lost port race, a preemption): 0 for the first.
    relaunch: int = 0

    @property
    def log_dir(self) -> str | None:
        """Where the group's logs are on this machine, if they are on a disk at all."""
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, **asdict(self)}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> GroupHandle:
        """Inverse of :meth:`to_dict`; raises ``ValueError`` naming what is wrong."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a group handle is a dict, got {type(data).__name__}: {data!r}")
        kind = data.get("backend")
        cls = _TYPES.get(str(kind))
        if cls is None:
            raise ValueError(f"handle names backend {kind!r}; known backends: {', '.join(_TYPES)}")
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names - {"backend"}
        if unknown:
            raise ValueError(f"not a {cls.__name__} (unknown fields {sorted(unknown)}): {dict(data)!r}")
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as exc:
            raise ValueError(f"not a {cls.__name__} ({exc}): {dict(data)!r}") from exc


@dataclass(frozen=True, kw_only=True)
class LocalHandle(GroupHandle):
    backend: ClassVar[str] = "local"
    group_dir: str  # <state_dir>/groups/<group_id>
    master_port: int

    @property
    def log_dir(self) -> str | None:
        return self.group_dir


@dataclass(frozen=True, kw_only=True)
class KubernetesHandle(GroupHandle):
    backend: ClassVar[str] = "kubernetes"
    namespace: str
    job_name: str
    job_uid: str | None = None
    master_addr: str | None = None
    master_port: int = 29500
    runtime: str | None = None
    queue: str | None = None
    # How to reach the cluster again from another process (trigger, retry).
    kubernetes_conn_id: str | None = None
    config_file: str | None = None
    cluster_context: str | None = None
    in_cluster: bool | None = None
    all_ranks_logs: bool = False
    # The Airflow deployment whose group this is (a relaunch from this handle keeps its identity).
    deployment: str | None = None


# Bounds on what a group, its files or an XCom may claim about it, far above any real group (a
# Kubernetes Indexed Job has at most 100,000 completions): whoever reads such a claim (the view)
# sizes no loop by more.
MAX_NODES = 100_000
MAX_WORLD_SIZE = 10_000_000
MAX_RELAUNCH = 1_000


def bounded_int(value: object, *, low: int, high: int) -> int | None:
    """``value`` when it is a whole number within ``[low, high]``, else None."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        return None
    return value


_TYPES: dict[str, type[GroupHandle]] = {cls.backend: cls for cls in (LocalHandle, KubernetesHandle)}
