"""Checkpoint bytes on S3 (moto's server over HTTP, through s3fs): uploaded in parts while written,
read back in concurrent ranges, the CRC-32 of every byte computed on the way; an abandoned upload
leaves neither an object nor an open multipart upload. The range plan is pure. On file://, a large
file goes past the page cache (O_DIRECT), byte-exact, with a fallback where the file system refuses."""

from __future__ import annotations

import errno
import os
import zlib

import pytest

from airflow_torchrun.storage.checkpoints import checksum_text
from airflow_torchrun.worker.checkpoint import streams
from airflow_torchrun.worker.checkpoint.streams import (
    S3_PART_BYTES,
    S3_READ_MAX_RANGE,
    BufferReader,
    DirectWriter,
    S3PartWriter,
    read_ranges,
    s3_read,
)

MIB = 1 << 20


@pytest.mark.parametrize("size", [0, 1, S3_PART_BYTES - 1, 4 * S3_PART_BYTES + 3, 168_000_000, 3 << 30])
@pytest.mark.parametrize("concurrency", [1, 4])
def test_read_ranges_cover_the_object_evenly_with_the_fewest_requests(size: int, concurrency: int) -> None:
    ranges = read_ranges(size, concurrency)
    starts, ends = [start for start, _ in ranges], [end for _, end in ranges]
    assert starts == ([0, *ends[:-1]] if ranges else [])  # contiguous, in order
    assert (ranges[-1][1] if ranges else 0) == size
    lengths = [end - start for start, end in ranges]
    assert all(n <= S3_READ_MAX_RANGE for n in lengths)
    assert all(n >= S3_PART_BYTES for n in lengths[:-1])  # only the last range may be short
    # As many ranges as the concurrency reads at once, where the object is big enough for them
    # (and never one more than needed): one for a small object, `concurrency` for 168 MB.
    needed = max(1, -(-size // S3_READ_MAX_RANGE))
    wanted = min(concurrency, max(1, -(-size // S3_PART_BYTES)))
    assert len(ranges) == (0 if size == 0 else max(needed, wanted))


@pytest.fixture
def fs(moto_s3):  # type: ignore[no-untyped-def]
    import s3fs

    return s3fs.S3FileSystem(**moto_s3.storage_options())


def _write(writer: S3PartWriter, data: bytes, chunk: int) -> None:
    for start in range(0, len(data), chunk):
        writer.write(memoryview(data)[start : start + chunk])


def test_a_large_object_goes_up_in_parts_and_comes_back_in_ranges_checksummed(moto_s3, fs) -> None:  # type: ignore[no-untyped-def]
    bucket = moto_s3.make_bucket()
    data = os.urandom(11 * MIB + 12345)
    path = f"{bucket}/step-1/state.pt"
    writer = S3PartWriter(fs, path, part_bytes=5 * MIB, concurrency=2)
    _write(writer, data, MIB + 3)  # records that straddle the parts
    writer.close()
    assert (writer.size, writer.checksum) == (len(data), checksum_text(zlib.crc32(data)))
    head = moto_s3.client().head_object(Bucket=bucket, Key="step-1/state.pt")
    assert head["ETag"].strip('"').endswith("-3"), head["ETag"]  # a multipart upload of three parts
    assert moto_s3.client().get_object(Bucket=bucket, Key="step-1/state.pt")["Body"].read() == data

    for kwargs in ({}, {"part_bytes": 2 * MIB, "concurrency": 3}, {"part_bytes": 3 * MIB, "concurrency": 1}):
        got, crc = s3_read(fs, path, **kwargs)
        assert bytes(got) == data, kwargs
        assert crc == zlib.crc32(data), kwargs


def test_a_small_object_is_one_put(moto_s3, fs) -> None:  # type: ignore[no-untyped-def]
    bucket = moto_s3.make_bucket()
    data = os.urandom(100_000)
    writer = S3PartWriter(fs, f"{bucket}/small.pt", part_bytes=5 * MIB)
    _write(writer, data, 7000)
    writer.close()
    head = moto_s3.client().head_object(Bucket=bucket, Key="small.pt")
    assert "-" not in head["ETag"], head["ETag"]
    got, crc = s3_read(fs, f"{bucket}/small.pt")
    assert (bytes(got), crc) == (data, zlib.crc32(data))


def test_an_abandoned_upload_leaves_no_object_and_no_open_upload(moto_s3, fs) -> None:  # type: ignore[no-untyped-def]
    """What a save that fails half-way (a full disk on the serialising side, a killed connection)
    must leave: nothing under the name, no parts kept by an open multipart upload."""
    bucket = moto_s3.make_bucket()
    writer = S3PartWriter(fs, f"{bucket}/torn.pt", part_bytes=5 * MIB, concurrency=2)
    _write(writer, os.urandom(12 * MIB), MIB)  # two parts sent, the third still buffered
    client = moto_s3.client()
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads"), "the parts should be on their way"
    writer.abort()
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    with pytest.raises(FileNotFoundError):
        s3_read(fs, f"{bucket}/torn.pt")


# --- file:// past the page cache -------------------------------------------------------------------


def test_the_checksum_is_zlibs_crc32_whichever_library_computes_it() -> None:
    """zlib-ng computes it (the worker extra brings it): the same CRC-32 as zlib's, so checkpoints
    written with either verify with the other; any length and alignment, continued piece by piece."""
    from airflow_torchrun.storage import checkpoints

    data = os.urandom(3 * MIB + 7)
    for start, end in ((0, 0), (0, 1), (1, 4097), (5, 2 * MIB + 3), (0, len(data))):
        piece = memoryview(data)[start:end]
        assert checkpoints.crc32_of(piece) == zlib.crc32(piece), (start, end)
    assert checkpoints.crc32_of(data[MIB:], checkpoints.crc32_of(data[:MIB])) == zlib.crc32(data)
    assert checkpoints.CRC32_LIBRARY == "zlib-ng"  # without it, every save and load checksums at a quarter of the speed


def test_a_writeback_start_waiting_for_the_disk_holds_up_no_checksum(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """sync_file_range blocks while the disk's queue is full: the records after it must still be
    checksummed and written meanwhile (on the checksum helper, they queued behind it)."""
    import threading

    release, started = threading.Event(), threading.Event()

    def stuck(fd: int, offset: int, count: int) -> None:
        started.set()
        release.wait(30)

    monkeypatch.setattr(streams, "_START_WRITEBACK", stuck)
    records = [
        os.urandom(streams.PARALLEL_BYTES) for _ in range(3 * (streams.WRITEBACK_BYTES // streams.PARALLEL_BYTES))
    ]
    fd = os.open(tmp_path / "state.pt.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    writer = streams.DiskWriter(fd)
    writing = threading.Thread(target=lambda: [writer.write(r) for r in records])
    try:
        writing.start()
        writing.join(10)
        assert started.is_set() and not writing.is_alive(), "the records waited for the stuck writeback start"
    finally:
        release.set()
        writing.join(30)
    writer.close()
    os.close(fd)
    expected = b"".join(records)
    assert (tmp_path / "state.pt.tmp").read_bytes() == expected
    assert writer.checksum == checksum_text(zlib.crc32(expected))


def _direct_file(tmp_path, buffer_bytes: int, records: list[bytes], **kwargs):  # type: ignore[no-untyped-def]
    path = tmp_path / "state.pt.tmp"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        writer = DirectWriter(fd, buffer_bytes=buffer_bytes, **kwargs)
        for record in records:
            writer.write(record)
        writer.close()
    finally:
        os.close(fd)
    return writer, path.read_bytes()


@pytest.mark.parametrize(
    "sizes",
    [
        [],  # an empty file
        [1],  # a tail shorter than one alignment unit
        [4096 * 4],  # exactly one buffer
        [4096 * 4 + 1],  # one byte into the second
        [7, 4096 * 9 + 5, 3, 4096 * 4 - 10, 50_001],  # records across many buffer boundaries
    ],
)
def test_the_direct_writer_writes_every_byte_and_its_crc_across_buffer_boundaries(tmp_path, sizes) -> None:  # type: ignore[no-untyped-def]
    records = [os.urandom(size) for size in sizes]
    writer, written = _direct_file(tmp_path, 4096 * 4, records, buffers=2)
    expected = b"".join(records)
    assert written == expected  # the padding of the last aligned write is cut off again
    assert writer.size == len(expected)
    assert writer.checksum == checksum_text(zlib.crc32(expected))


def test_the_direct_writer_checksums_and_writes_off_the_callers_thread(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """torch.save's thread only copies: the CRC (about 0.4 s of CPU per GB) and the writes run on
    two helper threads, so the three overlap."""
    import threading

    threads: dict[str, set[str]] = {"crc": set(), "pwrite": set()}
    real_crc, real_pwrite = streams.crc32_of, os.pwrite

    def crc(data, value=0):  # type: ignore[no-untyped-def]
        threads["crc"].add(threading.current_thread().name)
        return real_crc(data, value)

    def pwrite(fd, data, offset):  # type: ignore[no-untyped-def]
        threads["pwrite"].add(threading.current_thread().name)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(streams, "crc32_of", crc)
    monkeypatch.setattr(streams.os, "pwrite", pwrite)
    records = [os.urandom(4096 * 10 + 3)]
    writer, written = _direct_file(tmp_path, 4096 * 4, records)
    assert written == records[0] and writer.checksum == checksum_text(zlib.crc32(records[0]))
    assert threads == {"crc": {"airflow-torchrun-checksum"}, "pwrite": {"airflow-torchrun-disk"}}


def test_the_direct_writer_falls_back_to_the_page_cache_where_o_direct_is_refused_at_the_switch(
    tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    real_fcntl = streams.fcntl.fcntl

    def refuse_direct(fd: int, command: int, arg: int = 0) -> int:
        if command == streams.fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, command, arg)

    monkeypatch.setattr(streams.fcntl, "fcntl", refuse_direct)
    records = [os.urandom(100_000), os.urandom(3)]
    writer, written = _direct_file(tmp_path, 4096 * 4, records)
    assert writer.direct is False
    assert written == b"".join(records)


def test_the_direct_writer_falls_back_when_the_file_system_refuses_its_first_write(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    real_pwrite = os.pwrite
    refused: list[int] = []

    def pwrite(fd: int, data, offset: int) -> int:  # type: ignore[no-untyped-def]
        if streams.fcntl.fcntl(fd, streams.fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(streams.os, "pwrite", pwrite)
    records = [os.urandom(4096 * 9 + 17)]
    writer, written = _direct_file(tmp_path, 4096 * 4, records)
    assert refused == [0]  # refused once, then every buffer went through the page cache
    assert writer.direct is False
    assert written == records[0]


def test_a_direct_write_error_reaches_the_caller_and_the_buffers_are_freed(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def full_disk(fd: int, data, offset: int) -> int:  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(streams.os, "pwrite", full_disk)
    fd = os.open(tmp_path / "state.pt.tmp", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        writer = DirectWriter(fd, buffer_bytes=4096, buffers=2)
        with pytest.raises(OSError, match="No space left"):
            for _ in range(4):  # the first full buffer's error is raised when its buffer is needed again
                writer.write(os.urandom(4096))
            writer.close()
        writer.release()
        assert all(buffer.closed for buffer in writer._buffers)
    finally:
        os.close(fd)


def test_a_large_state_is_written_direct_and_loads_back_verified(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import torch

    from airflow_torchrun.storage.checkpoints import CheckpointStore
    from airflow_torchrun.worker.checkpoint import files

    chosen: list[str] = []
    real_direct = files.DirectWriter

    def direct(fd: int) -> DirectWriter:
        chosen.append("direct")
        return real_direct(fd, buffer_bytes=64 << 10)

    monkeypatch.setattr(streams, "DIRECT_BYTES", 1 << 20)
    monkeypatch.setattr(files, "DirectWriter", direct)
    store = CheckpointStore(tmp_path.as_uri())
    state = {"weight": torch.randn(512, 1024), "shared": [torch.arange(10)] * 2, "step": 3}
    assert files.tensor_bytes(state) == 512 * 1024 * 4 + 10 * 8  # the shared storage counted once
    path = str(tmp_path / "big.pt")
    size, checksum = files.write_torch(store, path, state)
    assert chosen == ["direct"]
    assert size == os.path.getsize(path)
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    loaded = files.read_torch(store, path, map_location="cpu", weights_only=True, size=size, checksum=checksum)
    assert torch.equal(loaded["weight"], state["weight"]) and loaded["step"] == 3

    small = str(tmp_path / "small.pt")
    files.write_torch(store, small, {"bias": torch.zeros(10)})
    assert chosen == ["direct"]  # a small file stays in the page cache


def test_the_readme_states_the_writers_thresholds_as_the_code_has_them() -> None:
    from pathlib import Path

    text = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert f"a file of {streams.DIRECT_BYTES >> 20} MiB or more written past the page cache (`O_DIRECT`" in text
    assert f"parts go up {streams.S3_CONCURRENCY} at a time" in text
    assert f"the disk's writeback starts every {streams.WRITEBACK_BYTES >> 20} MB on a helper thread" in text


@pytest.mark.slow
def test_a_forked_child_writes_with_helpers_of_its_own(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A fork (a DataLoader worker, multiprocessing's default start method) has none of the parent's
    helper threads: a write there handed work to threads that do not exist and waited for ever."""
    import signal
    import time

    _direct_file(tmp_path, 4096, [b"parent" * 1000])  # the parent's helpers exist now
    child_dir = tmp_path / "child"
    child_dir.mkdir()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            _, written = _direct_file(child_dir, 4096, [b"child" * 5000])
            os._exit(0 if written == b"child" * 5000 else 1)
        finally:
            os._exit(2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's write hung: it waited on the parent's helper threads")


def test_torch_loads_from_memory_without_copying_the_buffer_whole() -> None:
    """What a read from S3 gives torch.load: each record goes straight into its tensor (io.BytesIO
    would first copy the whole bytearray, 0.075 s per 168 MB here)."""
    import io
    import tracemalloc

    import torch

    state = {"w": torch.randn(1024, 1024), "n": 3}
    saved = io.BytesIO()
    torch.save(state, saved)
    data = bytearray(saved.getvalue())
    tracemalloc.start()
    try:
        loaded = torch.load(BufferReader(data), weights_only=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert torch.equal(loaded["w"], state["w"]) and loaded["n"] == 3
    assert peak < len(data) // 4, f"{peak} bytes allocated to load {len(data)}"


def test_the_buffer_reader_seeks_and_reads_as_a_file() -> None:
    reader = BufferReader(b"0123456789")
    assert reader.read(3) == b"012" and reader.tell() == 3
    assert reader.seek(-2, os.SEEK_END) == 8 and reader.read() == b"89" and reader.read(5) == b""
    assert reader.seek(2, os.SEEK_CUR) == 12 and reader.read(1) == b""  # past the end: nothing, as a file
    reader.seek(1)
    out = bytearray(4)
    assert reader.readinto(out) == 4 and out == b"1234"
    with pytest.raises(ValueError, match="negative seek"):
        reader.seek(-1)
    with pytest.raises(ValueError, match="invalid whence"):
        reader.seek(0, 3)
    reader.close()
    assert reader.closed
