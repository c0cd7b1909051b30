"""Frozen task settings: how a group is watched, relaunched, checkpointed and tracked. Pure.

Validated together with the :class:`~airflow_torchrun.spec.GroupSpec` by :func:`validate_task`,
so an invalid task lists every problem at once (spec and settings), at DAG parse time where the
values are known then and again once templates are rendered. The backend's answers about a
task's fields before they are rendered (:func:`resolved_script`, :func:`default_nproc`) are here too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import timedelta
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from airflow_torchrun.backends import backend_class, backend_names
from airflow_torchrun.backends.base import BackendOptions
from airflow_torchrun.errors import InvalidSpecError, StorageError
from airflow_torchrun.spec import (
    DEFAULT_RDZV_TIMEOUT,
    DEFAULT_STARTUP_TIMEOUT,
    DEFAULT_TEARDOWN_GRACE,
    GroupSpec,
    is_templated,
)
from airflow_torchrun.storage.lineage import RESUME_AUTO, RESUME_NEVER, resume_problem
from airflow_torchrun.storage.uri import parse_uri
from airflow_torchrun.watch import DEFAULT_ERROR_BUDGET

if TYPE_CHECKING:
    from airflow_torchrun.backends.base import Backend

DEFAULT_DEFER_AFTER = 60.0
DEFAULT_PREFLIGHT_BUDGET = 120.0


def flag(name: str, value: object, problems: list[str], *, allow_none: bool = False) -> Any:
    """A yes/no argument: ``True`` or ``False`` (``"true"``/``"false"`` from a rendered template too).
    Anything else is a problem listed with the task's others: ``bool("false")`` is True, so a flag
    is never taken by truthiness."""
    if isinstance(value, bool) or (value is None and allow_none):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    allowed = "True, False or None" if allow_none else "True or False"
    problems.append(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")
    return False if not allow_none else None


def seconds_or_none(name: str, value: object, problems: list[str]) -> float | None:
    """A positive duration: seconds (a number) or a ``timedelta``; ``None`` stays None. Anything
    else is a problem listed with the task's others."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    problems.append(f"{name} must be a positive number of seconds, a timedelta or None, got {value!r}")
    return None


