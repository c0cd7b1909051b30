"""Inside a rank: log to the task's MLflow run from rank 0 only; every other rank does nothing.

The training operator passes ``MLFLOW_TRACKING_URI`` and ``MLFLOW_RUN_ID`` (one run per DAG run
and task, kept across tries). Typical use in a training script::

    from airflow_torchrun.worker.tracking import RunLogger, StepTimer

    with RunLogger() as tracker:                  # a no-op on ranks other than 0
        tracker.log_params({"lr": lr, "epochs": epochs})
        timer = StepTimer()
        for step, batch in enumerate(loader, start=start_step):
            with timer.data():
                x, y = batch                      # time spent waiting for data
            with timer.compute():
                loss = train_step(x, y)
            tracker.log_step(step, loss=loss.item(), samples=len(x) * world_size, timing=timer.lap())
        tracker.log_loss_curve()
        tracker.log_model(model)

Metrics are buffered and sent with one ``log_batch`` call every ``flush_every`` steps (or
``flush_seconds``), not one request per value. Steps already in the run (logged by an earlier
try before it failed) are not logged again, so each step appears once in the run's history.
No Airflow import here; mlflow is imported on rank 0 only, when first needed.
"""

from __future__ import annotations

import inspect
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

log = logging.getLogger(__name__)

LOSS = "loss"
THROUGHPUT = "throughput_samples_per_s"
DATA_WAIT = "data_wait_fraction"
STEP_TIME = "step_time_s"
# MLflow accepts at most 1000 metrics in one log_batch request.
_BATCH_LIMIT = 1000


@dataclass(frozen=True)
class StepTiming:
    """How one training step's wall time divides into waiting for data and the rest."""

    data_seconds: float
    total_seconds: float

    @property
    def compute_seconds(self) -> float:
        return max(0.0, self.total_seconds - self.data_seconds)

    @property
    def data_fraction(self) -> float:
        """Share of the step spent waiting for data, in ``[0, 1]``."""
        if self.total_seconds <= 0:
            return 0.0
        return min(1.0, max(0.0, self.data_seconds / self.total_seconds))


class StepTimer:
    """Measure, per step, the time spent waiting for data against the step's whole wall time.

    Wrap the data fetch in ``with timer.data():`` and call :meth:`lap` once per step; the step
    time is the wall time between two laps (so logging and everything else count too).
    """

    def __init__(self) -> None:
        self._data = 0.0
        self._last: float | None = None

    def _start(self) -> float:
        now = time.perf_counter()
        if self._last is None:
            self._last = now
        return now

    @contextmanager
    def data(self) -> Iterator[None]:
        """Time spent in this block counts as waiting for data."""
        started = self._start()
        try:
            yield
        finally:
            self._data += time.perf_counter() - started

    @contextmanager
    def compute(self) -> Iterator[None]:
        """Marks the compute part of a step (it is the step time minus the data time)."""
        self._start()
        yield

    def lap(self) -> StepTiming:
        """End the current step and return its timing."""
        now = time.perf_counter()
        start = self._last if self._last is not None else now
        timing = StepTiming(data_seconds=self._data, total_seconds=now - start)
        self._data, self._last = 0.0, now
        return timing


def current_rank() -> int:
    """This process's global rank (torchrun's ``RANK``; 0 when unset)."""
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


