"""Storage outages against real servers: transient while the store does not answer, permanent when
only a change can help.

moto's S3 server is stopped and started again on the same port (its buckets survive, as a real
store's data would); 5xx answers and a hung endpoint come from small HTTP servers on 127.0.0.1.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from airflow_torchrun.errors import StorageError, is_transient, retry_transient
from airflow_torchrun.storage.checkpoints import CHECK_READ_TIMEOUT, CheckpointStore
from tests.s3_fixtures import HungServer, MotoS3, RestartableS3, s3_error_server

log = logging.getLogger(__name__)


def _failure(store: CheckpointStore) -> tuple[StorageError, float]:
    started = time.monotonic()
    with pytest.raises(StorageError) as info:
        store.check_access()
    return info.value, time.monotonic() - started


@pytest.mark.slow
def test_a_store_that_is_down_is_transient_and_the_check_passes_once_it_is_back(restartable_s3: RestartableS3) -> None:
    """Afterwards: the retried check passed once the server was back, within the budget, and left
    no probe object behind; the bucket made before the outage is still there."""
    s3 = restartable_s3.s3
    bucket = s3.make_bucket()
    store = CheckpointStore(f"s3://{bucket}/run", s3.storage_options())
    store.check_access()

    restartable_s3.stop()
    error, seconds = _failure(store)
    assert error.transient and is_transient(error)
    assert "cannot be reached" in str(error) and s3.endpoint in str(error)
    assert seconds < 10  # one short attempt, not botocore's default retries

    restartable_s3.start_after(3.0)
    started = time.monotonic()
    retry_transient(store.check_access, budget=25, what="S3 access check", log=log)
    waited = time.monotonic() - started
    assert 2.5 < waited < 25  # it rode out the outage instead of failing at the first refusal
    assert restartable_s3.running
    assert s3.client().list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


@pytest.mark.slow
def test_an_outage_longer_than_the_budget_ends_in_the_transient_error(restartable_s3: RestartableS3) -> None:
    """Afterwards: retry_transient gave up near its budget with the transient StorageError, so the
    caller can fail the try retryably."""
    bucket = restartable_s3.s3.make_bucket()
    store = CheckpointStore(f"s3://{bucket}/run", restartable_s3.s3.storage_options())
    restartable_s3.stop()
    started = time.monotonic()
    with pytest.raises(StorageError) as info:
        retry_transient(store.check_access, budget=3, what="S3 access check", log=log)
    assert info.value.transient
    assert 1 < time.monotonic() - started < 12


def test_a_missing_bucket_is_permanent_and_raised_at_once(moto_s3: MotoS3) -> None:
    """Afterwards: the error came at the first attempt (no waiting out the 60 s budget), permanent."""
    store = CheckpointStore("s3://no-such-bucket-faults/run", moto_s3.storage_options())
    started = time.monotonic()
    with pytest.raises(StorageError) as info:
        retry_transient(store.check_access, budget=60, what="S3 access check", log=log)
    assert not info.value.transient
    assert "does not exist" in str(info.value)
    assert time.monotonic() - started < 5


def test_bad_credentials_are_permanent_and_raised_at_once(moto_s3: MotoS3) -> None:
    """Afterwards: wrong secret, unknown key and missing rights each failed at once, permanent."""
    bucket = moto_s3.make_bucket()
    writer = moto_s3.iam_user("faults-writer", allow_s3=True)
    nobody = moto_s3.iam_user("faults-nobody", allow_s3=False)
    uri = f"s3://{bucket}/run"
    cases = {
        "SignatureDoesNotMatch": moto_s3.storage_options(key=writer["key"], secret="wrong-secret"),
        "InvalidAccessKeyId": moto_s3.storage_options(key="AKIAUNKNOWNKEY000000", secret="x"),
        "AccessDenied": moto_s3.storage_options(**nobody),
    }
    with moto_s3.enforce_auth():
        for code, options in cases.items():
            started = time.monotonic()
            with pytest.raises(StorageError) as info:
                retry_transient(CheckpointStore(uri, options).check_access, budget=60, what="S3 check", log=log)
            assert not info.value.transient, code
            assert code in str(info.value)
            assert time.monotonic() - started < 5, code


@pytest.mark.parametrize(
    ("status", "code", "transient", "says"),
    [
        (503, "SlowDown", True, "answered HTTP 503 (SlowDown)"),
        (500, "InternalError", True, "answered HTTP 500"),
        (503, "ServiceUnavailable", True, "answered HTTP 503"),
        (429, "TooManyRequests", True, "answered HTTP 429"),
        (403, "AccessDenied", False, "access denied (AccessDenied)"),
        (404, "NoSuchBucket", False, "'some-bucket' does not exist"),
    ],
)
def test_http_answers_follow_the_one_error_policy(status: int, code: str, transient: bool, says: str) -> None:
    """Afterwards: 5xx and throttling are transient and say the endpoint answered HTTP <status>;
    403/404 are permanent and name the fix."""
    with s3_error_server(status, code) as endpoint:
        options = {"key": "k", "secret": "s", "endpoint_url": endpoint, "client_kwargs": {"region_name": "us-east-1"}}
        error, seconds = _failure(CheckpointStore("s3://some-bucket/run", options))
    assert error.transient is transient
    assert seconds < 10
    assert says in str(error)


@pytest.mark.slow
def test_a_hung_endpoint_times_out_transient(hung_server: HungServer) -> None:
    """Afterwards: the check made one request, gave up after its read timeout with a transient error
    (botocore's max_attempts counts retries: it once made two, 2 x CHECK_READ_TIMEOUT)."""
    options = {
        "key": "k",
        "secret": "s",
        "endpoint_url": f"http://127.0.0.1:{hung_server.port}",
        "client_kwargs": {"region_name": "us-east-1"},
    }
    error, seconds = _failure(CheckpointStore("s3://some-bucket/run", options))
    assert error.transient
    assert "cannot be reached" in str(error)
    assert hung_server.connections == 1
    assert seconds >= CHECK_READ_TIMEOUT  # it waited for the answer, and only once (the count above)


def test_malformed_uris_and_unusable_local_paths_are_permanent(tmp_path: Path) -> None:
    with pytest.raises(StorageError) as info:
        CheckpointStore("s3://Bad_Bucket/x")
    assert not info.value.transient
    (tmp_path / "afile").write_text("x")
    with pytest.raises(StorageError) as info:
        retry_transient(CheckpointStore(str(tmp_path / "afile")).check_access, budget=60, what="check", log=log)
    assert not info.value.transient
