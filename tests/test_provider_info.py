"""Provider metadata as Airflow shows it: ``airflow providers get airflow-torchrun --full``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.mark.slow  # runs the airflow CLI
def test_providers_get_shows_the_integration_its_how_to_tags_and_the_plugin(tmp_path: Path) -> None:
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    result = subprocess.run(
        [sys.executable, "-m", "airflow", "providers", "get", "airflow-torchrun", "--full", "-o", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (info,) = json.loads(result.stdout[result.stdout.index("[") :])
    (integration,) = info["integrations"]
    assert integration["integration-name"] == "torchrun"
    assert integration["tags"] == ["software", "machine-learning", "pytorch", "distributed-training"]
    assert integration["how-to-guide"] == ["/docs/howto.md"]
    for page in integration["how-to-guide"]:
        assert (ROOT / page.lstrip("/")).is_file(), f"the how-to page {page} is not in the repository"
    assert info["plugins"] == [{"name": "airflow_torchrun", "plugin-class": "airflow_torchrun.plugin.TorchrunPlugin"}]
    modules = {m for t in info["triggers"] for m in t["python-modules"]}
    assert modules == {"airflow_torchrun.triggers", "airflow_torchrun.watchers"}
    operators = {m for o in info["operators"] for m in o["python-modules"]}
    assert "airflow_torchrun.operators.approval" in operators
    # Every module and class the metadata names imports.
    import importlib

    for name in [*modules, *operators]:
        importlib.import_module(name)
    for entry in info["plugins"]:
        module, _, cls = entry["plugin-class"].rpartition(".")
        assert getattr(importlib.import_module(module), cls).name == entry["name"]
