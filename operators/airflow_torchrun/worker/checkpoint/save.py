"""Saving a step: rank 0 writes, every rank meets at a barrier, the marker is written last, then pruning."""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from airflow_torchrun.storage.checkpoints import CheckpointStore
from airflow_torchrun.storage.uri import normalize_uri
from airflow_torchrun.worker.checkpoint.comm import Comm, checkpoint_comm
from airflow_torchrun.worker.checkpoint.env import (
    checkpoint_root,
    keep_last_of,
    lineage_env,
    resume_from,
    store_for,
    writer,
)
from airflow_torchrun.worker.checkpoint.files import (
    DCP_DIR,
    FORMAT_DCP,
    FORMAT_TORCH,
    PAYLOAD_VERSION,
    RNG_FILE,
    STATE_FILE,
    cpu_snapshot,
    is_sharded,
    write_torch,
)
from airflow_torchrun.worker.checkpoint.rng import capture_rng, restore_rng
from airflow_torchrun.worker.progress import recorder

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def _timed(save: F) -> F:
    """The seconds a save blocks this rank, for the progress records (``save_s``: the goodput
    ledger's checkpoint stall) and ``should_checkpoint`` (the measured save cost)."""

    @functools.wraps(save)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            return save(*args, **kwargs)
        finally:
            recorder().saved(time.monotonic() - started)

    return timed  # type: ignore[return-value]


# -- saving -----------------------------------------------------------------------------------
_EXECUTOR: ThreadPoolExecutor | None = None

_PENDING: Future[str] | None = None

_PENDING_LOCK = threading.Lock()

# Removals of pruned steps' files, handed to the background thread (see CheckpointStore.prune).
_REMOVING: list[Future[None]] = []

_THREAD_PREFIX = "airflow-torchrun-checkpoint"


def _executor() -> ThreadPoolExecutor:
    global _EXECUTOR
    with _PENDING_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix=_THREAD_PREFIX)
        return _EXECUTOR


def _forget_executor() -> None:
    """In a forked child: the parent's worker thread is not there, nor are its saves and removals
    (and the lock may be held)."""
    global _EXECUTOR, _PENDING, _PENDING_LOCK
    _EXECUTOR, _PENDING, _PENDING_LOCK = None, None, threading.Lock()
    _REMOVING.clear()


os.register_at_fork(after_in_child=_forget_executor)


def _remove_later(remove: Callable[[], None]) -> None:
    """Run ``remove`` on the background thread; the next save, :func:`wait_for_checkpoint` and the
    process's end wait for it (its worker is not a daemon thread: the interpreter joins it). On that
    thread already (an async save's prune), or once the interpreter is ending (it takes no new work
    then), it runs here."""

    def run() -> None:
        try:
            remove()
        except Exception:
            # An old checkpoint's files that could not be removed cost space, not correctness (it is
            # uncommitted already, and the next prune sweeps it as a torn step).
            log.warning("Could not remove a pruned checkpoint's files", exc_info=True)

    if threading.current_thread().name.startswith(_THREAD_PREFIX):
        run()
        return
    try:
        future = _executor().submit(run)
    except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
        run()
        return
    with _PENDING_LOCK:
        _REMOVING.append(future)


def wait_for_checkpoint() -> str | None:
    """Wait for a save started with ``blocking=False``, and for the removal of the files of every
    checkpoint retention pruned (after any save); return the pending save's URI (None if none).

    Re-raises the background save's error. Call it before ``destroy_process_group()``.
    """
    global _PENDING
    with _PENDING_LOCK:
        pending, _PENDING = _PENDING, None
    try:
        return pending.result() if pending is not None else None
    finally:
        with _PENDING_LOCK:
            removing = _REMOVING[:]
            _REMOVING.clear()
        for future in removing:
            future.result()


