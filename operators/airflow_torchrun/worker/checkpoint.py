"""Checkpoint save/load inside the ranks: commit marker last, exact resume, retention. No Airflow.

Contract with the operator (environment of every rank):

``TRAIN_CHECKPOINT_URI``
    Where this task's checkpoints go (``s3://bucket/prefix``, ``file:///path`` or a local path).
``TRAIN_RESUME_FROM``
    URI of the committed checkpoint (a step directory) to resume from; empty or unset on a fresh start.
``TRAIN_CHECKPOINT_KEEP_LAST``
    How many committed checkpoints to keep (default 3; 0 keeps all). The one resumed from is never deleted.
``TRAIN_CHECKPOINT_STORAGE_OPTIONS``
    Optional JSON object of s3fs options; the standard ``AWS_*`` variables are honoured without it.
``TRAIN_CHECKPOINT_LINEAGE``
    JSON: the task instance (dag, run, task, map index) and try writing; recorded in every commit marker.
``TRAIN_CHECKPOINT_TRUST_SHARDED``
    ``1`` when the operator was told to trust sharded checkpoints of other lineages (their metadata is pickled).

Typical use in a torchrun script::

    from airflow_torchrun.worker import load_checkpoint, resume_step, save_checkpoint, save_if_stopping

    state = load_checkpoint()               # None on a fresh start; restores this rank's RNG states
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    for step in range(resume_step() + 1, total + 1):
        ...
        save_if_stopping(lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, step)
        if step % every == 0:
            save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, step)

:func:`save_if_stopping` (optional, every step) turns SIGTERM into "save this step, exit 75".

Every rank calls :func:`save_checkpoint`. Rank 0 writes the state and the RNG states of every rank
(gathered to it) as one ``torch.save`` file, all ranks meet at a barrier, rank 0 writes
the commit marker (every file with its size and CRC-32, the world size, format, lineage and writer)
and prunes old checkpoints, and a final barrier releases everyone. A rank that dies on the way
leaves the step uncommitted: it is never resumed. State dicts holding DTensor or ShardedTensor values
(or ``sharded=True``) go through ``torch.distributed.checkpoint`` instead: every rank writes its own
part, and :func:`load_checkpoint` then needs ``into=`` (loaded in place).

:func:`load_checkpoint` verifies what it loads against the marker (sizes and checksums). A damaged
step (truncated, altered, a file missing) is never loaded: it is skipped with a warning, the previous
committed step that verifies is loaded instead, and ``TRAIN_RESUME_FROM`` is updated so that
:func:`resume_step` (call it after :func:`load_checkpoint`) says which.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from airflow_torchrun import contract
from airflow_torchrun.checkpoint import (
    STORAGE_OPTIONS_ENV,
    CheckpointRef,
    CheckpointStore,
    Lineage,
    checksum_text,
    crc32_of,
    is_within,
    marker_files,
    normalize_uri,
    ref_from_uri,
)
from airflow_torchrun.errors import StorageError

log = logging.getLogger(__name__)

ENV_CHECKPOINT_URI = contract.CHECKPOINT_URI
ENV_RESUME_FROM = contract.RESUME_FROM
ENV_KEEP_LAST = contract.CHECKPOINT_KEEP_LAST
ENV_STORAGE_OPTIONS = STORAGE_OPTIONS_ENV
ENV_LINEAGE = contract.CHECKPOINT_LINEAGE
ENV_TRUST_SHARDED = contract.CHECKPOINT_TRUST_SHARDED
DEFAULT_KEEP_LAST = 3

STATE_FILE = "state.pt"
RNG_FILE = "rng.pt"
DCP_DIR = "dcp"
FORMAT_TORCH = "torch"
FORMAT_DCP = "dcp"
PAYLOAD_VERSION = 1


# -- environment ------------------------------------------------------------------------------
def resume_from() -> str | None:
    """``TRAIN_RESUME_FROM``, or None on a fresh start."""
    value = os.environ.get(ENV_RESUME_FROM, "").strip()
    return value or None


def resume_step(uri: str | None = None) -> int:
    """The step of the checkpoint resumed from (``uri`` or ``TRAIN_RESUME_FROM``); 0 on a fresh start.

    Read from the step directory's name: no I/O, so it is safe to call before the process group exists.
    """
    uri = uri or resume_from()
    return ref_from_uri(uri).step if uri else 0


def _checkpoint_root(uri: str | None) -> str:
    root = uri or os.environ.get(ENV_CHECKPOINT_URI, "").strip()
    if not root:
        raise StorageError(
            f"save_checkpoint needs a location: {ENV_CHECKPOINT_URI} is not set (the operator sets it) and no uri= "
            "was given; pass uri='file:///path' or uri='s3://bucket/prefix' when running outside Airflow"
        )
    return root


def _keep_last(value: int | None) -> int:
    if value is None:
        raw = os.environ.get(ENV_KEEP_LAST, "").strip()
        if not raw:
            return DEFAULT_KEEP_LAST
        try:
            value = int(raw)
        except ValueError:
            raise StorageError(
                f"{ENV_KEEP_LAST}={raw!r} is not a whole number; set it to 0 (keep all) or more"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise StorageError(f"keep_last must be a whole number >= 0 (0 keeps all), got {value!r}")
    return value


def _storage_options() -> dict[str, Any]:
    raw = os.environ.get(ENV_STORAGE_OPTIONS, "").strip()
    if not raw:
        return {}
    try:
        options = json.loads(raw)
    except ValueError as exc:
        raise StorageError(f"{ENV_STORAGE_OPTIONS} is not valid JSON: {exc}") from exc
    if not isinstance(options, dict):
        raise StorageError(f"{ENV_STORAGE_OPTIONS} must be a JSON object of s3fs options, got {type(options).__name__}")
    return options


def _store_for(root: str) -> CheckpointStore:
    return CheckpointStore(root, _storage_options())


def _lineage_env() -> dict[str, Any] | None:
    raw = os.environ.get(ENV_LINEAGE, "").strip()
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        log.warning("%s is not valid JSON; checkpoints will record no lineage", ENV_LINEAGE)
        return None
    return data if isinstance(data, dict) else None


def _writer() -> dict[str, Any]:
    """Who commits: the try, the group (torchrun's run id), the host and process."""
    lineage = _lineage_env() or {}
    return {
        "try_number": lineage.get("try_number"),
        "group_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        "host": os.uname().nodename,
        "pid": os.getpid(),
    }


class _ChecksumWriter:
    """A write-only file object that passes everything on and keeps the CRC-32 and size."""

    def __init__(self, fp: Any) -> None:
        self._fp = fp
        self.crc = 0
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = crc32_of(view, self.crc)
        self.size += view.nbytes
        self._fp.write(view)
        return view.nbytes

    def flush(self) -> None:
        self._fp.flush()

    @property
    def checksum(self) -> str:
        return checksum_text(self.crc)


# -- process group ----------------------------------------------------------------------------
@dataclass
class _Comm:
    """Coordination between ranks for checkpointing: a gloo group of its own, so that it works
    whatever the training backend is (nccl needs no CPU tensors) and can be used from the
    background save thread without interleaving with the training collectives."""

    rank: int = 0
    world_size: int = 1
    group: Any = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.group is not None

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def all_gather(self, obj: Any) -> list[Any]:
        """Everyone's ``obj`` on every rank."""
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any) -> list[Any]:
        """Everyone's ``obj`` on rank 0 (an empty list elsewhere)."""
        if self.group is None:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out or []


