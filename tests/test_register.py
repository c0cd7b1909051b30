"""Model registration on real MLflow (SQLite registry) with real torch models: gate, aliases, idempotency."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from airflow_torchrun.compat import AirflowFailException, AirflowSkipException
from airflow_torchrun.errors import InvalidSpecError
from airflow_torchrun.operators.register import TAG_DAG_ID, TAG_DONE, TAG_RUN_ID, RegisterModelOperator, parse_gate
from airflow_torchrun.tracking import ensure_run

MODEL = "digits-mlp"


@pytest.fixture
def tracking_uri(mlflow_sqlite_uri: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_sqlite_uri)
    return mlflow_sqlite_uri


def _context(dag_run: str, task_id: str = "train") -> dict[str, Any]:
    return {"ti": SimpleNamespace(dag_id="pipe", run_id=dag_run, task_id=task_id, map_index=-1, try_number=1)}


def train(dag_run: str, metrics: dict[str, float]) -> str:
    """One 'training': an MLflow run with metrics and a tiny real torch model logged by rank 0."""
    import torch

    from airflow_torchrun.worker.tracking import RunLogger

    run_id = ensure_run(_context(dag_run))
    tracker = RunLogger(run_id=run_id, rank=0)
    tracker.log_metrics(metrics, step=0)
    tracker.flush()
    # pip_requirements given: skips MLflow's requirement inference (a 3 s subprocess per model).
    tracker.log_model(torch.nn.Sequential(torch.nn.Linear(4, 3)), pip_requirements=["torch"])
    return run_id


def register(dag_run: str, run_id: str, **kwargs: Any) -> dict[str, Any]:
    kwargs.setdefault("gate", {"accuracy": ">= 0.9"})
    op = RegisterModelOperator(task_id="register", model_name=MODEL, run_id=run_id, **kwargs)
    return op.execute(_context(dag_run, "register"))  # type: ignore[arg-type]


def _versions(tracking_uri: str) -> dict[int, list[str]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    found = client.search_model_versions(f"name = '{MODEL}'")
    return {int(v.version): sorted(client.get_model_version(MODEL, str(v.version)).aliases) for v in found}


def test_failing_gate_skips_and_registers_nothing(tracking_uri: str, capfd: pytest.CaptureFixture[str]) -> None:
    run_id = train("run-a", {"accuracy": 0.5, "loss": 1.2})
    with pytest.raises(AirflowSkipException, match=r"quality gate failed: accuracy = 0.5, needs >= 0.9"):
        register("run-a", run_id)
    out, err = capfd.readouterr()
    assert "Not registering digits-mlp from run" in out + err  # the reason is in the task log
    assert _versions(tracking_uri) == {}


def test_champion_goes_to_better_models_only_and_a_rerun_registers_nothing(tracking_uri: str) -> None:
    import mlflow.pytorch
    import torch

    first = register("run-1", train("run-1", {"accuracy": 0.91}))
    assert {k: first[k] for k in ("name", "version", "aliases", "champion")} == {
        "name": MODEL,
        "version": 1,
        "aliases": ["candidate", "champion"],
        "champion": True,
    }
    assert first["proposal"] == {
        "promote": True,
        "why": "there is no champion yet",
        "champion_version": None,
        "champion_metrics": {},
    }
    better = register("run-2", train("run-2", {"accuracy": 0.95}))
    assert better["version"] == 2 and better["champion"]
    worse = register("run-3", train("run-3", {"accuracy": 0.93}))
    assert worse["version"] == 3 and worse["aliases"] == ["candidate"] and not worse["champion"]
    assert _versions(tracking_uri) == {1: [], 2: ["champion"], 3: ["candidate"]}

    # Retry / re-run of the same DAG run: the same version back, nothing new, aliases untouched.
    again = register("run-3", worse["run_id"])
    assert again == worse
    assert _versions(tracking_uri) == {1: [], 2: ["champion"], 3: ["candidate"]}

    # The champion alias serves the registered torch model.
    model = mlflow.pytorch.load_model(f"models:/{MODEL}@champion")
    assert model(torch.zeros(1, 4)).shape == (1, 3)


def test_lower_is_better_gate_and_metrics_given_as_rendered_xcom(tracking_uri: str) -> None:
    gate = {"loss": "<= 0.5", "accuracy": "> 0.8"}
    # Metrics come from the evaluation task, here as the string a Jinja template renders.
    first = register("r1", train("r1", {}), gate=gate, metrics="{'loss': 0.4, 'accuracy': 0.85, 'path': '/x'}")
    worse = register("r2", train("r2", {}), gate=gate, metrics='{"loss": 0.45, "accuracy": 0.99}')
    better = register("r3", train("r3", {}), gate=gate, metrics={"loss": 0.3, "accuracy": 0.81})
    assert (first["champion"], worse["champion"], better["champion"]) == (True, False, True)
    with pytest.raises(AirflowSkipException, match=r"loss = 0.6, needs <= 0.5"):
        register("r4", train("r4", {}), gate=gate, metrics={"loss": 0.6, "accuracy": 0.9})


def test_a_try_that_died_before_setting_aliases_is_finished_by_the_retry(tracking_uri: str) -> None:
    from mlflow import MlflowClient

    run_id = train("run-x", {"accuracy": 0.97})
    result = register("run-x", run_id)
    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    # Undo what happens after the version was created, as if the worker died right there.
    client.delete_registered_model_alias(MODEL, "champion")
    client.delete_registered_model_alias(MODEL, "candidate")
    client.delete_model_version_tag(MODEL, "1", TAG_DONE)
    retried = register("run-x", run_id)
    assert retried == result and _versions(tracking_uri) == {1: ["candidate", "champion"]}
    tags = client.get_model_version(MODEL, "1").tags
    assert tags[TAG_DAG_ID] == "pipe" and tags[TAG_RUN_ID] == "run-x" and tags["metric.accuracy"] == "0.97"


def test_bad_gates_and_missing_things_fail_clearly(tracking_uri: str) -> None:
    with pytest.raises(InvalidSpecError, match=r"like '>= 0.9'.*got '0.9'"):
        RegisterModelOperator(task_id="r", model_name=MODEL, run_id="x", gate={"accuracy": "0.9"})
    with pytest.raises(InvalidSpecError, match="got '== 1'"):
        parse_gate('{"accuracy": "== 1"}')
    assert [str(r) for r in parse_gate({"f1": ">0.7", "loss": "< 2"})] == ["f1 > 0.7", "loss < 2"]
    # A template is only checked once rendered.
    RegisterModelOperator(task_id="r", model_name=MODEL, run_id="{{ x }}", gate="{{ params.gate }}")

    run_id = train("run-m", {"accuracy": 0.99})
    with pytest.raises(AirflowFailException, match=r"gate reads 'f1' but the metrics have only accuracy"):
        register("run-m", run_id, gate={"f1": ">= 0.5"})
    with pytest.raises(AirflowFailException, match="has no logged model named 'final'"):
        register("run-m", run_id, model_artifact="final")


@pytest.mark.slow
def test_register_through_dag_test_with_xcom_templates(run_dag: Any, tracking_uri: str) -> None:
    result = run_dag(
        f"""
        @task
        def train_and_evaluate():
            import torch
            from airflow_torchrun.worker.tracking import RunLogger
            run_id = ensure_run(get_current_context())
            RunLogger(run_id=run_id, rank=0).log_model(torch.nn.Linear(4, 3), pip_requirements=["torch"])
            return {{"run_id": run_id, "metrics": {{"accuracy": 0.92}}}}

        trained = train_and_evaluate()
        trained >> RegisterModelOperator(
            task_id="register",
            model_name={MODEL!r},
            run_id="{{{{ ti.xcom_pull('train_and_evaluate')['run_id'] }}}}",
            metrics="{{{{ ti.xcom_pull('train_and_evaluate')['metrics'] }}}}",
            gate="{{{{ params.gate }}}}",
        )
        """,
        imports=(
            "from airflow.sdk import task, get_current_context\n"
            "from airflow_torchrun.tracking import ensure_run\n"
            "from airflow_torchrun.operators.register import RegisterModelOperator"
        ),
        params={"gate": {"accuracy": ">= 0.9"}},
    )
    assert result.state == "success", result.log[-3000:]
    out = result.xcom("register")
    assert out["version"] == 1 and out["aliases"] == ["candidate", "champion"]
    assert _versions(tracking_uri) == {1: ["candidate", "champion"]}


def test_promote_false_proposes_and_the_promotion_moves_the_champion_only_when_proposed(tracking_uri: str) -> None:
    from airflow_torchrun.operators.approval import approval_body
    from airflow_torchrun.operators.register import PromoteModelOperator

    def promote(registration: dict[str, Any]) -> dict[str, Any]:
        op = PromoteModelOperator(task_id="promote", registration=registration)
        return op.execute(_context("any", "promote"))  # type: ignore[arg-type]

    metrics = {"accuracy": 0.91, "loss": 0.3}
    first = register("p-1", train("p-1", {}), metrics=metrics, promote=False)
    assert first["aliases"] == ["candidate"] and first["proposal"]["promote"] and not first["champion"]
    assert first["metrics"] == metrics and first["gate"] == ["accuracy >= 0.9"]
    assert promote(first)["aliases"] == ["candidate", "champion"]
    assert promote(first)["aliases"] == ["candidate", "champion"]  # again: harmless

    worse = register("p-2", train("p-2", {}), metrics={"accuracy": 0.905, "loss": 0.2}, promote=False)
    assert worse["proposal"] == {
        "promote": False,
        "why": "accuracy 0.905 vs champion version 1's 0.91 (higher is better)",
        "champion_version": 1,
        "champion_metrics": metrics,  # from version 1's tags
    }
    with pytest.raises(AirflowSkipException, match="was not proposed as champion"):
        promote(worse)
    better = register("p-3", train("p-3", {}), metrics={"accuracy": 0.97, "loss": 0.1}, promote=False)
    best = register("p-4", train("p-4", {}), metrics={"accuracy": 0.99, "loss": 0.05}, promote=False)
    assert better["proposal"]["promote"] and best["proposal"]["champion_version"] == 1
    assert _versions(tracking_uri) == {1: ["champion"], 2: [], 3: [], 4: ["candidate"]}
    promote(best)
    # The approver of version 3 compared it with version 1; the champion is version 4 now.
    with pytest.raises(AirflowSkipException, match="the champion is version 4 now, not 1"):
        promote(better)
    assert _versions(tracking_uri) == {1: [], 2: [], 3: [], 4: ["candidate", "champion"]}

    body = approval_body(better, "http://mlflow.test/#/experiments/1/runs/x")
    assert "| **accuracy** (gate) | 0.97 | 0.91 |" in body and "| loss | 0.1 | 0.3 |" in body
    assert "candidate: version 3" in body and "champion: version 1" in body
    assert "[" + better["run_id"] + "](http://mlflow.test/#/experiments/1/runs/x)" in body
    assert "*Approve* moves `champion` to version 3" in body


def test_register_refuses_a_flag_that_is_not_a_bool(tracking_uri: str) -> None:
    from airflow_torchrun.operators.approval import ModelApprovalOperator

    with pytest.raises(InvalidSpecError, match="promote must be True or False, got 'false'"):
        RegisterModelOperator(task_id="r", model_name=MODEL, run_id="x", promote="false")  # type: ignore[arg-type]
    with pytest.raises(InvalidSpecError, match="require_approval must be true or false, got 'no'"):
        ModelApprovalOperator(task_id="a", registration={}, require_approval="no")
    ModelApprovalOperator(task_id="a", registration={}, require_approval="{{ params.require_approval }}")
