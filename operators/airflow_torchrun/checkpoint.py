"""Checkpoint store on fsspec: step directories, a commit marker written last, latest, retention.

Layout under a checkpoint URI (``file://`` or a plain local path by default, ``s3://`` through s3fs)::

    <uri>/step-00000120/state.pt      (what the ranks wrote: any files, any depth; see
                                       airflow_torchrun.worker.checkpoint for what save_checkpoint writes)
    <uri>/step-00000120/COMMITTED     (JSON: step, time, world size, format, lineage and writer, every
                                       file with its size and CRC-32; written last)
    <uri>/LINEAGE                     (JSON: the task instance lineage that owns the root)

A step directory without ``COMMITTED`` is *torn* (a writer died, or is still writing): it is never
resumed and never counted for retention. A committed step whose files do not match the marker
(missing, truncated, altered) is *damaged*: it is never resumed either, and the previous committed
step is used. "Latest" is the newest committed step that verifies.

**Lineage.** A root belongs to one task instance lineage (dag, run, task, map index): the first task
that uses it writes ``LINEAGE`` (:func:`claim_lineage`), and any other lineage is refused before a
rank starts, so a fresh start never deletes, shadows or resumes another lineage's steps, and
retention (which works on one root) only ever prunes the writing lineage's own steps. Every try and
group that commits a step is recorded in its marker (``lineage``, ``writer``).

This module imports neither Airflow nor torch: the operator uses it before any rank starts
(:meth:`CheckpointStore.check_access`, :func:`resolve_resume`) and the worker helpers in
:mod:`airflow_torchrun.worker.checkpoint` use it inside the ranks.

An operator's ``aws_conn_id`` is resolved through the Amazon provider's hooks
(:func:`storage_options_from_aws_conn_id`). S3 settings otherwise come from the standard AWS
variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL``; any other credential source
botocore knows works too), overridden by an explicit ``storage_options`` dict (s3fs's arguments).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
import zlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from airflow_torchrun import contract
from airflow_torchrun.errors import StorageError, http_status, is_transient

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

log = logging.getLogger(__name__)

SUPPORTED_SCHEMES = ("file", "s3")
STEP_PREFIX = "step-"
STEP_DIGITS = 8
COMMIT_MARKER = "COMMITTED"
LINEAGE_FILE = "LINEAGE"
MARKER_VERSION = 2
CHECKSUM_ALGO = "crc32"
# Read in pieces this big when checksumming a stored file.
CHUNK_BYTES = 8 << 20
RESUME_AUTO = "auto"
RESUME_NEVER = "never"
# The part of storage_options that is not an AWS_* variable reaches the ranks as JSON here.
STORAGE_OPTIONS_ENV = contract.CHECKPOINT_STORAGE_OPTIONS

_STEP_DIR = re.compile(rf"^{STEP_PREFIX}(\d+)$")
# S3's bucket naming rules (lower case, 3-63 chars, no leading/trailing dot or hyphen).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# check_access must answer within a few seconds even when the endpoint is down.
CHECK_CONNECT_TIMEOUT = 2.0
CHECK_READ_TIMEOUT = 5.0


@dataclass(frozen=True)
class CheckpointRef:
    """A committed checkpoint: the URI of its step directory and its step."""

    uri: str
    step: int


@dataclass(frozen=True)
class Lineage:
    """The task instance lineage that owns a checkpoint root: every try of one mapped-or-not task
    of one DAG run."""

    dag_id: str
    run_id: str
    task_id: str
    map_index: int = -1

    def to_dict(self) -> dict[str, Any]:
        return {"dag_id": self.dag_id, "run_id": self.run_id, "task_id": self.task_id, "map_index": self.map_index}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Lineage:
        return cls(
            dag_id=str(data.get("dag_id")),
            run_id=str(data.get("run_id")),
            task_id=str(data.get("task_id")),
            map_index=int(data.get("map_index", -1)),
        )

    def describe(self) -> str:
        index = f", map index {self.map_index}" if self.map_index >= 0 else ""
        return f"dag {self.dag_id!r}, run {self.run_id!r}, task {self.task_id!r}{index}"


def crc32_of(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC-32 of ``data`` (continuing from ``value``)."""
    return zlib.crc32(data, value) & 0xFFFFFFFF


def checksum_text(value: int) -> str:
    """A checksum as the marker records it: ``crc32:<8 hex digits>``."""
    return f"{CHECKSUM_ALGO}:{value:08x}"


@dataclass(frozen=True)
class CheckpointLocation:
    """A validated checkpoint URI split into what fsspec needs."""

    uri: str  # canonical: file:///abs/path or s3://bucket/prefix, no trailing slash
    scheme: str
    path: str  # fsspec path: /abs/path or bucket/prefix
    bucket: str | None = None