_COMM_LOCK = threading.Lock()
_COMM_CACHE: dict[int, _Comm] = {}


def _comm() -> _Comm:
    if not (dist.is_available() and dist.is_initialized()):
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if world > 1:
            raise RuntimeError(
                f"WORLD_SIZE is {world} but torch.distributed is not initialised: call "
                "torch.distributed.init_process_group() before save_checkpoint/load_checkpoint so that the "
                "ranks can agree on a commit"
            )
        return _Comm()
    key = id(dist.group.WORLD)
    with _COMM_LOCK:
        comm = _COMM_CACHE.get(key)
        if comm is None:
            # Collective: every rank gets here in its first save_checkpoint.
            group = dist.new_group(backend="gloo")
            comm = _Comm(rank=dist.get_rank(), world_size=dist.get_world_size(), group=group)
            _COMM_CACHE.clear()
            _COMM_CACHE[key] = comm
    return comm


_STOP_GROUP_CACHE: dict[int, Any] = {}


def _stop_group() -> Any:
    """The stop flag's own gloo group (None when not distributed). :func:`save_if_stopping` runs its
    all-reduce on the main thread at every step while an async save's thread runs its collectives
    on :func:`_comm`'s group; two threads issuing collectives on one group pair different operations
    across ranks (seen: the example trainer with ``--async-checkpoint`` hung at its first save, each
    rank's main thread in the flag's all-reduce and its save thread in the commit barrier)."""
    if _comm().group is None:
        return None
    key = id(dist.group.WORLD)
    with _COMM_LOCK:
        if key not in _STOP_GROUP_CACHE:
            # Collective: every rank gets here in its first save_if_stopping (on the main thread).
            _STOP_GROUP_CACHE.clear()
            _STOP_GROUP_CACHE[key] = dist.new_group(backend="gloo")
        return _STOP_GROUP_CACHE[key]


