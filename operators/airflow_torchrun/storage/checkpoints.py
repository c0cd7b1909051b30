"""The checkpoint store: step directories, a commit marker written last, verification, retention.

Layout under a checkpoint URI (``file://`` or a plain local path by default, ``s3://`` through s3fs)::

    <uri>/step-00000120/state.pt      (what the ranks wrote: any files, any depth; see
                                       airflow_torchrun.worker.checkpoint for what save_checkpoint writes)
    <uri>/step-00000120/COMMITTED     (JSON: step, time, world size, format, lineage and writer, every
                                       file with its size and CRC-32; written last)
    <uri>/step-00000120/.claim        (object stores only: how the step's first writer claimed it)
    <uri>/LINEAGE                     (JSON: the task instance lineage that owns the root; see
                                       airflow_torchrun.storage.lineage)

A step directory without ``COMMITTED`` is *torn* (a writer died, or is still writing): it is never
resumed and never counted for retention. A committed step whose files do not match the marker
(missing, truncated, altered) is *damaged*: it is never resumed either, and the previous committed
step is used. "Latest" is the newest committed step that verifies.

This module imports neither Airflow nor torch: the operator uses it before any rank starts
(:meth:`CheckpointStore.check_access`) and the worker helpers in :mod:`airflow_torchrun.worker.checkpoint`
use it inside the ranks. Locations are :mod:`~airflow_torchrun.storage.uri`'s, S3 options
:mod:`~airflow_torchrun.storage.aws`'s.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow_torchrun.errors import StorageError, is_transient
from airflow_torchrun.storage.aws import endpoint_of, merge_options, s3_options_from_env
from airflow_torchrun.storage.errors import s3_storage_error
from airflow_torchrun.storage.uri import make_filesystem, normalize_uri, parse_uri

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

try:
    # zlib-ng's CRC-32 is zlib's (the same checksums), computed about four times as fast with the CPU's
    # carry-less multiply: at 1 GB, 0.04 s against 0.15-0.23 s here. It releases the GIL as zlib does.
    from zlib_ng.zlib_ng import crc32 as _crc32

    CRC32_LIBRARY = "zlib-ng"
except ImportError:  # the worker extra brings it; without it, the standard library's (the same values)
    from zlib import crc32 as _crc32

    CRC32_LIBRARY = "zlib"

log = logging.getLogger(__name__)

STEP_PREFIX = "step-"
STEP_DIGITS = 8
COMMIT_MARKER = "COMMITTED"
# The empty object by which the first writer of a step claims it on an object store (:meth:`CheckpointStore.claim`).
CLAIM = ".claim"
MARKER_VERSION = 2
CHECKSUM_ALGO = "crc32"
# Read in pieces this big when checksumming a stored file.
CHUNK_BYTES = 8 << 20

_STEP_DIR = re.compile(rf"^{STEP_PREFIX}(\d+)$")
# check_access must answer within a few seconds even when the endpoint is down.
CHECK_CONNECT_TIMEOUT = 2.0
CHECK_READ_TIMEOUT = 5.0


@dataclass(frozen=True)
class CheckpointRef:
    """A committed checkpoint: the URI of its step directory and its step."""

    uri: str
    step: int


def step_of(name: str) -> int | None:
    """The step of a step directory's name (``step-00000120`` -> 120); None for any other name."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def crc32_of(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC-32 of ``data`` (continuing from ``value``), with zlib-ng where it is installed."""
    return _crc32(data, value) & 0xFFFFFFFF


