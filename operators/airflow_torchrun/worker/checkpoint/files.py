"""Checkpoint files: written with their checksum as they go out (:mod:`.streams`), read back verified."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from airflow_torchrun.storage.checkpoints import CheckpointStore, checksum_text, crc32_of
from airflow_torchrun.worker.checkpoint import streams
from airflow_torchrun.worker.checkpoint.streams import BufferReader, DirectWriter, DiskWriter, S3PartWriter, s3_read

log = logging.getLogger(__name__)


STATE_FILE = "state.pt"

RNG_FILE = "rng.pt"

DCP_DIR = "dcp"

FORMAT_TORCH = "torch"

FORMAT_DCP = "dcp"

PAYLOAD_VERSION = 1


# -- I/O --------------------------------------------------------------------------------------
def sharded_types() -> tuple[type, ...]:
    """DTensor and ShardedTensor, where their modules are loaded: a state that holds one has
    imported it, and importing ``torch.distributed.tensor`` only to learn that a state holds none
    cost a first save seconds (measured on 2 cores: 1-7 s)."""
    types: list[type] = []
    for module, name in (
        ("torch.distributed.tensor", "DTensor"),
        ("torch.distributed._shard.sharded_tensor", "ShardedTensor"),
    ):
        found = getattr(sys.modules.get(module), name, None)
        if isinstance(found, type):
            types.append(found)
    return tuple(types)


def is_sharded(obj: Any, types: tuple[type, ...] | None = None) -> bool:
    """True when ``obj`` holds a DTensor or ShardedTensor anywhere."""
    types = sharded_types() if types is None else types
    if types and isinstance(obj, types):
        return True
    if isinstance(obj, Mapping):
        return any(is_sharded(v, types) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(is_sharded(v, types) for v in obj)
    return False


def cpu_snapshot(obj: Any) -> Any:
    """A copy that later training steps cannot change (tensors cloned to CPU)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        out = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for key, value in obj.items():
            out[key] = cpu_snapshot(value)
        # nn.Module.state_dict() keeps per-module versions here; load_state_dict reads them.
        metadata = getattr(obj, "_metadata", None)
        if metadata is not None:
            out._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [cpu_snapshot(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(cpu_snapshot(v) for v in obj)
    return copy.deepcopy(obj)


_CRC_CHUNK = 8 << 20


@contextlib.contextmanager
def _no_zip_checksums() -> Iterator[None]:
    """torch.save without its per-record zip CRC-32 (a second pass over every byte), on this thread
    only: the file's own checksum, in the commit marker, is what a load verifies."""
    from torch.utils.serialization import config

    with config.patch({"save.compute_crc32": False}):  # type: ignore[attr-defined]
        yield


def tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors ``obj`` holds (in mappings, lists and tuples), each storage once:
    about what ``torch.save`` will write."""
    seen: set[int] = set()

    def walk(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            if storage.data_ptr() in seen:
                return 0
            seen.add(storage.data_ptr())
            return int(storage.nbytes())
        if isinstance(value, Mapping):
            return sum(walk(v) for v in value.values())
        if isinstance(value, list | tuple):
            return sum(walk(v) for v in value)
        return 0

    return walk(obj)


def write_torch(store: CheckpointStore, path: str, obj: Any) -> tuple[int, str]:
    """torch.save ``obj`` to ``path`` (a temp name, one fsync, an atomic rename locally; one
    multipart upload on S3) and return its size and checksum, computed as the bytes go out.
    A large file goes to the disk past the page cache (:class:`~.streams.DirectWriter`)."""
    with _no_zip_checksums():
        if store.location.scheme == "file":
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            disk: DiskWriter | DirectWriter | None = None
            try:
                disk = DirectWriter(fd) if tensor_bytes(obj) >= streams.DIRECT_BYTES else DiskWriter(fd)
                torch.save(obj, disk)  # type: ignore[arg-type]
                disk.close()
            except BaseException:
                if isinstance(disk, DirectWriter):
                    disk.release()
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            os.close(fd)
            os.replace(tmp, path)
            return disk.size, disk.checksum
        upload = S3PartWriter(store.fs, path)
        try:
            torch.save(obj, upload)  # type: ignore[arg-type]
            upload.close()
        except BaseException:
            upload.abort()
            raise
        return upload.size, upload.checksum


def crc_of_fd(fd: int) -> tuple[int, str]:
    """Size and checksum of an open file, read with pread (the descriptor's offset is untouched)."""
    value, offset = 0, 0
    while chunk := os.pread(fd, _CRC_CHUNK, offset):
        value = crc32_of(chunk, value)
        offset += len(chunk)
    return offset, checksum_text(value)


def read_verified(store: CheckpointStore, path: str, size: int | None, checksum: str | None) -> bytes | bytearray:
    """The bytes of ``path``, checked against the marker's size and checksum (raises Damaged)."""
    name = path.rsplit("/", 1)[-1]
    actual: str | None = None
    try:
        if store.location.scheme == "file":
            with open(path, "rb") as fp:
                data: bytes | bytearray = fp.read()
        else:
            # The whole object, in concurrent ranged GETs (torch.load seeks around, which would cost
            # a request per seek), its checksum computed as the parts arrive.
            store.fs.invalidate_cache(path.rsplit("/", 1)[0])
            data, crc = s3_read(store.fs, path)
            actual = checksum_text(crc)
    except FileNotFoundError:
        raise Damaged(f"{name} is missing") from None
    if size is not None and len(data) != size:
        raise Damaged(f"{name} has {len(data)} bytes, the marker says {size}")
    if checksum is not None:
        actual = actual or checksum_text(crc32_of(data))
        if actual != checksum:
            raise Damaged(f"{name} does not match its checksum ({actual}, the marker says {checksum})")
    return data


class Damaged(Exception):
    """A committed step whose files do not match its marker."""


# Local file systems whose files a checkpoint load maps instead of reading (see load_verified_local).
MAPPED_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "tmpfs", "overlay"})


def file_system_of(path: str) -> str | None:
    """The type of the file system ``path`` lies on (``ext4``, ``nfs4``, ``fuse.s3fs``...), from the
    innermost of this process's mounts that holds it; None where that cannot be told."""
    target = os.path.realpath(path)
    found: tuple[int, str | None] = (-1, None)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as mounts:
            for line in mounts:
                fields, _, rest = line.partition(" - ")
                parts = fields.split()
                if len(parts) < 5 or not rest:
                    continue
                mount = parts[4].replace("\\040", " ")  # the kernel's escape for a space
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= found[0]:  # the innermost; of mounts stacked on one point, the last
                    found = (len(mount), rest.split()[0])
    except OSError:
        return None
    return found[1]


def load_verified_local(
    path: str, size: int | None, checksum: str | None, *, map_location: Any, weights_only: bool
) -> tuple[Any, str | None]:
    """torch.load a local file while a second thread checksums it (zlib releases the GIL), both
    through one open descriptor, so the bytes checked are the bytes loaded. Returns (payload,
    None), or (None, what is wrong): a damaged file's payload is never returned.

    On a local file system (:data:`MAPPED_FILE_SYSTEMS`) the tensors are mapped from the file
    (``mmap=True``, private: a write to them copies the page), not copied out of it: their pages are
    the page cache the checksum pass reads, one copy of the state in memory instead of two (168 MB:
    0.05 s less here). A checkpoint file is never rewritten in place (a temporary name, then a
    rename; retention unlinks, which leaves a local mapping whole), so the mapped bytes stay the
    bytes checked. Anywhere else (NFS, where another client's delete would fault a mapping; FUSE),
    or where mapping fails, the file is read into memory."""
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
        thread = threading.Thread(target=lambda: found.append(crc_of_fd(fd)[1]), daemon=True)
        if checksum is not None:
            thread.start()
        same_file = f"/proc/self/fd/{fd}" if os.path.exists(f"/proc/self/fd/{fd}") else path
        payload: Any = None
        error: BaseException | None = None
        mapped = file_system_of(path) in MAPPED_FILE_SYSTEMS
        try:
            payload = torch.load(same_file, map_location=map_location, weights_only=weights_only, mmap=mapped)
        except Exception as exc:  # a damaged file may not even parse: the checksum says which
            error = exc
        if checksum is not None:
            thread.join()
            if found[0] != checksum:
                return None, f"{name} does not match its checksum ({found[0]}, the marker says {checksum})"
        if error is not None:
            if not mapped:
                raise error
            # Sound bytes that did not load mapped: read them (a file that does not parse at all
            # raises again, the error a plain torch.load gives).
            log.info("%s did not load mapped (%s); reading it into memory", path, error)
            try:
                payload = torch.load(same_file, map_location=map_location, weights_only=weights_only)
            except Exception as again:
                raise again from error
        return payload, None
    finally:
        os.close(fd)


def read_torch(
    store: CheckpointStore,
    path: str,
    *,
    map_location: Any,
    weights_only: bool,
    size: int | None = None,
    checksum: str | None = None,
) -> Any:
    data = read_verified(store, path, size, checksum)
    return torch.load(BufferReader(data), map_location=map_location, weights_only=weights_only)  # type: ignore[arg-type]