# -- RNG --------------------------------------------------------------------------------------
def _capture_rng() -> dict[str, Any]:
    """This rank's RNG states in a form ``torch.load(weights_only=True)`` accepts."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
        state["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    except ImportError:
        pass
    # Only the current device, and only once CUDA is in use: touching every GPU from every rank
    # would create contexts on devices that belong to other ranks.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_device"] = torch.cuda.current_device()
    return state


def _restore_rng(state: Mapping[str, Any]) -> None:
    # The states may have been loaded with a map_location that put them on a GPU.
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            saved = state["numpy"]
            np.random.set_state(
                (
                    saved["name"],
                    saved["keys"].cpu().numpy().astype("uint32"),
                    saved["pos"],
                    saved["has_gauss"],
                    saved["cached_gaussian"],
                )
            )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu(), device=torch.cuda.current_device())


# -- I/O --------------------------------------------------------------------------------------
def _sharded_types() -> tuple[type, ...]:
    types: list[type] = []
    try:
        from torch.distributed.tensor import DTensor

        types.append(DTensor)
    except ImportError:  # pragma: no cover - depends on the torch build
        pass
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        types.append(ShardedTensor)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


def _is_sharded(obj: Any, types: tuple[type, ...] | None = None) -> bool:
    """True when ``obj`` holds a DTensor or ShardedTensor anywhere."""
    types = _sharded_types() if types is None else types
    if types and isinstance(obj, types):
        return True
    if isinstance(obj, Mapping):
        return any(_is_sharded(v, types) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_is_sharded(v, types) for v in obj)
    return False


def _cpu_snapshot(obj: Any) -> Any:
    """A copy that later training steps cannot change (tensors cloned to CPU)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        out = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for key, value in obj.items():
            out[key] = _cpu_snapshot(value)
        # nn.Module.state_dict() keeps per-module versions here; load_state_dict reads them.
        metadata = getattr(obj, "_metadata", None)
        if metadata is not None:
            out._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [_cpu_snapshot(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_cpu_snapshot(v) for v in obj)
    return copy.deepcopy(obj)


_CRC_CHUNK = 8 << 20


def _write_torch(store: CheckpointStore, path: str, obj: Any) -> tuple[int, str]:
    """torch.save ``obj`` to ``path`` (a temp name then an atomic rename locally, one object on S3);
    return its size and checksum, computed as the bytes go out (no second read)."""
    if store.location.scheme == "file":
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "w+b") as fp:  # readable too: the checksum is read back through it
            torch.save(obj, fp)
            fp.flush()
            # The checksum is read back from the page cache while fsync waits for the disk.
            found: list[tuple[int, str]] = []
            thread = threading.Thread(target=lambda: found.append(_crc_of_fd(fp.fileno())), daemon=True)
            thread.start()
            os.fsync(fp.fileno())
            thread.join()
        if not found:
            raise StorageError(f"could not checksum {tmp} after writing it")
        os.replace(tmp, path)
        return found[0]
    else:
        with store.fs.open(path, "wb") as fp:
            writer = _ChecksumWriter(fp)
            torch.save(obj, writer)  # type: ignore[arg-type]
    return writer.size, writer.checksum


