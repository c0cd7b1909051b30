"""Secrets in URIs: what a log line, an error, XCom or a rendered object may say about a URI that carries them.

A tracking URI such as ``http://alice:s3cret@mlflow:5000`` (or ``...?token=...``) works, and its
credentials must reach only where they are used: never a log, an error message, XCom, a file others
can read, a pod spec or ``airflow-torchrun render``. Standard library only.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

__all__ = ["credentials_in", "redact", "without_credentials"]

_SECRET_QUERY = re.compile(r"token|secret|password|passwd|key|auth|signature", re.IGNORECASE)


def credentials_in(uri: str) -> list[str]:
    """The secrets a tracking URI carries: the password (or a lone user name, a token) of its user
    part, and the values of query parameters that look like credentials."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return []
    found = []
    if parts.password:
        found.append(parts.password)
    elif parts.username and "@" in parts.netloc:
        found.append(parts.username)
    for key, value in parse_qsl(parts.query, keep_blank_values=False):
        if _SECRET_QUERY.search(key) and value:
            found.append(value)
    return [f for f in found if f]


def redact(text: str, uri: str | None) -> str:
    """``text`` with every secret of ``uri`` replaced by ``***``: what a log line, an error or XCom may
    say about a tracking URI (``http://alice:***@mlflow:5000``)."""
    if not uri:
        return text
    for secret in sorted(
        set(credentials_in(uri)) | {quote(c, safe="") for c in credentials_in(uri)}, key=len, reverse=True
    ):
        text = text.replace(secret, "***")
    return text


def without_credentials(uri: str) -> str:
    """``uri`` without its user part (a link to show people: its host and path only)."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
