"""The Airflow side of MLflow tracking: one MLflow run per DAG run and task, kept across tries.

The training operator calls :func:`ensure_run` before it starts the group and hands the run to
every rank through :func:`rank_env` (``MLFLOW_TRACKING_URI``, ``MLFLOW_RUN_ID``); rank 0 logs into
it with :mod:`airflow_torchrun.worker.tracking`. mlflow is imported only inside the functions,
so importing this module (and parsing a DAG) stays cheap.

Tracking URI, in order: the ``tracking_uri`` argument, ``$MLFLOW_TRACKING_URI`` (as everywhere in
MLflow), ``[torchrun] mlflow_tracking_uri``, then a SQLite store in the project's state directory.

Errors follow the one policy of :mod:`airflow_torchrun.errors`: :func:`check_tracking_uri` and
:func:`ensure_run` raise :class:`~airflow_torchrun.errors.TrackingError`, ``transient`` when the
server did not answer (refused, timed out, 5xx), permanent otherwise; each MLflow request waits
seconds, not MLflow's own minutes of retries, so a caller's
:func:`~airflow_torchrun.errors.retry_transient` budget means what it says. At the end of a
group, tracking is best effort: :func:`finish_run` never raises; a run it could not close is
remembered on this machine and closed by the next tracking call that reaches the server.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from airflow_torchrun import contract
from airflow_torchrun.errors import TrackingError, is_transient, retry_transient
from airflow_torchrun.mlflow_http import bounded_requests
from airflow_torchrun.naming import digest
from airflow_torchrun.redaction import credentials_in, redact, without_credentials
from airflow_torchrun.state import state_dir

if TYPE_CHECKING:
    from mlflow import MlflowClient

T = TypeVar("T")
log = logging.getLogger(__name__)

#: Tags every run gets; together dag_id, run_id, task_id and map_index identify it.
TAG_DAG_ID = "airflow.dag_id"
TAG_RUN_ID = "airflow.run_id"
TAG_TASK_ID = "airflow.task_id"
TAG_MAP_INDEX = "airflow.map_index"
TAG_TRY_NUMBER = "airflow.try_number"
#: Key under which the run id is kept in Airflow 3.3's ``task_state_store`` (survives retries).
STATE_KEY = "mlflow_run_id"
DEFAULT_CHECK_TIMEOUT = 5.0
#: Seconds one MLflow request may take (MLflow's own default is 120 s, retried 7 times).
REQUEST_TIMEOUT = 10.0
#: How long :func:`finish_run` rides out an outage before it gives up and leaves the run for later.
DEFAULT_FINISH_BUDGET = 30.0
#: Where runs that could not be closed wait for the next call that reaches the server.
UNFINISHED_DIR = "unfinished-runs"

#: The old name of :class:`~airflow_torchrun.errors.TrackingError` (kept so that imports work).
TrackingUnreachableError = TrackingError
# Try number of each run this process started or reused (ensure_run), for finish_run's record.
_tries: dict[str, str] = {}


def default_tracking_uri() -> str:
    """SQLite in the state directory: ``sqlite:///<state dir>/mlflow/mlflow.db``."""
    return f"sqlite:///{state_dir() / 'mlflow' / 'mlflow.db'}"


def resolve_tracking_uri(tracking_uri: str | None = None) -> str:
    """The tracking URI to use (see the module docstring for the order)."""
    uri = tracking_uri or os.environ.get(contract.MLFLOW_TRACKING_URI)
    if not uri:
        from airflow_torchrun.compat import conf

        uri = conf.get("torchrun", "mlflow_tracking_uri", fallback=None) or default_tracking_uri()
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        # Ranks run in other directories: a relative SQLite path must not depend on the cwd.
        uri = f"sqlite:///{Path(uri[len('sqlite:///') :]).resolve()}"
    return uri


def tracking_configured(tracking_uri: str | None = None) -> bool:
    """Whether a tracking server is configured: the argument, ``$MLFLOW_TRACKING_URI`` or
    ``[torchrun] mlflow_tracking_uri`` (the SQLite default in the state directory does not count).
    A training task with ``track=None`` creates an MLflow run only then."""
    if tracking_uri or os.environ.get(contract.MLFLOW_TRACKING_URI):
        return True
    from airflow_torchrun.compat import conf

    return bool(conf.get("torchrun", "mlflow_tracking_uri", fallback=None))


