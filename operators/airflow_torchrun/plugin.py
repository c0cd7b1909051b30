"""The Airflow plugin object (entry point ``airflow.plugins``: ``torchrun``).

- extra links (MLflow run, checkpoint, registered model version);
- the training view's API and page, a FastAPI app at ``/torchrun`` (:mod:`airflow_torchrun.ui.api`),
  served by the API server behind Airflow's auth;
- the "Training" tab on every task instance (an external view, opened in the UI's frame).
"""

from __future__ import annotations

from typing import Any

from airflow.plugins_manager import AirflowPlugin

from airflow_torchrun.links import CheckpointLink, MlflowRunLink, ModelVersionLink

VIEW_ROUTE = "torchrun-training"
API_PREFIX = "/torchrun"


class _TrainingApi:
    """The API's ASGI app, imported on its first request: every Airflow process loads plugins
    (the scheduler, the dag processor), only the API server serves this, and FastAPI with
    Airflow's auth is about a second of imports."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        from airflow_torchrun.ui.api import app

        await app(scope, receive, send)


class TorchrunPlugin(AirflowPlugin):
    name = "airflow_torchrun"
    operator_extra_links = [MlflowRunLink(), CheckpointLink(), ModelVersionLink()]
    fastapi_apps = [{"app": _TrainingApi(), "url_prefix": API_PREFIX, "name": "airflow-torchrun training view"}]
    external_views = [
        {
            "name": "Training",
            # Relative: the UI resolves it against its <base href> ([api] base_url), so a subpath works.
            "href": "torchrun/view/{DAG_ID}/{RUN_ID}/{TASK_ID}?map_index={MAP_INDEX}",
            "destination": "task_instance",
            "url_route": VIEW_ROUTE,
        }
    ]
