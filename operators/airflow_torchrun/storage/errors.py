"""S3 failures, told the way a user needs them: what happened, the likely cause, what to change.

Whether a failure is temporary is :func:`airflow_torchrun.errors.is_transient`'s call, the same for
storage as for the cluster API and tracking; this module only words it.
"""

from __future__ import annotations

from airflow_torchrun.errors import StorageError, http_status, is_transient


def error_code(exc: BaseException) -> str:
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
    code = error_code(exc)
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
