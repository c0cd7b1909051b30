"""Checkpoint bytes on their way out and in, each checksummed as it passes (no second read).

``torch.save`` hands its writer one record at a time (the pickle, then each tensor's storage, as a
memoryview valid only during the call). The writers here take each one as it comes:

- :class:`DiskWriter` (``file://``): the CRC-32 of a large record is computed on a helper thread
  while this thread copies the same bytes into the page cache (the CRC and ``os.write`` both release
  the GIL, so on two cores they overlap), and the disk's writeback of what is written so far is
  started every :data:`WRITEBACK_BYTES` (``sync_file_range``, on a helper of its own), so the one
  ``fsync`` at the end only waits for the tail: serialisation and the disk's write overlap.
- :class:`DirectWriter` (``file://``, a file of :data:`DIRECT_BYTES` or more): the page cache is
  left out (``O_DIRECT``). Past a few hundred MB, buffered writes are throttled by the kernel's
  dirty-page limits (a cgroup's memory limit lowers them): one GB took 0.46 s to 2.5 s buffered on
  our 2-core machines, and 0.42 s to 0.54 s direct. Records are copied into aligned buffers on
  this thread while one helper thread checksums the full ones and another writes them to the disk.
  Where the file system refuses ``O_DIRECT``, it falls back to buffered writes of the same buffers.
- :class:`S3PartWriter` (``s3://``): a multipart upload whose parts go out while later records are
  still being serialised, :data:`S3_CONCURRENCY` at a time, on s3fs's own event loop; an object
  smaller than one part is a single PUT. Aborted on any error: nothing half-uploaded is left.
- :func:`s3_read` reads an object in ranged GETs, concurrently, the checksum computed in order as the
  parts arrive. The object is split evenly over the concurrency (:func:`read_ranges`): as parallel as
  many small ranges, with the fewest requests (each one a round trip, and a server that serves a
  range by reading the whole object, as moto does, pays per request).
- :class:`BufferReader` hands those bytes to ``torch.load`` without another copy.

Memory: the disk writer holds nothing; the S3 writer at most ``S3_CONCURRENCY + 1`` parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import io
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from airflow_torchrun.storage.checkpoints import checksum_text, crc32_of

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

# Records at least this big are checksummed on the helper thread while they are written.
PARALLEL_BYTES = 1 << 20
# Start the disk's writeback every so many bytes written: the sooner the disk starts, the less the
# fsync waits (168 MB, 15 interleaved runs here: 0.30 s every 8 MB, 0.34 s every 32 MB or never; a raw
# write and fsync of the same bytes 0.31 s).
WRITEBACK_BYTES = 8 << 20
# A file expected to be at least this big is written with O_DIRECT (DirectWriter); below it the page
# cache takes the bytes at memory speed and the fsync is short (168 MB: 0.075 s buffered, 0.11 s direct).
DIRECT_BYTES = 256 << 20
DIRECT_BUFFER_BYTES = 16 << 20  # each of DIRECT_BUFFERS aligned buffers
DIRECT_BUFFERS = 3  # one filling, up to two written
DIRECT_ALIGN = 4096  # offsets, lengths and addresses of O_DIRECT I/O (mmap's are page-aligned)
S3_PART_BYTES = 16 << 20  # S3's minimum part is 5 MiB (the last one excepted)
S3_CONCURRENCY = 4
S3_READ_MAX_RANGE = 128 << 20  # a larger object is read in more ranges than S3_CONCURRENCY
_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Callable[[int, int, int], None] | None:
    """``sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE)`` (Linux): start writing the range
    back without waiting for it; None where libc has no such call."""
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
    call.restype = ctypes.c_int

    def start_writeback(fd: int, offset: int, count: int) -> None:
        call(fd, offset, count, _SYNC_FILE_RANGE_WRITE)  # a refusal only means the fsync does it all

    return start_writeback


_START_WRITEBACK = _sync_file_range()


class _Helper:
    """One daemon thread that runs functions, in the order given, while the caller does something else."""

    def __init__(self, role: str) -> None:
        self._work: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"airflow-torchrun-{role}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        with self._ready:
            self._work.append((fn, future))
            self._ready.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._work:
                    self._ready.wait()
                fn, future = self._work.pop(0)
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller, which re-raises it
                future.set_exception(exc)


_HELPERS: dict[str, _Helper] = {}
_HELPER_LOCK = threading.Lock()


def _forget_helpers() -> None:
    """In a forked child: the parent's helper threads are not there (and the lock may be held)."""
    global _HELPER_LOCK
    _HELPER_LOCK = threading.Lock()
    _HELPERS.clear()


