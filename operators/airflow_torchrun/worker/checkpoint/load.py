"""Loading the checkpoint to resume from: verified against its marker, a damaged step skipped for the previous one."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from airflow_torchrun import contract
from airflow_torchrun.errors import StorageError
from airflow_torchrun.storage.checkpoints import CheckpointRef, CheckpointStore, marker_files
from airflow_torchrun.storage.lineage import ref_from_uri
from airflow_torchrun.storage.uri import is_within
from airflow_torchrun.worker.checkpoint.comm import agree, checkpoint_comm
from airflow_torchrun.worker.checkpoint.env import (
    ENV_CHECKPOINT_URI,
    ENV_RESUME_FROM,
    ENV_TRUST_SHARDED,
    resume_from,
    store_for,
)
from airflow_torchrun.worker.checkpoint.files import (
    DCP_DIR,
    FORMAT_DCP,
    FORMAT_TORCH,
    RNG_FILE,
    STATE_FILE,
    Damaged,
    load_verified_local,
    read_torch,
)
from airflow_torchrun.worker.checkpoint.rng import restore_rank_rng

log = logging.getLogger(__name__)


# -- loading ----------------------------------------------------------------------------------
def load_checkpoint(
    map_location: Any = "cpu",
    *,
    uri: str | None = None,
    into: dict[str, Any] | None = None,
    weights_only: bool = True,
    restore_rng: bool = True,
    trust_sharded: bool | None = None,
) -> dict[str, Any] | None:
    """Load the checkpoint to resume from; None on a fresh start. Called by every rank.

    :param map_location: passed to ``torch.load``.
    :param uri: a committed step directory; default ``TRAIN_RESUME_FROM``.
    :param into: for sharded (``torch.distributed.checkpoint``) checkpoints: a state dict of the
        same structure, loaded in place and returned. Ignored for ordinary checkpoints.
    :param weights_only: ``torch.load``'s safe mode (tensors, numbers, strings, containers). Set
        False only for checkpoints you trust that hold other Python objects.
    :param restore_rng: restore this rank's RNG states (torch, CUDA, numpy, ``random``) as they
        were when the checkpoint was saved, so that the next random draws match the uninterrupted run.
    :param trust_sharded: loading a sharded checkpoint unpickles its metadata whatever
        ``weights_only`` says, so one outside this task's own root (``TRAIN_CHECKPOINT_URI``, which
        the operator resolved and claimed) is refused unless this is True, whatever its marker
        says of its writer. Default: ``TRAIN_CHECKPOINT_TRUST_SHARDED`` (the operator's
        ``trust_foreign_sharded``).

    Every file is checked against the commit marker (size and CRC-32) before it is used. When the
    checkpoint comes from ``TRAIN_RESUME_FROM`` and is damaged, it is skipped with a warning and the
    previous committed step that verifies is loaded instead (``TRAIN_RESUME_FROM`` is updated, so
    :func:`resume_step` called afterwards gives its step; None and a fresh start when none is
    left). An explicit ``uri`` that is damaged, or not committed, raises :class:`StorageError`.
    """
    fallback = uri is None and not os.environ.get(contract.EVAL_CHECKPOINT_URI)
    uri = uri or resume_from()
    if not uri:
        return None
    ref = ref_from_uri(uri)
    store = store_for(ref.uri.rsplit("/", 1)[0])
    trusted = os.environ.get(ENV_TRUST_SHARDED, "") == "1" if trust_sharded is None else trust_sharded
    while True:
        try:
            return _load_one(store, ref, map_location, into, weights_only, restore_rng, trusted)
        except Damaged as exc:
            if not fallback:
                raise StorageError(f"checkpoint {ref.uri} is damaged ({exc}); it was not loaded") from None
            previous = _previous_sound(store, ref.step)
            log.warning(
                "Checkpoint %s is damaged (%s): skipping it; %s",
                ref.uri,
                exc,
                f"loading the previous committed step {previous.uri} instead"
                if previous
                else "no earlier committed step verifies: starting fresh",
            )
            os.environ[ENV_RESUME_FROM] = previous.uri if previous else ""
            if previous is None:
                return None
            ref = previous


def _previous_sound(store: CheckpointStore, step: int) -> CheckpointRef | None:
    """The newest committed step before ``step`` whose files have their recorded sizes."""
    for ref in reversed(store.committed()):
        if ref.step < step and not store.verify(ref.step, content=False):
            return ref
    return None


def _is_own(ref: CheckpointRef) -> bool:
    """Whether a checkpoint lies inside the root the operator resolved and claimed for this task
    (``TRAIN_CHECKPOINT_URI``). Never by what its marker says: whoever can write a store writes its
    markers too, lineage included."""
    root = os.environ.get(ENV_CHECKPOINT_URI, "").strip()
    return bool(root) and is_within(ref.uri, root)


def _load_one(
    store: CheckpointStore,
    ref: CheckpointRef,
    map_location: Any,
    into: dict[str, Any] | None,
    weights_only: bool,
    restore_rng: bool,
    trusted: bool,
) -> dict[str, Any]:
    marker = store.read_marker(ref.step)
    try:
        expected = marker_files(marker)
    except StorageError as exc:  # the same marker on every rank: they all skip it alike
        raise Damaged(str(exc)) from None
    fmt = marker.get("format", FORMAT_TORCH)
    started = time.monotonic()
    step_path = store.step_path(ref.step)
    state: dict[str, Any]
    rng_states: list[Any] | None
    if fmt == FORMAT_DCP:
        if into is None:
            raise StorageError(
                f"{ref.uri} was saved sharded (torch.distributed.checkpoint); call load_checkpoint(into=state_dict) "
                "with a state dict of the same structure (e.g. from get_state_dict) to load it in place"
            )
        if not trusted and not _is_own(ref):
            raise StorageError(
                f"{ref.uri} is a sharded checkpoint outside this task's checkpoint root ({ENV_CHECKPOINT_URI}="
                f"{os.environ.get(ENV_CHECKPOINT_URI, '') or 'unset'}): loading it unpickles its "
                "metadata, which runs whatever its writer put there. Load it only from a store no one untrusted can "
                "write to, with load_checkpoint(trust_sharded=True) or the operator's trust_foreign_sharded=True"
            )
        _verify_dcp(store, ref.step, expected)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        group = checkpoint_comm().group
        dcp_dir = str(marker.get("dcp_dir") or DCP_DIR)
        reader = FsspecReader(f"{ref.uri}/{dcp_dir}", **store.storage_options)
        dcp.load(into, storage_reader=reader, process_group=group, no_dist=group is None)
        state = into
        rng_name = str(marker.get("rng_file") or RNG_FILE)
        rng_states = _read_rng_file(store, f"{step_path}/{rng_name}", expected.get(rng_name)) if restore_rng else None
    elif fmt == FORMAT_TORCH:
        name = str(marker.get("state_file") or STATE_FILE)
        size, checksum = expected.get(name, (None, None))
        problem = None if name in expected else f"{name} is not in the commit marker"
        payload: Any = None
        if problem is None and store.location.scheme == "file":
            payload, problem = load_verified_local(
                f"{step_path}/{name}", size, checksum, map_location=map_location, weights_only=weights_only
            )
        elif problem is None:
            try:
                payload = read_torch(
                    store,
                    f"{step_path}/{name}",
                    map_location=map_location,
                    weights_only=weights_only,
                    size=size,
                    checksum=checksum,
                )
            except Damaged as exc:
                problem = str(exc)
        if not agree(problem is None):
            raise Damaged(problem or "another rank found it damaged")
        if not isinstance(payload, dict) or "state" not in payload:
            raise StorageError(f"{ref.uri}/{name} was not written by save_checkpoint")
        state = payload["state"]
        rng_states = payload.get("rng")
    else:
        raise StorageError(f"{ref.uri} has the unknown checkpoint format {fmt!r}; was it written by a newer version?")
    if restore_rng:
        restore_rank_rng(rng_states, ref.uri)
    log.info("Loaded checkpoint %s (step %d, verified) in %.2fs", ref.uri, ref.step, time.monotonic() - started)
    return state


def _verify_dcp(store: CheckpointStore, step: int, expected: Mapping[str, tuple[int, str | None]]) -> None:
    """Sizes on every rank; checksums shared out between the ranks; all agree (raises Damaged)."""
    found = store.list_files(step)
    rank, world = 0, 1
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    for index, (rel, (size, checksum)) in enumerate(sorted(expected.items())):
        if rel not in found:
            problems.append(f"{rel} is missing")
        elif found[rel] != size:
            problems.append(f"{rel} has {found[rel]} bytes, the marker says {size}")
        elif checksum is not None and index % world == rank:
            actual = store.checksum_file(f"{store.step_path(step)}/{rel}")
            if actual != checksum:
                problems.append(f"{rel} does not match its checksum ({actual}, the marker says {checksum})")
    if not expected:
        problems.append("its commit marker lists no files")
    everyone = checkpoint_comm().all_gather(problems) if world > 1 else [problems]
    merged = sorted({p for part in everyone for p in part})
    if merged:
        raise Damaged("; ".join(merged))


def _read_rng_file(store: CheckpointStore, path: str, recorded: tuple[int, str | None] | None) -> list[Any] | None:
    size, checksum = recorded if recorded is not None else (None, None)
    try:
        states = read_torch(store, path, map_location="cpu", weights_only=True, size=size, checksum=checksum)
    except Damaged:
        if recorded is not None:
            raise
        return None
    return states if isinstance(states, list) else None