def _crc_of_fd(fd: int) -> tuple[int, str]:
    """Size and checksum of an open file, read with pread (the descriptor's offset is untouched)."""
    value, offset = 0, 0
    while chunk := os.pread(fd, _CRC_CHUNK, offset):
        value = crc32_of(chunk, value)
        offset += len(chunk)
    return offset, checksum_text(value)


def _read_verified(store: CheckpointStore, path: str, size: int | None, checksum: str | None) -> bytes:
    """The bytes of ``path``, checked against the marker's size and checksum (raises _Damaged)."""
    try:
        if store.location.scheme == "file":
            with open(path, "rb") as fp:
                data = fp.read()
        else:
            # One GET of the whole object: torch.load seeks around, which costs a request per seek on S3.
            store.fs.invalidate_cache(path.rsplit("/", 1)[0])
            data = store.fs.cat_file(path)
    except FileNotFoundError:
        raise _Damaged(f"{path.rsplit('/', 1)[-1]} is missing") from None
    name = path.rsplit("/", 1)[-1]
    if size is not None and len(data) != size:
        raise _Damaged(f"{name} has {len(data)} bytes, the marker says {size}")
    if checksum is not None:
        actual = checksum_text(crc32_of(data))
        if actual != checksum:
            raise _Damaged(f"{name} does not match its checksum ({actual}, the marker says {checksum})")
    return data


class _Damaged(Exception):
    """A committed step whose files do not match its marker."""


def _load_verified_local(
    path: str, size: int | None, checksum: str | None, *, map_location: Any, weights_only: bool
) -> tuple[Any, str | None]:
    """torch.load a local file while a second thread checksums it (zlib releases the GIL), both
    through one open descriptor, so the bytes checked are the bytes loaded. Returns (payload,
    None), or (None, what is wrong): a damaged file's payload is never returned."""
    name = path.rsplit("/", 1)[-1]
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None, f"{name} is missing"
    try:
        actual_size = os.fstat(fd).st_size
        if size is not None and actual_size != size:
            return None, f"{name} has {actual_size} bytes, the marker says {size}"
        found: list[str] = []
        thread = threading.Thread(target=lambda: found.append(_crc_of_fd(fd)[1]), daemon=True)
        if checksum is not None:
            thread.start()
        same_file = f"/proc/self/fd/{fd}" if os.path.exists(f"/proc/self/fd/{fd}") else path
        payload: Any = None
        error: BaseException | None = None
        try:
            payload = torch.load(same_file, map_location=map_location, weights_only=weights_only)
        except Exception as exc:  # a damaged file may not even parse: the checksum says which
            error = exc
        if checksum is not None:
            thread.join()
            if found[0] != checksum:
                return None, f"{name} does not match its checksum ({found[0]}, the marker says {checksum})"
        if error is not None:
            raise error
        return payload, None
    finally:
        os.close(fd)


def _read_torch(
    store: CheckpointStore,
    path: str,
    *,
    map_location: Any,
    weights_only: bool,
    size: int | None = None,
    checksum: str | None = None,
) -> Any:
    data = _read_verified(store, path, size, checksum)
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)


