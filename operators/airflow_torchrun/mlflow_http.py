"""MLflow's HTTP client within a budget: used by the Airflow side and inside the ranks alike.

MLflow reads its retry count and timeout from the environment on every request; this is the one
place that sets them. Standard library only (MLflow itself is imported by the callers).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

# The variables MLflow's HTTP client reads on every request (see bounded_requests).
_HTTP_RETRIES = "MLFLOW_HTTP_REQUEST_MAX_RETRIES"

_HTTP_TIMEOUT = "MLFLOW_HTTP_REQUEST_TIMEOUT"


@contextmanager
def bounded_requests(*, timeout: float | None, retries: int = 0) -> Iterator[None]:
    """MLflow HTTP requests made inside the block: at most ``retries`` retries, ``timeout`` s each.

    MLflow's client otherwise retries a dead server for minutes (7 retries, back-off factor 2,
    120 s timeouts): far longer than a task's budget, and a stalled training loop. MLflow reads
    these two variables per request, so they are set for the block and restored after it
    (process-wide while the block runs: enter it from one thread at a time).
    ``timeout=None`` leaves the timeout alone (artifact uploads may take long).
    """
    wanted = {_HTTP_RETRIES: str(int(retries))}
    if timeout is not None:
        wanted[_HTTP_TIMEOUT] = str(max(1, round(timeout)))
    saved = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
