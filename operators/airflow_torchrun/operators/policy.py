"""The error policy at the task's edges: transient trouble is ridden out, permanent trouble fails at once.

One rule for storage, tracking and the cluster API alike (:func:`airflow_torchrun.errors.is_transient`):
a call around the group (a storage check, the resume point, the MLflow run) is retried within the
task's ``preflight_budget``; past it the try fails *retryably*; a permanent error of ours fails the
task without spending Airflow's retries.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from airflow_torchrun.compat import AirflowException, AirflowFailException
from airflow_torchrun.errors import TorchrunError, is_transient, retry_transient

T = TypeVar("T")
NOT_RETRYING = "(A retry cannot fix this; not retrying.)"


def under_policy(exc: Exception, where: str, what: str = "") -> Exception:
    """The Airflow exception for an error of ours: retryable when transient, else final."""
    head = f"{where}: {what + ': ' if what else ''}{exc}"
    if is_transient(exc):
        return AirflowException(f"{head}. A retry may succeed")
    return AirflowFailException(f"{head}\n{NOT_RETRYING}")


def preflight(call: Callable[[], T], *, what: str, where: str, budget: float, log: logging.Logger) -> T:
    """One call to storage or tracking under the policy: transient trouble retried within ``budget``
    seconds, then the try fails retryably; a permanent error of ours fails the task without retry."""
    try:
        return retry_transient(call, budget=budget, what=f"{where}: {what}", log=log)
    except Exception as exc:
        if is_transient(exc):
            raise under_policy(exc, where, f"{what} failed for {budget:g}s") from exc
        if isinstance(exc, TorchrunError):
            raise under_policy(exc, where, f"{what} failed") from exc
        raise