def exit_codes(value: object) -> tuple[Any, ...]:
    """Exit codes as a tuple (validated with the settings, so a bad value is listed, not raised here)."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | set | frozenset):
        return (value,)
    return tuple(value)


@dataclass(frozen=True)
class LaunchOptions:
    """How the agents meet and stop (checked with the spec, which they become part of)."""

    rdzv_port: int | None = None
    rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT
    teardown_grace: float = DEFAULT_TEARDOWN_GRACE
    threads_per_proc: int | None = None

    def spec_arguments(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class RunSettings:
    """How a group is checked before launch and watched after (both modes alike)."""

    poll_interval: float = 0.1
    progress_timeout: float | None = None
    observe_error_budget: float = DEFAULT_ERROR_BUDGET
    preflight_budget: float = DEFAULT_PREFLIGHT_BUDGET
    deferrable: bool = False
    defer_after: float = DEFAULT_DEFER_AFTER
    max_preemptions: int = 3
    # In-try restarts after a retryable failure (Ray's max_failures, JobSet's maxRestarts): 0 = off.
    max_restarts: int = 0
    # Exit codes of the failing rank: listed in fail_on, the task fails at once (no restart, no
    # retry); with retry_on given, any other exit code fails at once too. Signals, a peer's death,
    # the "stopped to save" code and port races stay retryable whatever the lists say.
    retry_on_exit_codes: tuple[int, ...] | None = None
    fail_on_exit_codes: tuple[int, ...] = ()


@dataclass(frozen=True)
class CheckpointSettings:
    checkpoint_uri: str | None = None  # None: the per-run default under [torchrun] checkpoint_base
    resume: str = RESUME_AUTO
    keep_last: int = 3
    aws_conn_id: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # The [torchrun] checkpoint_base in effect, where checkpoint_uri is None (for the checks only).
    default_base: str | None = None


def _number(problems: list[str], name: str, value: object, *, allow_none: bool = False, zero: bool = False) -> float:
    if value is None and allow_none:
        return 0.0
    ok = isinstance(value, int | float) and not isinstance(value, bool) and (value >= 0 if zero else value > 0)
    if not ok:
        what = "a number of seconds >= 0" if zero else "a positive number of seconds"
        problems.append(f"{name} must be {what}{' or None' if allow_none else ''}, got {value!r}")
        return 0.0
    return float(value)  # type: ignore[arg-type]


def run_problems(w: RunSettings) -> list[str]:
    problems: list[str] = []
    _number(problems, "poll_interval", w.poll_interval)
    _number(problems, "progress_timeout", w.progress_timeout, allow_none=True)
    _number(problems, "observe_error_budget", w.observe_error_budget, zero=True)
    _number(problems, "preflight_budget", w.preflight_budget, zero=True)
    _number(problems, "defer_after", w.defer_after, zero=True)
    for name in ("max_preemptions", "max_restarts"):
        m = getattr(w, name)
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            problems.append(f"{name} must be a whole number >= 0, got {m!r}")
    codes: dict[str, set[int]] = {}
    for name in ("retry_on_exit_codes", "fail_on_exit_codes"):
        value = getattr(w, name)
        if value is None:
            continue
        bad = [c for c in value if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 255]
        if bad or isinstance(value, str | bytes):
            problems.append(f"{name} must be a list of exit codes between 1 and 255, got {value!r}")
            continue
        codes[name] = set(value)
    both = codes.get("retry_on_exit_codes", set()) & codes.get("fail_on_exit_codes", set())
    if both:
        problems.append(f"exit code(s) {sorted(both)} are in both retry_on_exit_codes and fail_on_exit_codes")
    return problems


def checkpoint_problems(c: CheckpointSettings) -> list[str]:
    problems: list[str] = []
    k = c.keep_last
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        problems.append(f"keep_last must be a whole number >= 0 (0 keeps every committed checkpoint), got {k!r}")
    for name in ("checkpoint_uri", "resume"):
        value = getattr(c, name)
        if value is None or is_templated(value) or value in (RESUME_AUTO, RESUME_NEVER):
            continue
        if not isinstance(value, str):
            problems.append(f"{name} must be a string, got {value!r}")
            continue
        if name == "resume" and (problem := resume_problem(value)):
            problems.append(problem)
            continue
        try:
            parse_uri(value)
        except StorageError as exc:
            problems.append(f"{name}: {exc}")
    return problems


# What MLflow's client can track to: a tracking server, a SQLAlchemy database, a local path, Databricks.
TRACKING_SCHEMES = frozenset(
    {"http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc"}
)


def tracking_uri_problems(uri: object, name: str = "mlflow_tracking_uri") -> list[str]:
    """What MLflow could not track to, at parse time (a template waits for rendering)."""
    from airflow_torchrun.redaction import without_credentials

    if uri is None or is_templated(uri):
        return []
    if not isinstance(uri, str) or not uri.strip():
        return [f"{name} must be an MLflow tracking URI (text), got {uri!r}"]
    value = uri.strip()
    if value.startswith(("/", ".")) or ":" not in value or value in ("databricks", "databricks-uc"):
        return []  # a local directory (MLflow's file store), or Databricks' default profile
    scheme = value.split(":", 1)[0].split("+", 1)[0].lower()
    if scheme in TRACKING_SCHEMES:
        return []
    return [
        f"{name} {without_credentials(value)!r} has the scheme {scheme!r}, which MLflow cannot track to; use "
        "http(s)://host:5000 (a tracking server), sqlite:////path/mlflow.db, postgresql://, mysql:// or mssql:// "
        "(a database), file:///path, or databricks"
    ]


def validate_task(
    make_spec: Callable[[], GroupSpec],
    *,
    where: str,
    backend: str,
    run: RunSettings,
    checkpoint: CheckpointSettings | None = None,
    tracking_uri: str | None = None,
    extra: list[str] | None = None,
    options: BackendOptions | None = None,
) -> GroupSpec | None:
    """The spec, or one :class:`InvalidSpecError` listing every problem of spec and settings.

    ``tracking_uri``: the MLflow store the ranks will log into, when the task tracks; ``options``:
    what the task tells its backend (its namespace, say), checked by that backend.

    Returns ``None`` when only the settings were checked because the spec still holds templates
    that ``make_spec`` could not validate (never: it raises with every problem instead).
    """
    problems = list(extra or [])
    spec: GroupSpec | None = None
    try:
        spec = make_spec()
    except InvalidSpecError as exc:
        problems += exc.problems
    if spec is not None and not is_templated(spec.backend):
        problems += backend_class(spec.backend).spec_problems(spec)
    problems += run_problems(run)
    if checkpoint is not None:
        problems += checkpoint_problems(checkpoint)
    problems += tracking_uri_problems(tracking_uri)
    if (cls := known_backend(backend)) is not None:
        uri = checkpoint.checkpoint_uri if checkpoint is not None else None
        problems += cls.task_problems(
            checkpoint_uri=uri if isinstance(uri, str) and not is_templated(uri) else None,
            default_checkpoint_base=checkpoint.default_base if checkpoint is not None and uri is None else None,
            tracking_uri=tracking_uri,
            options=options,
        )
    if problems:
        raise InvalidSpecError(problems, where)
    return spec


def known_backend(name: object) -> type[Backend[Any]] | None:
    """The class of the backend ``name`` names outright; None for a template or a name no backend
    has (the spec lists that), so a check that needs the backend waits for the rendered value."""
    return backend_class(name) if isinstance(name, str) and name in backend_names() else None


def resolved_script(backend: object, script: str | None, dag_file: str | None) -> str | None:
    """``script=`` as the backend finds it (a relative path beside the DAG file, for the local backend);
    a template or a task whose backend is not known yet keeps it as written."""
    cls = known_backend(backend)
    if cls is None or not isinstance(script, str) or is_templated(script):
        return script
    return cls.resolve_script(script, dag_file)


def default_nproc(backend: object, runtime: str | None, where: str) -> int:
    """Ranks per node for a task that names none: the backend's answer for its runtime, 1 until known."""
    cls = known_backend(backend)
    return 1 if cls is None or is_templated(runtime) else cls.default_nproc_per_node(runtime, where)