def parse_uri(uri: str) -> CheckpointLocation:
    """Validate a checkpoint URI and return its canonical form.

    Accepts ``s3://bucket[/prefix]``, ``file:///abs/path`` and plain local paths (made absolute).
    Raises :class:`StorageError` saying what is wrong and what a valid URI looks like.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise StorageError(
            f"checkpoint URI must be a non-empty string, got {uri!r}; use s3://bucket/prefix or file:///abs/path"
        )
    uri = uri.strip()
    if "://" not in uri:
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", uri) and not re.match(r"^[A-Za-z]:[\\/]", uri):
            raise StorageError(
                f"checkpoint URI {uri!r} is malformed: write the scheme as scheme://, e.g. s3://bucket/prefix"
            )
        path = os.path.abspath(os.path.expanduser(uri))
        return CheckpointLocation(uri=f"file://{path}", scheme="file", path=path)
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in SUPPORTED_SCHEMES:
        raise StorageError(
            f"checkpoint URI {uri!r} has the unsupported scheme {parts.scheme!r}; "
            f"use one of: {', '.join(s + '://' for s in SUPPORTED_SCHEMES)} (or a plain local path)"
        )
    if parts.query or parts.fragment:
        raise StorageError(f"checkpoint URI {uri!r} must not carry a query or fragment (?... or #...)")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise StorageError(
                f"checkpoint URI {uri!r} names the host {parts.netloc!r}; a file URI needs an absolute path "
                f"after three slashes, e.g. file:///{parts.netloc}{parts.path}"
            )
        if not parts.path.startswith("/"):
            raise StorageError(f"checkpoint URI {uri!r} has no absolute path; use file:///abs/path")
        path = os.path.normpath(parts.path)
        return CheckpointLocation(uri=f"file://{path}", scheme="file", path=path)
    bucket = parts.netloc
    if not bucket:
        raise StorageError(f"checkpoint URI {uri!r} has no bucket name; use s3://BUCKET/prefix")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise StorageError(
            f"checkpoint URI {uri!r}: {bucket!r} is not a valid S3 bucket name "
            "(3-63 characters: lower-case letters, digits, dots and hyphens; starts and ends with a letter or digit)"
        )
    prefix = "/".join(p for p in parts.path.split("/") if p)
    path = f"{bucket}/{prefix}" if prefix else bucket
    return CheckpointLocation(uri=f"s3://{path}", scheme="s3", path=path, bucket=bucket)


def normalize_uri(uri: str) -> str:
    """The canonical form of a checkpoint URI (for comparing two URIs)."""
    return parse_uri(uri).uri


def s3_options_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """s3fs options that botocore would not pick up from the environment on every version.

    Credentials and region are left to botocore's own chain (env, profile, web identity, instance
    role); the endpoint is passed explicitly so that ``AWS_ENDPOINT_URL`` works with older botocore.
    """
    env = os.environ if env is None else env
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    return {"endpoint_url": endpoint} if endpoint else {}


def storage_options_from_aws_connection(
    login: str | None, password: str | None, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """s3fs options from the fields of an Airflow AWS connection (no Airflow import here).

    ``login``/``password`` are the access key id and secret; ``extra`` may hold
    ``aws_session_token``, ``region_name``, ``endpoint_url`` (or ``service_config.s3.endpoint_url``,
    which wins, as in the Amazon provider). Empty fields are left to botocore's own chain.
    """
    extra = extra or {}
    options: dict[str, Any] = {}
    key = login or extra.get("aws_access_key_id")
    secret = password or extra.get("aws_secret_access_key")
    if key:
        options["key"] = key
    if secret:
        options["secret"] = secret
    if extra.get("aws_session_token"):
        options["token"] = extra["aws_session_token"]
    s3_config = (extra.get("service_config") or {}).get("s3") or {}
    endpoint = s3_config.get("endpoint_url") or extra.get("endpoint_url")
    if endpoint:
        options["endpoint_url"] = endpoint
    if extra.get("region_name"):
        options["client_kwargs"] = {"region_name": extra["region_name"]}
    return options


def storage_options_from_aws_conn_id(conn_id: str) -> dict[str, Any]:
    """s3fs options for the Airflow AWS connection ``conn_id``, resolved by the Amazon provider.

    The provider's ``AwsBaseHook`` builds the session exactly as every Amazon operator does (access
    keys, ``role_arn`` with assume-role, ``profile_name``, web identity, the worker's own chain),
    and the session's current credentials become ``key``/``secret``/``token``; region and the S3
    endpoint come from the connection (``service_config.s3.endpoint_url`` wins over
    ``endpoint_url``). These are what the operator itself uses; for the ranks of a ``role_arn``
    connection see :mod:`airflow_torchrun.aws` (they assume the role themselves, and refresh it).

    Imports Airflow and the provider when called (never at module import). Without the provider
    installed, the connection's own fields are used (:func:`storage_options_from_aws_connection`).
    Raises :class:`StorageError`: transient when STS or the endpoint did not answer properly.
    """
    try:
        from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook
    except ImportError:  # pragma: no cover - the provider is a dependency of the airflow extra
        from airflow_torchrun.compat import BaseHook

        connection = BaseHook.get_connection(conn_id)
        return storage_options_from_aws_connection(connection.login, connection.password, connection.extra_dejson)
    from airflow_torchrun.compat import BaseHook

    try:
        # The provider quietly falls back to the worker's own chain for an unknown id: a typo
        # must not silently use other credentials.
        BaseHook.get_connection(conn_id)
    except Exception as exc:
        if type(exc).__name__ != "AirflowNotFoundException":
            raise
        message = f"aws_conn_id={conn_id!r}: no such Airflow connection; create it or fix the name"
        raise StorageError(message, transient=False) from exc
    hook = AwsBaseHook(aws_conn_id=conn_id, client_type="s3")
    try:
        credentials = hook.get_credentials()
    except AttributeError as exc:  # the session found no credentials at all
        raise StorageError(
            f"aws_conn_id={conn_id!r}: no AWS credentials found (not in the connection, nor in the worker's "
            "environment or profile); give the connection keys, a role_arn or a profile",
            transient=False,
        ) from exc
    except Exception as exc:
        raise StorageError(
            f"aws_conn_id={conn_id!r}: the Amazon provider could not get credentials from this connection "
            f"({type(exc).__name__}: {exc}); check its keys, role_arn, profile or web identity settings",
            transient=is_transient(exc),
        ) from exc
    options: dict[str, Any] = {}
    if credentials.access_key:
        options["key"] = credentials.access_key
    if credentials.secret_key:
        options["secret"] = credentials.secret_key
    if credentials.token:
        options["token"] = credentials.token
    config = hook.conn_config
    endpoint = config.get_service_endpoint_url("s3")
    if endpoint:
        options["endpoint_url"] = endpoint
    if config.region_name:
        options["client_kwargs"] = {"region_name": config.region_name}
    return options


def storage_env(storage_options: Mapping[str, Any] | None) -> dict[str, str]:
    """Environment that gives every rank the same S3 access as ``storage_options``.

    Credentials, region and endpoint become the standard ``AWS_*`` variables (botocore reads them);
    any other option travels as JSON in ``TRAIN_CHECKPOINT_STORAGE_OPTIONS``. On Kubernetes put the
    credentials in a Secret rather than in the pod spec.
    """
    options = dict(storage_options or {})
    env: dict[str, str] = {}
    for option, variable in (
        ("key", "AWS_ACCESS_KEY_ID"),
        ("secret", "AWS_SECRET_ACCESS_KEY"),
        ("token", "AWS_SESSION_TOKEN"),
        ("endpoint_url", "AWS_ENDPOINT_URL"),
    ):
        value = options.pop(option, None)
        if value:
            env[variable] = str(value)
    client_kwargs = dict(options.pop("client_kwargs", None) or {})
    region = client_kwargs.pop("region_name", None)
    if region:
        env["AWS_DEFAULT_REGION"] = str(region)
    endpoint = client_kwargs.pop("endpoint_url", None)
    if endpoint and "AWS_ENDPOINT_URL" not in env:
        env["AWS_ENDPOINT_URL"] = str(endpoint)
    if client_kwargs:
        options["client_kwargs"] = client_kwargs
    if options:
        try:
            env[STORAGE_OPTIONS_ENV] = json.dumps(options, sort_keys=True)
        except TypeError as exc:
            raise StorageError(f"storage_options must be JSON-serialisable to reach the ranks: {exc}") from exc
    return env


def _merge_options(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _endpoint_of(options: Mapping[str, Any]) -> str:
    client_kwargs = options.get("client_kwargs") or {}
    return str(options.get("endpoint_url") or client_kwargs.get("endpoint_url") or "the default AWS S3 endpoint")


def _make_filesystem(location: CheckpointLocation, options: Mapping[str, Any]) -> AbstractFileSystem:
    import fsspec

    if location.scheme == "file":
        return fsspec.filesystem("file")
    try:
        import s3fs  # noqa: F401
    except ImportError as exc:
        raise StorageError(
            f"{location.uri} needs s3fs, which is not installed here; install airflow-torchrun[s3] (or s3fs)"
        ) from exc
    return fsspec.filesystem("s3", **options)


class CheckpointStore:
    """Committed checkpoints under one URI: layout, commit marker, latest, retention, access check.

    :param uri: ``s3://bucket/prefix``, ``file:///abs/path`` or a local path.
    :param storage_options: s3fs arguments (``key``, ``secret``, ``token``, ``endpoint_url``,
        ``client_kwargs``, ``config_kwargs``...). They override what the AWS environment variables say.
        Ignored for local paths.
    """

    def __init__(self, uri: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.location = parse_uri(uri)
        self.uri = self.location.uri
        base = s3_options_from_env() if self.location.scheme == "s3" else {}
        self.storage_options: dict[str, Any] = (
            _merge_options(base, storage_options or {}) if self.location.scheme == "s3" else {}
        )
        self._fs: AbstractFileSystem | None = None

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r})"

    # -- paths ------------------------------------------------------------------------------
    @property
    def fs(self) -> AbstractFileSystem:
        """The fsspec filesystem (created on first use)."""
        if self._fs is None:
            self._fs = _make_filesystem(self.location, self.storage_options)
        return self._fs

    @staticmethod
    def step_name(step: int) -> str:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"checkpoint step must be a whole number >= 0, got {step!r}")
        return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"

    def step_uri(self, step: int) -> str:
        """URI of the directory that holds ``step``."""
        return f"{self.uri}/{self.step_name(step)}"

    def step_path(self, step: int) -> str:
        """fsspec path of the directory that holds ``step`` (for ``self.fs``)."""
        return f"{self.location.path}/{self.step_name(step)}"

    def path_of(self, uri: str) -> str:
        """fsspec path of a URI under this store's scheme."""
        return parse_uri(uri).path

    def _marker_path(self, step: int) -> str:
        return f"{self.step_path(step)}/{COMMIT_MARKER}"

    # -- reading ----------------------------------------------------------------------------
    def _step_dirs(self) -> list[int]:
        """Steps of every step directory, committed or not, ascending."""
        fs = self.fs
        fs.invalidate_cache(self.location.path)
        try:
            entries = fs.ls(self.location.path, detail=True)
        except FileNotFoundError:
            return []
        steps = []
        for entry in entries:
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            match = _STEP_DIR.match(name)
            if match and entry.get("type") == "directory":
                steps.append(int(match.group(1)))
        return sorted(steps)

    def is_committed(self, step: int) -> bool:
        """True when ``step`` has its commit marker."""
        path = self._marker_path(step)
        self.fs.invalidate_cache(self.step_path(step))
        return bool(self.fs.exists(path))

    def committed(self) -> list[CheckpointRef]:
        """Every committed checkpoint (marker present; not verified), oldest first."""
        return [CheckpointRef(self.step_uri(s), s) for s in self._step_dirs() if self.is_committed(s)]

    def latest(self, *, verify: bool = True, skip: Collection[int] = ()) -> CheckpointRef | None:
        """The newest committed checkpoint that verifies, or None when there is none.

        Torn directories are skipped silently; a committed step whose files do not match its marker
        (:meth:`verify` with sizes only: a listing, no download) is skipped with a warning naming
        what is wrong, and the previous committed step is tried. ``skip``: steps not to consider.
        """
        for step in reversed(self._step_dirs()):
            if step in skip or not self.is_committed(step):
                continue
            if verify:
                problems = self.verify(step, content=False)
                if problems:
                    log.warning(
                        "Skipping checkpoint %s: %s; trying the previous committed step",
                        self.step_uri(step),
                        "; ".join(problems),
                    )
                    continue
            return CheckpointRef(self.step_uri(step), step)
        return None

    def verify(self, step: int, *, content: bool = True) -> list[str]:
        """What is wrong with committed ``step`` (empty when nothing is): its marker must be readable
        and every file it lists present with the recorded size and, with ``content``, checksum."""
        try:
            marker = self.read_marker(step)
        except StorageError as exc:
            return [str(exc)]
        expected = marker_files(marker)
        if not expected:
            return ["its commit marker lists no files"]
        found = self.list_files(step)
        problems = []
        for rel, (size, checksum) in expected.items():
            if rel not in found:
                problems.append(f"{rel} is missing")
            elif found[rel] != size:
                problems.append(f"{rel} has {found[rel]} bytes, the marker says {size}")
            elif content and checksum is not None:
                actual = self.checksum_file(f"{self.step_path(step)}/{rel}")
                if actual != checksum:
                    problems.append(f"{rel} does not match its checksum ({actual}, the marker says {checksum})")
        return problems

    def checksum_file(self, path: str) -> str:
        """The marker-style checksum of a stored file (read in pieces)."""
        value = 0
        with self.fs.open(path, "rb", block_size=CHUNK_BYTES) as fp:
            while True:
                chunk = fp.read(CHUNK_BYTES)
                if not chunk:
                    break
                value = crc32_of(chunk, value)
        return checksum_text(value)

    # -- lineage ----------------------------------------------------------------------------
    def read_lineage(self) -> Lineage | None:
        """The lineage that owns this root (its ``LINEAGE`` file), or None when none claimed it."""
        path = f"{self.location.path}/{LINEAGE_FILE}"
        self.fs.invalidate_cache(self.location.path)
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        try:
            return Lineage.from_dict(json.loads(raw))
        except (ValueError, TypeError, AttributeError) as exc:
            raise StorageError(
                f"{self.uri}/{LINEAGE_FILE} is not valid: {exc}; remove it only if no other task uses this root",
                transient=False,
            ) from exc

    def write_lineage(self, lineage: Lineage) -> None:
        if self.location.scheme == "file":
            os.makedirs(self.location.path, exist_ok=True)
        data = json.dumps(lineage.to_dict(), sort_keys=True).encode()
        self.fs.pipe_file(f"{self.location.path}/{LINEAGE_FILE}", data)

    def read_marker(self, step: int) -> dict[str, Any]:
        """The commit marker of ``step``; :class:`StorageError` if the step is not committed."""
        # A listing cached by this process (s3fs keeps one) must not hide a marker written since.
        self.fs.invalidate_cache(self.step_path(step))
        try:
            raw = self.fs.cat_file(self._marker_path(step))
        except FileNotFoundError:
            raise StorageError(
                f"checkpoint {self.step_uri(step)} is not committed (no {COMMIT_MARKER} marker): it was torn by a "
                "failure or is still being written; resume from a committed step or from the checkpoint root"
            ) from None
        try:
            marker = json.loads(raw)
        except ValueError as exc:
            raise StorageError(f"commit marker of {self.step_uri(step)} is not valid JSON: {exc}") from exc
        if not isinstance(marker, dict):
            raise StorageError(f"commit marker of {self.step_uri(step)} is not a JSON object")
        return marker

    # -- writing ----------------------------------------------------------------------------
    def list_files(self, step: int) -> dict[str, int]:
        """Files under the step directory (relative path -> size), without the marker."""
        root = self.step_path(step)
        self.fs.invalidate_cache(root)
        try:
            found = self.fs.find(root, detail=True)
        except FileNotFoundError:
            return {}
        files = {}
        for name, info in found.items():
            rel = name[len(root) :].lstrip("/") if name.startswith(root) else name.rsplit("/", 1)[-1]
            if rel and rel != COMMIT_MARKER and info.get("type") != "directory":
                files[rel] = int(info.get("size") or 0)
        return dict(sorted(files.items()))

    def commit(
        self,
        step: int,
        meta: Mapping[str, Any] | None = None,
        *,
        files: Mapping[str, int] | None = None,
        checksums: Mapping[str, str] | None = None,
    ) -> CheckpointRef:
        """Write the commit marker of ``step``: call it only once every file of the step is written.

        The marker records the step, the time, the files with their sizes (``files``: what the
        writer wrote; listed from the step directory when not given) and CRC-32 checksums
        (``checksums``; computed from the stored files for any file without one) and ``meta``
        (world size, format, lineage, writer...). It is written in one piece (a rename locally,
        a single PUT on S3), so a reader sees either no marker or a complete one.
        """
        files = dict(files) if files is not None else self.list_files(step)
        if not files:
            raise StorageError(f"refusing to commit {self.step_uri(step)}: the step directory holds no files")
        sums = dict(checksums or {})
        for rel in files:
            if rel not in sums:
                sums[rel] = self.checksum_file(f"{self.step_path(step)}/{rel}")
        marker: dict[str, Any] = dict(meta or {})
        marker.update(
            {
                "version": MARKER_VERSION,
                "step": step,
                "committed_at": time.time(),
                "files": dict(sorted(files.items())),
                "checksums": {rel: sums[rel] for rel in sorted(files)},
                "total_bytes": sum(files.values()),
            }
        )
        data = json.dumps(marker, indent=1, sort_keys=True).encode()
        path = self._marker_path(step)
        if self.location.scheme == "file":
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            with open(tmp, "wb") as fp:
                fp.write(data)
                fp.flush()
                os.fsync(fp.fileno())
            os.replace(tmp, path)
            _fsync_dir(self.step_path(step))
        else:
            self.fs.pipe_file(path, data)
        return CheckpointRef(self.step_uri(step), step)

    def delete_step(self, step: int) -> None:
        """Remove a step directory; the marker goes first so a half-deleted step is never 'committed'."""
        marker = self._marker_path(step)
        if self.fs.exists(marker):
            self.fs.rm_file(marker)
        try:
            self.fs.rm(self.step_path(step), recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(self.location.path)

    def prune(self, keep_last: int, protect: Collection[str] = ()) -> list[str]:
        """Delete old checkpoints; return the URIs deleted.

        Keeps the ``keep_last`` most recently committed steps (commit time, then step); never deletes
        a URI in ``protect`` (the checkpoint being resumed from). Only this root is touched, and a
        root belongs to one lineage (:func:`claim_lineage`). Torn directories older than
        the newest committed step are removed too (they can never be resumed); newer torn ones may
        still be in the middle of being written and are left alone.
        """
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be a whole number >= 1, got {keep_last!r}")
        protected = {normalize_uri(u) for u in protect if u}
        steps = self._step_dirs()
        committed = [s for s in steps if self.is_committed(s)]
        if not committed:
            return []
        # Newest by commit time, not by step: a fresh start of this lineage (resume="never" on a
        # retry) writes low steps after high ones, and those are the ones to keep.
        keep = set(sorted(committed, key=lambda s: (self._committed_at(s), s))[-keep_last:])
        newest = committed[-1]
        deleted = []
        for step in steps:
            if step in keep or (step >= newest and step not in committed) or self.step_uri(step) in protected:
                continue
            self.delete_step(step)
            deleted.append(self.step_uri(step))
        if deleted:
            log.info("Pruned %d checkpoint(s) under %s: %s", len(deleted), self.uri, ", ".join(deleted))
        return deleted

    def _committed_at(self, step: int) -> float:
        try:
            return float(self.read_marker(step).get("committed_at") or 0.0)
        except (StorageError, TypeError, ValueError):
            return 0.0

    # -- access check -----------------------------------------------------------------------
    def check_access(self, *, write: bool = True) -> None:
        """Fail fast, before any rank starts, when this store cannot be used.

        Checks that the location is reachable, exists (the bucket) and that the credentials may
        list it and, with ``write``, write to it (a small probe object is written and deleted).
        Raises :class:`StorageError` naming the cause and the fix. Its ``transient`` follows
        :func:`airflow_torchrun.errors.is_transient`: ``True`` when the store did not answer
        properly (endpoint unreachable, timeout, HTTP 5xx, throttling), so the same check may pass
        later (call it through :func:`~airflow_torchrun.errors.retry_transient`); ``False`` for
        what only a change can fix (malformed URI, at construction; missing bucket; unknown access
        key; wrong secret; access denied; a file where the directory should be).
        One attempt takes at most a few seconds even when the endpoint does not answer.
        """
        if self.location.scheme == "file":
            self._check_local(write)
        else:
            self._check_s3(write)

    def _check_local(self, write: bool) -> None:
        path = self.location.path
        try:
            if os.path.exists(path) and not os.path.isdir(path):
                raise StorageError(
                    f"checkpoint location {self.uri} exists but is a file, not a directory; "
                    "point checkpoint_uri at a directory (or remove the file)",
                    transient=False,
                )
            if not write:
                return
            os.makedirs(path, exist_ok=True)
            probe = os.path.join(path, f".access-check-{uuid.uuid4().hex}")
            with open(probe, "wb") as fp:
                fp.write(b"ok")
            os.remove(probe)
        except PermissionError as exc:
            raise StorageError(
                f"checkpoint location {self.uri} is not writable by this user ({exc.strerror}); "
                "choose a directory the worker can write to, or fix its permissions",
                transient=False,
            ) from exc
        except OSError as exc:
            if isinstance(exc, StorageError):
                raise
            # A timed-out network mount is transient; a full or read-only disk is not.
            raise StorageError(
                f"checkpoint location {self.uri} cannot be used: {exc}", transient=is_transient(exc)
            ) from exc

    def _check_s3(self, write: bool) -> None:
        options = _merge_options(
            self.storage_options,
            {
                "skip_instance_cache": True,
                "config_kwargs": {
                    "connect_timeout": CHECK_CONNECT_TIMEOUT,
                    "read_timeout": CHECK_READ_TIMEOUT,
                    "retries": {"max_attempts": 1, "mode": "standard"},
                },
            },
        )
        fs = _make_filesystem(self.location, options)
        # s3fs retries some errors itself, with back-off; one attempt is enough to diagnose.
        fs.retries = 1  # type: ignore[attr-defined]
        bucket = self.location.bucket or ""
        prefix = self.location.path[len(bucket) :].strip("/")
        endpoint = _endpoint_of(options)
        try:
            fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=f"{prefix}/" if prefix else "", MaxKeys=1)
            if write:
                probe = f"{self.location.path}/.access-check-{uuid.uuid4().hex}"
                fs.pipe_file(probe, b"ok")
                fs.rm_file(probe)
        except Exception as exc:
            raise s3_storage_error(exc, uri=self.uri, bucket=bucket, endpoint=endpoint) from exc


