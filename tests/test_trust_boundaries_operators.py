"""Issue 23: the findings whose subject is an operator, each with the review's probe as its scenario
(real DAG runs through ``dag.test()``; see ``tests/test_trust_boundaries.py`` for the rest)."""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from airflow_torchrun.backends.local.zygote import DIR_VAR as ZYGOTE_DIR_VAR
from airflow_torchrun.worker import save_checkpoint
from tests import s3_fixtures
from tests.conftest import STATE_DIR, DagResult
from tests.s3_fixtures import MotoS3

moto_s3 = s3_fixtures.moto_s3

SAVER = textwrap.dedent(
    """
    import torch
    from airflow_torchrun.worker import load_checkpoint, resume_step, save_checkpoint
    state = load_checkpoint()
    print("RESUMED FROM STEP", resume_step(), flush=True)
    save_checkpoint({"w": torch.ones(2)}, resume_step() + 1)
    """
)


@pytest.fixture
def saver(tmp_path: Path) -> Path:
    path = tmp_path / "saver.py"
    path.write_text(SAVER)
    return path


# -- finding 7: bool("false") is True ------------------------------------------------------------------
@pytest.mark.slow
def test_resume_from_outside_false_as_a_string_keeps_the_protection(
    run_dag: Callable[..., DagResult], saver: Path, tmp_path: Path
) -> None:
    """The probe, as a new user writes it: ``resume_from_outside="false"``. ``bool("false")`` is
    True, and a checkpoint outside ``checkpoint_uri`` was loaded."""
    os.environ.pop("TRAIN_CHECKPOINT_LINEAGE", None)
    outside = save_checkpoint({"w": torch.full((2,), 7.0)}, 10, uri=f"file://{tmp_path}/someone-elses")
    result = run_dag(
        f"""
        DistributedTrainingOperator(task_id="train", script={str(saver)!r}, track=False, resume={outside!r},
                                    resume_from_outside="false")
        """
    )
    assert result.state == "failed" and "resume_from_outside=True" in result.log, result.log[-3000:]
    assert "RESUMED FROM STEP 10" not in result.log and "Launched group" not in result.log


@pytest.mark.parametrize("value", ["no", "0", 1, "False "])
def test_a_safety_flag_that_is_not_true_or_false_is_refused_at_parse_time(value: object) -> None:
    from airflow_torchrun import DistributedTrainingOperator
    from airflow_torchrun.errors import InvalidSpecError

    if value == "False ":  # strictly parsed: surrounding spaces of a rendered "false" are fine
        op = DistributedTrainingOperator(task_id="t", script=__file__, resume_from_outside=value)
        assert op.training.resume_from_outside is False
        return
    with pytest.raises(InvalidSpecError, match="resume_from_outside must be True or False"):
        DistributedTrainingOperator(task_id="t", script=__file__, resume_from_outside=value)


# -- finding 10: long-lived source keys stayed on disk ---------------------------------------------------
SOURCE_SECRET = "i23-source-secret-4c9b1e"
PROFILE_PRINTER = textwrap.dedent(
    """
    import os, torch
    from airflow_torchrun.worker import save_checkpoint
    print("RANK PROFILE", os.environ["AWS_CONFIG_FILE"], os.path.exists(os.environ["AWS_CONFIG_FILE"]), flush=True)
    save_checkpoint({"w": torch.ones(3)}, 1)
    """
)


