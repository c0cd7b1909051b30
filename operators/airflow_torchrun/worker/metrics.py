"""Report evaluation metrics from a rank back to the task that started it. Never imports Airflow.

``EvaluateModelOperator`` gives every rank ``EVAL_METRICS_URI`` (a ``file://`` or ``s3://`` URI
next to the checkpoint, so it works on every backend); rank 0 writes the metrics there as JSON and
the operator returns them through XCom and logs them to the MLflow run.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping

from airflow_torchrun.contract import EVAL_METRICS_URI

METRICS_ENV = EVAL_METRICS_URI


def report_metrics(metrics: Mapping[str, float]) -> str | None:
    """Rank 0 writes ``metrics`` to ``$EVAL_METRICS_URI``; other ranks do nothing. Returns the URI.

    Values must be finite numbers (they end up in MLflow and in a quality gate).
    """
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    uri = os.environ.get(METRICS_ENV)
    if not uri:
        raise RuntimeError(f"{METRICS_ENV} is not set: report_metrics() runs inside EvaluateModelOperator's ranks")
    clean: dict[str, float] = {}
    for key, value in metrics.items():
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"metric {key!r} is {value!r}; metrics must be finite numbers")
        clean[str(key)] = number
    import fsspec

    from airflow_torchrun.storage.aws import s3_options_from_env

    options = s3_options_from_env() if uri.startswith("s3://") else {}
    with fsspec.open(uri, "w", **options) as fp:
        json.dump(clean, fp, sort_keys=True)
    return uri
