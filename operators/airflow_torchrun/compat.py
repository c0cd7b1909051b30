"""The one place that knows where Airflow keeps things (Airflow >= 3.3)."""

from __future__ import annotations

from airflow.sdk import BaseHook, BaseOperator, BaseOperatorLink, Context, conf
from airflow.sdk.bases.xcom import BaseXCom as XCom
from airflow.sdk.exceptions import (
    AirflowException,
    AirflowFailException,
    AirflowSkipException,
    AirflowTaskTimeout,
)

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
]
