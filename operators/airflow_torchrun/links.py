"""Extra links on training and registration tasks: they read XCom (the training try's own, from memory).

- **MLflow run** (training): the run the ranks logged into, pushed at launch.
- **Checkpoint** (training): the final checkpoint (or the checkpoint root) in a storage console,
  from the ``[torchrun] checkpoint_console_url`` template, pushed when training succeeds.
- **Registered model version** (registration): the version in the MLflow UI.

XCom is data others can write (any task of the DAG, a user with XCom access through the REST API),
and for ``@task.torchrun`` rank 0's return value is the task's. So a link is shown only when it is
an ``http(s)`` URL under a base this deployment configured (:func:`safe_link`): the MLflow UI for
the run and model links, the storage console for the checkpoint link. Anything else (a
``javascript:`` URL, another host) shows as no link.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING
from urllib.parse import quote, urlsplit

from airflow_torchrun.compat import BaseOperatorLink, XCom

if TYPE_CHECKING:
    from airflow.sdk.types import TaskInstanceKey

    from airflow_torchrun.compat import BaseOperator

MLFLOW_RUN_URL_KEY = "mlflow_run_url"
CHECKPOINT_URL_KEY = "checkpoint_url"
MODEL_VERSION_URL_KEY = "model_version_url"
# The AWS console's page of an S3 prefix; another console (MinIO, GCS) through the config option.
DEFAULT_S3_CONSOLE = "https://s3.console.aws.amazon.com/s3/buckets/{bucket}?prefix={key}/"


def checkpoint_url(uri: str, template: str | None = None) -> str:
    """Where a person opens ``uri``: ``[torchrun] checkpoint_console_url`` (placeholders ``{uri}``,
    ``{bucket}``, ``{key}``, ``{path}``) for ``s3://``, the AWS console by default; a ``file://``
    URI as is (the view shows it)."""
    if template is None:
        from airflow_torchrun.compat import conf

        template = conf.get("torchrun", "checkpoint_console_url", fallback=None) or None
    if uri.startswith("s3://"):
        bucket, _, key = uri[len("s3://") :].partition("/")
        return (template or DEFAULT_S3_CONSOLE).format(
            uri=quote(uri, safe=":/"), bucket=quote(bucket), key=quote(key.rstrip("/")), path=quote(key)
        )
    if template and "{path}" in template and uri.startswith("file://"):
        return template.format(uri=uri, bucket="", key="", path=uri[len("file://") :])
    return uri


def safe_link(url: object, bases: Iterable[str]) -> str | None:
    """``url`` when it is an ``http(s)`` URL under one of ``bases`` (same scheme, host and port, its
    path under the base's), else None. No credentials, no control characters or spaces."""
    if not isinstance(url, str) or not url or any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in url):
        return None
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or "@" in parts.netloc:
        return None
    for base in bases:
        b = urlsplit(base)
        if (b.scheme, b.netloc.lower()) != (parts.scheme, parts.netloc.lower()):
            continue
        prefix = b.path.rstrip("/")
        if not prefix or parts.path == prefix or parts.path.startswith(prefix + "/"):
            return url
    return None


def mlflow_bases() -> list[str]:
    """Where MLflow links may point: the MLflow UI this deployment configured (or its tracking server)."""
    from airflow_torchrun.tracking import resolve_tracking_uri

    try:
        return [mlflow_ui_base(resolve_tracking_uri())]
    except Exception:  # no tracking configured here: no MLflow link can be checked, so none shows
        return []


def console_bases() -> list[str]:
    """Where checkpoint links may point: the origin of ``[torchrun] checkpoint_console_url`` (the AWS
    console by default)."""
    from airflow_torchrun.compat import conf

    template = conf.get("torchrun", "checkpoint_console_url", fallback=None) or DEFAULT_S3_CONSOLE
    parts = urlsplit(template.split("{", 1)[0])
    return [f"{parts.scheme}://{parts.netloc}"] if parts.scheme in ("http", "https") and parts.netloc else []


def mlflow_ui_base(tracking_uri: str) -> str:
    """Base URL of the MLflow UI: ``[torchrun] mlflow_ui_url``, else the tracking server itself."""
    from airflow_torchrun.compat import conf

    base = tracking_uri if tracking_uri.startswith(("http://", "https://")) else None
    if base is not None and "@" in urlsplit(base).netloc:  # a link never carries the server's credentials
        parts = urlsplit(base)
        base = parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]).geturl()
    return (conf.get("torchrun", "mlflow_ui_url", fallback=None) or base or "http://localhost:5000").rstrip("/")


def model_version_url(base: str, name: str, version: int | str) -> str:
    return f"{base.rstrip('/')}/#/models/{quote(name, safe='')}/versions/{version}"


_NOT_PUSHED = object()
_TRY_FIELDS = ("dag_id", "task_id", "run_id", "map_index", "try_number")


def pushed_by_this_try(operator: object, ti_key: object, key: str) -> object:
    """What the try running in this process pushed as XCom ``key``, else ``_NOT_PUSHED``.

    Airflow's worker asks every link of a task once it ends, each an XCom read through the API
    server before the task may end; the training task's own try kept what it pushed
    (``TaskIO.pushed``), so its links are answered from that: two round trips fewer per try.
    """
    io = getattr(operator, "_io", None)
    pushed = getattr(io, "pushed", None)
    ti = getattr(io, "context", {}).get("ti") if io is not None else None
    if not isinstance(pushed, dict) or key not in pushed or ti is None:
        return _NOT_PUSHED
    if ti is not ti_key and any(getattr(ti, f, None) != getattr(ti_key, f, _NOT_PUSHED) for f in _TRY_FIELDS):
        return _NOT_PUSHED
    return pushed[key]


class _XComLink(BaseOperatorLink):
    key = ""

    def bases(self) -> list[str]:
        return mlflow_bases()

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        url = pushed_by_this_try(operator, ti_key, self.key)
        if url is _NOT_PUSHED:
            # Airflow types the key as read-only here and as settable in get_value; it is the same object.
            url = XCom.get_value(key=self.key, ti_key=ti_key)  # type: ignore[arg-type]
        return safe_link(url, self.bases()) or ""


class MlflowRunLink(_XComLink):
    """'MLflow run': the run this task's ranks logged into (pushed by the operator at launch)."""

    name = "MLflow run"
    key = MLFLOW_RUN_URL_KEY


class CheckpointLink(_XComLink):
    """'Checkpoint': the training's final checkpoint in the storage console (pushed on success)."""

    name = "Checkpoint"
    key = CHECKPOINT_URL_KEY

    def bases(self) -> list[str]:
        return console_bases()


class ModelVersionLink(_XComLink):
    """'Registered model version': the version the registration created, in the MLflow UI."""

    name = "Registered model version"
    key = MODEL_VERSION_URL_KEY