@pytest.mark.slow
def test_the_ranks_aws_profile_lives_only_as_long_as_its_group(
    run_dag: Callable[..., DagResult], moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The probe: after a run with an assume-role connection, its source keys stayed in
    ``<state_dir>/credentials/<hash>.ini``, readable by every local rank of every DAG, for good."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    connection = {
        "conn_type": "aws",
        "login": "AKIAI23SOURCEKEY0001",
        "password": SOURCE_SECRET,
        "extra": {
            "role_arn": "arn:aws:iam::123456789012:role/checkpoints",
            "region_name": s3_fixtures.REGION,
            "endpoint_url": moto_s3.endpoint,
            "service_config": {"sts": {"endpoint_url": moto_s3.endpoint}},
        },
    }
    monkeypatch.setenv("AIRFLOW_CONN_CKPT_ROLE_I23", json.dumps(connection))
    # A profile an older version left, and one a launch that crashed long ago staged.
    credentials = STATE_DIR / "credentials"
    credentials.mkdir(parents=True, exist_ok=True)
    (credentials / "0123abcd.ini").write_text(f"aws_secret_access_key = {SOURCE_SECRET}\n")
    stale = credentials / "staged-0000000000000000.ini"
    stale.write_text(f"aws_secret_access_key = {SOURCE_SECRET}\n")
    os.utime(stale, (1.0, 1.0))
    script = tmp_path / "profile_printer.py"
    script.write_text(PROFILE_PRINTER)
    bucket = moto_s3.make_bucket()
    result = run_dag(
        f"""
        DistributedTrainingOperator(task_id="train", script={str(script)!r}, track=False,
                                    checkpoint_uri="s3://{bucket}/ckpt", aws_conn_id="ckpt_role_i23")
        """
    )
    assert result.state == "success", result.log[-4000:]
    line = next(x for x in result.log.splitlines() if "RANK PROFILE " in x)
    where, exists = line.split("RANK PROFILE ", 1)[1].split()[:2]
    group_dir = Path(result.xcom("train", key="group")["group_dir"])
    assert exists == "True" and Path(where).parent == group_dir, line  # the try's own, while it ran
    leftovers = [str(p) for p in STATE_DIR.rglob("*") if p.is_file() and SOURCE_SECRET.encode() in p.read_bytes()]
    assert leftovers == [], leftovers


# -- finding 3, evaluation's side: its automatic trust came from the marker's lineage -------------------
EVALUATOR = textwrap.dedent(
    """
    import os, torch
    from airflow_torchrun.errors import StorageError
    from airflow_torchrun.worker import load_checkpoint
    from airflow_torchrun.worker.metrics import report_metrics
    try:
        load_checkpoint(into={"w": torch.zeros(4)})
        loaded = 1.0
    except StorageError as exc:
        print("REFUSED", exc, flush=True)
        loaded = 0.0
    report_metrics({"loaded": loaded})
    """
)


@pytest.mark.slow
def test_evaluation_trusts_a_sharded_checkpoint_by_where_it_is_not_by_its_marker(
    run_dag: Callable[..., DagResult], tmp_path: Path
) -> None:
    """The probe: a sharded checkpoint in a store outside the DAG run's checkpoints, whose marker
    names this very DAG run (anyone who writes that store writes its marker), was loaded by
    ``EvaluateModelOperator`` with the ranks' pickle guard off."""
    evaluator = tmp_path / "evaluate.py"
    evaluator.write_text(EVALUATOR)
    foreign_root = f"file://{tmp_path}/foreign"
    result = run_dag(
        f"""
        @task
        def write_checkpoints(dag_run=None):
            import json, os, torch
            from airflow_torchrun.naming import join, lineage_path
            try:
                from airflow_torchrun.operators.training_contract import checkpoint_base
            except ImportError:  # before the operators' refactor (to run this against e4ca0ea)
                from airflow_torchrun.operators.training import checkpoint_base
            from airflow_torchrun.worker import save_checkpoint

            claim = {{"dag_id": dag_run.dag_id, "run_id": dag_run.run_id, "task_id": "train", "map_index": -1}}
            os.environ["TRAIN_CHECKPOINT_LINEAGE"] = json.dumps(claim)
            own_root = join(checkpoint_base(), lineage_path(dag_run.dag_id, dag_run.run_id, "train"))
            state = {{"w": torch.arange(4.0)}}
            return {{
                "foreign": save_checkpoint(state, 3, uri={foreign_root!r}, sharded=True),
                "own": save_checkpoint(state, 3, uri=own_root, sharded=True),
            }}

        made = write_checkpoints()
        for which in ("foreign", "own"):
            made >> EvaluateModelOperator(
                task_id=f"evaluate_{{which}}", script={str(evaluator)!r},
                checkpoint=f"{{{{{{{{ ti.xcom_pull('write_checkpoints')['{{which}}'] }}}}}}}}",
            )
        """,
        imports="from airflow.sdk import task\nfrom airflow_torchrun import EvaluateModelOperator",
    )
    assert result.state == "success", result.log[-4000:]
    assert result.xcom("evaluate_foreign") == {"loaded": 0.0}, result.log[-4000:]
    assert "outside this task's checkpoint root" in result.log or "of another lineage" in result.log
    assert result.xcom("evaluate_own") == {"loaded": 1.0}


