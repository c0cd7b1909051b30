"""The one place that knows where Airflow keeps things (Airflow >= 3.3)."""

from __future__ import annotations

from airflow.sdk import BaseHook, BaseOperator, BaseOperatorLink, Context, conf
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException

__all__ = [
    "AirflowException",
    "AirflowFailException",
    "AirflowSkipException",
    "BaseHook",
    "BaseOperator",
    "BaseOperatorLink",
    "Context",
    "conf",
]
