"""What a finished training try tells the world beyond its result: MLflow, the extra links, the asset event.

All best effort: a tracking server that is away or a link that cannot be built is a warning in the
task log, never a failed training. The training contract calls these; nothing here decides the
task's outcome.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from airflow_torchrun.links import CHECKPOINT_URL_KEY

if TYPE_CHECKING:
    from airflow_torchrun.backends.handles import GroupHandle
    from airflow_torchrun.compat import Context


def close_run(
    run_id: str,
    *,
    succeeded: bool,
    tracking_uri: str | None,
    try_number: int,
    budget: float,
    handle: GroupHandle | None,
    log: logging.Logger,
    goodput: Mapping[str, Any] | None = None,
) -> None:
    """The try's warnings (data starvation, stragglers) and its goodput ledger and resume audit
    into the run, then the run closed."""
    from airflow_torchrun.tracking import DEFAULT_FINISH_BUDGET, finish_run

    if handle is not None:
        record_warnings(run_id, handle, tracking_uri, log)
    if goodput:
        record_goodput(run_id, goodput, tracking_uri, try_number, log)
    finish_run(
        run_id,
        succeeded=succeeded,
        tracking_uri=tracking_uri,
        try_number=try_number,
        budget=min(DEFAULT_FINISH_BUDGET, budget),
    )


def record_warnings(run_id: str, handle: GroupHandle, tracking_uri: str | None, log: logging.Logger) -> None:
    """Starvation and straggler warnings of the whole try (replayed from the ranks' progress
    records) as tags and metrics of the MLflow run."""
    from airflow_torchrun.backends.base import backend_from_handle
    from airflow_torchrun.contract.progress import parse_records
    from airflow_torchrun.progress import STARVATION, STRAGGLER, ProgressThresholds, replay
    from airflow_torchrun.tracking import client

    try:
        records = parse_records(backend_from_handle(handle).read_progress_lines(handle))
        nproc = max(1, handle.world_size // max(1, handle.num_nodes))
        board, seen = replay(records, nproc_per_node=nproc, thresholds=ProgressThresholds.from_conf())
        if not seen and not board.seen:
            return
        tags: dict[str, str] = {}
        metrics: dict[str, float] = {}
        starved = [a for a in seen if a.kind == STARVATION]
        stragglers = [a for a in seen if a.kind == STRAGGLER]
        if starved:
            tags["torchrun.data_starvation"] = starved[-1].message[:5000]
            metrics["torchrun_data_wait_median"] = max(a.value or 0.0 for a in starved)
        if stragglers:
            tags["torchrun.straggler_ranks"] = ",".join(sorted({str(a.rank) for a in stragglers}))
            tags["torchrun.straggler"] = stragglers[-1].message[:5000]
            metrics["torchrun_straggler_ratio"] = max(a.value or 0.0 for a in stragglers)
        summary = board.summary()
        if summary is not None and summary.data_wait is not None:
            metrics["torchrun_final_data_wait"] = summary.data_wait
        # Each try's values describe its training up to the step it reached: logged at that step,
        # so a retry's come after the first try's instead of a second value at step 0.
        step = summary.step if summary is not None else 0
        mlflow = client(tracking_uri)
        for key, value in tags.items():
            mlflow.set_tag(run_id, key, value)
        for key, number in metrics.items():
            mlflow.log_metric(run_id, key, number, step=step)
    except Exception as exc:  # never fails a finished group
        log.warning("Could not record the training's warnings in MLflow run %s: %s", run_id, exc)


def record_goodput(
    run_id: str, goodput: Mapping[str, Any], tracking_uri: str | None, try_number: int, log: logging.Logger
) -> None:
    """The goodput ledger as metrics of the run (``goodput_<category>_s``, ``goodput_ettr`` of the
    task; ``goodput_try_ettr``, ``goodput_try_wall_s`` of this try; at step = the try number), and
    the resume audit as tags (``torchrun.resume_audit``: exact, close, diverged or none;
    ``torchrun.resume_audit_detail``: its log line)."""
    from airflow_torchrun.audit import ResumeAudit
    from airflow_torchrun.goodput import TaskLedger, TryLedger, mlflow_metrics, task_ledger
    from airflow_torchrun.tracking import client

    try:
        this = TryLedger.from_dict(goodput.get("try") or {})
        tries = [t for t in (TryLedger.from_dict(d) for d in goodput.get("tries") or ()) if t is not None]
        if this is None:
            return
        task: TaskLedger = task_ledger(tries or [this])
        mlflow = client(tracking_uri)
        for key, value in mlflow_metrics(this, task).items():
            mlflow.log_metric(run_id, key, value, step=try_number)
        audit = ResumeAudit.from_dict(goodput.get("resume_audit")) if goodput.get("resume_audit") else None
        if audit is not None:
            mlflow.set_tag(run_id, "torchrun.resume_audit", audit.status.value)
            mlflow.set_tag(run_id, "torchrun.resume_audit_detail", audit.line()[:5000])
    except Exception as exc:  # never fails a finished group
        log.warning("Could not record the goodput ledger in MLflow run %s: %s", run_id, exc)


def final_metrics(run_id: str | None, tracking_uri: str | None, log: logging.Logger) -> dict[str, float]:
    """The MLflow run's latest metrics (none when tracking is off or away)."""
    if not run_id:
        return {}
    try:
        from airflow_torchrun.tracking import client

        return {str(k): float(v) for k, v in client(tracking_uri).get_run(run_id).data.metrics.items()}
    except Exception as exc:
        log.warning("Could not read the final metrics of MLflow run %s: %s", run_id, exc)
        return {}


def publish_checkpoint(
    context: Context,
    push: Callable[[str, Any], None],
    outlets: Any,
    uri: str,
    step: int | None,
    metrics: dict[str, float],
    log: logging.Logger,
    goodput: Mapping[str, Any] | None = None,
) -> None:
    """The 'Checkpoint' link (XCom, through ``push``), and the asset event's metadata: checkpoint
    URI, step, final metrics, the task's goodput ledger (``goodput``: wall, categories, ETTR, lost
    steps, tries) and the resume audit's verdict (``resume_audit``)."""
    from airflow_torchrun.assets import annotate_outlets
    from airflow_torchrun.links import checkpoint_url

    try:
        push(CHECKPOINT_URL_KEY, checkpoint_url(uri))
    except Exception as exc:  # only the link
        log.warning("Could not build the checkpoint's link for %s: %s", uri, exc)
    if outlets:
        extra: dict[str, Any] = {"checkpoint_uri": uri, "step": step, "metrics": metrics}
        if goodput:
            extra["goodput"] = goodput.get("task")
            audit = goodput.get("resume_audit")
            extra["resume_audit"] = audit.get("status") if isinstance(audit, Mapping) else None
        annotate_outlets(context, outlets, extra, log)
