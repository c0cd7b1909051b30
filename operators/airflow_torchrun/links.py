"""Extra links on training tasks: they only read XCom."""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow_torchrun.compat import BaseOperatorLink, XCom

if TYPE_CHECKING:
    from airflow.sdk.types import TaskInstanceKey

    from airflow_torchrun.compat import BaseOperator

MLFLOW_RUN_URL_KEY = "mlflow_run_url"


class MlflowRunLink(BaseOperatorLink):
    """'MLflow run': the run this task's ranks logged into (pushed by the operator at launch)."""

    name = "MLflow run"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        # Airflow types the key as read-only here and as settable in get_value; it is the same object.
        url = XCom.get_value(key=MLFLOW_RUN_URL_KEY, ti_key=ti_key)  # type: ignore[arg-type]
        return str(url) if url else ""
