"""What a task's storage and tracking must be for pods on other machines: checked when the DAG is parsed."""

from __future__ import annotations

import re
from collections.abc import Mapping


def local_path(uri: str) -> bool:
    """A ``file:`` URI or a plain path: storage on one machine's disk."""
    return uri.startswith("file:") or "://" not in uri


def local_tracking_store(uri: str) -> bool:
    """An MLflow tracking URI that names a store on this machine (SQLite, a file store, a path)."""
    if uri == "databricks" or uri.startswith("databricks"):
        return False
    return uri.startswith("sqlite:") or local_path(uri)


def _credentials_in(uri: str) -> bool:
    from airflow_torchrun.redaction import credentials_in

    return bool(credentials_in(uri))


# Variables that carry credentials by convention: these names, or names ending in these words. A
# value given for one in ``env=`` would be written into the Job's pod spec in plain text. Words
# that also name settings (``HF_HUB_DISABLE_IMPLICIT_TOKEN``, ``PAD_TOKEN``,
# ``GOOGLE_APPLICATION_CREDENTIALS``, a path) are not among them: a value Airflow itself knows as
# a secret is refused whatever its name (:func:`secret_values`).
_CREDENTIAL_WORDS = (
    "PASSWORD",
    "PASSWD",
    "SECRET",
    "SECRET_KEY",
    "SECRET_ACCESS_KEY",
    "API_KEY",
    "APIKEY",
    "PRIVATE_KEY",
    "ACCESS_TOKEN",
    "AUTH_TOKEN",
    "SESSION_TOKEN",
    "TOKEN",
)
_CREDENTIAL_NAMES = frozenset(
    {"AWS_ACCESS_KEY_ID", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "GH_TOKEN", "GITHUB_TOKEN", "DATABRICKS_TOKEN"}
)
_CREDENTIAL_ENDINGS = tuple(f"_{word}" for word in _CREDENTIAL_WORDS if word != "TOKEN")


def credential_names(env: Mapping[str, str]) -> list[str]:
    """The names in ``env`` that carry credentials by convention (``HF_TOKEN``, ``DB_PASSWORD``,
    ``OPENAI_API_KEY``; not ``TOKENIZERS_PARALLELISM``: names are matched by their last words)."""
    return sorted(
        n
        for n in env
        if n.upper() in _CREDENTIAL_NAMES or n.upper() in _CREDENTIAL_WORDS or n.upper().endswith(_CREDENTIAL_ENDINGS)
    )


def secret_values(env: Mapping[str, str]) -> list[str]:
    """The names in ``env`` whose value Airflow's secrets masker holds: a connection's password or
    extra, a Variable of a sensitive name, what a task masked. Known only once the values are
    rendered, in the task's process (at parse time it holds nothing)."""
    try:
        from airflow.sdk.log import redact
    except ImportError:  # pragma: no cover - an Airflow without the task SDK's masker
        return []
    return sorted(n for n, v in env.items() if isinstance(v, str) and v and redact(v) != v)


def env_problems(env: Mapping[str, str]) -> list[str]:
    """``env=`` must not carry credentials into the pod spec."""
    named = sorted({*credential_names(env), *secret_values(env)})
    if not named:
        return []
    return [
        f"env: {', '.join(named)} would be written into the Job's pod spec in plain text (readable by anyone who "
        "may read Jobs, and by airflow-torchrun render); put credentials in a Kubernetes Secret and have the "
        "platform name it in the runtime's env_from_secrets (each of its keys becomes a variable of every rank)"
    ]


def task_problems(
    *, checkpoint_uri: str | None, default_checkpoint_base: str | None, tracking_uri: str | None
) -> list[str]:
    """Checkpoints must be storage every pod and the Airflow worker share, and rank 0 logs into the
    tracking store from a pod: it must be a server the pods reach."""
    problems = []
    if checkpoint_uri is not None and local_path(checkpoint_uri):
        problems.append(
            f"checkpoint_uri {checkpoint_uri!r} is a local path, which pods on other machines cannot share; "
            "give checkpoint_uri='s3://...' or set [torchrun] checkpoint_base to shared storage"
        )
    if default_checkpoint_base is not None and local_path(default_checkpoint_base):
        problems.append(
            f"checkpoint_uri is not set, and the default root [torchrun] checkpoint_base ({default_checkpoint_base}) "
            "is a local path, which pods on other machines cannot share (a retry could not resume); give "
            "checkpoint_uri='s3://bucket/prefix', or set [torchrun] checkpoint_base to shared storage (s3://...)"
        )
    if tracking_uri is not None and _credentials_in(tracking_uri):
        from airflow_torchrun.redaction import redact

        problems.append(
            f"the MLflow tracking URI {redact(tracking_uri, tracking_uri)!r} carries credentials, which would be "
            "written into the Job's pod spec (readable by anyone who may read Jobs, and by airflow-torchrun render); "
            "give the URI without them and the credentials to the pods through the runtime's env_from_secrets "
            "(a Secret with MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN)"
        )
    if tracking_uri is not None and local_tracking_store(tracking_uri):
        problems.append(
            f"the MLflow tracking URI {tracking_uri!r} is a store on the Airflow worker's disk, which the pods "
            "(rank 0 logs there) cannot reach; give mlflow_tracking_uri='http://<mlflow server>:5000' (or set "
            "MLFLOW_TRACKING_URI / [torchrun] mlflow_tracking_uri) to a tracking server that both the worker and "
            "the pods reach, or track=False"
        )
    return problems


_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def namespace_problems(namespace: object) -> list[str]:
    """A namespace is an RFC 1123 label (what the API server accepts); a template waits for rendering."""
    from airflow_torchrun.spec import is_templated

    if namespace is None or is_templated(namespace):
        return []
    if isinstance(namespace, str) and len(namespace) <= 63 and _NAMESPACE.match(namespace):
        return []
    suggestion = ""
    if isinstance(namespace, str) and namespace.strip():
        fixed = re.sub(r"[^a-z0-9-]+", "-", namespace.strip().lower()).strip("-")[:63].strip("-")
        suggestion = f", e.g. {fixed!r}" if fixed else ""
    return [
        f"namespace {namespace!r} is not a Kubernetes namespace name: at most 63 lower-case letters, digits "
        f"and '-', starting and ending with a letter or digit{suggestion}"
    ]
