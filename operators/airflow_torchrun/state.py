"""Where airflow-torchrun keeps local state (group logs, default checkpoints, shards, MLflow)."""

from __future__ import annotations

import os
from pathlib import Path


def state_dir() -> Path:
    """``[torchrun] state_dir`` (or ``$AIRFLOW_TORCHRUN_STATE_DIR``), else ``~/.airflow-torchrun``.

    Importable without Airflow (the local supervisor uses it); Airflow's config is read only when
    Airflow is installed and the environment does not already say.
    """
    configured = os.environ.get("AIRFLOW__TORCHRUN__STATE_DIR") or os.environ.get("AIRFLOW_TORCHRUN_STATE_DIR")
    if not configured:
        try:
            from airflow_torchrun.compat import conf

            configured = conf.get("torchrun", "state_dir", fallback=None)
        except ImportError:
            configured = None
    return Path(configured) if configured else Path.home() / ".airflow-torchrun"