def _committed_and_sound(store: CheckpointStore, step: int) -> bool:
    """True when ``step`` is committed and its files have the sizes its marker records."""
    return store.is_committed(step) and not store.verify(step, content=False)


# -- saving -----------------------------------------------------------------------------------
_EXECUTOR: ThreadPoolExecutor | None = None
_PENDING: Future[str] | None = None
_PENDING_LOCK = threading.Lock()


def wait_for_checkpoint() -> str | None:
    """Wait for a save started with ``blocking=False``; return its URI (None if none is pending).

    Re-raises the background save's error. Call it before ``destroy_process_group()``.
    """
    global _PENDING
    with _PENDING_LOCK:
        pending, _PENDING = _PENDING, None
    return pending.result() if pending is not None else None


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
    :param keep_last: committed checkpoints to keep (0: all); default ``TRAIN_CHECKPOINT_KEEP_LAST`` or 3.
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
    comm = _comm()
    store = _store_for(_checkpoint_root(uri))
    step_uri = store.step_uri(step)
    keep = _keep_last(keep_last)
    resumed = resume_from()
    if resumed and normalize_uri(resumed) == step_uri:
        # Rewriting the checkpoint we resumed from would put the only good copy at risk for nothing.
        if comm.rank == 0:
            log.info("Checkpoint %s is the one this run resumed from; keeping it as is", step_uri)
        return step_uri
    extra = dict(meta or {})
    json.dumps(extra)  # fail now, not in the background, if meta is not JSON-serialisable
    wait_for_checkpoint()
    use_dcp = _is_sharded(state) if sharded is None else sharded
    my_rng = _capture_rng()
    rng_states = comm.gather(my_rng)
    job = _SaveJob(comm, store, step, rng_states, keep, extra, time.monotonic())
    if use_dcp:
        if not blocking and comm.rank == 0:
            log.info("Sharded checkpoints are written synchronously")
        job.run_dcp(state)
        # Libraries doing the I/O may draw from the global RNGs (botocore's retry jitter):
        # put them back so the training's random stream does not depend on checkpointing.
        _restore_rng(my_rng)
        return step_uri
    payload: dict[str, Any] | None = None
    if comm.rank == 0:
        payload = {"version": PAYLOAD_VERSION, "step": step, "state": state}
    if blocking:
        job.run_torch(payload)
        _restore_rng(my_rng)
        return step_uri
    snapshot = _cpu_snapshot(payload) if payload is not None else None
    if comm.rank == 0:
        log.info(
            "Checkpoint step %d copied to CPU in %.3fs; writing it in the background",
            step,
            time.monotonic() - job.started,
        )
    global _EXECUTOR, _PENDING
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="airflow-torchrun-checkpoint")
    future = _EXECUTOR.submit(job.run_torch, snapshot)
    with _PENDING_LOCK:
        _PENDING = future
    return step_uri


@dataclass
class _SaveJob:
    """One save of one step, as every rank runs it (possibly on the background thread)."""

    comm: _Comm
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
            name = _writer_name(self.store, self.step, STATE_FILE)
            # One file, one fsync: the RNG states are small and every rank reads the state anyway.
            written[name] = _write_torch(self.store, f"{step_path}/{name}", {**(payload or {}), "rng": self.rng_states})
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
            (_writer_name(self.store, self.step, DCP_DIR), _writer_name(self.store, self.step, RNG_FILE))
            if self.comm.rank == 0
            else None
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
            mine[rng_file] = _write_torch(self.store, f"{step_path}/{rng_file}", self.rng_states)
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
            "lineage": _lineage_env(),
            "writer": _writer(),
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
                store.prune(self.keep, protect=[u for u in (resume_from(),) if u])
            except Exception:
                # A checkpoint that could not be pruned costs space, not correctness: keep training.
                log.warning("Could not prune old checkpoints under %s", store.uri, exc_info=True)