class RunLogger:
    """Rank-0 logging into the task's MLflow run; every method is a no-op on other ranks.

    Also a no-op (with one warning) when no run is configured, so a script still runs outside
    Airflow. Use it as a context manager, or call :meth:`close`, so buffered metrics are sent.

    :param run_id: Default: ``MLFLOW_RUN_ID``.
    :param tracking_uri: Default: ``MLFLOW_TRACKING_URI``.
    :param rank: Default: ``RANK``.
    :param flush_every: Send buffered metrics every this many steps.
    :param flush_seconds: ...or when this much time passed since the last send.
    """

    def __init__(
        self,
        run_id: str | None = None,
        tracking_uri: str | None = None,
        *,
        rank: int | None = None,
        flush_every: int = 20,
        flush_seconds: float = 10.0,
    ) -> None:
        self.rank = current_rank() if rank is None else rank
        self.run_id = run_id or os.environ.get("MLFLOW_RUN_ID") or None
        self.tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        self.flush_every = max(1, int(flush_every))
        self.flush_seconds = float(flush_seconds)
        self.enabled = self.rank == 0 and self.run_id is not None
        if self.rank == 0 and self.run_id is None:
            log.warning("MLFLOW_RUN_ID is not set: not logging to MLflow (run through DistributedTrainingOperator)")
        self._client: MlflowClient | None = None
        self._pending: list[Metric] = []
        self._pending_steps = 0
        self._last_flush = time.monotonic()
        self._logged: dict[str, set[int]] = {}
        self.steps_skipped = 0

    # -- plumbing ------------------------------------------------------------------------------
    @property
    def client(self) -> MlflowClient:
        if self._client is None:
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    @property
    def _run(self) -> str:
        # Only reached when enabled, which implies a run id.
        if self.run_id is None:
            raise RuntimeError("no MLflow run configured (MLFLOW_RUN_ID is not set)")
        return self.run_id

    def _steps_logged(self, key: str) -> set[int]:
        """Steps of metric ``key`` already in the run, read once per key."""
        if key not in self._logged:
            # A resumed try repeats the steps between its checkpoint and the failure.
            steps = {m.step for m in self.client.get_metric_history(self._run, key)}
            if steps:
                log.info("MLflow run already holds %s up to step %d; not logging those steps again", key, max(steps))
            self._logged[key] = steps
        return self._logged[key]

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Send what is buffered."""
        self.flush()

    # -- params and metrics --------------------------------------------------------------------
    def log_params(self, params: Mapping[str, object]) -> None:
        """Log hyperparameters once: keys the run already has are left as they are."""
        if not self.enabled or not params:
            return
        from mlflow.entities import Param

        existing = self.client.get_run(self._run).data.params
        new = []
        for key, value in params.items():
            text = str(value)[:6000]
            if key not in existing:
                new.append(Param(str(key), text))
            elif existing[key] != text:
                log.warning("MLflow param %s already logged as %r; keeping it (not %r)", key, existing[key], text)
        for start in range(0, len(new), 100):
            self.client.log_batch(self._run, params=new[start : start + 100])

    def log_step(
        self,
        step: int,
        *,
        loss: float,
        samples: int | None = None,
        timing: StepTiming | None = None,
        **extra: float,
    ) -> None:
        """Buffer one step's metrics: loss, and with ``timing`` the step time, throughput and data wait.

        :param step: The global step (kept across resumed tries).
        :param loss: The step's training loss.
        :param samples: Samples processed in this step by all ranks together (e.g.
            ``batch_size * WORLD_SIZE``); throughput is ``samples / step time``.
        :param timing: From :meth:`StepTimer.lap`.
        :param extra: More metrics for this step (e.g. ``lr=...``).
        """
        if not self.enabled:
            return
        metrics: dict[str, float] = {LOSS: float(loss)}
        if timing is not None:
            metrics[STEP_TIME] = timing.total_seconds
            metrics[DATA_WAIT] = timing.data_fraction
            if samples is not None and timing.total_seconds > 0:
                metrics[THROUGHPUT] = samples / timing.total_seconds
        metrics.update({k: float(v) for k, v in extra.items()})
        self.log_metrics(metrics, step)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Buffer metrics for ``step``; a metric an earlier try already logged at ``step`` is left out."""
        if not self.enabled:
            return
        fresh = {k: float(v) for k, v in metrics.items() if step not in self._steps_logged(k)}
        if len(fresh) < len(metrics):
            self.steps_skipped += 1
        if not fresh:
            return
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self._pending.extend(Metric(k, v, now_ms, int(step)) for k, v in fresh.items())
        for key in fresh:
            self._logged[key].add(step)
        self._pending_steps += 1
        if self._pending_steps >= self.flush_every or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Send buffered metrics now (one request per 1000 values)."""
        if not self.enabled or not self._pending:
            return
        pending, self._pending, self._pending_steps = self._pending, [], 0
        for start in range(0, len(pending), _BATCH_LIMIT):
            self.client.log_batch(self._run, metrics=pending[start : start + _BATCH_LIMIT])
        self._last_flush = time.monotonic()

    # -- artifacts -----------------------------------------------------------------------------
    def log_loss_curve(self, *, metric: str = LOSS, artifact_file: str = "loss_curve.png") -> str | None:
        """Plot the run's whole ``metric`` history (all tries) to a PNG artifact; returns its path in the run."""
        if not self.enabled:
            return None
        self.flush()
        history = sorted((m.step, m.value) for m in self.client.get_metric_history(self._run, metric))
        if not history:
            log.warning("No %s values in MLflow run %s; no loss curve", metric, self.run_id)
            return None
        # The object API with the Agg canvas: no pyplot, no global backend switch, no display.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ax.plot([s for s, _ in history], [v for _, v in history], linewidth=1.2)
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} ({len(history)} steps)")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / Path(artifact_file).name
            fig.savefig(path, format="png")
            parent = str(Path(artifact_file).parent)
            self.client.log_artifact(self._run, str(path), artifact_path=None if parent == "." else parent)
        return artifact_file

    def log_model(
        self,
        model: Any,
        name: str = "model",
        *,
        input_example: Any = None,
        **kwargs: Any,
    ) -> str | None:
        """Log ``model`` (a ``torch.nn.Module``; DDP wrappers are unwrapped) as an MLflow model of the run.

        Without ``input_example`` the model is saved in MLflow's pickle format (the ``pt2`` format
        needs an example to trace). ``RegisterModelOperator`` finds it by ``name``. Other keyword
        arguments go to ``mlflow.pytorch.log_model``. Returns the model URI.
        """
        if not self.enabled:
            return None
        self.flush()
        import mlflow
        import mlflow.pytorch

        module = getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model
        if self.tracking_uri:
            mlflow.set_tracking_uri(self.tracking_uri)
        # The logged model belongs to the run's experiment, not to whatever experiment is active.
        mlflow.set_experiment(experiment_id=self.client.get_run(self._run).info.experiment_id)
        if input_example is None and "serialization_format" in inspect.signature(mlflow.pytorch.log_model).parameters:
            # Newer MLflow defaults to "pt2", which cannot save without an example to trace.
            kwargs.setdefault("serialization_format", "pickle")
        info = mlflow.pytorch.log_model(module, name=name, run_id=self._run, input_example=input_example, **kwargs)
        log.info("Logged model %s to MLflow run %s as %s", name, self.run_id, info.model_uri)
        return str(info.model_uri)
