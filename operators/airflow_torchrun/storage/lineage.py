"""Who owns a checkpoint root, and where a new try starts: claim, final checkpoint, resume point.

**Lineage.** A root belongs to one task instance lineage (deployment, dag, run, task, map index):
the first task that uses it creates ``LINEAGE`` (:func:`claim_lineage`, a conditional create: of two
racing claims exactly one wins), and any other lineage is refused before a rank starts, so a fresh
start never deletes, shadows or resumes another lineage's steps. Two Airflow deployments sharing a
store have equal run ids (every ``scheduled__...`` is the same everywhere): the deployment's
identity keeps their lineages apart. Retention prunes only the writing lineage's own steps
(:meth:`CheckpointStore.prune` with ``lineage``). Every try and group that commits a step is
recorded in its marker (``lineage``, ``writer``).

**Resume.** :func:`resolve_resume` turns the operator's ``resume`` argument into the committed
checkpoint a try starts from; a URI outside the task's own root needs ``allow_outside``.
Imports neither Airflow nor torch.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from airflow_torchrun.errors import StorageError
from airflow_torchrun.storage.checkpoints import CheckpointRef, CheckpointStore, step_of
from airflow_torchrun.storage.uri import is_within, normalize_uri, parse_uri

log = logging.getLogger(__name__)

LINEAGE_FILE = "LINEAGE"
# The operator's ``resume``: the latest committed checkpoint of the task's own root, or none.
RESUME_AUTO = "auto"
RESUME_NEVER = "never"


@dataclass(frozen=True)
class Lineage:
    """The task instance lineage that owns a checkpoint root: every try of one mapped-or-not task
    of one DAG run of one Airflow deployment.

    ``deployment`` None: not recorded (a root or marker written before lineages named their
    deployment); such a lineage :meth:`matches` one of any deployment with the same ids.
    """

    dag_id: str
    run_id: str
    task_id: str
    map_index: int = -1
    deployment: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "dag_id": self.dag_id,
            "run_id": self.run_id,
            "task_id": self.task_id,
            "map_index": self.map_index,
        }
        if self.deployment is not None:
            data["deployment"] = self.deployment
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Lineage:
        deployment = data.get("deployment")
        return cls(
            dag_id=str(data.get("dag_id")),
            run_id=str(data.get("run_id")),
            task_id=str(data.get("task_id")),
            map_index=int(data.get("map_index", -1)),
            deployment=None if deployment is None else str(deployment),
        )

    def matches(self, other: Lineage) -> bool:
        """The same task instance lineage; a deployment that either side did not record is no difference."""
        same = (self.dag_id, self.run_id, self.task_id, self.map_index) == (
            other.dag_id,
            other.run_id,
            other.task_id,
            other.map_index,
        )
        return same and (self.deployment is None or other.deployment is None or self.deployment == other.deployment)

    def describe(self) -> str:
        index = f", map index {self.map_index}" if self.map_index >= 0 else ""
        where = f" of Airflow deployment {self.deployment!r}" if self.deployment is not None else ""
        return f"dag {self.dag_id!r}, run {self.run_id!r}, task {self.task_id!r}{index}{where}"


def recorded_lineage(marker: Mapping[str, Any]) -> Lineage | None:
    """The lineage a commit marker records (None: none, or not one)."""
    recorded = marker.get("lineage")
    if not isinstance(recorded, Mapping):
        return None
    try:
        return Lineage.from_dict(recorded)
    except (TypeError, ValueError):
        return None


def read_lineage(store: CheckpointStore) -> Lineage | None:
    """The lineage that owns ``store``'s root (its ``LINEAGE`` file), or None when none claimed it."""
    path = f"{store.location.path}/{LINEAGE_FILE}"
    store.fs.invalidate_cache(store.location.path)
    try:
        raw = store.fs.cat_file(path)
    except FileNotFoundError:
        return None
    try:
        return Lineage.from_dict(json.loads(raw))
    except (ValueError, TypeError, AttributeError) as exc:
        raise StorageError(
            f"{store.uri}/{LINEAGE_FILE} is not valid: {exc}; remove it only if no other task uses this root",
            transient=False,
        ) from exc


