"""Where airflow-torchrun keeps local state (group logs, default checkpoints, shards, MLflow)."""

from __future__ import annotations

import os
from pathlib import Path

# The folder of the state directory inside an Airflow home, when none is configured.
STATE_FOLDER = "torchrun"


def airflow_home() -> Path:
    """``$AIRFLOW_HOME``, else Airflow's own default (``~/airflow``), resolved as Airflow does."""
    try:
        from airflow.configuration import AIRFLOW_HOME

        return Path(AIRFLOW_HOME).expanduser()
    except ImportError:  # the ranks' side: the environment says it, or Airflow's default
        return Path(os.environ.get("AIRFLOW_HOME") or "~/airflow").expanduser()


def state_dir() -> Path:
    """``[torchrun] state_dir`` (or ``$AIRFLOW_TORCHRUN_STATE_DIR``), else ``<AIRFLOW_HOME>/torchrun``.

    The default belongs to one Airflow home, not to the OS user: two deployments on one machine
    (two ``AIRFLOW_HOME``s) never share group directories, default checkpoints or the default MLflow
    store, whose run ids may well be equal. Importable without Airflow (the local supervisor uses it);
    Airflow's config is read only when Airflow is installed and the environment does not already say.
    """
    configured = os.environ.get("AIRFLOW__TORCHRUN__STATE_DIR") or os.environ.get("AIRFLOW_TORCHRUN_STATE_DIR")
    if not configured:
        try:
            from airflow_torchrun.compat import conf

            configured = conf.get("torchrun", "state_dir", fallback=None)
        except ImportError:
            configured = None
    return Path(configured).expanduser() if configured else airflow_home() / STATE_FOLDER