def checksum_text(value: int) -> str:
    """A checksum as the marker records it: ``crc32:<8 hex digits>``."""
    return f"{CHECKSUM_ALGO}:{value:08x}"


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
            merge_options(base, storage_options or {}) if self.location.scheme == "s3" else {}
        )
        self._fs: AbstractFileSystem | None = None

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r})"

    # -- paths ------------------------------------------------------------------------------
    @property
    def fs(self) -> AbstractFileSystem:
        """The fsspec filesystem (created on first use)."""
        if self._fs is None:
            self._fs = make_filesystem(self.location, self.storage_options)
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
            expected = marker_files(self.read_marker(step))
        except StorageError as exc:
            return [str(exc)]
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

    def claim(self, step: int) -> bool:
        """Whether this writer is the first to write ``step`` into this store, decided in one atomic
        operation, so two writers of one step (a zombie try and its retry) never both take the plain
        file names: locally the step's directory is created exclusively; on an object store, an empty
        ``CLAIM`` object is created with ``If-None-Match: *`` (AWS S3 and moto honour it; a store
        that ignores the condition lets both through, as the existence check before it would). A
        step that exists already (torn, committed, being written) is never claimed."""
        path = self.step_path(step)
        if self.location.scheme == "file":
            os.makedirs(self.location.path, exist_ok=True)
            try:
                os.mkdir(path)
            except FileExistsError:
                return False
            return True
        self.fs.invalidate_cache(self.location.path)
        if self.fs.exists(path):
            return False
        try:
            self.fs.pipe_file(f"{path}/{CLAIM}", b"", mode="create")
        except FileExistsError:
            return False
        except OSError as exc:
            # The condition failed without saying which (412, EINVAL) or a racing put won (409
            # ConditionalRequestConflict, EBUSY): another writer has the step.
            if exc.errno in (errno.EINVAL, errno.EBUSY):
                return False
            raise
        return True

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
        self.uncommit(step)
        self.remove_files(step)

    def uncommit(self, step: int) -> None:
        """Remove the step's commit marker (one file or object): from here on it is a torn step, never
        resumed, and swept by the next :meth:`prune` if :meth:`remove_files` never ran."""
        marker = self._marker_path(step)
        if self.fs.exists(marker):
            self.fs.rm_file(marker)
        self.fs.invalidate_cache(self.step_path(step))

    def remove_files(self, step: int) -> None:
        """Remove what is left of a step directory (after :meth:`uncommit`)."""
        try:
            self.fs.rm(self.step_path(step), recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(self.location.path)

    def prune(
        self,
        keep_last: int,
        protect: Collection[str] = (),
        *,
        lineage: Mapping[str, Any] | None = None,
        defer: Callable[[Callable[[], None]], object] | None = None,
    ) -> list[str]:
        """Delete old checkpoints; return the URIs deleted (uncommitted, their files removed or handed
        to ``defer``).

        Keeps the ``keep_last`` most recently committed steps (commit time, then step); never deletes
        a URI in ``protect`` (the checkpoint being resumed from). Only this root is touched, and a
        root belongs to one lineage (:func:`claim_lineage`); with ``lineage`` (the writer's, as in
        ``TRAIN_CHECKPOINT_LINEAGE``) only steps whose marker records that lineage (or none, written by
        an older version) are counted and deleted, so a step another lineage committed here anyway
        is never pruned. Torn directories older than the newest committed step are removed too
        (they can never be resumed); newer torn ones may still be in the middle of being written
        and are left alone.

        Each deleted step is uncommitted (its marker removed) before this returns: no listing of
        committed steps and no resume sees it any more (its directory may stay a moment, as a torn
        step). The removal of its files is handed to ``defer`` when given (a saver's background
        thread: deleting a large file costs the freeing of its page cache, about 0.1 s per 168 MB
        here) and done here otherwise.
        """
        from airflow_torchrun.storage.lineage import Lineage, recorded_lineage

        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be a whole number >= 1, got {keep_last!r}")
        protected = {normalize_uri(u) for u in protect if u}
        mine = Lineage.from_dict(lineage) if lineage is not None else None
        steps = self._step_dirs()
        committed = [s for s in steps if self.is_committed(s)]
        if not committed:
            return []
        markers = {s: self._marker_or_none(s) for s in committed}

        def own(step: int) -> bool:
            if mine is None:
                return True
            recorded = recorded_lineage(markers[step] or {})
            return recorded is None or recorded.matches(mine)

        # Newest by commit time, not by step: a fresh start of this lineage (resume="never" on a
        # retry) writes low steps after high ones, and those are the ones to keep.
        candidates = [s for s in committed if own(s)]
        keep = set(sorted(candidates, key=lambda s: (_committed_at(markers[s]), s))[-keep_last:])
        newest = committed[-1]
        deleted = []
        for step in steps:
            if step in committed and (step in keep or not own(step)):
                continue
            if (step >= newest and step not in committed) or self.step_uri(step) in protected:
                continue
            self.uncommit(step)
            if defer is None:
                self.remove_files(step)
            else:
                defer(functools.partial(self.remove_files, step))
            deleted.append(self.step_uri(step))
        if deleted:
            log.info("Pruned %d checkpoint(s) under %s: %s", len(deleted), self.uri, ", ".join(deleted))
        return deleted

    def _marker_or_none(self, step: int) -> dict[str, Any] | None:
        try:
            return self.read_marker(step)
        except StorageError:
            return None

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
        options = merge_options(
            self.storage_options,
            {
                "skip_instance_cache": True,
                "config_kwargs": {
                    "connect_timeout": CHECK_CONNECT_TIMEOUT,
                    "read_timeout": CHECK_READ_TIMEOUT,
                    # total_max_attempts counts the first try; botocore's max_attempts counts
                    # retries (max_attempts=1 made two reads, 2 x CHECK_READ_TIMEOUT on a hung server).
                    "retries": {"total_max_attempts": 1, "mode": "standard"},
                },
            },
        )
        fs = make_filesystem(self.location, options)
        # s3fs retries some errors itself, with back-off; one attempt is enough to diagnose.
        fs.retries = 1
        bucket = self.location.bucket or ""
        prefix = self.location.path[len(bucket) :].strip("/")
        endpoint = endpoint_of(options)
        try:
            fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=f"{prefix}/" if prefix else "", MaxKeys=1)
            if write:
                probe = f"{self.location.path}/.access-check-{uuid.uuid4().hex}"
                fs.pipe_file(probe, b"ok")
                fs.rm_file(probe)
        except Exception as exc:
            raise s3_storage_error(exc, uri=self.uri, bucket=bucket, endpoint=endpoint) from exc


def _committed_at(marker: Mapping[str, Any] | None) -> float:
    try:
        return float((marker or {}).get("committed_at") or 0.0)
    except (TypeError, ValueError):
        return 0.0


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


def marker_files(marker: Mapping[str, Any]) -> dict[str, tuple[int, str | None]]:
    """A marker's files: relative path -> (size, checksum or None for a version-1 marker).

    Raises :class:`StorageError` when the marker's file list is not one (a size that is not a whole
    number): the step is then damaged, like one whose files do not match, and is skipped.
    """
    files = marker.get("files") or {}
    sums = marker.get("checksums") or {}
    out: dict[str, tuple[int, str | None]] = {}
    if isinstance(files, Mapping):
        for rel, size in files.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise StorageError(f"its commit marker gives {rel!r} the size {size!r}, not a number of bytes")
            checksum = sums.get(rel) if isinstance(sums, Mapping) else None
            out[str(rel)] = (size, str(checksum) if checksum else None)
    return out