def _writer_name(store: CheckpointStore, step: int, name: str) -> str:
    """``name`` for a new step directory; a name of this writer's own when the directory exists
    (a torn leftover, another try's committed copy, a writer racing this one): nothing another
    writer committed is overwritten or deleted, and the marker, replaced in one piece, names
    only the files of the writer that wrote it."""
    store.fs.invalidate_cache(store.location.path)
    if not store.fs.exists(store.step_path(step)):
        return name
    stem, dot, ext = name.partition(".")
    unique = f"{stem}-{uuid.uuid4().hex[:8]}{dot}{ext}"
    log.info(
        "Checkpoint %s already exists (%s); writing %s beside what is there",
        store.step_uri(step),
        "committed" if store.is_committed(step) else "torn",
        unique,
    )
    return unique


# -- save on SIGTERM --------------------------------------------------------------------------
STOPPED_TO_SAVE_EXIT_CODE = contract.STOPPED_TO_SAVE_EXIT_CODE


@dataclass
class _StopRequest:
    installed: bool = False
    signalled_at: float | None = None  # time.time() of the first SIGTERM
    signum: int | None = None


_STOP = _StopRequest()


def _on_stop_signal(signum: int, _frame: Any) -> None:
    # Only note it: the ranks agree at the next step boundary, and save there.
    if _STOP.signalled_at is None:
        _STOP.signalled_at = time.time()
        _STOP.signum = signum


def _install_stop_handler() -> None:
    if _STOP.installed:
        return
    _STOP.installed = True
    if threading.current_thread() is not threading.main_thread():
        log.warning("save_if_stopping is not called from the main thread: SIGTERM cannot be caught, no save on stop")
        return
    signal.signal(signal.SIGTERM, _on_stop_signal)


def stop_requested() -> bool:
    """True once this rank received SIGTERM (after the first :func:`save_if_stopping` call)."""
    return _STOP.signalled_at is not None


