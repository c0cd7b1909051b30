"""Path segments and lineage names derived from Airflow identities, injectively, in one place.

A segment that is already safe for a path or an S3 key (letters, digits, ``.``, ``_``, ``-``; not
``.`` or ``..``) is kept as is. Anything else is sanitised *and* given ``~`` plus a short hash of
the original: ``~`` never appears in a kept segment, so two different inputs never share a
directory (``a:b``, ``a+b`` and ``a~b`` become ``a_b~<hash1>``, ``a_b~<hash2>``, ``a_b~<hash3>``).
A mapped task instance's segment is ``<task>~map<index>``: never the same as a task named
``<task>-<index>``, and never a sanitised segment (``m`` is not a hex digit). Standard library only.
"""

from __future__ import annotations

import hashlib
import re

_SAFE = re.compile(r"^[A-Za-z0-9._-]+$")
_UNSAFE_RUN = re.compile(r"[^A-Za-z0-9._-]+")
HASH_CHARS = 8


def short_hash(text: str) -> str:
    """The first hex digits of the SHA-256 of ``text`` (UTF-8)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:HASH_CHARS]


def segment(raw: str) -> str:
    """``raw`` as one path segment: unchanged when safe, else sanitised with ``~<hash>`` appended."""
    text = str(raw)
    if _SAFE.match(text) and text not in (".", ".."):
        return text
    cleaned = _UNSAFE_RUN.sub("_", text).strip(".") or "_"
    return f"{cleaned}~{short_hash(text)}"


def task_segment(task_id: str, map_index: int = -1) -> str:
    """The segment of one task instance: the task's, plus ``~map<index>`` for a mapped one."""
    base = segment(task_id)
    return base if map_index is None or map_index < 0 else f"{base}~map{int(map_index)}"


def lineage_path(dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> str:
    """``<dag>/<run>/<task>``: the relative checkpoint path of one task instance lineage."""
    return f"{segment(dag_id)}/{segment(run_id)}/{task_segment(task_id, map_index)}"
