"""The training and evaluation tasks on Kubernetes when the API misbehaves, through ``dag.test()``.

The fake API server answers 5xx (or holds requests unanswered) for a while, or refuses an object
with a 4xx. What must hold afterwards: a healthy group is never torn down for a flaky API, in sync
and deferred mode alike; a refusal fails the task once, without Airflow retries, leaving nothing;
evaluation never puts storage credentials into the pod spec.
"""

from __future__ import annotations

import json
import time

import pytest

from airflow_torchrun.storage.checkpoints import CheckpointStore
from tests import s3_fixtures

from .fake_api import FakeKubeAPI
from .test_operator_k8s import NS, RETRY_ONCE, TASK, Autopilot, created_jobs, posted_jobs, trainer_env

OUTAGE_S = 6.0


def outage_then_succeed(status: int):
    def scenario(fake: FakeKubeAPI, job: str) -> None:
        fake.create_pods(NS, job)
        fake.set_running(NS, job)
        for index in (0, 1):
            pod = fake.pod(NS, job, index)["metadata"]["name"]
            fake.add_log(pod, f"[node {index} rank {index}] step 1 loss 0.50")
        time.sleep(1.0)
        # Every request (watch, list, logs) fails while every rank keeps training.
        fake.outage(OUTAGE_S, status=status)
        time.sleep(OUTAGE_S + 0.5)
        fake.set_terminated(NS, job, None, exit_code=0, reason="Completed")

    return scenario


@pytest.mark.parametrize(
    ("deferrable", "status"), [(False, 503), (True, 503), (False, 429)], ids=["sync-503", "deferred-503", "sync-429"]
)
def test_an_api_outage_does_not_tear_a_healthy_group_down(
    fake_api: FakeKubeAPI, k8s_connection: str, run_dag, deferrable: bool, status: int
) -> None:
    started = time.time()
    body = TASK.replace("track=False,", f"track=False,\n    deferrable={deferrable},\n    defer_after=0,")
    with Autopilot(fake_api, outage_then_succeed(status)):
        result = run_dag(body)
    assert result.task_states == {"train": "success"}, result.log[-4000:]
    (job,) = created_jobs(fake_api)  # no relaunch, no retry
    # The Job was deleted only once it had succeeded, after the outage.
    deletes = [c for c in fake_api.calls if c.method == "DELETE" and c.path.endswith(f"/jobs/{job}")]
    assert deletes and all(c.at >= started + OUTAGE_S for c in deletes)
    assert "could not look at the group (transient" in result.log
    assert "observing again after" in result.log
    assert result.xcom("train")["node_exit_codes"] == [0, 0]


def test_an_api_rejection_at_launch_fails_once_without_retry(
    fake_api: FakeKubeAPI, k8s_connection: str, run_dag
) -> None:
    fake_api.outage(60.0, status=422, method="POST", resource="jobs")
    result = run_dag(TASK, **RETRY_ONCE)
    assert result.task_states == {"train": "failed"}
    assert "A retry cannot fix this" in result.log, result.log[-3000:]
    posts = [c for c in fake_api.calls if c.method == "POST" and c.path.endswith("/jobs")]
    assert len(posts) == 1, "an API refusal must not be retried by Airflow"
    assert not [k for k in fake_api.objects if k[0] in ("jobs", "pods", "services", "networkpolicies")]


def test_evaluation_keeps_storage_credentials_out_of_the_pod_spec(
    fake_api: FakeKubeAPI, k8s_connection: str, run_dag, moto_s3: s3_fixtures.MotoS3, monkeypatch
) -> None:
    secret = "eval-secret-must-not-leak"
    bucket = moto_s3.make_bucket()
    options = moto_s3.storage_options(secret=secret)
    store = CheckpointStore(f"s3://{bucket}/train", options)
    store.fs.pipe_file(f"{store.step_path(10)}/state.pt", b"weights")
    store.commit(10, {"world_size": 1})
    monkeypatch.setenv(
        "AIRFLOW_CONN_EVAL_S3",
        json.dumps(
            {
                "conn_type": "aws",
                "login": s3_fixtures.ACCESS_KEY,
                "password": secret,
                "extra": {"endpoint_url": moto_s3.endpoint, "region_name": s3_fixtures.REGION},
            }
        ),
    )

    def evaluate(fake: FakeKubeAPI, job: str) -> None:
        fake.create_pods(NS, job)
        fake.set_running(NS, job)
        time.sleep(0.3)
        fake.set_terminated(NS, job, None, exit_code=0, reason="Completed")

    with Autopilot(fake_api, evaluate):
        result = run_dag(
            f"""
            EvaluateModelOperator(
                task_id="evaluate", backend="kubernetes", runtime="cpu", script="/opt/trainer/evaluate.py",
                checkpoint={store.step_uri(10)!r}, aws_conn_id="eval_s3", poll_interval=0.05,
            )
            """,
            imports="from airflow_torchrun import EvaluateModelOperator",
        )
    (job,) = posted_jobs(fake_api)
    env = trainer_env(job)
    assert env["EVAL_CHECKPOINT_URI"] == store.step_uri(10)
    assert env["AWS_ENDPOINT_URL"] == moto_s3.endpoint  # where to go, without the key to get in
    assert secret not in json.dumps(job), "the storage secret reached the Job object"
    assert "AWS_SECRET_ACCESS_KEY" not in env
    # The task itself fails: no metrics were reported (the fake runs no script); that is not this test's point.
    assert result.task_states == {"evaluate": "failed"}
    assert "without reporting metrics" in result.log
