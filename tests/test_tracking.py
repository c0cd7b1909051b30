"""MLflow tracking: one run per DAG run and task across tries; rank 0 alone logs; fast failure."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from airflow_torchrun import tracking
from airflow_torchrun.tracking import (
    STATE_KEY,
    TAG_TRY_NUMBER,
    TrackingUnreachableError,
    default_tracking_uri,
    ensure_run,
    finish_run,
    rank_env,
    resolve_tracking_uri,
)
from tests.ports import refusing_port
from tests.s3_fixtures import HungServer


@pytest.fixture
def tracking_uri(mlflow_sqlite_uri: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_sqlite_uri)
    return mlflow_sqlite_uri


def _context(try_number: int, task_id: str = "train", store: Any = None) -> dict[str, Any]:
    ti = SimpleNamespace(dag_id="pipe", run_id="manual__1", task_id=task_id, map_index=-1, try_number=try_number)
    return {"ti": ti, **({"task_state_store": store} if store is not None else {})}


class _Store:
    """The ``get``/``set`` surface of Airflow's task_state_store, kept in a dict."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value


def test_ensure_run_reuses_the_run_across_tries(tracking_uri: str) -> None:
    from mlflow import MlflowClient

    first = ensure_run(_context(1))
    assert finish_run(first, succeeded=False) is True
    second = ensure_run(_context(2))
    other_task = ensure_run(_context(1, task_id="evaluate"))
    assert second == first and other_task != first

    client = MlflowClient(tracking_uri)
    run = client.get_run(first)
    assert run.info.status == "RUNNING"  # the failed try's FAILED is undone by the retry
    assert run.data.tags["airflow.dag_id"] == "pipe" and run.data.tags["airflow.run_id"] == "manual__1"
    assert run.data.tags[TAG_TRY_NUMBER] == "2"
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.name == "pipe"
    # Artifacts next to the SQLite store, not in ./mlruns of whatever the cwd is.
    assert exp.artifact_location.startswith(Path(tracking_uri[len("sqlite:///") :]).parent.as_uri())
    assert len(client.search_runs([run.info.experiment_id])) == 2


def test_ensure_run_prefers_the_task_state_store(tracking_uri: str) -> None:
    from mlflow import MlflowClient

    store = _Store()
    first = ensure_run(_context(1, store=store), experiment_name="exp-a")
    assert store.data[STATE_KEY] == first
    # The stored id wins even where the tags would not find it (another experiment name).
    assert ensure_run(_context(2, store=store), experiment_name="exp-b") == first
    # A stored run that was deleted is not resurrected: a fresh one is made.
    MlflowClient(tracking_uri).delete_run(first)
    third = ensure_run(_context(3, store=store), experiment_name="exp-a")
    assert third != first and store.data[STATE_KEY] == third


def test_rank_env_and_default_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    state = os.environ["AIRFLOW__TORCHRUN__STATE_DIR"]
    assert default_tracking_uri() == f"sqlite:///{state}/mlflow/mlflow.db"
    assert resolve_tracking_uri() == default_tracking_uri()
    monkeypatch.chdir(tmp_path)
    assert resolve_tracking_uri("sqlite:///rel.db") == f"sqlite:///{tmp_path / 'rel.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert rank_env("abc") == {"MLFLOW_TRACKING_URI": "http://mlflow.example:5000", "MLFLOW_RUN_ID": "abc"}


# -- an unreachable tracking server --------------------------------------------------------------
def test_unreachable_tracking_server_fails_fast_with_a_clear_message(hung_server: HungServer) -> None:
    started = time.monotonic()
    with (
        refusing_port() as port,
        pytest.raises(
            TrackingUnreachableError, match=r"MLflow tracking server http://127\.0\.0\.1:\d+ is not reach"
        ) as info,
    ):
        ensure_run(_context(1), tracking_uri=f"http://127.0.0.1:{port}")
    assert info.value.transient  # the operator rides it out within its budget, then retries the task
    from airflow_torchrun.tracking import check_tracking_uri

    with pytest.raises(TrackingUnreachableError, match=r"timed out.*within 0\.5s") as info:
        check_tracking_uri(f"http://127.0.0.1:{hung_server.port}", timeout=0.5)
    assert info.value.transient
    # MLflow's own client would retry with backoff for minutes; generous bound, far from that.
    assert time.monotonic() - started < 30


