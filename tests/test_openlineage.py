"""OpenLineage from the pipeline: the provider's listener, a file transport, every event validated.

``airflow dags test torchrun_pipeline`` (one node, one epoch, approval off) with the OpenLineage
provider installed (the ``openlineage`` extra) and ``[openlineage] transport`` a file. Every event
in the file must validate against OpenLineage's published JSON schema (``tests/openlineage_spec``:
the run event, each standard facet by name) and our ``torchrun`` facet against its schema in the
package. Then the datasets: the source data into ``shard``, the manifest out of it; the manifest
into ``train``, its final checkpoint out with the ``torchrun`` facet; the checkpoint into
``evaluate``, its metrics out; the model version out of ``register`` and ``promote``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

SPEC = Path(__file__).parent / "openlineage_spec"
OURS = ROOT / "operators" / "airflow_torchrun" / "lineage_schemas"
DAG_ID = "torchrun_pipeline"

pytest.importorskip("airflow.providers.openlineage", reason="the openlineage extra is not installed")


def _registry() -> Any:
    from referencing import Registry, Resource

    resources = []
    for path in [SPEC / "OpenLineage.json", *sorted((SPEC / "facets").glob("*.json")), *OURS.glob("*.json")]:
        schema = json.loads(path.read_text())
        resources.append((schema["$id"], Resource.from_contents(schema)))
    return Registry().with_resources(resources)


def _facet_schemas() -> dict[str, str]:
    """Facet name -> the $ref of its definition, for the standard facets and ours."""
    out = {}
    for path in [*sorted((SPEC / "facets").glob("*.json")), *OURS.glob("*.json")]:
        schema = json.loads(path.read_text())
        for name in schema.get("$defs", {}):
            if name.endswith("Facet"):
                out[name] = f"{schema['$id']}#/$defs/{name}"
    return out


def validate(event: dict[str, Any]) -> list[str]:
    """Problems of one event: against RunEvent, then each facet whose schema is one we hold.
    Returns the names of the facets validated (to check that ours were)."""
    from jsonschema import Draft202012Validator

    registry = _registry()
    run_event = {"$ref": "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent"}
    Draft202012Validator(run_event, registry=registry).validate(event)
    known = _facet_schemas()
    checked = []
    facets: list[dict[str, Any]] = [event["run"].get("facets", {}), event["job"].get("facets", {})]
    for dataset in [*event.get("inputs", []), *event.get("outputs", [])]:
        facets += [dataset.get("facets", {}), dataset.get("inputFacets", {}), dataset.get("outputFacets", {})]
    for group in facets:
        for key, facet in group.items():
            url = str(facet.get("_schemaURL", ""))
            name = url.rsplit("/", 1)[-1].split(".json", maxsplit=1)[0]
            if name in known:
                Draft202012Validator({"$ref": known[name]}, registry=registry).validate(facet)
                checked.append(key)
    return checked


@pytest.fixture(scope="module")
def events(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("openlineage")
    sink = base / "events.jsonl"
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(base / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__TORCHRUN__STATE_DIR": str(base / "state"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps({"type": "file", "log_file_path": str(sink), "append": True}),
        "AIRFLOW__OPENLINEAGE__NAMESPACE": "airflow-torchrun-test",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, capture_output=True)
    conf = {"num_nodes": 1, "epochs": 1, "require_approval": False, "quality_gate": {"accuracy": ">= 0.5"}}
    run = subprocess.run(
        [sys.executable, "-m", "airflow", "dags", "test", DAG_ID, "-c", json.dumps(conf)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert sink.exists(), f"no OpenLineage events were written\n{(run.stdout + run.stderr)[-4000:]}"
    yield [json.loads(line) for line in sink.read_text().splitlines() if line.strip()]


def _of(events: list[dict[str, Any]], task: str, kind: str) -> dict[str, Any]:
    found = [e for e in events if e["job"]["name"] == f"{DAG_ID}.{task}" and e["eventType"] == kind]
    assert found, f"no {kind} event for {task}: {sorted({(e['job']['name'], e['eventType']) for e in events})}"
    return found[-1]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_event_validates_against_the_openlineage_schema(events: list[dict[str, Any]]) -> None:
    tasks = {"export_dataset", "shard", "train", "evaluate", "register", "approve", "promote"}
    seen = {e["job"]["name"].split(".", 1)[1] for e in events if "." in e["job"]["name"]}
    assert tasks <= seen, seen
    for event in events:
        validate(event)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_shard_and_register_name_their_datasets(events: list[dict[str, Any]]) -> None:
    shard = _of(events, "shard", "COMPLETE")
    (source,) = shard["inputs"]
    assert source["namespace"] == "file" and source["name"].endswith("/data/digits.npz"), source
    (manifest,) = shard["outputs"]
    assert manifest["namespace"] == "file" and manifest["name"].endswith("/manifest.json"), manifest
    register = _of(events, "register", "COMPLETE")
    (version,) = register["outputs"]
    assert version == {**version, "namespace": "mlflow://local", "name": "models/digits-mlp/versions/1"}, version
    (model_run,) = register["inputs"]
    assert model_run["name"].startswith("runs/"), model_run
    assert _of(events, "register", "START")["inputs"] == [model_run]  # the run it registers from, at once
    assert _of(events, "promote", "COMPLETE")["outputs"][0]["name"] == "models/digits-mlp/versions/1"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_train_and_evaluate_events_carry_the_group(events: list[dict[str, Any]]) -> None:
    train = _of(events, "train", "COMPLETE")
    assert "torchrun" in validate(train)
    facet = train["run"]["facets"]["torchrun"]
    assert (facet["worldSize"], facet["numNodes"], facet["nprocPerNode"], facet["tryNumber"]) == (1, 1, 1, 1), facet
    assert 0 < facet["goodput"] <= 1, facet  # the try's ETTR, from the ledger the engine published
    assert [d["name"].rsplit("/", 1)[-1] for d in train["inputs"]] == ["manifest.json"], train["inputs"]
    (checkpoint,) = train["outputs"]
    assert checkpoint["namespace"] == "file" and "/train/step-" in checkpoint["name"], checkpoint
    evaluate = _of(events, "evaluate", "COMPLETE")
    assert "torchrun" in validate(evaluate)
    assert checkpoint in evaluate["inputs"], evaluate["inputs"]
    assert [d["name"].rsplit("/", 2)[-2] for d in evaluate["outputs"]] == ["eval"], evaluate["outputs"]


def test_the_training_facets_of_a_real_operator_validate() -> None:
    """The facet functions on real operators, with what the operators keep in memory."""
    from airflow_torchrun import DistributedTrainingOperator, EvaluateModelOperator
    from airflow_torchrun.lineage_openlineage import evaluation_lineage, training_lineage

    root = "s3://ckpt-bucket/pipe/run/train"
    summary = {
        "checkpoint_uri": root,
        "final_checkpoint": f"{root}/step-00000110",
        "world_size": 4,
        "num_nodes": 2,
        "nproc_per_node": 2,
        "backend": "local",
    }
    trainer = str(ROOT / "images" / "trainer")
    train = DistributedTrainingOperator(
        task_id="train",
        script=f"{trainer}/train.py",
        num_nodes=2,
        nproc_per_node=2,
        shard_manifest="file:///data/manifest.json",
    )
    lineage = training_lineage(
        train,
        2,
        summary=summary,
        resumed={"uri": f"{root}/step-00000020", "step": 20},
        goodput={"version": 1, "try": {"try": 2, "ettr": 0.83}, "task": {"ettr": 0.5}},
    )
    assert [(d.namespace, d.name) for d in lineage.inputs] == [
        ("file", "/data/manifest.json"),
        ("s3://ckpt-bucket", "pipe/run/train/step-00000020"),
    ]
    assert [(d.namespace, d.name) for d in lineage.outputs] == [("s3://ckpt-bucket", "pipe/run/train/step-00000110")]
    facet = lineage.run_facets["torchrun"]
    assert (facet.worldSize, facet.numNodes, facet.tryNumber, facet.resumedStep, facet.goodput) == (4, 2, 2, 20, 0.83)
    started = training_lineage(train, 1)  # before the group: the shape asked for
    assert started.run_facets["torchrun"].numNodes == 2 and started.run_facets["torchrun"].worldSize is None
    evaluate = EvaluateModelOperator(
        task_id="evaluate",
        script=f"{trainer}/evaluate.py",
        checkpoint=f"{root}/step-00000110",
        shard_manifest="/data/m.json",
    )
    ev = evaluation_lineage(evaluate, 1, metrics_uri=f"{root}/eval/evaluate-t1.json", group={"world_size": 1})
    assert [d.name for d in ev.inputs] == ["pipe/run/train/step-00000110", "/data/m.json"]
    assert [d.name for d in ev.outputs] == ["pipe/run/train/eval/evaluate-t1.json"]

    from openlineage.client.serde import Serde

    for facets in (lineage.run_facets, ev.run_facets):
        event = _event_with(json.loads(Serde.to_json(facets["torchrun"])))
        assert validate(event) == ["torchrun"]


def _event_with(facet: dict[str, Any]) -> dict[str, Any]:
    return {
        "eventType": "COMPLETE",
        "eventTime": "2026-12-01T00:00:00Z",
        "producer": "https://github.com/apache/airflow",
        "schemaURL": "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent",
        "run": {"runId": "0191b0e0-0000-7000-8000-000000000000", "facets": {"torchrun": facet}},
        "job": {"namespace": "test", "name": "pipe.train"},
        "inputs": [],
        "outputs": [],
    }


def test_register_names_the_run_it_registers_from_on_start_and_on_failure() -> None:
    """Every one of shard, train, evaluate and register answers on start, complete and failure."""
    from airflow_torchrun import RegisterModelOperator
    from airflow_torchrun.operators.evaluate import EvaluateModelOperator
    from airflow_torchrun.operators.shard import ShardDatasetOperator
    from airflow_torchrun.operators.training import DistributedTrainingOperator

    for cls in (ShardDatasetOperator, DistributedTrainingOperator, EvaluateModelOperator, RegisterModelOperator):
        for hook in ("on_start", "on_complete", "on_failure"):
            assert callable(getattr(cls, f"get_openlineage_facets_{hook}", None)), (cls.__name__, hook)
    register = RegisterModelOperator(
        task_id="register", model_name="digits", run_id="abc123", tracking_uri="http://mlflow:5000"
    )
    (started,) = register.get_openlineage_facets_on_start().inputs
    assert (started.namespace, started.name) == ("mlflow://mlflow:5000", "runs/abc123")
    failed = register.get_openlineage_facets_on_failure(None)  # failed before a version was made
    assert [d.name for d in failed.inputs] == ["runs/abc123"] and failed.outputs == []
    register._lineage_result = {"name": "digits", "version": 3, "run_id": "abc123"}  # failed after: the gate
    after = register.get_openlineage_facets_on_failure(None)
    assert [d.name for d in after.outputs] == ["models/digits/versions/3"]
    templated = RegisterModelOperator(task_id="r2", model_name="digits", run_id="{{ ti.xcom_pull('train') }}")
    assert templated.get_openlineage_facets_on_start().inputs == []  # not rendered: nothing claimed
