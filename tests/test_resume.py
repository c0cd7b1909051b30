"""Retries resume from the latest committed checkpoint, exactly: file:// and s3:// (moto over HTTP).

The example trainer prints ``FINAL ... weights_sha256=<digest>``; a run whose rank is SIGKILLed
mid-training and retried by Airflow must end with the uninterrupted run's digest, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest

from tests import s3_fixtures
from tests.conftest import group_processes
from tests.example_trainer import IMPORTS, TRAINER
from tests.example_trainer import digest as _digest
from tests.example_trainer import train_task as _train_task
from tests.ports import refusing_port

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("fail_rank", [1, 0], ids=["rank1-killed", "rank0-killed"])
def test_killed_rank_is_retried_and_resumes_bit_identical_on_disk(run_dag, uninterrupted, fail_rank):
    result = run_dag(
        _train_task(["--fail-at-step", "25", "--fail-rank", str(fail_rank), "--fail-mode", "kill"], retries=1),
        imports=IMPORTS,
    )
    assert result.state == "success", result.log[-4000:]
    assert f"rank {fail_rank} (node {fail_rank}, local rank 0) was killed by signal SIGKILL" in result.log
    assert re.search(r"resuming from file://\S+/step-0*20 \(step 20\)", result.log), "retry did not resume"
    assert _digest(result.log) == uninterrupted
    xcom = result.xcom("train")
    assert xcom["final_checkpoint"].startswith("file://")
    assert group_processes(xcom["group_id"]) == []


def test_killed_rank_resumes_bit_identical_from_s3(run_dag, uninterrupted, moto_s3, monkeypatch):
    bucket = moto_s3.make_bucket()
    # Credentials come from an Airflow connection: they reach the ranks' environment only.
    monkeypatch.setenv(
        "AIRFLOW_CONN_CKPT_S3",
        json.dumps(
            {
                "conn_type": "aws",
                "login": s3_fixtures.ACCESS_KEY,
                "password": s3_fixtures.SECRET_KEY,
                "extra": {"endpoint_url": moto_s3.endpoint, "region_name": s3_fixtures.REGION},
            }
        ),
    )
    result = run_dag(
        _train_task(
            ["--fail-at-step", "25", "--fail-rank", "1", "--fail-mode", "kill"],
            retries=1,
            checkpoint_uri=f"s3://{bucket}/runs/{{{{ run_id }}}}",
            aws_conn_id="ckpt_s3",
        ),
        imports=IMPORTS,
    )
    assert result.state == "success", result.log[-4000:]
    assert re.search(rf"resuming from s3://{bucket}/\S+/step-0*20 \(step 20\)", result.log)
    assert _digest(result.log) == uninterrupted
    assert s3_fixtures.SECRET_KEY not in json.dumps(result.xcom("train"))
    keys = [o["Key"] for o in moto_s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert any(k.endswith("COMMITTED") for k in keys)


@pytest.mark.parametrize(
    ("checkpoint_uri", "conn", "expected"),
    [
        ("s3://no-such-bucket-xyz/ck", "good", "does not exist"),
        ("s3://{bucket}/ck", "wrong-secret", "cannot use s3://"),
        ("s3://{bucket}/ck", "unreachable", "cannot be reached"),
    ],
    ids=["missing-bucket", "wrong-credentials", "unreachable-endpoint"],
)
def test_bad_storage_fails_before_any_rank_starts(
    run_dag, moto_s3, monkeypatch, tiny_script, checkpoint_uri, conn, expected
):
    bucket = moto_s3.make_bucket()
    # An unreachable endpoint: a port held refusing for the test's length (no server of another test takes it).
    with refusing_port() if conn == "unreachable" else contextlib.nullcontext() as refused:
        endpoint = f"http://127.0.0.1:{refused}" if refused else moto_s3.endpoint
        # moto checks credentials only while auth is enforced; an unknown key id is then refused
        login = "AKIAUNKNOWNKEY0000000" if conn == "wrong-secret" else s3_fixtures.ACCESS_KEY
        extra = {"endpoint_url": endpoint, "region_name": s3_fixtures.REGION}
        monkeypatch.setenv(
            "AIRFLOW_CONN_BAD_S3",
            json.dumps({"conn_type": "aws", "login": login, "password": s3_fixtures.SECRET_KEY, "extra": extra}),
        )
        ctx = moto_s3.enforce_auth() if conn == "wrong-secret" else contextlib.nullcontext()
        # An unreachable endpoint is transient: waited for within preflight_budget, then retryable.
        retries = 0 if conn == "unreachable" else 3
        with ctx:
            result = run_dag(
                f"""
                DistributedTrainingOperator(task_id="train", script={str(tiny_script)!r}, num_nodes=2,
                                            retries={retries}, preflight_budget=2,
                                            checkpoint_uri={checkpoint_uri.format(bucket=bucket)!r},
                                            aws_conn_id="bad_s3")
                """
            )
        assert result.state == "failed"
        assert expected in result.log
        if conn == "unreachable":
            assert "A retry may succeed" in result.log
        else:  # permanent: Airflow's 3 retries are not spent on it
            assert result.try_number("train") == 1 and "A retry cannot fix this" in result.log
        assert result.xcom("train", key="group") is None, "a group was launched"
        assert "Launched group" not in result.log


def test_malformed_checkpoint_uri_fails_at_parse_time(tmp_path, tiny_script):
    from airflow.sdk import DAG

    from airflow_torchrun import DistributedTrainingOperator
    from airflow_torchrun.errors import InvalidSpecError

    with DAG("bad_uri", schedule=None), pytest.raises(InvalidSpecError, match="checkpoint_uri"):
        DistributedTrainingOperator(task_id="train", script=str(tiny_script), checkpoint_uri="s3://")


def test_contract_variables_cannot_be_overridden_through_env(tiny_script):
    from airflow.sdk import DAG

    from airflow_torchrun import DistributedTrainingOperator
    from airflow_torchrun.errors import InvalidSpecError

    with DAG("bad_env", schedule=None), pytest.raises(InvalidSpecError, match=r"checkpoint_uri=\.\.\."):
        DistributedTrainingOperator(task_id="train", script=str(tiny_script), env={"TRAIN_CHECKPOINT_URI": "/x"})


def test_trainer_is_in_the_repo():
    assert Path(TRAINER).is_file()
