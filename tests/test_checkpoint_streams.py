"""Checkpoint bytes on S3 (moto's server over HTTP, through s3fs): uploaded in parts while written,
read back in concurrent ranges, the CRC-32 of every byte computed on the way; an abandoned upload
leaves neither an object nor an open multipart upload. The range plan is pure."""

from __future__ import annotations

import os
import zlib

import pytest

from airflow_torchrun.storage.checkpoints import checksum_text
from airflow_torchrun.worker.checkpoint.streams import (
    S3_PART_BYTES,
    S3_READ_MAX_RANGE,
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