def _fsync_dir(path: str) -> None:
    # The rename is durable only once the directory entry is on disk.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _error_code(exc: BaseException) -> str:
    """The S3 error code (``NoSuchBucket``, ``AccessDenied``...) found anywhere in the exception chain."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            if code:
                return str(code)
        current = current.__cause__ or current.__context__
    return ""


def _chain_names(exc: BaseException) -> set[str]:
    names: set[str] = set()
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        names.update(cls.__name__ for cls in type(current).__mro__)
        current = current.__cause__ or current.__context__
    return names


def s3_storage_error(exc: BaseException, *, uri: str, bucket: str, endpoint: str) -> StorageError:
    """The :class:`StorageError` for an s3fs/botocore failure: :func:`describe_s3_error`'s message,
    transient exactly when :func:`airflow_torchrun.errors.is_transient` says so."""
    return StorageError(describe_s3_error(exc, uri=uri, bucket=bucket, endpoint=endpoint), transient=is_transient(exc))


def describe_s3_error(exc: BaseException, *, uri: str, bucket: str, endpoint: str) -> str:
    """Turn an s3fs/botocore failure into: what happened, the likely cause, what to change.

    The S3 error code picks the message for what needs a change (credentials, bucket, rights);
    whether the failure is temporary is :func:`airflow_torchrun.errors.is_transient`'s call, the
    same for storage as for the cluster API and tracking.
    """
    code = _error_code(exc)
    names = _chain_names(exc)
    status = http_status(exc)
    if code in ("InvalidAccessKeyId", "InvalidClientTokenId"):
        return (
            f"cannot use {uri}: {endpoint} does not know the access key id ({code}). "
            "Check AWS_ACCESS_KEY_ID / the connection's login, and that it belongs to this endpoint"
        )
    if code == "SignatureDoesNotMatch":
        return (
            f"cannot use {uri}: the secret key does not match the access key id ({code}). "
            "Check AWS_SECRET_ACCESS_KEY / the connection's password"
        )
    if code in ("ExpiredToken", "TokenRefreshRequired", "InvalidToken"):
        return f"cannot use {uri}: the session token is expired or invalid ({code}); refresh AWS_SESSION_TOKEN"
    if code in ("AccessDenied", "AllAccessDisabled", "403") or (not code and "PermissionError" in names):
        return (
            f"cannot use {uri}: access denied ({code or 'PermissionError'}). The credentials are valid but may "
            f"not list and write s3://{bucket}; grant s3:ListBucket, s3:GetObject, s3:PutObject and "
            "s3:DeleteObject on it"
        )
    if code in ("NoSuchBucket", "404") or (not code and "FileNotFoundError" in names):
        return f"cannot use {uri}: the bucket {bucket!r} does not exist at {endpoint}; create it or fix the bucket name"
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        return (
            f"cannot use {uri}: no AWS credentials were found. Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "give the task an AWS connection, or pass storage_options"
        )
    if is_transient(exc):
        if status is not None:
            return (
                f"cannot use {uri}: the S3 endpoint {endpoint} answered HTTP {status}"
                f"{f' ({code})' if code else ''}: it is overloaded, throttling or failing. This is usually "
                "temporary; if it lasts, check the storage service's health and request rate"
            )
        return (
            f"cannot use {uri}: the S3 endpoint {endpoint} cannot be reached ({type(exc).__name__}: {exc}). "
            "If it is down for a moment this passes by itself; otherwise check AWS_ENDPOINT_URL / the "
            "connection's endpoint_url and that the server is up and reachable from the workers"
        )
    detail = f" ({code})" if code else ""
    return f"cannot use {uri}{detail}: {type(exc).__name__}: {exc}"


def marker_files(marker: Mapping[str, Any]) -> dict[str, tuple[int, str | None]]:
    """A marker's files: relative path -> (size, checksum or None for a version-1 marker)."""
    files = marker.get("files") or {}
    sums = marker.get("checksums") or {}
    out: dict[str, tuple[int, str | None]] = {}
    if isinstance(files, Mapping):
        for rel, size in files.items():
            checksum = sums.get(rel) if isinstance(sums, Mapping) else None
            out[str(rel)] = (int(size), str(checksum) if checksum else None)
    return out


