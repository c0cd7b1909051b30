"""The Airflow plugin object (entry point ``airflow.plugins``: ``torchrun``)."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from airflow_torchrun.links import MlflowRunLink


class TorchrunPlugin(AirflowPlugin):
    name = "airflow_torchrun"
    operator_extra_links = [MlflowRunLink()]