@_timed
def save_checkpoint(
    state: Mapping[str, Any],
    step: int,
    *,
    uri: str | None = None,
    sharded: bool | None = None,
    keep_last: int | None = None,
    blocking: bool = True,
    meta: Mapping[str, Any] | None = None,
) -> str:
    """Save ``state`` as checkpoint ``step`` and commit it; called by EVERY rank. Returns the step's URI.

    :param state: what to save (model/optimizer state dicts, counters...). Rank 0's copy is written;
        the RNG states of every rank (torch, CUDA, numpy, ``random``) are added automatically.
    :param step: the training step reached (the directory is ``step-%08d``); resume continues after it.
    :param uri: the checkpoint root; default ``TRAIN_CHECKPOINT_URI``.
    :param sharded: force (True) or forbid (False) ``torch.distributed.checkpoint``; by default used
        when ``state`` holds DTensor or ShardedTensor values.
    :param keep_last: committed checkpoints to keep (0: every one, as the operator's ``keep_last=0``);
        default ``TRAIN_CHECKPOINT_KEEP_LAST`` (the operator's ``keep_last``) or 3.
    :param blocking: with False, the state is copied to CPU now and written by a background thread
        while training goes on (not for sharded state); the next save, or :func:`wait_for_checkpoint`,
        waits for it.
    :param meta: extra JSON-serialisable facts recorded in the commit marker.

    The step directory is committed only once every rank got through the save; if a rank dies on
    the way the step stays uncommitted and is never resumed. A blocking save leaves the RNG states
    as they were when it started, whatever the I/O libraries drew meanwhile, so that the random
    stream of the uninterrupted run is the one a resumed run gets. Saving the step this run resumed from
    again is a no-op (its committed copy is kept).
    """
    comm = checkpoint_comm()
    store = store_for(checkpoint_root(uri))
    step_uri = store.step_uri(step)
    keep = keep_last_of(keep_last)
    resumed = resume_from()
    if resumed and normalize_uri(resumed) == step_uri:
        # Rewriting the checkpoint we resumed from would put the only good copy at risk for nothing.
        if comm.rank == 0:
            log.info("Checkpoint %s is the one this run resumed from; keeping it as is", step_uri)
        return step_uri
    extra = dict(meta or {})
    json.dumps(extra)  # fail now, not in the background, if meta is not JSON-serialisable
    wait_for_checkpoint()
    use_dcp = is_sharded(state) if sharded is None else sharded
    my_rng = capture_rng()
    rng_states = comm.gather_states(my_rng)
    job = _SaveJob(comm, store, step, rng_states, keep, extra, time.monotonic())
    if use_dcp:
        if not blocking and comm.rank == 0:
            log.info("Sharded checkpoints are written synchronously")
        job.run_dcp(state)
        # Libraries doing the I/O may draw from the global RNGs (botocore's retry jitter):
        # put them back so the training's random stream does not depend on checkpointing.
        restore_rng(my_rng)
        return step_uri
    payload: dict[str, Any] | None = None
    if comm.rank == 0:
        payload = {"version": PAYLOAD_VERSION, "step": step, "state": state}
    if blocking:
        job.run_torch(payload)
        restore_rng(my_rng)
        return step_uri
    snapshot = cpu_snapshot(payload) if payload is not None else None
    if comm.rank == 0:
        log.info(
            "Checkpoint step %d copied to CPU in %.3fs; writing it in the background",
            step,
            time.monotonic() - job.started,
        )
    global _PENDING
    future = _executor().submit(job.run_torch, snapshot)
    with _PENDING_LOCK:
        _PENDING = future
    return step_uri