os.register_at_fork(after_in_child=_forget_helpers)


def _helper(role: str = "checksum") -> _Helper:
    """The helper thread for ``role``: ``checksum`` (CRCs) or ``disk`` (a DirectWriter's writes, a
    DiskWriter's writeback starts), so that a checksum and a write can run at the same time, and a
    writeback start that waits for the disk's queue holds up no checksum."""
    with _HELPER_LOCK:
        if role not in _HELPERS:
            _HELPERS[role] = _Helper(role)
        return _HELPERS[role]


class _Writer:
    """What every writer here keeps: the CRC-32 and the size of the bytes written so far."""

    def __init__(self) -> None:
        self.crc = 0
        self.size = 0

    def flush(self) -> None:
        """Nothing to push early (torch.save calls it before the writer is closed): each writer
        hands bytes on in the units it must (records, aligned buffers, S3 parts), and :meth:`close`
        sends the last of them and makes the whole durable."""

    @property
    def checksum(self) -> str:
        return checksum_text(self.crc)


class DiskWriter(_Writer):
    """A write-only file object over ``fd`` for ``torch.save``: CRC-32 and size kept as bytes pass,
    the disk's writeback started as they go. :meth:`close` makes the file durable (one fsync)."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd
        self._written_back = 0
        self._writeback: Future[Any] | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        count = view.nbytes
        if count >= PARALLEL_BYTES:
            crc, start = self.crc, view
            summed = _helper().submit(lambda: crc32_of(start, crc))
            try:
                self._write_all(view)
            finally:
                self.crc = summed.result()  # the view is torch's only for the call: never leave it in use
        else:
            self.crc = crc32_of(view, self.crc)
            self._write_all(view)
        self.size += count
        due = _START_WRITEBACK is not None and self.size - self._written_back >= WRITEBACK_BYTES
        if due and (self._writeback is None or self._writeback.done()):
            fd, offset, length, begin = self.fd, self._written_back, self.size - self._written_back, _START_WRITEBACK
            self._writeback = _helper("disk").submit(lambda: begin(fd, offset, length) if begin else None)
            self._written_back = self.size
        return count

    def _write_all(self, view: memoryview) -> None:
        while view.nbytes:
            view = view[os.write(self.fd, view) :]

    def close(self) -> None:
        """Durable: every byte on the disk (the rename and its directory are the caller's)."""
        if self._writeback is not None:
            self._writeback.result()
        os.fsync(self.fd)


class DirectWriter(_Writer):
    """A write-only file object over ``fd`` for ``torch.save`` that bypasses the page cache.

    Each record is copied into one of ``buffers`` aligned buffers; a full buffer is checksummed by one
    helper thread and written at its offset (``pwrite``) by another while the next one fills (the
    CRC-32 of 1 GB is 0.04 s of CPU here with zlib-ng, 0.15 to 0.4 s with zlib, the copy 0.1 s: on the
    caller's thread they would add up with the disk's write instead of overlapping it). :meth:`close`
    writes the tail padded to the alignment, cuts the file to its size and makes it durable. A file
    system that refuses ``O_DIRECT`` (at the switch, or at the first write: EINVAL) gets the same
    buffers through the page cache; ``direct`` says which it was.
    """

    def __init__(self, fd: int, *, buffer_bytes: int = DIRECT_BUFFER_BYTES, buffers: int = DIRECT_BUFFERS) -> None:
        if buffer_bytes % DIRECT_ALIGN:
            raise ValueError(f"buffer_bytes must be a multiple of {DIRECT_ALIGN}, got {buffer_bytes}")
        super().__init__()
        self.fd = fd
        self._flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, self._flags | os.O_DIRECT)
            self.direct = True
        except OSError:
            self.direct = False
        self._buffers = [mmap.mmap(-1, buffer_bytes) for _ in range(max(2, buffers))]
        self._pending: list[tuple[Future[Any], Future[Any]] | None] = [None] * len(self._buffers)
        self._current = 0
        self._fill = 0
        self._offset = 0  # of the current buffer in the file

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        count = view.nbytes
        self.size += count
        room = len(self._buffers[0])
        while view.nbytes:
            take = min(room - self._fill, view.nbytes)
            self._buffers[self._current][self._fill : self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill == room:
                self._send(room, room)
        return count

    def _send(self, summed: int, length: int) -> None:
        """Hand the current buffer to the helpers (the CRC of its first ``summed`` bytes, the write of
        its first ``length``); take the next free one."""
        buffer, offset = self._buffers[self._current], self._offset
        self._pending[self._current] = (
            _helper("checksum").submit(lambda: self._sum(buffer, summed)),
            _helper("disk").submit(lambda: self._pwrite(buffer, length, offset)),
        )
        self._offset += length
        self._current = (self._current + 1) % len(self._buffers)
        self._fill = 0
        self._wait(self._current)

    def _wait(self, index: int) -> None:
        """Wait until buffer ``index`` is free again; re-raise its checksum's or write's error."""
        waiting, self._pending[index] = self._pending[index], None
        for future in waiting or ():
            future.result()

    def _sum(self, buffer: mmap.mmap, length: int) -> None:
        with memoryview(buffer) as whole, whole[:length] as view:
            self.crc = crc32_of(view, self.crc)  # buffers are summed in order, on one thread

    def _pwrite(self, buffer: mmap.mmap, length: int, offset: int) -> None:
        view = memoryview(buffer)[:length]
        try:
            while view.nbytes:
                try:
                    written = os.pwrite(self.fd, view, offset)
                except OSError as exc:
                    if exc.errno != errno.EINVAL or not self.direct:
                        raise
                    # Accepted at the switch, refused at the write: buffered from here on (every write
                    # runs on the one "disk" helper thread, so nothing else writes meanwhile).
                    fcntl.fcntl(self.fd, fcntl.F_SETFL, self._flags & ~os.O_DIRECT)
                    self.direct = False
                    continue
                view, offset = view[written:], offset + written
        finally:
            view.release()

    def close(self) -> None:
        """Durable: every byte on the disk, the file cut to its size (the rename is the caller's)."""
        try:
            if self._fill:
                tail = self._fill
                padded = -(-tail // DIRECT_ALIGN) * DIRECT_ALIGN
                self._buffers[self._current][tail:padded] = bytes(padded - tail)
                self._send(tail, padded)
            for index in range(len(self._pending)):
                self._wait(index)
            os.ftruncate(self.fd, self.size)
            os.fsync(self.fd)
        finally:
            self.release()

    def release(self) -> None:
        """Wait for the writes in flight and free the buffers (also after an error)."""
        for waiting in self._pending:
            for future in waiting or ():
                with contextlib.suppress(Exception):  # the save failed already; its error is what is raised
                    future.result()
        self._pending = [None] * len(self._pending)
        for buffer in self._buffers:
            buffer.close()


class S3PartWriter(_Writer):
    """A write-only file object for ``torch.save`` that uploads ``path`` in parts while it is written.

    Parts of :data:`S3_PART_BYTES` go out on the filesystem's event loop as they fill, at most
    ``concurrency`` at a time (the writer waits for the oldest beyond that). :meth:`close` uploads
    the last part and completes the upload (or, for an object smaller than a part, PUTs it whole);
    :meth:`abort` (on any error) abandons it, so no torn object ever appears under ``path``.
    """

    def __init__(
        self,
        fs: AbstractFileSystem,
        path: str,
        *,
        part_bytes: int = S3_PART_BYTES,
        concurrency: int = S3_CONCURRENCY,
    ) -> None:
        self.fs, self.path = fs, path
        self.bucket, self.key, _ = fs.split_path(path)
        super().__init__()
        self.part_bytes, self.concurrency = part_bytes, max(1, concurrency)
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[tuple[int, Future[Any]]] = []

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        count = view.nbytes
        self.crc = crc32_of(view, self.crc)
        self.size += count
        while view.nbytes:
            room = self.part_bytes - len(self._buffer)
            self._buffer += view[:room]
            view = view[room:]
            if len(self._buffer) == self.part_bytes:
                part, self._buffer = self._buffer, bytearray()  # handed over whole: no copy
                self._send(part)
        return count

    def _call(self, method: str, **kwargs: Any) -> Future[Any]:
        coro = self.fs._call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs)
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop)

    def _send(self, part: bytearray) -> None:
        if self._upload_id is None:
            self._upload_id = str(self._call("create_multipart_upload").result()["UploadId"])
        in_flight = [f for _, f in self._parts if not f.done()]
        if len(in_flight) >= self.concurrency:
            in_flight[0].result()
        number = len(self._parts) + 1
        self._parts.append((number, self._call("upload_part", PartNumber=number, UploadId=self._upload_id, Body=part)))

    def close(self) -> None:
        if self._upload_id is None:
            self._call("put_object", Body=self._buffer).result()
        else:
            if self._buffer or not self._parts:
                self._send(self._buffer)
            done = [{"PartNumber": n, "ETag": f.result()["ETag"]} for n, f in self._parts]
            self._call("complete_multipart_upload", UploadId=self._upload_id, MultipartUpload={"Parts": done}).result()
        self._buffer = bytearray()
        self.fs.invalidate_cache(self.path)

    def abort(self) -> None:
        """Abandon the upload (best effort: S3 drops an unfinished upload's parts on abort)."""
        for _, future in self._parts:
            future.cancel()
        if self._upload_id is not None:
            try:
                self._call("abort_multipart_upload", UploadId=self._upload_id).result()
            except Exception:  # the save failed already; a lifecycle rule may still sweep the parts
                pass


