"""Storage locations on fsspec: parse and normalise URIs, containment, the filesystem for a URI.

The one fsspec layer of the package: checkpoints (:mod:`~airflow_torchrun.storage.checkpoints`),
shards (:mod:`airflow_torchrun.sharding`) and the ranks' helpers open their stores through it.
Checkpoint locations are ``file://`` (or a plain local path) and ``s3://`` (through s3fs); data
sources may be any URI fsspec opens. An S3 URI may name the Airflow connection that reaches it, as
``ObjectStoragePath`` does: ``s3://<conn_id>@bucket/prefix``; :func:`split_conn_id` takes it out,
and every canonical URI (what the ranks see) is the plain one. Imports neither Airflow nor torch;
fsspec when used.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from airflow_torchrun.errors import StorageError

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem


SUPPORTED_SCHEMES = ("file", "s3")

# S3's bucket naming rules (lower case, 3-63 chars, no leading/trailing dot or hyphen).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


# An Airflow connection id as ObjectStoragePath puts it before the bucket: letters, digits, _ . -
_CONN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,250}$")


@dataclass(frozen=True)
class CheckpointLocation:
    """A validated checkpoint URI split into what fsspec needs."""

    uri: str  # canonical: file:///abs/path or s3://bucket/prefix, no trailing slash, no connection
    scheme: str
    path: str  # fsspec path: /abs/path or bucket/prefix
    bucket: str | None = None
    conn_id: str | None = None  # the Airflow connection named in s3://<conn_id>@bucket/...


def split_conn_id(uri: str) -> tuple[str | None, str]:
    """``("aws_data", "s3://bucket/prefix")`` for ``s3://aws_data@bucket/prefix``; ``(None, uri)`` for a
    URI that names no connection. Raises :class:`StorageError` for a malformed one (``s3://@bucket``)."""
    if not isinstance(uri, str) or "://" not in uri:
        return None, uri
    scheme, _, rest = uri.partition("://")
    netloc, slash, tail = rest.partition("/")
    if "@" not in netloc:
        return None, uri
    if scheme.lower() not in ("s3", "s3a"):
        raise StorageError(f"{uri!r}: only s3:// URIs may name a connection (<conn_id>@bucket)")
    conn, _, bucket = netloc.rpartition("@")
    if not _CONN_ID.match(conn) or not bucket:
        raise StorageError(
            f"{uri!r}: write the connection as s3://<conn_id>@bucket/prefix, the conn_id being an Airflow "
            "connection id (letters, digits, '_', '.', '-')"
        )
    return conn, f"{scheme}://{bucket}{slash}{tail}"


def one_conn_id(uris: Iterable[str], aws_conn_id: str | None) -> str | None:
    """The one AWS connection of a task's storage: ``aws_conn_id``, else the one its URIs name
    (``s3://<conn_id>@bucket/...``, as ``ObjectStoragePath`` writes it). Two different ones: a
    :class:`StorageError` that names both."""
    named = {conn for conn, _ in map(split_conn_id, uris) if conn is not None}
    if aws_conn_id:
        named.add(aws_conn_id)
    if len(named) > 1:
        raise StorageError(
            f"the storage URIs and aws_conn_id name different connections ({', '.join(sorted(named))}); name one"
        )
    return next(iter(named), None)


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
    conn_id, plain = split_conn_id(uri)
    if conn_id is not None:
        return replace(parse_uri(plain), conn_id=conn_id)
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


def make_filesystem(location: CheckpointLocation, options: Mapping[str, Any]) -> AbstractFileSystem:
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


def is_within(uri: str, root: str) -> bool:
    """True when ``uri`` is ``root`` or lies under it (canonical forms compared)."""
    uri, root = normalize_uri(uri), normalize_uri(root)
    return uri == root or uri.startswith(root + "/")


# -- reading --------------------------------------------------------------------------------------
def url_filesystem(uri: str, storage_options: Mapping[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem and the path inside it for ``uri``.

    For ``s3://`` the endpoint in ``AWS_ENDPOINT_URL`` is used (as for checkpoints), overridden
    by ``storage_options``; credentials come from botocore's usual chain.
    """
    from fsspec.core import url_to_fs

    options = dict(storage_options or {})
    if uri.startswith(("s3://", "s3a://")):
        from airflow_torchrun.storage.aws import s3_options_from_env

        options = {**s3_options_from_env(), **options}
    try:
        return url_to_fs(uri, **options)
    except (ImportError, ValueError) as exc:
        raise StorageError(
            f"cannot open {uri!r}: {exc}. For s3:// install s3fs (pip install 'airflow-torchrun[s3]')",
            transient=False,
        ) from exc


def absolute_uri(uri: str) -> str:
    """``uri`` with a local relative path made absolute, so ranks in other directories find it."""
    if "://" in uri:
        return uri.rstrip("/") or uri
    return os.path.abspath(uri)
