"""Retrain when new data lands: an asset watcher on the data's prefix triggers ``torchrun_pipeline``.

The asset ``digits-incoming`` is watched by :class:`airflow_torchrun.watchers.NewDataTrigger`: every
``TORCHRUN_RETRAIN_POLL_S`` seconds (default 60) the triggerer lists ``TORCHRUN_RETRAIN_URI``
(default ``file://<state dir>/incoming/digits``; ``s3://<conn_id>@bucket/prefix`` for S3) and, when
objects appeared or changed there, records one asset event naming them. This DAG is scheduled on that
asset: each event (or several, if they came while a run was starting) makes one run, which picks the
newest ``.npz``/``.parquet``/``.csv`` among the new objects and triggers ``torchrun_pipeline`` on it;
the promotion of the retrained model still waits for an approval there. Data that was already there
when the watcher first looked, and data it already reported (also across triggerer restarts: its
state is in the asset's state store), trigger nothing. Unpause both DAGs to use it.
"""

from __future__ import annotations

import os
from typing import Any

import pendulum
from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import DAG, Asset, AssetWatcher, task

from airflow_torchrun.state import state_dir
from airflow_torchrun.storage.uri import split_conn_id
from airflow_torchrun.watchers import NewDataTrigger

DATA_URI = os.environ.get("TORCHRUN_RETRAIN_URI") or f"file://{state_dir() / 'incoming' / 'digits'}"
POLL_S = float(os.environ.get("TORCHRUN_RETRAIN_POLL_S") or 60)
DATASETS = (".npz", ".parquet", ".csv")

INCOMING = Asset(
    name="digits-incoming",
    uri=split_conn_id(DATA_URI)[1],  # the asset is the data; the connection only reaches it
    watchers=[AssetWatcher(name="digits-incoming-watcher", trigger=NewDataTrigger(DATA_URI, poll_interval=POLL_S))],
)

with DAG(
    dag_id="torchrun_retrain",
    description="Retrain the digits MLP when new data lands under the watched prefix",
    schedule=[INCOMING],
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    tags=["torchrun", "example"],
    doc_md=__doc__,
):

    @task
    def newest_data(triggering_asset_events: Any = None) -> str:
        """The newest dataset file among the objects the triggering events name (each event names
        them oldest first, and the events come in the order they happened)."""
        named: list[str] = []
        for events in (triggering_asset_events or {}).values():
            for event in sorted(events, key=lambda e: e.timestamp):
                payload = (event.extra or {}).get("payload") or {}
                named += [str(u) for u in payload.get("new", [])]
        data = [u for u in named if u.endswith(DATASETS)]
        if not data:
            from airflow.sdk.exceptions import AirflowSkipException

            raise AirflowSkipException(f"no dataset among the new objects ({', '.join(named[:5]) or 'none'})")
        return data[-1]

    TriggerDagRunOperator(
        task_id="retrain",
        trigger_dag_id="torchrun_pipeline",
        conf={"source_uri": newest_data()},
        wait_for_completion=False,
    )