def _sqlite_path(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri[len("sqlite:///") :].split("?", 1)[0])


def check_tracking_uri(tracking_uri: str, timeout: float = DEFAULT_CHECK_TIMEOUT) -> None:
    """Fail fast, with a clear message, when ``tracking_uri`` cannot be used.

    HTTP(S) servers get one request with a short timeout (MLflow's own client would retry for
    minutes first). No answer, or a 5xx/408/429 one, raises a transient :class:`TrackingError`;
    any other HTTP answer counts as reachable. For SQLite the directory is created (a permanent
    :class:`TrackingError` when it cannot be).
    """
    try:
        _check_tracking_uri(tracking_uri, timeout)
    except TrackingError as exc:
        if not credentials_in(tracking_uri):
            raise
        raise TrackingError(redact(str(exc), tracking_uri), transient=exc.transient) from None


def _check_tracking_uri(tracking_uri: str, timeout: float) -> None:
    if tracking_uri.startswith(("http://", "https://")):
        url = tracking_uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout):
                pass
        except urllib.error.HTTPError as exc:
            if is_transient(exc):
                raise TrackingError(
                    f"MLflow tracking server {tracking_uri} answered HTTP {exc.code} ({exc.reason}): it is up "
                    "but failing or overloaded. This is usually temporary; if it lasts, check the server's logs "
                    "and its database",
                    transient=True,
                ) from exc
            return  # it answered: reachable (auth or routing is MLflow's business)
        except OSError as exc:  # URLError, timeouts and refused connections are all OSErrors
            reason = getattr(exc, "reason", exc)
            raise TrackingError(
                f"MLflow tracking server {tracking_uri} is not reachable ({reason}) within {timeout:g}s. "
                "Start it (mlflow server ...), fix tracking_uri / MLFLOW_TRACKING_URI, or unset "
                f"MLFLOW_TRACKING_URI to use the local SQLite store ({default_tracking_uri()})",
                transient=True,
            ) from exc
        return
    db = _sqlite_path(tracking_uri)
    if db is not None:
        try:
            db.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TrackingError(
                f"cannot create the directory of the MLflow SQLite store {tracking_uri}: {exc}. "
                "Point MLFLOW_TRACKING_URI (or tracking_uri) at a writable location",
                transient=False,
            ) from exc


def tracking_error(exc: BaseException, doing: str, tracking_uri: str) -> TrackingError:
    """``exc`` from MLflow as a :class:`TrackingError`, transient as :func:`is_transient` says; the
    URI's credentials never in its message."""
    error = _tracking_error(exc, doing, tracking_uri)
    return (
        error
        if not credentials_in(tracking_uri)
        else TrackingError(redact(str(error), tracking_uri), transient=error.transient)
    )


def _tracking_error(exc: BaseException, doing: str, tracking_uri: str) -> TrackingError:
    if isinstance(exc, TrackingError):
        return exc
    if is_transient(exc):
        return TrackingError(
            f"MLflow at {tracking_uri} did not answer while {doing} ({type(exc).__name__}: {exc}). If the server "
            "is restarting this passes; otherwise check that it is up and reachable from the Airflow workers",
            transient=True,
        )
    return TrackingError(
        f"MLflow at {tracking_uri} refused {doing} ({type(exc).__name__}: {exc}). Retrying will not help: "
        "fix the tracking URI, the credentials (MLFLOW_TRACKING_TOKEN / _USERNAME / _PASSWORD) or the run",
        transient=False,
    )


def _guarded(doing: str, tracking_uri: str, call: Callable[[], T]) -> T:
    """Run MLflow calls with short requests; their errors become :class:`TrackingError`."""
    try:
        with bounded_requests(timeout=REQUEST_TIMEOUT, retries=0):
            return call()
    except Exception as exc:
        raise tracking_error(exc, doing, tracking_uri) from exc


def artifact_location(tracking_uri: str, experiment_name: str) -> str | None:
    """Where a new experiment keeps artifacts: next to a SQLite store, else the server's choice.

    Without this, MLflow puts a SQLite store's artifacts in ``./mlruns`` of whatever directory
    the process happens to run in.
    """
    db = _sqlite_path(tracking_uri)
    if db is None:
        return None
    from airflow_torchrun.naming import segment

    return (db.parent / "artifacts" / segment(experiment_name)).resolve().as_uri()


