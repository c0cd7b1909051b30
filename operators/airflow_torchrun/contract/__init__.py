"""The contract between the operators and the ranks: rank variables, shared names, wire formats.

This package is what both sides import (the ranks' helpers in :mod:`airflow_torchrun.worker`, no
Airflow; the Airflow side, which never imports ``worker/``): the variables below,
:mod:`~airflow_torchrun.contract.progress` (the progress-record line),
:mod:`~airflow_torchrun.contract.function` (a ``@task.torchrun`` call) and
:mod:`~airflow_torchrun.contract.launch` (the names the wiring, launchers and backends share). Standard library only.

The public rank contract: the variables the operators set in every rank's environment.

One source of truth. :meth:`GroupSpec.create <airflow_torchrun.spec.GroupSpec.create>` refuses
these names in ``env``, :func:`airflow_torchrun.wiring.plan` never lets ``env`` override them, the
worker helpers read them, and README's contract table lists them. Standard library only: both the
ranks (no Airflow) and DAG parsing (no torch) import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

CHECKPOINT_URI = "TRAIN_CHECKPOINT_URI"
# The same location as a path, for a script's own flag (``--output_dir``, ``--default_root_dir``).
CHECKPOINT_DIR = "TRAIN_CHECKPOINT_DIR"
RESUME_FROM = "TRAIN_RESUME_FROM"
CHECKPOINT_KEEP_LAST = "TRAIN_CHECKPOINT_KEEP_LAST"
CHECKPOINT_STORAGE_OPTIONS = "TRAIN_CHECKPOINT_STORAGE_OPTIONS"
CHECKPOINT_LINEAGE = "TRAIN_CHECKPOINT_LINEAGE"
CHECKPOINT_TRUST_SHARDED = "TRAIN_CHECKPOINT_TRUST_SHARDED"
SHARD_MANIFEST = "TRAIN_SHARD_MANIFEST"
# should_checkpoint's inputs: the operator's mtbf (seconds), and this lineage's failures seen so far
# (JSON {"failures": k, "seconds": t}: failed launches in t seconds of its earlier launches).
CHECKPOINT_MTBF = "TRAIN_CHECKPOINT_MTBF"
FAILURES_OBSERVED = "TRAIN_FAILURES_OBSERVED"
MLFLOW_TRACKING_URI = "MLFLOW_TRACKING_URI"
MLFLOW_RUN_ID = "MLFLOW_RUN_ID"
EVAL_CHECKPOINT_URI = "EVAL_CHECKPOINT_URI"
EVAL_METRICS_URI = "EVAL_METRICS_URI"

# A rank that was asked to stop (SIGTERM) and saved a checkpoint first exits with this code
# (EX_TEMPFAIL): retryable, and the retry resumes from that checkpoint. Not a variable.
STOPPED_TO_SAVE_EXIT_CODE = 75

# Each name, and what to set instead of putting it in ``env``.
CONTRACT_ENV: Mapping[str, str] = MappingProxyType(
    {
        CHECKPOINT_URI: "set the operator argument checkpoint_uri=... instead",
        CHECKPOINT_DIR: "set the operator argument checkpoint_uri=... instead (this is its path form)",
        RESUME_FROM: "set the operator argument resume=... instead (EvaluateModelOperator: checkpoint=...)",
        CHECKPOINT_KEEP_LAST: "set the operator argument keep_last=... instead",
        CHECKPOINT_STORAGE_OPTIONS: "set the operator argument storage_options=... (or aws_conn_id=...) instead",
        CHECKPOINT_LINEAGE: "derived from the task instance; set checkpoint_uri=... for another root instead",
        CHECKPOINT_TRUST_SHARDED: "set the operator argument trust_foreign_sharded=... (True) instead",
        SHARD_MANIFEST: "set the operator argument shard_manifest=... instead",
        CHECKPOINT_MTBF: "set the operator argument mtbf=... (seconds) instead",
        FAILURES_OBSERVED: "derived from the task's earlier launches; set mtbf=... to override instead",
        MLFLOW_TRACKING_URI: "set the operator argument mlflow_tracking_uri=... instead",
        MLFLOW_RUN_ID: "set track=True (EvaluateModelOperator: mlflow_run_id=...) instead",
        EVAL_CHECKPOINT_URI: "set EvaluateModelOperator's argument checkpoint=... instead",
        EVAL_METRICS_URI: "EvaluateModelOperator chooses it, beside checkpoint=...; remove it from env",
    }
)


def checkpoint_dir(uri: str) -> str:
    """The path form of a checkpoint URI (``TRAIN_CHECKPOINT_DIR``): ``file:///a/b`` -> ``/a/b``.

    Other schemes (``s3://...``) stay as they are: frameworks that write through fsspec (Lightning)
    take them; those that need a local disk (Hugging Face Trainer's ``output_dir``) need a
    ``file://`` checkpoint location or one of the integrations.
    """
    if uri.startswith("file://"):
        return uri[len("file://") :] or "/"
    return uri
