"""What a task's storage and tracking must be for pods on other machines: checked when the DAG is parsed."""

from __future__ import annotations


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