class BufferReader(io.RawIOBase):
    """A read-only, seekable file over bytes already in memory, for ``torch.load``: it reads each
    record with ``readinto`` straight into the tensor's storage. ``io.BytesIO`` would first copy a
    ``bytearray`` whole (0.075 s per 168 MB here, a tenth of a read from S3)."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        bases = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._view.nbytes}
        if whence not in bases:
            raise ValueError(f"invalid whence ({whence}, should be 0, 1 or 2)")
        base = bases[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, out: Any) -> int:
        target = memoryview(out).cast("B")
        count = max(0, min(target.nbytes, self._view.nbytes - self._pos))
        target[:count] = self._view[self._pos : self._pos + count]
        self._pos += count
        return count

    def close(self) -> None:
        self._view.release()
        super().close()


def read_ranges(size: int, concurrency: int = S3_CONCURRENCY) -> list[tuple[int, int]]:
    """``(start, end)`` byte ranges covering ``size`` bytes: split evenly over ``concurrency``, none
    smaller than :data:`S3_PART_BYTES` (one range for a small object) nor larger than
    :data:`S3_READ_MAX_RANGE` (more ranges for a large one)."""
    concurrency = max(1, concurrency)
    part = min(S3_READ_MAX_RANGE, max(S3_PART_BYTES, -(-size // concurrency)))
    return [(start, min(size, start + part)) for start in range(0, size, part)]


def s3_read(
    fs: AbstractFileSystem, path: str, *, part_bytes: int | None = None, concurrency: int = S3_CONCURRENCY
) -> tuple[bytearray, int]:
    """The object's bytes and their CRC-32, fetched in ranged GETs ``concurrency`` at a time (ranges
    of ``part_bytes``, or as :func:`read_ranges` splits it); the checksum is computed in order as the
    ranges arrive."""
    size = int(fs.size(path))  # raises FileNotFoundError for a missing object
    out = bytearray(size)
    loop = fs.loop
    if part_bytes is None:
        ranges = read_ranges(size, concurrency)
    else:
        ranges = [(start, min(size, start + part_bytes)) for start in range(0, size, part_bytes)]

    def fetch(index: int) -> Future[Any]:
        start, end = ranges[index]
        return asyncio.run_coroutine_threadsafe(fs._cat_file(path, start=start, end=end), loop)

    futures = {index: fetch(index) for index in range(min(concurrency, len(ranges)))}
    crc = 0
    for index, (start, end) in enumerate(ranges):
        data = futures.pop(index).result()
        if index + concurrency < len(ranges):
            futures[index + concurrency] = fetch(index + concurrency)
        if len(data) != end - start:
            raise FileNotFoundError(f"{path} changed while it was read")
        out[start:end] = data
        crc = crc32_of(data, crc)
    return out, crc
