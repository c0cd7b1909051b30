"""The exception tree of airflow-torchrun, and the one error policy: transient or permanent.

Every error says what happened, why it likely happened and what to change.
``InvalidSpecError`` is a ``ValueError`` so that a DAG file with a bad spec fails
to import with the message in Airflow's import-error list.

The policy (:func:`is_transient`) is the same for the cluster API, storage and tracking:
connection refused or reset, timeouts, HTTP 5xx, 408 and 429 are *transient* (ridden out within a
time budget, then a retryable failure); everything else, 4xx validation, bad credentials, a
missing bucket, an invalid spec, is *permanent* (the task fails at once, without Airflow retries).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_log = logging.getLogger(__name__)

# Exception class names (anywhere in an exception's chain) that mean "the other side did not
# answer in time or dropped the connection": botocore, urllib3, requests, aiohttp, kubernetes.
_TRANSIENT_NAMES = frozenset(
    {
        "ConnectionError",
        "TimeoutError",
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "NewConnectionError",
        "MaxRetryError",
        "ProtocolError",
        "ReadTimeout",
        "ConnectTimeout",
        "ClientConnectorError",
        "ClientOSError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
        "RemoteDisconnected",
        "IncompleteRead",
        "ThrottlingException",
        "SlowDown",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
    }
)


class TorchrunError(Exception):
    """Base class of every error raised by airflow-torchrun.

    ``transient``: whether the same call may succeed later without anyone changing anything.
    """

    transient: bool = False

    def __init__(self, message: str = "", *, transient: bool | None = None) -> None:
        if transient is not None:
            self.transient = transient
        super().__init__(message)


class InvalidSpecError(TorchrunError, ValueError):
    """The group spec cannot run as written; nothing was started.

    Carries every problem found, not just the first, so one fix-and-reparse cycle is enough.
    """

    def __init__(self, problems: list[str], where: str = "") -> None:
        self.problems = list(problems)
        head = f"Invalid torchrun group spec{f' for {where}' if where else ''}"
        body = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{head}:\n{body}", transient=False)


class GroupLaunchError(TorchrunError):
    """The group could not be started. Permanent (the API refused the objects) unless ``transient``
    (the API did not answer, or answered 5xx); either way nothing of the group is left running."""


class StorageError(TorchrunError):
    """A checkpoint or dataset location cannot be used (bad URI, unreachable, no access).

    Transient when the store did not answer (endpoint down, timeout, 5xx); permanent otherwise.
    """


class TrackingError(TorchrunError):
    """The MLflow tracking server (or store) cannot be reached or used."""


def http_status(exc: BaseException) -> int | None:
    """The HTTP status an API client attached to ``exc`` (kubernetes, botocore, mlflow), if any."""
    for candidate in _chain(exc):
        status = getattr(candidate, "status", None)
        if isinstance(status, int) and 100 <= status < 600:
            return status
        response = getattr(candidate, "response", None)
        if isinstance(response, dict):
            meta = response.get("ResponseMetadata") or {}
            code = meta.get("HTTPStatusCode")
            if isinstance(code, int):
                return code
        code = getattr(candidate, "http_status_code", None)  # mlflow's RestException
        if isinstance(code, int):
            return code
    return None


def is_transient(exc: BaseException) -> bool:
    """The error policy: may the same call succeed later, with nothing changed?"""
    if isinstance(exc, TorchrunError):
        return exc.transient
    status = http_status(exc)
    if status is not None:
        return status >= 500 or status in (408, 429)
    for candidate in _chain(exc):
        if isinstance(candidate, ConnectionError | TimeoutError | asyncio.TimeoutError):
            return True
        if {cls.__name__ for cls in type(candidate).__mro__} & _TRANSIENT_NAMES:
            return True
    return False


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


def retry_transient(
    call: Callable[[], T],
    *,
    budget: float,
    what: str,
    log: Any = None,  # a logging.Logger, or the operator's structlog logger
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Run ``call``; ride out transient errors (:func:`is_transient`) for up to ``budget`` seconds.

    Permanent errors are raised at once. Past the budget the last transient error is raised, so the
    caller can fail the try retryably. Back-off doubles from 0.5 s to 10 s.
    """
    started = clock()
    delay = 0.5
    attempt = 0
    while True:
        attempt += 1
        try:
            return call()
        except Exception as exc:
            waited = clock() - started
            if not is_transient(exc) or waited + delay > budget:
                raise
            (log or _log).warning(
                "%s failed (transient, attempt %d, %.0fs of a %.0fs budget): %s; retrying in %.1fs",
                what,
                attempt,
                waited,
                budget,
                exc,
                delay,
            )
            sleep(delay)
            delay = min(delay * 2, 10.0)