def claim_lineage(store: CheckpointStore, lineage: Lineage) -> None:
    """Make sure ``store``'s root belongs to ``lineage`` (claiming it when nobody has), before launch.

    Raises a permanent :class:`StorageError` when the root belongs to another lineage (its
    ``LINEAGE`` file, or the lineage recorded in its committed steps' markers): a fresh start there
    would shadow its checkpoints and retention would prune them. Nothing is deleted.
    """
    owner = store.read_lineage()
    if owner is None:
        for ref in store.committed():
            try:
                recorded = store.read_marker(ref.step).get("lineage")
            except StorageError:
                continue
            if isinstance(recorded, Mapping):
                owner = Lineage.from_dict(recorded)
                break
        if owner is None or owner == lineage:
            if owner is None and store.committed():
                log.warning(
                    "Checkpoint root %s holds committed steps of no recorded lineage (written by an older "
                    "version); %s adopts them",
                    store.uri,
                    lineage.describe(),
                )
            store.write_lineage(lineage)
            return
    if owner != lineage:
        raise StorageError(
            f"checkpoint_uri {store.uri} belongs to another task instance ({owner.describe()}); this task "
            f"({lineage.describe()}) would shadow its checkpoints, and retention would prune them, so nothing "
            "was launched and nothing was deleted. Give this task a checkpoint_uri of its own (leave "
            "checkpoint_uri unset for the per-run default, or put {{ run_id }} in it); to start from that task's "
            f"checkpoints, set resume={store.uri!r} and resume_from_outside=True on a checkpoint_uri of its own",
            transient=False,
        )


