"""The one place that knows where Airflow keeps things (Airflow >= 3.3)."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseHook, BaseOperator, BaseOperatorLink, Context, conf
from airflow.sdk.bases.xcom import BaseXCom as XCom
from airflow.sdk.exceptions import (
    AirflowException,
    AirflowFailException,
    AirflowSkipException,
    AirflowTaskTimeout,
)

# The task instance's own key-value store that survives its retries (Airflow 3.3's task state store).
TASK_STATE_STORE = "task_state_store"


def task_state_store(context: Any) -> Any | None:
    """The task instance's state store (``get(key)``, ``set(key, value)``), or None where this
    Airflow has none (a context built by hand, an older release)."""
    try:
        return context.get(TASK_STATE_STORE)
    except Exception:
        return None


__all__ = [
    "AirflowException",
    "AirflowFailException",
    "AirflowSkipException",
    "AirflowTaskTimeout",
    "BaseHook",
    "BaseOperator",
    "BaseOperatorLink",
    "Context",
    "XCom",
    "conf",
    "task_state_store",
]