@dataclass
class _SaveJob:
    """One save of one step, as every rank runs it (possibly on the background thread)."""

    comm: Comm
    store: CheckpointStore
    step: int
    rng_states: list[Any]
    keep: int
    meta: dict[str, Any]
    started: float

    def run_torch(self, payload: dict[str, Any] | None) -> str:
        """Rank 0 writes the state with every rank's RNG in one file; commit once all ranks got here."""
        step_path = self.store.step_path(self.step)
        written: dict[str, tuple[int, str]] = {}
        if self.comm.rank == 0:
            (name,) = _writer_names(self.store, self.step, STATE_FILE)
            # One file, one fsync: the RNG states are small and every rank reads the state anyway.
            written[name] = write_torch(self.store, f"{step_path}/{name}", {**(payload or {}), "rng": self.rng_states})
        self.comm.barrier()
        if self.comm.rank == 0:
            self._commit_and_prune(FORMAT_TORCH, written, {"state_file": next(iter(written))})
        self.comm.barrier()
        return self.store.step_uri(self.step)

    def run_dcp(self, state: Mapping[str, Any]) -> str:
        """Every rank writes its part through torch.distributed.checkpoint; commit after all are done."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        step_path = self.store.step_path(self.step)
        names = self.comm.all_gather(
            _writer_names(self.store, self.step, DCP_DIR, RNG_FILE) if self.comm.rank == 0 else None
        )[0]
        dcp_dir, rng_file = names
        writer = FsspecWriter(f"{self.store.step_uri(self.step)}/{dcp_dir}", **self.store.storage_options)
        dcp.save(dict(state), storage_writer=writer, process_group=self.comm.group, no_dist=self.comm.group is None)
        # Each rank checksums the part it wrote (read back from the page cache locally).
        mine: dict[str, tuple[int, str]] = {}
        prefix = f"__{self.comm.rank}_"
        for rel, size in self.store.list_files(self.step).items():
            top, _, base = rel.partition("/")
            if top == dcp_dir and (base.startswith(prefix) or (self.comm.rank == 0 and base == ".metadata")):
                mine[rel] = (size, self.store.checksum_file(f"{step_path}/{rel}"))
        if self.comm.rank == 0:
            mine[rng_file] = write_torch(self.store, f"{step_path}/{rng_file}", self.rng_states)
        parts = self.comm.gather(mine)
        if self.comm.rank == 0:
            written = {rel: v for part in parts for rel, v in part.items()}
            self._commit_and_prune(FORMAT_DCP, written, {"dcp_dir": dcp_dir, "rng_file": rng_file})
        self.comm.barrier()
        return self.store.step_uri(self.step)

    def _commit_and_prune(self, fmt: str, written: dict[str, tuple[int, str]], names: dict[str, str]) -> None:
        store = self.store
        files = {rel: size for rel, (size, _) in written.items()}
        meta = {
            **self.meta,
            **names,
            "format": fmt,
            "world_size": self.comm.world_size,
            "lineage": lineage_env(),
            "writer": writer(),
        }
        store.commit(self.step, meta, files=files, checksums={rel: c for rel, (_, c) in written.items()})
        size_mb = sum(files.values()) / 1e6
        log.info(
            "Checkpoint %s committed: %.1f MB in %.2fs",
            store.step_uri(self.step),
            size_mb,
            time.monotonic() - self.started,
        )
        if self.keep:
            try:
                store.prune(
                    self.keep, protect=[u for u in (resume_from(),) if u], lineage=lineage_env(), defer=_remove_later
                )
            except Exception:
                # A checkpoint that could not be pruned costs space, not correctness: keep training.
                log.warning("Could not prune old checkpoints under %s", store.uri, exc_info=True)


def _writer_names(store: CheckpointStore, step: int, *names: str) -> tuple[str, ...]:
    """``names`` when this writer is the first of the step (:meth:`CheckpointStore.claim`); else names of
    this writer's own (the step is a torn leftover, another try's committed copy, or a writer racing
    this one): nothing another writer committed is overwritten or deleted, and the marker, replaced in
    one piece, names only the files of the writer that wrote it."""
    if store.claim(step):
        return names
    mine = uuid.uuid4().hex[:8]
    unique = tuple(f"{stem}-{mine}{dot}{ext}" for stem, dot, ext in (n.partition(".") for n in names))
    log.info(
        "Checkpoint %s already exists (%s); writing %s beside what is there",
        store.step_uri(step),
        "committed" if store.is_committed(step) else "torn",
        ", ".join(unique),
    )
    return unique