# -- also: two deployments sharing a checkpoint store ----------------------------------------------------
TWO_HOMES_DAG = textwrap.dedent(
    """
    import pendulum
    from airflow.sdk import DAG
    from airflow_torchrun import DistributedTrainingOperator

    with DAG("shared_pipeline", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False) as dag:
        DistributedTrainingOperator(task_id="train", script={saver!r}, track=False)

    if __name__ == "__main__":
        run = dag.test(run_after=pendulum.datetime(2026, 1, 1, tz="UTC"))
        print("RUN", run.run_id, run.state, flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_second_deployment_on_the_same_store_is_refused_before_launch(saver: Path, tmp_path: Path) -> None:
    """The probe: staging and production (two Airflow homes, each with its own metadata database,
    nothing configured but a shared checkpoint_base) run the same DAG for the same logical date;
    equal run ids, so the second resumed from the first one's checkpoints as its own."""
    import subprocess
    import sys

    shared = f"file://{tmp_path}/shared-bucket"
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "shared_pipeline.py").write_text(TWO_HOMES_DAG.format(saver=str(saver)))
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "TRAIN_", "MLFLOW"))}
    base_env[ZYGOTE_DIR_VAR] = os.environ[ZYGOTE_DIR_VAR]  # the session's zygotes, stopped at its end
    logs = {}
    for home in ("staging", "production"):
        env = {
            **base_env,
            "AIRFLOW_HOME": str(tmp_path / home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__TORCHRUN__CHECKPOINT_BASE": shared,
            "OMP_NUM_THREADS": "1",
        }
        subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, capture_output=True)
        done = subprocess.run(
            [sys.executable, str(dags / "shared_pipeline.py")],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        logs[home] = done.stdout + done.stderr
    assert "RUN manual__2026-01-01T00:00:00+00:00 success" in logs["staging"], logs["staging"][-3000:]
    second = logs["production"]
    assert "RUN manual__2026-01-01T00:00:00+00:00 failed" in second, second[-3000:]
    assert "another Airflow deployment" in second and "checkpoint_base" in second, second[-3000:]
    assert "RESUMED FROM STEP" not in second
    from airflow_torchrun.storage.checkpoints import CheckpointStore

    roots = list(Path(tmp_path / "shared-bucket").rglob("LINEAGE"))
    assert len(roots) == 1 and [r.step for r in CheckpointStore(str(roots[0].parent)).committed()] == [1]


# -- also: the operator's metrics were logged at step 0 once per try ---------------------------------------
FAILS_ONCE_WITH_PROGRESS = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist
    from airflow_torchrun.worker import load_checkpoint, resume_step, save_checkpoint
    from airflow_torchrun.worker.tracking import RunLogger, StepTimer

    dist.init_process_group("gloo")
    load_checkpoint()
    tracker, timer = RunLogger(), StepTimer()
    marker = os.environ["FAIL_ONCE_MARKER"]
    for step in range(resume_step() + 1, 41):
        with timer.data():
            time.sleep(0.01)
        with timer.compute():
            time.sleep(0.01)
        tracker.log_step(step, loss=1.0 / step, samples=8, timing=timer.lap())
        if step % 10 == 0:
            save_checkpoint({"step": step}, step)
        if step == 25 and not os.path.exists(marker):
            open(marker, "w").close()
            sys.exit(3)
    tracker.close()
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_operators_metrics_are_logged_at_the_step_they_describe(
    run_dag: Callable[..., DagResult], tmp_path: Path
) -> None:
    """The probe: a run with one retry showed two values of torchrun_final_data_wait at step 0."""
    script = tmp_path / "fails_once.py"
    script.write_text(FAILS_ONCE_WITH_PROGRESS)
    env = {"AIRFLOW_TORCHRUN_PROGRESS_INTERVAL": "0.2", "FAIL_ONCE_MARKER": str(tmp_path / "failed")}
    result = run_dag(
        f"""
        DistributedTrainingOperator(task_id="train", script={str(script)!r}, env={env!r}, track=True,
                                    retries=1, retry_delay=timedelta(0))
        """,
        imports="from datetime import timedelta",
    )
    assert result.state == "success" and result.try_number("train") == 2, result.log[-4000:]
    from airflow_torchrun.tracking import client

    history = client().get_metric_history(result.xcom("train", key="mlflow_run_id"), "torchrun_final_data_wait")
    steps = [m.step for m in history]
    assert len(steps) == 2 and len(set(steps)) == 2 and 0 not in steps, steps