def final_checkpoint(store: CheckpointStore, lineage: Lineage) -> CheckpointRef | None:
    """The task's own final checkpoint: of the committed steps that verify (sizes) and that
    ``lineage`` wrote, the most recently committed one (a fresh start on a retry writes low steps
    after an earlier try's high ones; its own are the result). None when there is none."""
    best: tuple[float, int] | None = None
    for ref in store.committed():
        try:
            marker = store.read_marker(ref.step)
        except StorageError:
            continue
        recorded = marker.get("lineage")
        if isinstance(recorded, Mapping) and Lineage.from_dict(recorded) != lineage:
            continue
        if store.verify(ref.step, content=False):
            continue
        key = (float(marker.get("committed_at") or 0.0), ref.step)
        if best is None or key > best:
            best = key
    return CheckpointRef(store.step_uri(best[1]), best[1]) if best else None


def is_within(uri: str, root: str) -> bool:
    """True when ``uri`` is ``root`` or lies under it (canonical forms compared)."""
    uri, root = normalize_uri(uri), normalize_uri(root)
    return uri == root or uri.startswith(root + "/")


def resolve_resume(
    checkpoint_uri: str,
    resume: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    allow_outside: bool = False,
) -> CheckpointRef | None:
    """Decide which committed checkpoint a new try starts from.

    :param checkpoint_uri: where this task's checkpoints go.
    :param resume: ``"auto"``: the latest committed checkpoint under ``checkpoint_uri`` that
        verifies, or None on a fresh start; ``"never"``: None; otherwise a URI: a committed step
        directory (``.../step-00000120``, warm start; an error if it is not committed or does not
        verify) or a checkpoint root (its latest committed step that verifies; an error if none).
    :param allow_outside: a ``resume`` URI outside ``checkpoint_uri`` is refused (permanently)
        unless this is True: whoever can write to the store it names can run code in every rank.
    """
    if not isinstance(resume, str) or not resume.strip():
        raise StorageError(f"resume must be 'auto', 'never' or a checkpoint URI, got {resume!r}")
    resume = resume.strip()
    if resume == RESUME_NEVER:
        return None
    if resume == RESUME_AUTO:
        return CheckpointStore(checkpoint_uri, storage_options).latest()
    if "://" not in resume and not os.path.isabs(resume):
        raise StorageError(
            f"resume must be 'auto', 'never' or a checkpoint URI (s3://..., file:///... or an absolute path), "
            f"got {resume!r}"
        )
    location = parse_uri(resume)
    if not allow_outside and not is_within(location.uri, checkpoint_uri):
        raise StorageError(
            f"resume={resume!r} lies outside this task's checkpoint_uri {normalize_uri(checkpoint_uri)}: loading a "
            "checkpoint runs what its writer put there in every rank, so resuming from another store needs "
            "resume_from_outside=True (only for stores that no one untrusted can write to)",
            transient=False,
        )
    parent, _, name = location.uri.rpartition("/")
    match = _STEP_DIR.match(name)
    if match and parent and not parent.endswith(":/"):
        store = CheckpointStore(parent, storage_options)
        step = int(match.group(1))
        store.read_marker(step)  # raises when the step is not committed
        problems = store.verify(step, content=False)
        if problems:
            raise StorageError(
                f"resume={resume!r} is damaged ({'; '.join(problems)}); point resume at another committed step",
                transient=False,
            )
        return CheckpointRef(store.step_uri(step), step)
    ref = CheckpointStore(location.uri, storage_options).latest()
    if ref is None:
        raise StorageError(
            f"resume={resume!r}: no committed checkpoint under {location.uri}; point resume at a committed "
            "step directory or a checkpoint root that has one, or use resume='auto'"
        )
    return ref


def ref_from_uri(uri: str) -> CheckpointRef:
    """The :class:`CheckpointRef` of a step-directory URI (no I/O)."""
    location = parse_uri(uri)
    name = location.uri.rsplit("/", 1)[-1]
    match = _STEP_DIR.match(name)
    if not match:
        raise StorageError(f"{uri!r} is not a checkpoint step directory (its last part must look like step-00000120)")
    return CheckpointRef(location.uri, int(match.group(1)))