# -- rank 0 logs, rank 1 does not: two real processes ---------------------------------------------
RANK_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from airflow_torchrun.worker.tracking import RunLogger, StepTimer
    rank = int(os.environ["RANK"])
    first, last = int(sys.argv[1]), int(sys.argv[2])
    with RunLogger(flush_every=4) as tracker:
        tracker.log_params({"lr": 0.1, "rank_that_logged": rank})
        timer = StepTimer()
        for step in range(first, last):
            with timer.data():
                time.sleep(0.002)
            with timer.compute():
                time.sleep(0.004)
            # rank 1's values would be told apart: 1000 + step
            tracker.log_step(step, loss=1000 * rank + 1.0 / (step + 1), samples=32, timing=timer.lap())
        tracker.log_loss_curve()
        if os.environ.get("LOG_MODEL"):
            import torch
            tracker.log_model(torch.nn.Linear(3, 1), pip_requirements=["torch"])
    print("skipped", tracker.steps_skipped, "enabled", tracker.enabled, "mlflow" in sys.modules, flush=True)
    """
)


def _ranks(run_id: str, tracking_uri: str, first: int, last: int, *, log_model: bool = False) -> list[str]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(first), str(last)],
            env={
                **os.environ,
                **rank_env(run_id, tracking_uri),
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                # No progress records on stdout: this test reads what the script prints.
                "AIRFLOW_TORCHRUN_PROGRESS_INTERVAL": "0",
                **({"LOG_MODEL": "1"} if log_model else {}),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs.append(out.strip())
    return outs


@pytest.mark.slow
def test_only_rank_zero_logs_once_per_step_across_a_resumed_try(tracking_uri: str) -> None:
    from mlflow import MlflowClient

    run_id = ensure_run(_context(1))
    outs = _ranks(run_id, tracking_uri, 0, 10, log_model=True)
    # Rank 1 never even imported mlflow.
    assert outs == ["skipped 0 enabled True True", "skipped 0 enabled False False"]
    # The retry resumes from a checkpoint at step 6: steps 6..9 run again but are not re-logged.
    outs = _ranks(ensure_run(_context(2)), tracking_uri, 6, 14)
    assert outs[0] == "skipped 4 enabled True True"

    # An evaluation logging at the last training step: its new metric goes in, a repeated loss does not.
    from airflow_torchrun.worker.tracking import RunLogger

    with RunLogger(run_id=run_id, tracking_uri=tracking_uri, rank=0) as evaluation:
        evaluation.log_metrics({"eval_accuracy": 0.9, "loss": 5.0}, step=13)

    client = MlflowClient(tracking_uri)
    loss = client.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in loss) == list(range(14))  # once per step, all tries together
    assert all(m.value < 1000 for m in loss) and 5.0 not in {m.value for m in loss}  # nothing from rank 1
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval_accuracy")] == [(13, 0.9)]
    for name in ("throughput_samples_per_s", "data_wait_fraction", "step_time_s"):
        assert len(client.get_metric_history(run_id, name)) == 14, name
    waits = [m.value for m in client.get_metric_history(run_id, "data_wait_fraction")]
    assert all(0.0 < w < 1.0 for w in waits)
    run = client.get_run(run_id)
    assert run.data.params == {"lr": "0.1", "rank_that_logged": "0"}
    assert [a.path for a in client.list_artifacts(run_id)] == ["loss_curve.png"]
    png = Path(client.download_artifacts(run_id, "loss_curve.png"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    models = client.search_logged_models([run.info.experiment_id], filter_string="name = 'model'")
    assert [m.source_run_id for m in models] == [run_id]


def test_logger_is_a_no_op_without_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_torchrun.worker.tracking import RunLogger, StepTimer

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setenv("RANK", "0")
    tracker = RunLogger()
    assert not tracker.enabled
    tracker.log_step(0, loss=1.0, samples=1, timing=StepTimer().lap())
    assert tracker.log_loss_curve() is None and tracker.log_model(object()) is None


@pytest.mark.slow
def test_a_retried_airflow_task_keeps_its_run(run_dag: Any, tracking_uri: str) -> None:
    from mlflow import MlflowClient

    result = run_dag(
        """
        @task(retries=1, retry_delay=datetime.timedelta(seconds=0))
        def train():
            ctx = get_current_context()
            before = ctx["task_state_store"].get(STATE_KEY)
            run_id = ensure_run(ctx)
            print("TRY", ctx["ti"].try_number, "RUN", run_id, "STORED BEFORE", before)
            if ctx["ti"].try_number == 1:
                raise RuntimeError("first try fails on purpose")
            return run_id

        train()
        """,
        imports=(
            "import datetime\nfrom airflow.sdk import task, get_current_context\n"
            "from airflow_torchrun.tracking import ensure_run, STATE_KEY"
        ),
    )
    assert result.state == "success", result.log[-3000:]
    run_id = result.xcom("train")
    # The second try found the run in Airflow's task_state_store, kept across tries.
    assert f"TRY 1 RUN {run_id} STORED BEFORE None" in result.log
    assert f"TRY 2 RUN {run_id} STORED BEFORE {run_id}" in result.log
    client = MlflowClient(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name(result.dag_id).experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    assert runs[0].data.tags[TAG_TRY_NUMBER] == "2"


def test_a_client_leaves_the_process_environment_as_it_was(tmp_path, monkeypatch, mlflow_sqlite_uri):
    # dag.test() runs every task in one process: one task's tracking URI must not become the next one's.
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = mlflow_sqlite_uri
    tracking.client(uri)
    assert "MLFLOW_TRACKING_URI" not in os.environ
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mine.db'}")
    tracking.client(uri)
    assert os.environ["MLFLOW_TRACKING_URI"] == f"sqlite:///{tmp_path / 'mine.db'}"


def test_a_rank_where_mlflow_is_not_installed_trains_on_without_logging(monkeypatch, caplog):
    """Seen on the first real cluster: the trainer image had no mlflow, MLFLOW_RUN_ID was set, and
    rank 0 died at its fifth step (ModuleNotFoundError from log_metrics). Tracking must never end
    training: one error saying what to install, then every call is a no-op."""
    import importlib.util
    import logging
    import sys

    from airflow_torchrun.worker import tracking

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        tracking.importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real_find_spec(name, *a)
    )
    for name in [m for m in sys.modules if m == "mlflow" or m.startswith("mlflow.")] + ["mlflow", "mlflow.entities"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import mlflow...` raises ImportError now
    with caplog.at_level(logging.ERROR, logger=tracking.log.name):
        logger = tracking.RunLogger(run_id="run-1", tracking_uri="http://127.0.0.1:9", rank=0)
        for step in range(10):
            logger.log_metrics({"loss": 1.0, "accuracy": 0.5}, step)
        logger.close()
    assert logger.enabled is False
    assert "mlflow is not installed" in caplog.text and "airflow-torchrun[mlflow]" in caplog.text


def test_a_logged_model_names_its_requirements_without_mlflows_inference(tracking_uri: str, tmp_path: Path) -> None:
    """``log_model`` without requirements: MLflow's defaults for the flavor, then the distribution of
    each layer's package, pinned, then ``extra_pip_requirements``. No inference subprocess (under
    ``make check``'s guard one would fail this test; MLflow's inference also listed pandas, scipy,
    Lightning and transformers for a plain ``nn.Linear``), and the model loads back and computes
    the same."""
    from importlib import metadata

    import mlflow.pytorch
    import torch

    transformers_activations = pytest.importorskip("transformers.activations")
    from airflow_torchrun.worker.tracking import RunLogger

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), transformers_activations.GELUActivation())
    run_id = ensure_run(_context(1))
    uri = RunLogger(run_id=run_id, rank=0).log_model(model, extra_pip_requirements=["numpy"])
    assert uri is not None

    saved = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp_path)))
    requirements = (saved / "requirements.txt").read_text().split()
    expected = [
        f"mlflow=={metadata.version('mlflow')}",
        *mlflow.pytorch.get_default_pip_requirements(),
        f"transformers=={metadata.version('transformers')}",
        "numpy",
    ]
    assert requirements == expected
    x = torch.randn(2, 4)
    assert torch.equal(mlflow.pytorch.load_model(uri)(x), model(x))


def test_model_requirements_add_nothing_for_torch_and_script_layers() -> None:
    import mlflow.pytorch
    import torch

    from airflow_torchrun.worker.tracking import model_requirements

    class Head(torch.nn.Module):  # defined here, in no installed distribution
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), Head())
    assert model_requirements(model) == mlflow.pytorch.get_default_pip_requirements()
