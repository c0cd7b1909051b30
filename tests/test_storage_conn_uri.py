"""``s3://<conn_id>@bucket/prefix``: the connection in the URI, as ``ObjectStoragePath`` writes it."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from airflow_torchrun.errors import StorageError
from airflow_torchrun.storage.uri import parse_uri, split_conn_id
from tests import s3_fixtures
from tests.s3_fixtures import MotoS3

moto_s3 = s3_fixtures.moto_s3


def test_the_connection_is_split_off_and_the_canonical_uri_is_plain() -> None:
    assert split_conn_id("s3://aws_data@my-bucket/a/b/") == ("aws_data", "s3://my-bucket/a/b/")
    assert split_conn_id("s3://my-bucket/a") == (None, "s3://my-bucket/a")
    assert split_conn_id("/local/path") == (None, "/local/path")
    location = parse_uri("s3://aws.data-1@my-bucket/ckpt/")
    assert (location.uri, location.conn_id, location.bucket) == ("s3://my-bucket/ckpt", "aws.data-1", "my-bucket")
    with pytest.raises(StorageError, match="only s3:// URIs may name a connection"):
        split_conn_id("file://me@host/x")
    with pytest.raises(StorageError, match=r"write the connection as s3://<conn_id>@bucket/prefix"):
        parse_uri("s3://@my-bucket/x")


def test_a_shard_task_reads_through_the_connection_its_uri_names(
    moto_s3: MotoS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numpy as np

    from airflow_torchrun import ShardDatasetOperator

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)  # only the connection knows the way
    connection = {
        "conn_type": "aws",
        "login": s3_fixtures.ACCESS_KEY,
        "password": s3_fixtures.SECRET_KEY,
        "extra": {"endpoint_url": moto_s3.endpoint, "region_name": s3_fixtures.REGION},
    }
    monkeypatch.setenv("AIRFLOW_CONN_MOTO_DATA", json.dumps(connection))
    bucket = moto_s3.make_bucket("data")
    buffer = io.BytesIO()
    np.savez(buffer, x=np.arange(80, dtype="float32").reshape(20, 4), y=np.arange(20) % 3)
    moto_s3.client().put_object(Bucket=bucket, Key="digits.npz", Body=buffer.getvalue())

    op = ShardDatasetOperator(
        task_id="shard", source_uri=f"s3://moto_data@{bucket}/digits.npz", output_uri=str(tmp_path), num_shards=2
    )
    pushed: dict[str, Any] = {}
    ti = SimpleNamespace(
        dag_id="d", run_id="r", task_id="shard", map_index=-1, xcom_push=lambda key, value: pushed.update({key: value})
    )
    manifest_uri = op.execute({"ti": ti})  # type: ignore[arg-type]
    manifest = json.loads(Path(manifest_uri.removeprefix("file://")).read_text())
    assert manifest["source_uri"] == f"s3://{bucket}/digits.npz", manifest  # no connection in the data
    assert pushed["summary"]["num_rows"] == 20

    with pytest.raises(Exception, match="name different connections"):
        ShardDatasetOperator(
            task_id="s", source_uri=f"s3://a@{bucket}/x.npz", output_uri=f"s3://b@{bucket}/out", num_shards=2
        )


def test_a_training_task_takes_its_connection_from_checkpoint_uri(tmp_path: Path) -> None:
    from airflow_torchrun import DistributedTrainingOperator, EvaluateModelOperator
    from airflow_torchrun.compat import AirflowFailException

    script = str(tmp_path / "train.py")
    Path(script).write_text("print('hi')\n")
    train = DistributedTrainingOperator(task_id="t", script=script, checkpoint_uri="s3://ckpt_conn@my-bucket/runs/")
    assert train.storage_conn_id() == "ckpt_conn"
    assert DistributedTrainingOperator(task_id="t", script=script, aws_conn_id="a").storage_conn_id() == "a"
    evaluate = EvaluateModelOperator(task_id="e", script=script, checkpoint="s3://ev@my-bucket/runs/step-00000020")
    assert evaluate.storage_conn_id() == "ev"
    both = DistributedTrainingOperator(
        task_id="t", script=script, checkpoint_uri="s3://ckpt_conn@my-bucket/runs/", aws_conn_id="other"
    )
    with pytest.raises(AirflowFailException, match="name different connections \\(ckpt_conn, other\\)"):
        both.storage_conn_id()
