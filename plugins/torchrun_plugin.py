"""The airflow-torchrun Airflow plugin: the 'MLflow run' extra link on training tasks.

Installed packages register it through the ``airflow.plugins`` entry point (``pip install`` is
enough); this file serves deployments that load plugins from a plugins folder instead.
"""

from __future__ import annotations

from airflow_torchrun.plugin import TorchrunPlugin

__all__ = ["TorchrunPlugin"]
