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

Tracking is best effort: no MLflow failure reaches the training loop. While the server does not
answer, metrics and params stay buffered (a value leaves the buffer only once the server took it)
and are sent again after a back-off (5 s doubling to 60 s; each attempt waits at most
``request_timeout`` seconds, MLflow's own minutes-long retries are turned off for it). The buffer
holds at most ``max_buffered`` values: past that the *oldest* are dropped, counted in
``metrics_dropped`` and named in a warning. :meth:`RunLogger.close` keeps trying for
``close_budget`` seconds, then warns about what is left unsent. A value the server refuses
(permanent error, e.g. an invalid key) is dropped with an error log. Re-sending a batch whose
answer was lost does not duplicate it: every value keeps its timestamp, and MLflow's SQL store
ignores a metric identical in key, value, timestamp and step. Artifacts (the loss curve, the
model) ride out an outage of up to 30 s / 60 s, then are skipped with a warning; errors that are
not the server's absence (a model that cannot be saved) are raised as before.
No Airflow import here; mlflow is imported on rank 0 only, when first needed.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from airflow_torchrun import contract
from airflow_torchrun.errors import is_transient, retry_transient
from airflow_torchrun.mlflow_http import bounded_requests

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

T = TypeVar("T")

log = logging.getLogger(__name__)

LOSS = "loss"
THROUGHPUT = "throughput_samples_per_s"
DATA_WAIT = "data_wait_fraction"
STEP_TIME = "step_time_s"
# MLflow accepts at most 1000 metrics (and 100 params) in one log_batch request.
_BATCH_LIMIT = 1000
_PARAM_LIMIT = 100
# After a failed send: wait this long before the next attempt, doubling up to the maximum.
RETRY_FIRST_S = 5.0
RETRY_MAX_S = 60.0


def model_requirements(model: Any) -> list[str]:
    """What a logged PyTorch model needs installed: MLflow's own defaults for its ``pytorch`` flavor
    (torch and cloudpickle, pinned to the versions here), then the installed distribution, pinned,
    of every package that defines one of the model's layers (``model.modules()``). A layer defined
    in the training script itself belongs to no distribution and adds nothing.

    MLflow's inference (what ``log_model`` does without requirements) loads the saved model again in
    a subprocess and lists every distribution that load imported: 10 s of rank 0's time on a busy
    two-core machine, with every other rank waiting, and a list with whatever MLflow's own imports
    pulled in (accelerate, pandas, scipy, transformers where they are installed, for an ``nn.Linear``).
    """
    from importlib import metadata

    import mlflow.pytorch
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found = list(mlflow.pytorch.get_default_pip_requirements())
    seen = {canonicalize_name(Requirement(r).name) for r in found}
    layers = model.modules() if hasattr(model, "modules") else [model]
    packages = {type(layer).__module__.partition(".")[0] for layer in layers} - {"torch", "__main__", "builtins"}
    owners = metadata.packages_distributions() if packages else {}
    for package in sorted(packages):
        for dist in owners.get(package, []):
            if canonicalize_name(dist) not in seen:
                seen.add(canonicalize_name(dist))
                found.append(f"{dist}=={metadata.version(dist)}")
    return found


@dataclass(frozen=True)
class StepTiming:
    """How one training step's wall time divides into waiting for data and the rest."""

    data_seconds: float
    total_seconds: float
    peer_seconds: float = 0.0  # spent in ``StepTimer.peers()``: waiting for the other ranks

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
        self._peers = 0.0
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
    def peers(self) -> Iterator[None]:
        """Time spent in this block counts as waiting for the other ranks (e.g. a ``dist.barrier()``
        before the backward pass). In synchronous training every rank's wall step time is the
        slowest rank's; the time *not* spent waiting for peers tells which rank is slow, so
        straggler warnings need this block."""
        started = self._start()
        try:
            yield
        finally:
            self._peers += time.perf_counter() - started

    @contextmanager
    def compute(self) -> Iterator[None]:
        """Marks the compute part of a step (it is the step time minus the data time)."""
        self._start()
        yield

    def lap(self) -> StepTiming:
        """End the current step and return its timing."""
        now = time.perf_counter()
        start = self._last if self._last is not None else now
        timing = StepTiming(data_seconds=self._data, total_seconds=now - start, peer_seconds=self._peers)
        self._data, self._peers, self._last = 0.0, 0.0, now
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
    No method raises because MLflow is down or refuses a value (see the module docstring).

    :param run_id: Default: ``MLFLOW_RUN_ID``.
    :param tracking_uri: Default: ``MLFLOW_TRACKING_URI``.
    :param rank: Default: ``RANK``.
    :param flush_every: Send buffered metrics every this many steps.
    :param flush_seconds: ...or when this much time passed since the last send.
    :param max_buffered: Most metric values kept while MLflow does not answer; past it the oldest
        are dropped (and counted in ``metrics_dropped``).
    :param request_timeout: Seconds one request to the tracking server may take.
    :param close_budget: Seconds :meth:`close` keeps retrying what is still buffered.
    """

    def __init__(
        self,
        run_id: str | None = None,
        tracking_uri: str | None = None,
        *,
        rank: int | None = None,
        flush_every: int = 20,
        flush_seconds: float = 10.0,
        max_buffered: int = 100_000,
        request_timeout: float = 5.0,
        close_budget: float = 30.0,
    ) -> None:
        self.rank = current_rank() if rank is None else rank
        self.run_id = run_id or os.environ.get(contract.MLFLOW_RUN_ID) or None
        self.tracking_uri = tracking_uri or os.environ.get(contract.MLFLOW_TRACKING_URI) or None
        self.flush_every = max(1, int(flush_every))
        self.flush_seconds = float(flush_seconds)
        self.max_buffered = max(1, int(max_buffered))
        self.request_timeout = float(request_timeout)
        self.close_budget = float(close_budget)
        self.enabled = self.rank == 0 and self.run_id is not None
        if self.rank == 0 and self.run_id is None:
            log.warning("MLFLOW_RUN_ID is not set: not logging to MLflow (run through DistributedTrainingOperator)")
        if self.enabled and importlib.util.find_spec("mlflow") is None:
            # Tracking never fails training: say once what to change instead of raising at a step.
            log.error(
                "MLFLOW_RUN_ID is set but mlflow is not installed where this rank runs: not logging to MLflow "
                "(install airflow-torchrun[mlflow] in the trainer's environment or image)"
            )
            self.enabled = False
        self._client: MlflowClient | None = None
        self._pending: list[Metric] = []
        self._pending_params: dict[str, str] = {}
        self._pending_steps = 0
        self._last_flush = time.monotonic()
        self._logged: dict[str, set[int]] = {}
        # Keys whose history could not be read (server down): checked before their values are sent.
        self._unverified: set[str] = set()
        self._retry_at = 0.0
        self._retry_delay = RETRY_FIRST_S
        self._outage_since: float | None = None
        self.steps_skipped = 0
        #: Metric values dropped because the buffer overflowed or the server refused them.
        self.metrics_dropped = 0

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

    @property
    def pending(self) -> int:
        """Metric values buffered and not yet taken by the server."""
        return len(self._pending)

    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        with bounded_requests(timeout=self.request_timeout, retries=0):
            return fn(*args, **kwargs)

    def _where(self) -> str:
        return self.tracking_uri or "the MLflow tracking URI"

    def _failed(self, exc: Exception, doing: str) -> None:
        """Note a transient failure: back off, and warn once per outage."""
        now = time.monotonic()
        if self._outage_since is None:
            self._outage_since = now
            log.warning(
                "MLflow at %s did not answer while %s (%s); training goes on, %d metric values stay buffered "
                "(at most %d; the oldest are dropped past that) and are sent again in %.0fs",
                self._where(),
                doing,
                exc,
                len(self._pending),
                self.max_buffered,
                self._retry_delay,
            )
        else:
            log.debug("MLflow still not answering while %s: %s", doing, exc)
        self._retry_at = now + self._retry_delay
        self._retry_delay = min(self._retry_delay * 2, RETRY_MAX_S)

    def _answered(self) -> None:
        if self._outage_since is not None:
            log.warning(
                "MLflow at %s answers again after %.0fs; buffered values sent",
                self._where(),
                time.monotonic() - self._outage_since,
            )
        self._outage_since = None
        self._retry_at = 0.0
        self._retry_delay = RETRY_FIRST_S

    def _steps_logged(self, key: str) -> set[int]:
        """Steps of metric ``key`` already in the run, read once per key."""
        if key not in self._logged:
            self._logged[key] = set()
            if time.monotonic() < self._retry_at:
                self._unverified.add(key)
            else:
                try:
                    self._read_history(key)
                except Exception as exc:
                    if not is_transient(exc):
                        raise
                    self._unverified.add(key)
                    self._failed(exc, f"reading the history of {key}")
        return self._logged[key]

    def _read_history(self, key: str) -> None:
        # A resumed try repeats the steps between its checkpoint and the failure.
        steps = {m.step for m in self._call(self.client.get_metric_history, self._run, key)}
        if steps:
            log.info("MLflow run already holds %s up to step %d; not logging those steps again", key, max(steps))
        self._logged[key] |= steps
        self._unverified.discard(key)

    def _verify(self) -> None:
        """Read the history of every key first seen during an outage; drop what the run already has."""
        skipped: set[int] = set()
        for key in sorted(self._unverified):
            buffered = set(self._logged[key])
            self._logged[key] = set()
            self._read_history(key)
            known = self._logged[key]
            skipped |= {m.step for m in self._pending if m.key == key and m.step in known}
            self._pending = [m for m in self._pending if m.key != key or m.step not in known]
            self._logged[key] |= buffered
        self.steps_skipped += len(skipped)

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Send what is buffered, retrying for up to ``close_budget`` seconds; never raises."""
        if not self.enabled:
            return
        deadline = time.monotonic() + self.close_budget
        while not self.flush():
            wait = max(0.0, self._retry_at - time.monotonic())
            if time.monotonic() + wait >= deadline:
                break
            time.sleep(wait)
        if self._pending or self._pending_params:
            steps = sorted({m.step for m in self._pending})
            log.warning(
                "MLflow at %s did not take %d buffered metric values (steps %s) and %d params within %.0fs; "
                "they are not in run %s (training itself is unaffected)",
                self._where(),
                len(self._pending),
                f"{steps[0]}-{steps[-1]}" if steps else "none",
                len(self._pending_params),
                self.close_budget,
                self.run_id,
            )

    # -- params and metrics --------------------------------------------------------------------
    def log_params(self, params: Mapping[str, object]) -> None:
        """Log hyperparameters once: keys the run already has are left as they are.

        Sent now; while MLflow does not answer they wait in the buffer with the metrics.
        """
        if not self.enabled or not params:
            return
        for key, value in params.items():
            self._pending_params.setdefault(str(key), str(value)[:6000])
        self.flush()

    def _send_params(self) -> None:
        if not self._pending_params:
            return
        from mlflow.entities import Param

        existing = self._call(self.client.get_run, self._run).data.params
        new: list[Param] = []
        for key, text in self._pending_params.items():
            if key not in existing:
                new.append(Param(key, text))
            elif existing[key] != text:
                log.warning("MLflow param %s already logged as %r; keeping it (not %r)", key, existing[key], text)
        for start in range(0, len(new), _PARAM_LIMIT):
            chunk = new[start : start + _PARAM_LIMIT]
            self._call(self.client.log_batch, self._run, params=chunk)
        self._pending_params.clear()

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

        Every rank (MLflow or not) also feeds this step to its progress records
        (:mod:`airflow_torchrun.worker.progress`): the task log, the watch and the training view read them.
        """
        from airflow_torchrun.worker.progress import recorder

        recorder().note(
            step,
            samples=samples,
            loss=float(loss),
            step_seconds=timing.total_seconds if timing is not None else None,
            data_seconds=timing.data_seconds if timing is not None else None,
            peer_seconds=timing.peer_seconds if timing is not None else None,
        )
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
        try:
            fresh = {k: float(v) for k, v in metrics.items() if step not in self._steps_logged(k)}
        except Exception as exc:  # permanent: the run is gone or the key is refused
            log.error(
                "MLflow refused reading run %s (%s); these metrics of step %d are dropped", self.run_id, exc, step
            )
            self.metrics_dropped += len(metrics)
            return
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
        self._drop_overflow()
        due = self._pending_steps >= self.flush_every or time.monotonic() - self._last_flush >= self.flush_seconds
        # While MLflow is down, wait out the back-off rather than stall every step on it.
        if due and time.monotonic() >= self._retry_at:
            self.flush()

    def _drop_overflow(self) -> None:
        overflow = len(self._pending) - self.max_buffered
        if overflow <= 0:
            return
        dropped, self._pending = self._pending[:overflow], self._pending[overflow:]
        self.metrics_dropped += overflow
        log.warning(
            "MLflow buffer full (%d values while %s does not answer): dropped the oldest %d (steps %d-%d); "
            "they will be missing from run %s",
            self.max_buffered,
            self._where(),
            overflow,
            dropped[0].step,
            dropped[-1].step,
            self.run_id,
        )

    def flush(self) -> bool:
        """Try to send everything buffered now (one request per 1000 values); never raises.

        Returns True when nothing is left buffered. A value leaves the buffer only once the server
        took it; on a transient failure the rest stays for the next attempt.
        """
        if not self.enabled:
            return True
        if not self._pending and not self._pending_params:
            return True
        try:
            self._send_params()
            self._verify()
            while self._pending:
                chunk = self._pending[:_BATCH_LIMIT]
                try:
                    self._call(self.client.log_batch, self._run, metrics=chunk)
                except Exception as exc:
                    if is_transient(exc):
                        raise
                    log.error(
                        "MLflow refused %d metric values (steps %d-%d) for run %s: %s; dropped them",
                        len(chunk),
                        chunk[0].step,
                        chunk[-1].step,
                        self.run_id,
                        exc,
                    )
                    self.metrics_dropped += len(chunk)
                del self._pending[: len(chunk)]
        except Exception as exc:
            if is_transient(exc):
                self._failed(exc, "sending metrics")
            else:
                log.error(
                    "MLflow refused run %s (%s); %d buffered params dropped",
                    self.run_id,
                    exc,
                    len(self._pending_params),
                )
                self._pending_params.clear()
            return False
        finally:
            self._pending_steps = 0
            self._last_flush = time.monotonic()
        self._answered()
        return True

    def _best_effort(self, what: str, fn: Callable[[], T], budget: float) -> T | None:
        """Run an artifact upload, riding out an outage of up to ``budget`` seconds; past it warn and
        return None. A permanent error (a model that cannot be saved, say) is raised: it is a bug
        to fix, not the server's weather."""
        try:
            with bounded_requests(timeout=None, retries=0):
                return retry_transient(fn, budget=budget, what=what, log=log)
        except Exception as exc:
            if not is_transient(exc):
                raise
            log.warning(
                "%s: MLflow at %s did not answer within %.0fs (%s); training is unaffected, run %s lacks it",
                what,
                self._where(),
                budget,
                exc,
                self.run_id,
            )
            return None

    # -- artifacts -----------------------------------------------------------------------------
    def log_loss_curve(self, *, metric: str = LOSS, artifact_file: str = "loss_curve.png") -> str | None:
        """Plot the run's whole ``metric`` history (all tries) to a PNG artifact; returns its path in the run."""
        if not self.enabled:
            return None
        self.flush()
        return self._best_effort(f"Logging {artifact_file}", lambda: self._loss_curve(metric, artifact_file), budget=30)

    def _loss_curve(self, metric: str, artifact_file: str) -> str | None:
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
        arguments go to ``mlflow.pytorch.log_model``. Without ``pip_requirements`` (or
        ``conda_env``) the requirements are :func:`model_requirements` plus any
        ``extra_pip_requirements``, not MLflow's inference. Returns the model URI, or None when MLflow
        did not answer within a minute (a warning says so; training is not failed for it).
        """
        if not self.enabled:
            return None
        self.flush()
        return self._best_effort(
            f"Logging model {name}", lambda: self._log_model(model, name, input_example, kwargs), budget=60
        )

    def _log_model(self, model: Any, name: str, input_example: Any, kwargs: dict[str, Any]) -> str:
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
        if not any(k in kwargs for k in ("pip_requirements", "conda_env")):
            # Not MLflow's inference: a subprocess that loads the model again (model_requirements).
            kwargs["pip_requirements"] = [*model_requirements(module), *kwargs.pop("extra_pip_requirements", [])]
        info = mlflow.pytorch.log_model(module, name=name, run_id=self._run, input_example=input_example, **kwargs)
        log.info("Logged model %s to MLflow run %s as %s", name, self.run_id, info.model_uri)
        return str(info.model_uri)