def write_lineage(store: CheckpointStore, lineage: Lineage, *, exclusive: bool = False) -> bool:
    """Write ``LINEAGE``; with ``exclusive``, only when there is none yet (False: another was there).

    The exclusive create is a hard link of a complete file locally (atomic, and a reader never sees
    half of it) and a conditional PUT (``If-None-Match: *``) on S3. A store that ignores the
    condition (some S3-compatible ones do) makes the last of two racing claims win instead.
    """
    data = json.dumps(lineage.to_dict(), sort_keys=True).encode()
    path = f"{store.location.path}/{LINEAGE_FILE}"
    if store.location.scheme != "file":
        try:
            store.fs.pipe_file(path, data, mode="create" if exclusive else "overwrite")
        except FileExistsError:
            return False
        return True
    os.makedirs(store.location.path, exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "wb") as fp:
        fp.write(data)
        fp.flush()
        os.fsync(fp.fileno())
    try:
        if not exclusive:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def claim_lineage(store: CheckpointStore, lineage: Lineage) -> None:
    """Make sure ``store``'s root belongs to ``lineage`` (claiming it when nobody has), before launch.

    Raises a permanent :class:`StorageError` when the root belongs to another lineage (its
    ``LINEAGE`` file, or the lineage recorded in its committed steps' markers): a fresh start there
    would shadow its checkpoints and retention would prune them. Nothing is deleted. Of two tasks
    that claim an unclaimed root at once, one wins and the other is refused.
    """
    owner = read_lineage(store)
    if owner is None:
        for ref in store.committed():
            try:
                owner = recorded_lineage(store.read_marker(ref.step))
            except StorageError:
                continue
            if owner is not None:
                break
        if owner is None or owner.matches(lineage):
            if owner is None and store.committed():
                log.warning(
                    "Checkpoint root %s holds committed steps of no recorded lineage (written by an older "
                    "version); %s adopts them",
                    store.uri,
                    lineage.describe(),
                )
            if write_lineage(store, lineage, exclusive=True):
                return
            owner = read_lineage(store)  # another claim came first: it decides
            if owner is None:
                raise StorageError(f"{store.uri}/{LINEAGE_FILE} was created and removed again while it was claimed")
    if owner.matches(lineage):
        if owner.deployment is None and lineage.deployment is not None:
            write_lineage(store, lineage)  # a root claimed before lineages named their deployment
        return
    other_deployment = owner.deployment != lineage.deployment and (owner.dag_id, owner.run_id, owner.task_id) == (
        lineage.dag_id,
        lineage.run_id,
        lineage.task_id,
    )
    why = (
        "another Airflow deployment (same dag, run and task ids: two deployments sharing a store, such as staging "
        "and production on one bucket or two AIRFLOW_HOMEs on one machine) owns it"
        if other_deployment
        else "it belongs to another task instance"
    )
    raise StorageError(
        f"checkpoint_uri {store.uri}: {why} ({owner.describe()}); this task ({lineage.describe()}) would shadow "
        "its checkpoints, resume from them as if they were its own, and retention would prune them, so nothing was "
        "launched and nothing was deleted. Give this task a checkpoint_uri of its own (leave checkpoint_uri unset "
        "for the per-run default, or put {{ run_id }} in it; a deployment of its own needs its own [torchrun] "
        f"checkpoint_base); to start from that task's checkpoints, set resume={store.uri!r} and "
        "resume_from_outside=True on a checkpoint_uri of its own",
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
        recorded = recorded_lineage(marker)
        if recorded is not None and not recorded.matches(lineage):
            continue
        if store.verify(ref.step, content=False):
            continue
        key = (float(marker.get("committed_at") or 0.0), ref.step)
        if best is None or key > best:
            best = key
    return CheckpointRef(store.step_uri(best[1]), best[1]) if best else None


def resume_problem(resume: object) -> str | None:
    """What is wrong with a ``resume`` value (``None``: nothing), before any storage is touched."""
    if not isinstance(resume, str) or not resume.strip():
        return f"resume must be 'auto', 'never' or a checkpoint URI, got {resume!r}"
    value = resume.strip()
    if value in (RESUME_AUTO, RESUME_NEVER) or "://" in value or os.path.isabs(value):
        return None
    hint = " ('latest' is spelt 'auto': the latest committed checkpoint that verifies)" if value == "latest" else ""
    return (
        f"resume must be 'auto', 'never' or a checkpoint URI (s3://..., file:///... or an absolute path), "
        f"got {resume!r}{hint}"
    )


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
    problem = resume_problem(resume)
    if problem:
        raise StorageError(problem)
    resume = resume.strip()
    if resume == RESUME_NEVER:
        return None
    if resume == RESUME_AUTO:
        return CheckpointStore(checkpoint_uri, storage_options).latest()
    location = parse_uri(resume)
    if not allow_outside and not is_within(location.uri, checkpoint_uri):
        raise StorageError(
            f"resume={resume!r} lies outside this task's checkpoint_uri {normalize_uri(checkpoint_uri)}: loading a "
            "checkpoint runs what its writer put there in every rank, so resuming from another store needs "
            "resume_from_outside=True (only for stores that no one untrusted can write to)",
            transient=False,
        )
    parent, _, name = location.uri.rpartition("/")
    step = step_of(name)
    if step is not None and parent and not parent.endswith(":/"):
        store = CheckpointStore(parent, storage_options)
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
    step = step_of(location.uri.rsplit("/", 1)[-1])
    if step is None:
        raise StorageError(f"{uri!r} is not a checkpoint step directory (its last part must look like step-00000120)")
    return CheckpointRef(location.uri, step)
