"""One ``airflow standalone`` for this package's modules: the shipped pipeline as a user drives it.

``test_pipeline_ui.py`` (REST, the trigger form, the Training tab, the sweep) and
``test_pipeline_ui_approval.py`` (the approval before promotion) need the same services: the
repository's ``dags/``, the state dir's MLflow store, ``[torchrun] mlflow_ui_url`` and one default
retry. They share one, started for the package's first test and stopped after its last (on two
cores a start took about a minute, and the API server's first task start another 15 s); ``make
test`` keeps the package on one worker (``XDIST_DIRECTORY_GROUPS`` in ``tests/conftest.py``).
``test_pipeline_ui.py`` runs first (file order) and expects the services as started: the pipeline
paused, no run. The approval tests tell their story from an empty model registry; their module
fixture empties it first and pauses the pipeline again when it is done.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import ROOT
from tests.standalone import Standalone, start_standalone

DAG_ID = "torchrun_pipeline"
# Distinctive, so the extra links show they come from [torchrun] mlflow_ui_url.
MLFLOW_UI_URL = "http://mlflow.example.test:5000"


@pytest.fixture(scope="package")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    root = tmp_path_factory.mktemp("pipeline-ui")
    extra = {
        "AIRFLOW__TORCHRUN__MLFLOW_UI_URL": MLFLOW_UI_URL,
        # A task whose start the loaded API server did not answer in time (its PATCH .../run waited
        # 33-55 s on SQLite) failed the whole run; tasks that set their own retries keep them.
        "AIRFLOW__CORE__DEFAULT_TASK_RETRIES": "1",
        "AIRFLOW__CORE__DEFAULT_TASK_RETRY_DELAY": "0",
    }
    with start_standalone(root, ROOT / "dags", DAG_ID, "train", extra_env=extra) as server:
        yield server
