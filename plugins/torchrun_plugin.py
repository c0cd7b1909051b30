"""The airflow-torchrun Airflow plugin, for deployments that load plugins from a plugins folder.

An installed package registers the plugin through its ``airflow.plugins`` entry point (``pip
install`` is enough). Airflow loads the plugins folder *and* entry points, and refuses a second
plugin of the same name with a warning (``Plugin 'airflow_torchrun' already registered``), so this
file exposes the plugin class only where the package's entry point is not installed.
"""

from __future__ import annotations

from importlib.metadata import entry_points

_ENTRY_POINT = "airflow_torchrun.plugin:TorchrunPlugin"

if not any(ep.value == _ENTRY_POINT for ep in entry_points(group="airflow.plugins")):
    from airflow_torchrun.plugin import TorchrunPlugin

    __all__ = ["TorchrunPlugin"]
