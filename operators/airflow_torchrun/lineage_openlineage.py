"""OpenLineage for the pipeline's operators: datasets in and out, and what the torchrun group was.

The operators' ``get_openlineage_facets_on_start/complete/failure`` call the functions here (a few
lines each); this module is imported only then, so ``apache-airflow-providers-openlineage`` (the
``openlineage`` extra) stays optional: without it nothing here is ever imported.

Datasets follow OpenLineage's naming: ``s3://bucket/key`` is namespace ``s3://bucket``, name ``key``;
a local path is namespace ``file``, name the absolute path; a model version is namespace
``mlflow://<tracking host>`` (``mlflow://local`` for a file or SQLite store), name
``models/<name>/versions/<version>``. What each task reads and writes:

- shard: the source data in; the shard manifest out;
- train: the shard manifest and the checkpoint it resumed from in; its checkpoint out (the final one
  once it succeeded, else the checkpoint root);
- evaluate: the checkpoint and the manifest in; the metrics file out;
- register: the MLflow run's model in; the model version out. promote: the version in and out.

Run facets: ``torchrun`` (:class:`TorchrunRunFacet`: world size, nodes, ranks per node, try,
resumed step, goodput when the ledger reported it) on train and evaluate. Its schema ships with the
package (``lineage_schemas/TorchrunRunFacet.json``) under the URN in :data:`TORCHRUN_FACET_SCHEMA`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

import attrs
from airflow.providers.openlineage.extractors import OperatorLineage
from openlineage.client.event_v2 import Dataset
from openlineage.client.facet_v2 import RunFacet

from airflow_torchrun.storage.uri import split_conn_id

TORCHRUN_FACET_SCHEMA = "urn:airflow-torchrun:schema:TorchrunRunFacet:1-0-0#/$defs/TorchrunRunFacet"


@attrs.define
class TorchrunRunFacet(RunFacet):
    """The torchrun group behind a task's run (camelCase, as OpenLineage facets are)."""

    # camelCase: OpenLineage facets name their fields so.
    worldSize: int | None = attrs.field(default=None)
    numNodes: int | None = attrs.field(default=None)
    nprocPerNode: int | None = attrs.field(default=None)
    tryNumber: int | None = attrs.field(default=None)
    resumedStep: int | None = attrs.field(default=None)
    goodput: float | None = attrs.field(default=None)
    backend: str | None = attrs.field(default=None)

    @staticmethod
    def _get_schema() -> str:
        return TORCHRUN_FACET_SCHEMA


def dataset(uri: str) -> Dataset:
    """The OpenLineage dataset of a storage URI (a connection named in it is not part of the data)."""
    plain = split_conn_id(uri)[1].rstrip("/")
    parts = urlsplit(plain)
    if parts.scheme in ("s3", "s3a", "gs", "gcs", "abfss", "hdfs"):
        return Dataset(namespace=f"{parts.scheme}://{parts.netloc}", name=parts.path.lstrip("/") or "/")
    path = parts.path if parts.scheme == "file" else plain
    return Dataset(namespace="file", name=path)


def model_dataset(tracking_uri: str, name: str, version: int | str) -> Dataset:
    host = urlsplit(tracking_uri).netloc if tracking_uri.startswith(("http://", "https://")) else "local"
    return Dataset(namespace=f"mlflow://{host}", name=f"models/{name}/versions/{version}")


def _datasets(uris: Iterable[object]) -> list[Dataset]:
    out: list[Dataset] = []
    for uri in uris:
        if isinstance(uri, str) and uri.strip() and "{{" not in uri:
            found = dataset(uri.strip())
            if found not in out:
                out.append(found)
    return out


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _goodput(value: object) -> float | None:
    """This try's ETTR from the goodput ledger (XCom ``goodput``: ``{"try": {"ettr": ...}, ...}``),
    when it has one (a script without the progress helpers has none)."""
    this = value.get("try") if isinstance(value, Mapping) else None
    share = this.get("ettr") if isinstance(this, Mapping) else None
    if isinstance(share, int | float) and not isinstance(share, bool) and 0 <= share <= 1:
        return float(share)
    return None


def torchrun_facet(
    summary: Mapping[str, Any] | None, try_number: int | None, resumed: object, goodput: object
) -> TorchrunRunFacet:
    s = summary or {}
    return TorchrunRunFacet(
        worldSize=_int(s.get("world_size")),
        numNodes=_int(s.get("num_nodes")),
        nprocPerNode=_int(s.get("nproc_per_node")),
        tryNumber=try_number,
        resumedStep=_int(resumed.get("step")) if isinstance(resumed, Mapping) else None,
        goodput=_goodput(goodput),
        backend=s.get("backend") if isinstance(s.get("backend"), str) else None,
    )