def client(tracking_uri: str | None = None) -> MlflowClient:
    """An ``MlflowClient`` for the resolved tracking URI (registry at the same URI), checked first."""
    import mlflow
    from mlflow import MlflowClient

    uri = resolve_tracking_uri(tracking_uri)
    check_tracking_uri(uri)
    # The SQL registry resolves ``models:/<id>`` sources through MLflow's *global* tracking URI
    # (MLflow 3), which otherwise defaults to ./mlflow.db of whatever the working directory is.
    # MLflow also exports it as $MLFLOW_TRACKING_URI "for subprocesses": the next task run in this
    # process (dag.test() runs every task in one) would then resolve this URI instead of its own.
    exported = os.environ.get(contract.MLFLOW_TRACKING_URI)
    try:
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
    finally:
        if exported is None:
            os.environ.pop(contract.MLFLOW_TRACKING_URI, None)
        else:
            os.environ[contract.MLFLOW_TRACKING_URI] = exported
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def get_or_create_experiment(mlflow_client: MlflowClient, name: str) -> str:
    """The id of experiment ``name``, created if needed (safe when two tasks race to create it)."""
    from mlflow.exceptions import MlflowException

    existing = mlflow_client.get_experiment_by_name(name)
    if existing is not None:
        if existing.lifecycle_stage == "deleted":
            mlflow_client.restore_experiment(existing.experiment_id)
        return str(existing.experiment_id)
    try:
        return str(
            mlflow_client.create_experiment(name, artifact_location=artifact_location(mlflow_client.tracking_uri, name))
        )
    except MlflowException:
        again = mlflow_client.get_experiment_by_name(name)
        if again is None:
            raise
        return str(again.experiment_id)


def quote_filter_value(value: str) -> str:
    quote = "'" if "'" not in value else '"'
    if quote in value:
        raise ValueError(f"cannot search MLflow for a value holding both quote characters: {value!r}")
    return f"{quote}{value}{quote}"


def identity_tags(context: Mapping[str, Any]) -> dict[str, str]:
    """The tags that name one task of one DAG run (plus its try number)."""
    ti = context["ti"]
    map_index = getattr(ti, "map_index", None)
    return {
        TAG_DAG_ID: str(ti.dag_id),
        TAG_RUN_ID: str(ti.run_id),
        TAG_TASK_ID: str(ti.task_id),
        TAG_MAP_INDEX: str(-1 if map_index is None else map_index),
        TAG_TRY_NUMBER: str(getattr(ti, "try_number", 1)),
    }


def find_run(mlflow_client: MlflowClient, experiment_id: str, tags: Mapping[str, str]) -> str | None:
    """The newest live run in ``experiment_id`` whose identity tags equal ``tags``."""
    keys = (TAG_DAG_ID, TAG_RUN_ID, TAG_TASK_ID, TAG_MAP_INDEX)
    filter_string = " and ".join(f"tags.`{k}` = {quote_filter_value(tags[k])}" for k in keys)
    runs = mlflow_client.search_runs(
        [experiment_id], filter_string=filter_string, max_results=1, order_by=["attributes.start_time DESC"]
    )
    return runs[0].info.run_id if runs else None


def _live_run(mlflow_client: MlflowClient, run_id: object) -> str | None:
    from mlflow.exceptions import MlflowException

    if not isinstance(run_id, str) or not run_id:
        return None
    try:
        run = mlflow_client.get_run(run_id)
    except MlflowException:
        return None
    return run_id if run.info.lifecycle_stage == "active" else None


def ensure_run(
    context: Mapping[str, Any],
    experiment_name: str | None = None,
    tracking_uri: str | None = None,
) -> str:
    """The MLflow run of this DAG run's task: created on the first try, reused on later ones.

    Looked up first in ``context["task_state_store"]`` (Airflow >= 3.3, survives retries), then
    by the tags ``airflow.dag_id``/``airflow.run_id``/``airflow.task_id``/``airflow.map_index``
    (which also finds it when the task is cleared and re-run). On reuse the run is set back to
    RUNNING and ``airflow.try_number`` is updated. Returns the run id (``MLFLOW_RUN_ID``).

    :param context: The task's Airflow context.
    :param experiment_name: MLflow experiment; default: the DAG id.
    :param tracking_uri: Default: see :func:`resolve_tracking_uri`.
    :raises TrackingError: transient when the tracking server does not answer (each request
        gives up within seconds: call this through ``retry_transient``), permanent when it refuses.
    """
    uri = resolve_tracking_uri(tracking_uri)
    run_id = _guarded("starting the task's run", uri, lambda: _ensure_run(context, experiment_name, uri))
    _tries[run_id] = identity_tags(context)[TAG_TRY_NUMBER]
    return run_id