def save_if_stopping(state: Mapping[str, Any] | Any, step: int, **save_kwargs: Any) -> None:
    """Call at every step boundary, on every rank: when the group is asked to stop, save and exit.

    The first call makes SIGTERM (an eviction or preemption with its grace period, a teardown
    before a relaunch, the task being killed) only *note* the request. Each call, the ranks agree
    on one flag (one small collective): if any rank was signalled, every rank saves checkpoint
    ``step`` (:func:`save_checkpoint`, blocking, marker ``"stopped": true``) and the process exits
    with :data:`STOPPED_TO_SAVE_EXIT_CODE` (75); the retry or relaunch resumes from that step, so
    at most the step in progress is lost. ``state``: the state to save, or a callable returning it
    (only called when saving). A script that never calls it is stopped by SIGTERM as before.
    The save must finish within the grace period (``teardown_grace`` locally, the runtime's
    termination grace period on Kubernetes).
    """
    if not _STOP.installed:
        _install_stop_handler()
    comm = _comm()  # collective on first use: create the groups now, while the store is up
    group = _stop_group()
    flag = 1 if _STOP.signalled_at is not None else 0
    if group is not None:
        tensor = torch.tensor([flag], dtype=torch.int32)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        flag = int(tensor.item())
    if not flag:
        return
    wait_for_checkpoint()
    payload = state() if callable(state) else state
    meta = {**dict(save_kwargs.pop("meta", None) or {}), "stopped": True}
    uri = save_checkpoint(payload, step, blocking=True, meta=meta, **save_kwargs)
    since = time.time() - _STOP.signalled_at if _STOP.signalled_at is not None else None
    if comm.rank == 0:
        log.warning(
            "Stopped to save: checkpoint %s (step %d) committed%s; exiting with code %d so that the retry resumes "
            "from it",
            uri,
            step,
            f" {since:.2f}s after SIGTERM" if since is not None else " (another rank was signalled)",
            STOPPED_TO_SAVE_EXIT_CODE,
        )
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # the peers may be gone already; the checkpoint is committed
            pass
    os._exit(STOPPED_TO_SAVE_EXIT_CODE)


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
        ``weights_only`` says, so one written by another lineage (another task, run or DAG) is
        refused unless this is True. Default: ``TRAIN_CHECKPOINT_TRUST_SHARDED`` (the operator's
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
    store = _store_for(ref.uri.rsplit("/", 1)[0])
    trusted = os.environ.get(ENV_TRUST_SHARDED, "") == "1" if trust_sharded is None else trust_sharded
    while True:
        try:
            return _load_one(store, ref, map_location, into, weights_only, restore_rng, trusted)
        except _Damaged as exc:
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


def _agree(ok: bool) -> bool:
    """True when every rank says ``ok`` (just ``ok`` outside a process group), so that all ranks
    load the same step."""
    if not (dist.is_available() and dist.is_initialized()):
        return ok
    return all(_comm().all_gather(ok))


def _is_own(marker: Mapping[str, Any], ref: CheckpointRef) -> bool:
    """Whether a checkpoint belongs to this rank's lineage (else it is foreign)."""
    recorded, mine = marker.get("lineage"), _lineage_env()
    if isinstance(recorded, Mapping) and mine is not None:
        return Lineage.from_dict(recorded) == Lineage.from_dict(mine)
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
    expected = marker_files(marker)
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
        if not trusted and not _is_own(marker, ref):
            raise StorageError(
                f"{ref.uri} is a sharded checkpoint of another lineage: loading it unpickles its metadata, which runs "
                "whatever its writer put there. Load it only from a store no one untrusted can write to, with "
                "load_checkpoint(trust_sharded=True) or the operator's trust_foreign_sharded=True"
            )
        _verify_dcp(store, ref.step, expected)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        group = _comm().group
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
            payload, problem = _load_verified_local(
                f"{step_path}/{name}", size, checksum, map_location=map_location, weights_only=weights_only
            )
        elif problem is None:
            try:
                data = _read_verified(store, f"{step_path}/{name}", size, checksum)
            except _Damaged as exc:
                problem = str(exc)
            else:
                payload = torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
        if not _agree(problem is None):
            raise _Damaged(problem or "another rank found it damaged")
        if not isinstance(payload, dict) or "state" not in payload:
            raise StorageError(f"{ref.uri}/{name} was not written by save_checkpoint")
        state = payload["state"]
        rng_states = payload.get("rng")
    else:
        raise StorageError(f"{ref.uri} has the unknown checkpoint format {fmt!r}; was it written by a newer version?")
    if restore_rng:
        _restore_rank_rng(rng_states, ref.uri)
    log.info("Loaded checkpoint %s (step %d, verified) in %.2fs", ref.uri, ref.step, time.monotonic() - started)
    return state


def _verify_dcp(store: CheckpointStore, step: int, expected: Mapping[str, tuple[int, str | None]]) -> None:
    """Sizes on every rank; checksums shared out between the ranks; all agree (raises _Damaged)."""
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
    everyone = _comm().all_gather(problems) if world > 1 else [problems]
    merged = sorted({p for part in everyone for p in part})
    if merged:
        raise _Damaged("; ".join(merged))


def _read_rng_file(store: CheckpointStore, path: str, recorded: tuple[int, str | None] | None) -> list[Any] | None:
    size, checksum = recorded if recorded is not None else (None, None)
    try:
        states = _read_torch(store, path, map_location="cpu", weights_only=True, size=size, checksum=checksum)
    except _Damaged:
        if recorded is not None:
            raise
        return None
    return states if isinstance(states, list) else None


def _restore_rank_rng(states: list[Any] | None, uri: str) -> None:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0") or 0)
    if not states:
        log.warning("Checkpoint %s has no RNG states; random draws will not match the uninterrupted run", uri)
        return
    if rank >= len(states):
        log.warning(
            "Checkpoint %s holds RNG states of %d rank(s), this is rank %d: its RNG is not restored",
            uri,
            len(states),
            rank,
        )
        return
    _restore_rng(states[rank])