# -- per operator ---------------------------------------------------------------------------------
def shard_lineage(source_uri: object, manifest_uri: object) -> OperatorLineage:
    return OperatorLineage(inputs=_datasets([source_uri]), outputs=_datasets([manifest_uri]))


def training_lineage(
    op: Any,
    try_number: int | None,
    *,
    summary: Mapping[str, Any] | None = None,
    resumed: Mapping[str, Any] | None = None,
    goodput: object = None,
) -> OperatorLineage:
    """``DistributedTrainingOperator``: manifest and resume point in, checkpoint out, the group's facet.

    The values come from the operator's memory (what ``execute`` kept: its result, ``resumed_from``,
    the goodput ledger's), never from XCom: the provider calls the complete and failure methods in a
    forked process, where an XCom read through the task's supervisor channel hung until the listener
    killed it. ``summary`` None: the task has not succeeded (start, failure): the checkpoint root.
    """
    s = summary or {}
    facet = torchrun_facet(
        {"num_nodes": _int(op.num_nodes), "nproc_per_node": _int(op.nproc_per_node), "backend": op.backend, **s},
        try_number,
        resumed,
        goodput,
    )
    return OperatorLineage(
        inputs=_datasets([op.shard_manifest, (resumed or {}).get("uri")]),
        outputs=_datasets([s.get("final_checkpoint") or s.get("checkpoint_uri") or op.checkpoint_uri]),
        run_facets={"torchrun": facet},
    )


def evaluation_lineage(
    op: Any, try_number: int | None, *, metrics_uri: str | None = None, group: Mapping[str, Any] | None = None
) -> OperatorLineage:
    """``EvaluateModelOperator``: checkpoint and manifest in, metrics out (values from memory, as above)."""
    return OperatorLineage(
        inputs=_datasets([op.checkpoint, op.shard_manifest]),
        outputs=_datasets([metrics_uri]),
        run_facets={"torchrun": torchrun_facet(group, try_number, None, None)},
    )


def _engine_memory(op: Any) -> tuple[Any, dict[str, Any], Any]:
    """The try's engine, what its contract pushed, and its result (all from memory; see above)."""
    engine = getattr(op, "_engine", None)
    contract = getattr(engine, "contract", None)
    pushed = getattr(getattr(contract, "io", None), "pushed", None)
    return contract, dict(pushed or {}), getattr(engine, "result", None)


def training_lineage_of(op: Any, ti: Any) -> OperatorLineage:
    """What ``DistributedTrainingOperator``'s methods return: :func:`training_lineage` from the try's memory."""
    contract, pushed, result = _engine_memory(op)
    summary = dict(result) if isinstance(result, Mapping) else {}
    if contract is not None and not summary.get("checkpoint_uri"):
        summary["checkpoint_uri"] = getattr(contract, "checkpoint_uri", None)
    resumed = pushed.get("resumed_from")
    return training_lineage(
        op,
        _int(getattr(ti, "try_number", None)),
        summary=summary,
        resumed=resumed if isinstance(resumed, Mapping) else None,
        goodput=pushed.get("goodput"),
    )


def evaluation_lineage_of(op: Any, ti: Any) -> OperatorLineage:
    """What ``EvaluateModelOperator``'s methods return: :func:`evaluation_lineage` from the try's memory."""
    contract, pushed, _result = _engine_memory(op)
    metrics_uri = None
    if contract is not None:
        try:
            metrics_uri = contract._metrics_location()
        except Exception:  # lineage never fails a task: no metrics location is no output
            metrics_uri = None
    group = pushed.get("group_summary")
    return evaluation_lineage(
        op,
        _int(getattr(ti, "try_number", None)),
        metrics_uri=metrics_uri,
        group=group if isinstance(group, Mapping) else None,
    )


def run_model_lineage(run_id: object, tracking_uri: str) -> OperatorLineage:
    """``RegisterModelOperator`` before (or without) a version: the training run's model in, nothing out."""
    if not isinstance(run_id, str) or not run_id.strip() or "{{" in run_id:
        return OperatorLineage()
    namespace = model_dataset(tracking_uri, "-", 0).namespace
    return OperatorLineage(inputs=[Dataset(namespace=namespace, name=f"runs/{run_id.strip()}")])


def registration_lineage(result: Mapping[str, Any] | None, tracking_uri: str) -> OperatorLineage:
    """``RegisterModelOperator`` / ``PromoteModelOperator``: the run's model in, the version out."""
    if not result or "version" not in result:
        return OperatorLineage()
    name, version = str(result.get("name")), result["version"]
    inputs = [
        Dataset(namespace=model_dataset(tracking_uri, name, version).namespace, name=f"runs/{result.get('run_id')}")
    ]
    return OperatorLineage(inputs=inputs, outputs=[model_dataset(tracking_uri, name, version)])