def _ensure_run(context: Mapping[str, Any], experiment_name: str | None, tracking_uri: str) -> str:
    mlflow_client = client(tracking_uri)
    close_unfinished(mlflow_client)
    tags = identity_tags(context)
    experiment_id = get_or_create_experiment(mlflow_client, experiment_name or tags[TAG_DAG_ID])
    store = context.get("task_state_store")

    run_id = _live_run(mlflow_client, store.get(STATE_KEY)) if store is not None else None
    how = "task_state_store"
    if run_id is None:
        run_id, how = find_run(mlflow_client, experiment_id, tags), "tags"
    if run_id is None:
        run = mlflow_client.create_run(
            experiment_id, tags=tags, run_name=f"{tags[TAG_TASK_ID]}__{tags[TAG_RUN_ID]}"[:250]
        )
        run_id = run.info.run_id
        log.info(
            "Created MLflow run %s in experiment %s for %s.%s (%s), try %s",
            run_id,
            experiment_id,
            tags[TAG_DAG_ID],
            tags[TAG_TASK_ID],
            tags[TAG_RUN_ID],
            tags[TAG_TRY_NUMBER],
        )
    else:
        mlflow_client.set_tag(run_id, TAG_TRY_NUMBER, tags[TAG_TRY_NUMBER])
        mlflow_client.update_run(run_id, status="RUNNING")
        log.info("Reusing MLflow run %s (found by %s), try %s", run_id, how, tags[TAG_TRY_NUMBER])
    if store is not None:
        store.set(STATE_KEY, run_id)
    return run_id


def rank_env(run_id: str, tracking_uri: str | None = None) -> dict[str, str]:
    """What every rank needs to log into ``run_id``: ``MLFLOW_TRACKING_URI`` and ``MLFLOW_RUN_ID``."""
    return {contract.MLFLOW_TRACKING_URI: resolve_tracking_uri(tracking_uri), contract.MLFLOW_RUN_ID: run_id}


def finish_run(
    run_id: str,
    *,
    succeeded: bool,
    tracking_uri: str | None = None,
    budget: float = DEFAULT_FINISH_BUDGET,
    try_number: int | str | None = None,
) -> bool:
    """Mark the run FINISHED or FAILED once the group has ended (the next try sets it RUNNING again).

    Best effort, never raises: the group's outcome stands whatever MLflow does. A transient failure
    is retried for up to ``budget`` seconds; past that (or on a permanent one) a warning names the
    run and returns False. A run left RUNNING by an outage is written down under the state
    directory and closed, with this end time, by the next :func:`ensure_run` or :func:`finish_run`
    on this machine that reaches the same server, unless a later try has taken the run over by then.

    :param try_number: The try that ends (default: the one :func:`ensure_run` saw in this process);
        a record of an older try than the run's ``airflow.try_number`` is discarded, not applied.
    :returns: True when MLflow recorded the status.
    """
    status = "FINISHED" if succeeded else "FAILED"
    end_ms = int(time.time() * 1000)
    uri = tracking_uri or "MLflow"
    try:
        uri = resolve_tracking_uri(tracking_uri)

        def close() -> None:
            def calls() -> None:
                mlflow_client = client(uri)
                mlflow_client.set_terminated(run_id, status=status, end_time=end_ms)
                close_unfinished(mlflow_client)

            _guarded(f"marking run {run_id} {status}", uri, calls)

        retry_transient(close, budget=budget, what=f"Marking MLflow run {run_id} {status}", log=log)
    except Exception as exc:
        if not is_transient(exc):
            log.warning(
                "MLflow run %s could not be marked %s (%s). The task's outcome is not affected; the run keeps "
                "its current status (set it in the MLflow UI if it matters)",
                run_id,
                status,
                redact(str(exc), uri),
            )
            return False
        tries = str(try_number) if try_number is not None else _tries.get(run_id)
        where = _remember_unfinished(uri, run_id, status, end_ms, tries)
        log.warning(
            "MLflow run %s could not be marked %s within %.0fs (%s). The task's outcome is not affected; the run "
            "stays RUNNING until the next tracking call from this machine that reaches %s closes it (%s)",
            run_id,
            status,
            budget,
            redact(str(exc), uri),
            redact(uri, uri),
            f"recorded in {where}" if where else "could not record it: close it in the MLflow UI",
        )
        return False
    _forget_unfinished(run_id)
    return True


