"""Every name and path derived from Airflow identities, in one place, injectively. Standard library only.

Both sides use it: the operators and backends (group ids, Job names, labels, default locations)
and the ranks' helpers (nothing here imports Airflow or torch).

**Path segments.** A segment that is already safe for a path or an S3 key (letters, digits, ``.``,
``_``, ``-``; not ``.`` or ``..``) is kept as is. Anything else is sanitised *and* given ``~`` plus a
short hash of the original: ``~`` never appears in a kept segment, so two different inputs never
share a directory (``a:b``, ``a+b`` and ``a~b`` become ``a_b~<hash1>``, ``a_b~<hash2>``,
``a_b~<hash3>``). A mapped task instance's segment is ``<task>~map<index>``: never the same as a task
named ``<task>-<index>``, and never a sanitised segment (``m`` is not a hex digit).

**Group ids.** One scheme for every backend (the local group directory, the Kubernetes Job and
Service, the training view's launches): ``<dag>-<task>-<hash>-t<try>[-r<relaunch>]``, a DNS-1035
label of at most :data:`MAX_GROUP_ID` characters, where the hash covers the deployment, dag, task,
run and map index.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace

_SAFE = re.compile(r"^[A-Za-z0-9._-]+$")
_UNSAFE_RUN = re.compile(r"[^A-Za-z0-9._-]+")
_LAUNCH_SUFFIX = re.compile(r"-t\d+(?:-r(\d{1,6}))?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
HASH_CHARS = 8
# A Job's pods are named <job>-<index>-<5 random>, their hostnames <job>-<index>: both must stay
# within 63 characters, so the group id (the Job's name) keeps 11 for the rest.
MAX_GROUP_ID = 52
# The deployment name of an Airflow that has none of its own; it is left out of the hash, so the
# group ids of such a deployment are the ones they were before deployments had names.
DEFAULT_DEPLOYMENT = "default"


def short_hash(text: str) -> str:
    """The first hex digits of the SHA-256 of ``text`` (UTF-8)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:HASH_CHARS]


def digest(*parts: object, length: int = 10) -> str:
    """A hex digest of ``parts`` joined by NUL (no part can run into the next)."""
    return hashlib.sha256("\0".join(str(p) for p in parts).encode("utf-8", "surrogatepass")).hexdigest()[:length]


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
    """``<dag>/<run>/<task>``: the relative path of one task instance lineage (checkpoints, shards)."""
    return f"{segment(dag_id)}/{segment(run_id)}/{task_segment(task_id, map_index)}"


def join(base: str, *parts: str) -> str:
    """``base/part/...`` for a URI or a path, without doubled slashes at the joins."""
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


def shard_root(base: str, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> str:
    """The default output of a sharding task instance: ``<base>/<dag>/<run>/<task>``."""
    return join(base, lineage_path(dag_id, run_id, task_id, map_index))


def function_result_uri(checkpoint_uri: str, task_id: str, map_index: int, try_number: int) -> str:
    """Where rank 0 of a ``@task.torchrun`` try writes its return value: beside the task's checkpoints."""
    return join(checkpoint_uri, "results", f"{task_segment(task_id, map_index)}-try{int(try_number)}.json")


def eval_metrics_uri(checkpoint_root: str, task_id: str, map_index: int, try_number: int) -> str:
    """Where rank 0 of an evaluation try reports its metrics: beside the checkpoints it evaluates."""
    return join(checkpoint_root, "eval", f"{task_segment(task_id, map_index)}-try{int(try_number)}.json")


def dns_label(text: str) -> str:
    """Lower-case letters, digits and single hyphens, without leading or trailing hyphens."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-")


def label_value(raw: str) -> str:
    """A valid Kubernetes label value for ``raw``: itself when valid, else a cleaned prefix plus a hash."""
    if len(raw) <= 63 and _LABEL_VALUE.match(raw):
        return raw
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "_", raw).strip("_.-")[:52].rstrip("_.-")
    hashed = digest(raw)
    return f"{cleaned}-{hashed}" if cleaned else hashed


# What :func:`is_label_value` accepts, as the errors that refuse a name say it.
LABEL_VALUE_RULE = (
    "a Kubernetes label value: at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
)


def is_label_value(raw: str) -> bool:
    return label_value(raw) == raw


@dataclass(frozen=True)
class GroupIdentity:
    """Who a group belongs to: one launch of one try of one task instance of one deployment."""

    dag_id: str
    task_id: str
    run_id: str
    try_number: int = 1
    map_index: int = -1
    # Launches of this try before this one (a lost port race, a preempted group): 0 for the first.
    relaunch: int = 0
    # The Airflow deployment (two deployments may run the same dag and run ids).
    deployment: str = DEFAULT_DEPLOYMENT

    @property
    def instance_key(self) -> str:
        """The same for every try and launch of one task instance of one deployment."""
        parts: tuple[object, ...] = (self.dag_id, self.task_id, self.run_id, self.map_index)
        if self.deployment != DEFAULT_DEPLOYMENT:
            parts = (self.deployment, *parts)
        return digest(*parts, length=16)

    @property
    def group_id(self) -> str:
        """``<dag>-<task>-<hash>-t<try>[-r<relaunch>]``: a DNS-1035 label (starts with a letter) of
        at most :data:`MAX_GROUP_ID` characters; the hash keeps deployments and long or similar ids
        apart, the try and relaunch keep launches apart."""
        suffix = f"-{self.instance_key[:10]}-t{self.try_number}" + (f"-r{self.relaunch}" if self.relaunch else "")
        stem = dns_label(f"{self.dag_id}-{self.task_id}")
        if not stem or not stem[0].isalpha():
            stem = f"tr-{stem}"
        stem = stem[: MAX_GROUP_ID - len(suffix)].rstrip("-")
        return f"{stem}{suffix}"

    def relaunch_of(self, group_id: str) -> int | None:
        """Which launch of this try ``group_id`` is (0 for the first), or None when it is not one
        of this try's: a scan by the try's id finds every relaunch, however many there were."""
        found = _LAUNCH_SUFFIX.search(group_id)
        if found is None or (found.group(1) or "").startswith("0"):
            return None
        relaunch = int(found.group(1) or 0)
        return relaunch if replace(self, relaunch=relaunch).group_id == group_id else None
