"""The checkpoint store on a local directory and on S3 (moto's server over HTTP, through s3fs)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from airflow_torchrun.errors import StorageError
from airflow_torchrun.storage.checkpoints import COMMIT_MARKER, CheckpointRef, CheckpointStore
from airflow_torchrun.storage.lineage import ref_from_uri, resolve_resume
from airflow_torchrun.storage.uri import normalize_uri, parse_uri
from tests.ports import refusing_port
from tests.s3_fixtures import MotoS3, reachable


@dataclass
class Root:
    """A fresh checkpoint root on one backend."""

    uri: str
    options: dict[str, Any]

    def store(self, suffix: str = "") -> CheckpointStore:
        return CheckpointStore(self.uri + suffix, self.options)

    def write_step(self, step: int, *, commit: bool, suffix: str = "", meta: dict[str, Any] | None = None) -> str:
        """A step directory as a writer leaves it: files, then (when committing) the marker."""
        store = self.store(suffix)
        base = store.step_path(step)
        if store.location.scheme == "file":
            os.makedirs(f"{base}/shards", exist_ok=True)
        store.fs.pipe_file(f"{base}/state.pt", b"s" * (100 + step))
        store.fs.pipe_file(f"{base}/shards/rank-1.pt", b"r" * 7)
        if commit:
            store.commit(step, meta or {"world_size": 2})
        return store.step_uri(step)


@pytest.fixture(params=["file", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Root:
    if request.param == "file":
        return Root(uri=f"file://{tmp_path}/ckpt", options={})
    moto: MotoS3 = request.getfixturevalue("moto_s3")
    bucket = moto.make_bucket()
    return Root(uri=f"s3://{bucket}/runs/run-1", options=moto.storage_options())


# -- URIs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("/tmp/x/ckpt/", "file:///tmp/x/ckpt"),
        ("file:///tmp/x/../y", "file:///tmp/y"),
        ("file://localhost/tmp/z", "file:///tmp/z"),
        ("s3://my-bucket", "s3://my-bucket"),
        ("s3://my-bucket/a//b/", "s3://my-bucket/a/b"),
        ("S3://my.bucket-1/p", "s3://my.bucket-1/p"),
    ],
)
def test_uris_are_normalized(uri: str, expected: str) -> None:
    assert normalize_uri(uri) == expected


def test_relative_path_becomes_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_uri("ckpt").uri == f"file://{tmp_path}/ckpt"


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("gs://bucket/x", "unsupported scheme 'gs'"),
        ("s3://", "no bucket name"),
        ("s3:///prefix/only", "no bucket name"),
        ("s3://Bad_Bucket/x", "not a valid S3 bucket name"),
        ("s3://ab/x", "not a valid S3 bucket name"),
        ("s3://bucket/x?versionId=1", "query or fragment"),
        ("file://host/path", "names the host 'host'"),
        ("s3:bucket/x", "write the scheme as scheme://"),
        ("", "non-empty"),
    ],
)
def test_malformed_uris_are_rejected_with_the_fix(uri: str, message: str) -> None:
    with pytest.raises(StorageError, match=message.replace("?", r"\?")):
        CheckpointStore(uri)


def test_step_uri_layout_and_bad_steps() -> None:
    store = CheckpointStore("s3://bucket-a/run")
    assert store.step_uri(120) == "s3://bucket-a/run/step-00000120"
    assert ref_from_uri("s3://bucket-a/run/step-00000120/") == CheckpointRef("s3://bucket-a/run/step-00000120", 120)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="whole number"):
            store.step_uri(bad)  # type: ignore[arg-type]
    with pytest.raises(StorageError, match="not a checkpoint step directory"):
        ref_from_uri("s3://bucket-a/run")


# -- layout, marker, latest ---------------------------------------------------------------------
def test_commit_marker_is_written_last_and_lists_the_files(root: Root) -> None:
    store = root.store()
    assert store.latest() is None
    assert store.committed() == []
    uri = root.write_step(120, commit=False)
    assert uri == f"{store.uri}/step-00000120"
    # Files written, no marker yet: the step is not a checkpoint.
    assert not store.is_committed(120)
    assert store.latest() is None
    with pytest.raises(StorageError, match="not committed"):
        store.read_marker(120)

    ref = store.commit(120, {"world_size": 2, "format": "torch"})
    assert ref == CheckpointRef(uri, 120)
    assert store.latest() == ref
    marker = store.read_marker(120)
    assert marker["step"] == 120
    assert marker["world_size"] == 2
    assert marker["files"] == {"shards/rank-1.pt": 7, "state.pt": 220}
    assert marker["total_bytes"] == 227
    assert abs(marker["committed_at"] - time.time()) < 600
    # The marker is the newest object of the step (S3 and local report modification times).
    step_path = store.step_path(120)
    marker_time = store.fs.modified(f"{step_path}/{COMMIT_MARKER}")
    assert all(store.fs.modified(f"{step_path}/{name}") <= marker_time for name in marker["files"])
    # Nothing but the files and the marker (no temp file left by the atomic write).
    names = sorted(p.rsplit("/", 1)[-1] for p in store.fs.find(step_path))
    assert names == [COMMIT_MARKER, "rank-1.pt", "state.pt"]


def test_commit_of_an_empty_step_is_refused(root: Root) -> None:
    with pytest.raises(StorageError, match="holds no files"):
        root.store().commit(5, {})


def test_latest_skips_torn_steps(root: Root) -> None:
    store = root.store()
    root.write_step(10, commit=True)
    root.write_step(20, commit=True)
    root.write_step(30, commit=False)  # a writer died here
    root.write_step(5, commit=False)
    assert store.latest() == CheckpointRef(store.step_uri(20), 20)
    assert [r.step for r in store.committed()] == [10, 20]
    # Something that is not a step directory is ignored.
    store.fs.pipe_file(f"{store.location.path}/notes.txt", b"x")
    assert [r.step for r in store.committed()] == [10, 20]


def test_prune_keeps_the_newest_and_the_protected(root: Root) -> None:
    store = root.store()
    for step in (10, 20, 30, 40, 50, 60):
        root.write_step(step, commit=True)
    root.write_step(25, commit=False)  # torn, older than the latest: removable
    root.write_step(70, commit=False)  # torn, newer: may be being written, kept
    protected = store.step_uri(20)
    deleted = store.prune(keep_last=2, protect=[protected + "/"])
    assert sorted(deleted) == sorted(store.step_uri(s) for s in (10, 25, 30, 40))
    assert [r.step for r in store.committed()] == [20, 50, 60]
    assert store.fs.exists(store.step_path(70))
    assert not store.fs.exists(store.step_path(10))
    # Idempotent.
    assert store.prune(keep_last=2, protect=[protected]) == []


def test_prune_never_deletes_the_newest(root: Root) -> None:
    store = root.store()
    root.write_step(1, commit=True)
    root.write_step(2, commit=True)
    assert store.prune(keep_last=1) == [store.step_uri(1)]
    assert store.latest() == CheckpointRef(store.step_uri(2), 2)
    for bad in (0, -1, "3"):
        with pytest.raises(ValueError, match="keep_last"):
            store.prune(keep_last=bad)  # type: ignore[arg-type]


def test_prune_uncommits_at_once_and_defers_the_removal_of_files(root: Root) -> None:
    """With ``defer`` (a saver's background thread), the pruned steps are uncommitted before prune
    returns and their files removed only when the deferred work runs; a removal that never ran (the
    process killed) leaves a torn step that the next prune sweeps."""
    store = root.store()
    for step in (1, 2, 3):
        root.write_step(step, commit=True)
    later: list[Any] = []
    assert store.prune(keep_last=1, defer=later.append) == [store.step_uri(1), store.step_uri(2)]
    assert [r.step for r in store.committed()] == [3]
    assert store.fs.exists(store.step_path(1)) and store.fs.exists(store.step_path(2))
    assert len(later) == 2
    later[0]()
    assert not store.fs.exists(store.step_path(1))
    # The second removal is lost (its process died): the next prune, deferring nothing, sweeps it.
    assert store.prune(keep_last=1) == [store.step_uri(2)]
    assert not store.fs.exists(store.step_path(2)) and store.fs.exists(store.step_path(3))


def test_delete_step_removes_the_marker_first(root: Root) -> None:
    store = root.store()
    root.write_step(3, commit=True)
    store.delete_step(3)
    assert store.latest() is None
    assert not store.fs.exists(store.step_path(3))


# -- resume ---------------------------------------------------------------------------------------
def test_resolve_resume(root: Root) -> None:
    store = root.store()
    assert resolve_resume(root.uri, "auto", root.options) is None
    assert resolve_resume(root.uri, "never", root.options) is None
    root.write_step(10, commit=True)
    root.write_step(20, commit=True)
    root.write_step(30, commit=False)
    latest = CheckpointRef(store.step_uri(20), 20)
    assert resolve_resume(root.uri, "auto", root.options) == latest
    assert resolve_resume(root.uri, "never", root.options) is None

    # Warm start from another run: a committed step directory, or another root's latest; outside
    # the task's own checkpoint_uri only with allow_outside (the operator's resume_from_outside).
    other = root.uri + "-other"
    fresh = root.uri + "-fresh"
    with pytest.raises(StorageError, match="outside this task's checkpoint_uri") as refused:
        resolve_resume(fresh, store.step_uri(10), root.options)
    assert refused.value.transient is False
    with pytest.raises(StorageError, match="resume_from_outside=True"):
        resolve_resume(other, root.uri, root.options)
    assert resolve_resume(root.uri, store.step_uri(10), root.options) == CheckpointRef(store.step_uri(10), 10)
    outside = {"allow_outside": True}
    assert resolve_resume(fresh, store.step_uri(10), root.options, **outside) == CheckpointRef(store.step_uri(10), 10)
    assert resolve_resume(fresh, store.step_uri(10) + "/", root.options, **outside) == CheckpointRef(
        store.step_uri(10), 10
    )
    assert resolve_resume(other, root.uri, root.options, **outside) == latest
    with pytest.raises(StorageError, match="not committed"):
        resolve_resume(fresh, store.step_uri(30), root.options, **outside)
    with pytest.raises(StorageError, match="no committed checkpoint under"):
        resolve_resume(root.uri, fresh, root.options, **outside)


@pytest.mark.parametrize("value", ["latest", "", "  ", "relative/dir"])
def test_resolve_resume_rejects_unknown_values(value: str) -> None:
    with pytest.raises(StorageError, match="resume must be 'auto', 'never' or a checkpoint URI"):
        resolve_resume("file:///tmp/never-used", value)


# -- access check ---------------------------------------------------------------------------------
def test_check_access_local(tmp_path: Path) -> None:
    CheckpointStore(str(tmp_path / "new" / "dir")).check_access()
    assert (tmp_path / "new" / "dir").is_dir()
    assert list((tmp_path / "new" / "dir").iterdir()) == []  # the probe is gone
    (tmp_path / "afile").write_text("x")
    with pytest.raises(StorageError, match="is a file, not a directory"):
        CheckpointStore(str(tmp_path / "afile")).check_access()


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_check_access_local_not_writable(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(StorageError, match="not writable"):
        CheckpointStore(str(locked / "ckpt")).check_access()


def test_check_access_s3_ok_and_probe_removed(moto_s3: MotoS3) -> None:
    bucket = moto_s3.make_bucket()
    store = CheckpointStore(f"s3://{bucket}/run", moto_s3.storage_options())
    store.check_access()
    assert moto_s3.client().list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


def test_check_access_s3_through_aws_environment(s3_env: MotoS3) -> None:
    """AWS_ENDPOINT_URL and the key variables alone are enough (what the ranks get)."""
    bucket = s3_env.make_bucket()
    store = CheckpointStore(f"s3://{bucket}/run")
    assert store.storage_options == {"endpoint_url": s3_env.endpoint}
    store.check_access()
    store.fs.pipe_file(f"{bucket}/run/step-00000001/x", b"1")
    store.commit(1, {})
    assert store.latest() == CheckpointRef(f"s3://{bucket}/run/step-00000001", 1)


def _timed_failure(store: CheckpointStore, *, transient: bool = False) -> tuple[str, float]:
    started = time.monotonic()
    with pytest.raises(StorageError) as info:
        store.check_access()
    assert info.value.transient is transient, info.value
    return str(info.value), time.monotonic() - started


def test_check_access_unreachable_endpoint_fails_fast(moto_s3: MotoS3) -> None:
    with refusing_port() as port:
        endpoint = f"http://127.0.0.1:{port}"
        store = CheckpointStore("s3://some-bucket/run", moto_s3.storage_options(endpoint_url=endpoint))
        message, seconds = _timed_failure(store, transient=True)
    assert "cannot be reached" in message
    assert endpoint in message
    assert "AWS_ENDPOINT_URL" in message
    # Generous bound: botocore's defaults (5 attempts, 60 s timeouts) would take far longer.
    assert seconds < 15


def test_check_access_unknown_host(moto_s3: MotoS3) -> None:
    store = CheckpointStore("s3://some-bucket/run", moto_s3.storage_options(endpoint_url="http://no-such-host.invalid"))
    message, seconds = _timed_failure(store, transient=True)
    assert "cannot be reached" in message
    assert seconds < 15


def test_check_access_missing_bucket(moto_s3: MotoS3) -> None:
    store = CheckpointStore("s3://no-such-bucket-xyz/run", moto_s3.storage_options())
    message, _ = _timed_failure(store)
    assert "bucket 'no-such-bucket-xyz' does not exist" in message
    assert moto_s3.endpoint in message


def test_check_access_wrong_credentials(moto_s3: MotoS3) -> None:
    """moto checks signatures and IAM policies only when told to; enforce_auth does that."""
    bucket = moto_s3.make_bucket()
    writer = moto_s3.iam_user("ckpt-writer", allow_s3=True)
    nobody = moto_s3.iam_user("ckpt-nobody", allow_s3=False)
    uri = f"s3://{bucket}/run"
    with moto_s3.enforce_auth():
        # Valid keys with S3 rights pass: the failures below are about the credentials.
        reachable(CheckpointStore(uri, moto_s3.storage_options(**writer)))
        message, _ = _timed_failure(
            CheckpointStore(uri, moto_s3.storage_options(key="AKIAUNKNOWNKEY000000", secret="x"))
        )
        assert "does not know the access key id (InvalidAccessKeyId)" in message
        message, _ = _timed_failure(
            CheckpointStore(uri, moto_s3.storage_options(key=writer["key"], secret="wrong-secret"))
        )
        assert "the secret key does not match the access key id (SignatureDoesNotMatch)" in message
        message, _ = _timed_failure(CheckpointStore(uri, moto_s3.storage_options(**nobody)))
        assert "access denied (AccessDenied)" in message
        assert "s3:PutObject" in message


def test_marker_is_json_that_names_the_step(root: Root) -> None:
    store = root.store()
    root.write_step(7, commit=True, meta={"world_size": 4, "format": "dcp", "epoch": 1})
    raw = store.fs.cat_file(f"{store.step_path(7)}/{COMMIT_MARKER}")
    marker = json.loads(raw)
    assert (marker["step"], marker["world_size"], marker["format"], marker["epoch"]) == (7, 4, "dcp", 1)


# -- from an Airflow connection to the ranks' environment ----------------------------------------
def test_storage_options_from_aws_connection_and_back_to_env() -> None:
    from airflow_torchrun.storage.aws import storage_env, storage_options_from_aws_connection

    extra = {
        "region_name": "eu-west-1",
        "aws_session_token": "tok",
        "endpoint_url": "http://ignored:1",
        "service_config": {"s3": {"endpoint_url": "http://minio:9000"}},
    }
    options = storage_options_from_aws_connection("AKID", "SECRET", extra)
    assert options == {
        "key": "AKID",
        "secret": "SECRET",
        "token": "tok",
        "endpoint_url": "http://minio:9000",
        "client_kwargs": {"region_name": "eu-west-1"},
    }
    assert storage_options_from_aws_connection(None, None, {}) == {}  # botocore's own chain decides
    env = storage_env({**options, "config_kwargs": {"connect_timeout": 3}})
    assert env == {
        "AWS_ACCESS_KEY_ID": "AKID",
        "AWS_SECRET_ACCESS_KEY": "SECRET",
        "AWS_SESSION_TOKEN": "tok",
        "AWS_ENDPOINT_URL": "http://minio:9000",
        "AWS_DEFAULT_REGION": "eu-west-1",
        "TRAIN_CHECKPOINT_STORAGE_OPTIONS": '{"config_kwargs": {"connect_timeout": 3}}',
    }
    assert storage_env(None) == {}
    with pytest.raises(StorageError, match="JSON-serialisable"):
        storage_env({"config_kwargs": object()})