def _unfinished_dir() -> Path:
    return state_dir() / "mlflow" / UNFINISHED_DIR


def _remember_unfinished(uri: str, run_id: str, status: str, end_ms: int, try_number: str | None) -> Path | None:
    # The record is a file on this machine: the URI's credentials stay out of it (matched by digest).
    record = {
        "tracking_uri": redact(uri, uri),
        "tracking_uri_digest": digest(uri, length=32),
        "run_id": run_id,
        "status": status,
        "end_time": end_ms,
        "try_number": try_number,
    }
    path = _unfinished_dir() / f"{run_id}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)
    except OSError as exc:
        log.warning("Cannot record unfinished MLflow run %s in %s: %s", run_id, path, exc)
        return None
    return path


def _forget_unfinished(run_id: str) -> None:
    try:
        (_unfinished_dir() / f"{run_id}.json").unlink(missing_ok=True)
    except OSError:
        pass


def unfinished_runs(tracking_uri: str | None = None) -> list[dict[str, Any]]:
    """Runs :func:`finish_run` could not close on this machine (all of them, or those of one URI)."""
    records = []
    folder = _unfinished_dir()
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict):
            continue
        same = tracking_uri is not None and record.get("tracking_uri_digest") == digest(tracking_uri, length=32)
        legacy = tracking_uri is not None and record.get("tracking_uri") == tracking_uri
        if tracking_uri is None or same or legacy:
            records.append(record)
    return records


def close_unfinished(mlflow_client: MlflowClient) -> int:
    """Close the runs left RUNNING by an outage at this client's server; returns how many it closed.

    A run is closed with the status and end time its try ended with, unless it is no longer
    RUNNING or a later try took it over (its ``airflow.try_number`` moved on): then the record
    is just dropped. Stops at the first transient error (the server is down again) and never raises.
    """
    from mlflow.exceptions import MlflowException

    closed = 0
    for record in unfinished_runs(mlflow_client.tracking_uri):
        run_id = str(record.get("run_id"))
        try:
            with bounded_requests(timeout=REQUEST_TIMEOUT, retries=0):
                run = mlflow_client.get_run(run_id)
                taken_over = record.get("try_number") not in (None, run.data.tags.get(TAG_TRY_NUMBER))
                if run.info.status == "RUNNING" and run.info.lifecycle_stage == "active" and not taken_over:
                    mlflow_client.set_terminated(run_id, status=str(record["status"]), end_time=record.get("end_time"))
                    log.info("Closed MLflow run %s as %s (left RUNNING by an earlier outage)", run_id, record["status"])
                    closed += 1
        except Exception as exc:
            if is_transient(exc):
                log.debug("MLflow still not answering; unfinished run %s stays recorded: %s", run_id, exc)
                break
            if not isinstance(exc, MlflowException):
                log.warning("Cannot close unfinished MLflow run %s: %s", run_id, exc)
                break
            log.warning("Dropping the record of unfinished MLflow run %s: %s", run_id, exc)
        _forget_unfinished(run_id)
    return closed


def run_url(run_id: str, tracking_uri: str | None = None) -> str:
    """The run's page in the MLflow UI (``[torchrun] mlflow_ui_url``, or the server itself when the
    tracking URI is an MLflow server)."""
    from airflow_torchrun.compat import conf

    uri = resolve_tracking_uri(tracking_uri)
    # A link people open (and XCom holds): the server's address, never its credentials.
    base = without_credentials(uri) if uri.startswith(("http://", "https://")) else None
    base = conf.get("torchrun", "mlflow_ui_url", fallback=None) or base or "http://localhost:5000"
    experiment_id = client(uri).get_run(run_id).info.experiment_id
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
