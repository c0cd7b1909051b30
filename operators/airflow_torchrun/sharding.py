"""Split a dataset into per-rank shards plus a held-out evaluation split, described by a manifest.

This is the core behind :class:`~airflow_torchrun.operators.shard.ShardDatasetOperator` and
:mod:`airflow_torchrun.worker.shards`; it imports neither Airflow nor torch. Storage goes through
fsspec, so ``file://`` (or a plain path) and ``s3://`` (with s3fs) both work.

Layout written under ``output_uri``::

    shard-00000-of-00004.parquet   # one file per shard, in the source's format
    ...
    eval.parquet                   # the held-out evaluation split (absent when eval_fraction=0)
    manifest.json                  # written last: its presence means every file above is complete

Importing this module is cheap (numpy and pyarrow are imported when used), so the operator
module that uses it keeps DAG parsing fast.

The split is a pure function of (number of rows, number of shards, eval fraction, seed), and the
files are written byte-for-byte reproducibly, so running the same task twice gives the same files
and the same checksums.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

from airflow_torchrun.errors import StorageError, TorchrunError
from airflow_torchrun.naming import join
from airflow_torchrun.storage.uri import absolute_uri, url_filesystem

if TYPE_CHECKING:
    import numpy as np
    from fsspec import AbstractFileSystem

log = logging.getLogger(__name__)

FORMATS = ("parquet", "csv", "npz")
MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
EVAL_NAME = "eval"
#: The manifest fields that, together, determine every byte of the output.
REQUEST_KEYS = ("source_uri", "source_sha256", "format", "seed", "eval_fraction", "num_shards")
_EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".npz": "npz"}
_SUFFIX = {"parquet": ".parquet", "csv": ".csv", "npz": ".npz"}
# A fixed timestamp inside .npz zip entries: numpy's own savez stamps the current time, which
# would make every retry produce different bytes (and checksums) for the same data.
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)

#: What :func:`read_shard` returns: one NumPy array per column (first axis = rows).
Columns: TypeAlias = "dict[str, np.ndarray]"


class DatasetError(TorchrunError, ValueError):
    """The dataset or the sharding request cannot work as given; nothing was written."""


class ShardIntegrityError(TorchrunError):
    """A shard's bytes do not match the checksum recorded in the manifest."""


@dataclass(frozen=True)
class ShardFile:
    """One file named by the manifest: a training shard or the evaluation split."""

    uri: str
    rows: int
    bytes: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"uri": self.uri, "rows": self.rows, "bytes": self.bytes, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardFile:
        return cls(uri=str(data["uri"]), rows=int(data["rows"]), bytes=int(data["bytes"]), sha256=str(data["sha256"]))


@dataclass(frozen=True)
class Manifest:
    """The manifest of one sharding: what was split, how, and where each piece lives."""

    source_uri: str
    source_sha256: str
    format: str
    seed: int
    eval_fraction: float
    num_rows: int
    columns: tuple[str, ...]
    dtypes: Mapping[str, str]
    shards: tuple[ShardFile, ...]
    eval: ShardFile | None = None
    version: int = MANIFEST_VERSION
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def request(self) -> dict[str, Any]:
        """The inputs that determine every byte written; equal requests give equal files."""
        everything = self.to_dict()
        return {key: everything[key] for key in REQUEST_KEYS}

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "source_uri": self.source_uri,
            "source_sha256": self.source_sha256,
            "format": self.format,
            "seed": self.seed,
            "eval_fraction": self.eval_fraction,
            "num_rows": self.num_rows,
            "num_shards": self.num_shards,
            "columns": list(self.columns),
            "dtypes": dict(self.dtypes),
            "shards": [s.to_dict() for s in self.shards],
            "eval": self.eval.to_dict() if self.eval else None,
            **({"extra": dict(self.extra)} if self.extra else {}),
        }

    def to_json(self) -> str:
        # Sorted keys and a trailing newline: the manifest itself is byte-reproducible too.
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        version = int(data.get("version", 0))
        if version != MANIFEST_VERSION:
            raise DatasetError(
                f"shard manifest version {version} is not supported (this airflow-torchrun reads "
                f"version {MANIFEST_VERSION}); re-run the sharding task with this version"
            )
        return cls(
            source_uri=str(data["source_uri"]),
            source_sha256=str(data["source_sha256"]),
            format=str(data["format"]),
            seed=int(data["seed"]),
            eval_fraction=float(data["eval_fraction"]),
            num_rows=int(data["num_rows"]),
            columns=tuple(data["columns"]),
            dtypes=dict(data["dtypes"]),
            shards=tuple(ShardFile.from_dict(s) for s in data["shards"]),
            eval=ShardFile.from_dict(data["eval"]) if data.get("eval") else None,
            version=version,
            extra=dict(data.get("extra") or {}),
        )


@dataclass(frozen=True)
class ShardResult:
    """What :func:`shard_dataset` did: the manifest, where it is, and whether it was reused."""

    manifest_uri: str
    manifest: Manifest
    reused: bool


# -- validation ------------------------------------------------------------------------------------
def detect_format(uri: str, format: str | None = None) -> str:
    """The dataset format: ``format`` when given, else from ``uri``'s extension."""
    if format is not None:
        fmt = str(format).lower().lstrip(".")
        if fmt == "pq":
            fmt = "parquet"
        if fmt not in FORMATS:
            raise DatasetError(f"unknown dataset format {format!r}; supported formats: {', '.join(FORMATS)}")
        return fmt
    path = uri.split("?", 1)[0].rstrip("/")
    ext = os.path.splitext(path)[1].lower()
    fmt_from_ext = _EXTENSIONS.get(ext)
    if fmt_from_ext is None:
        raise DatasetError(
            f"cannot tell the format of {uri!r} from its extension {ext or '(none)'!r}; name the file "
            f"*.parquet, *.csv or *.npz, or pass format= (one of {', '.join(FORMATS)})"
        )
    return fmt_from_ext


def check_request(num_shards: object, eval_fraction: object, seed: object) -> list[str]:
    """Problems with the sharding parameters themselves (no I/O); empty when they are fine."""
    problems: list[str] = []
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        problems.append(f"num_shards must be a whole number >= 1 (one shard per training rank), got {num_shards!r}")
    if (
        isinstance(eval_fraction, bool)
        or not isinstance(eval_fraction, int | float)
        or not 0.0 <= float(eval_fraction) < 1.0
    ):
        problems.append(
            f"eval_fraction must be a number in [0, 1) (the share of rows held out for evaluation), "
            f"got {eval_fraction!r}"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        problems.append(f"seed must be a whole number >= 0, got {seed!r}")
    return problems


# -- the split ----------------------------------------------------------------------------------
def eval_rows(num_rows: int, eval_fraction: float) -> int:
    """How many rows are held out: ``round(num_rows * eval_fraction)``, at least 1 when asked for."""
    if eval_fraction <= 0:
        return 0
    return max(1, round(num_rows * eval_fraction))


def split_indices(
    num_rows: int, num_shards: int, eval_fraction: float, seed: int
) -> tuple[list[np.ndarray], np.ndarray]:
    """Row indices of each shard and of the evaluation split.

    A seeded permutation of ``range(num_rows)``: its first ``eval_rows()`` entries are the
    evaluation split, the rest is cut into ``num_shards`` contiguous pieces whose sizes differ by
    at most one. Each piece is sorted, so a shard keeps the source's row order. Every row lands in
    exactly one shard or in the evaluation split.
    """
    import numpy as np

    if num_rows < 1:
        raise DatasetError("the dataset has no rows; there is nothing to shard")
    n_eval = eval_rows(num_rows, eval_fraction)
    n_train = num_rows - n_eval
    if n_train < num_shards:
        raise DatasetError(
            f"more shards than rows: {num_shards} shards requested but only {n_train} training rows "
            f"({num_rows} rows, {n_eval} held out for evaluation). Every shard needs at least one row: "
            f"use num_shards <= {n_train}, a smaller eval_fraction, or a larger dataset"
        )
    perm = np.random.default_rng(seed).permutation(num_rows)
    eval_idx = np.sort(perm[:n_eval])
    shards = [np.sort(piece) for piece in np.array_split(perm[n_eval:], num_shards)]
    return shards, eval_idx


def _filesystem(uri: str, storage_options: Mapping[str, Any] | None) -> tuple[AbstractFileSystem, str]:
    try:
        return url_filesystem(uri, storage_options)
    except StorageError as exc:
        raise DatasetError(str(exc)) from exc


def _read_bytes(uri: str, storage_options: Mapping[str, Any] | None, what: str) -> bytes:
    fs, path = _filesystem(uri, storage_options)
    try:
        with fs.open(path, "rb") as f:
            data: bytes = f.read()
    except FileNotFoundError as exc:
        raise DatasetError(f"{what} {uri!r} does not exist; check the URI (and the bucket or directory)") from exc
    except IsADirectoryError as exc:
        raise DatasetError(f"{what} {uri!r} is a directory; give the URI of one .parquet, .csv or .npz file") from exc
    return data


def parse_table(data: bytes, fmt: str, *, uri: str = "", dtypes: Mapping[str, str] | None = None) -> Any:
    """Parse ``data`` into a ``pyarrow.Table`` (parquet, csv) or a :data:`Columns` dict (npz)."""
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return pq.read_table(io.BytesIO(data))
        if fmt == "csv":
            import pyarrow as pa
            import pyarrow.csv as pacsv

            # A shard's own type inference may differ from the whole file's (a float column whose
            # rows happen to be whole numbers reads back as int): pin the source's types.
            column_types = {}
            for name, type_name in (dtypes or {}).items():
                try:
                    column_types[name] = pa.type_for_alias(type_name)
                except ValueError:
                    continue
            options = pacsv.ConvertOptions(column_types=column_types)
            return pacsv.read_csv(io.BytesIO(data), convert_options=options)
        if fmt == "npz":
            import numpy as np

            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                return {name: npz[name] for name in npz.files}
    except DatasetError:
        raise
    except Exception as exc:
        raise DatasetError(f"cannot read {uri or 'data'!r} as {fmt}: {exc}") from exc
    raise DatasetError(f"unknown dataset format {fmt!r}; supported formats: {', '.join(FORMATS)}")


def _row_count(table: Any, fmt: str, uri: str) -> int:
    if fmt != "npz":
        return int(table.num_rows)
    if not table:
        raise DatasetError(f"{uri!r} holds no arrays; there is nothing to shard")
    lengths = {}
    for name, arr in table.items():
        if arr.ndim == 0:
            raise DatasetError(
                f"array {name!r} in {uri!r} is a scalar; every array needs one entry per sample along its first axis"
            )
        lengths[name] = arr.shape[0]
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{k}: {v}" for k, v in lengths.items())
        raise DatasetError(
            f"arrays in {uri!r} have different lengths ({listed}); every array needs one entry per sample "
            "along its first axis"
        )
    return int(next(iter(lengths.values())))


def _schema(table: Any, fmt: str) -> tuple[tuple[str, ...], dict[str, str]]:
    if fmt == "npz":
        return tuple(table), {name: str(arr.dtype) for name, arr in table.items()}
    return tuple(table.column_names), {f.name: str(f.type) for f in table.schema}


# -- writing --------------------------------------------------------------------------------------
def _npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    import numpy as np

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, arr in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_EPOCH)
            with zf.open(info, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


def encode_rows(table: Any, fmt: str, indices: np.ndarray) -> bytes:
    """The bytes of the rows ``indices`` of ``table``, in format ``fmt`` (deterministic)."""
    if fmt == "npz":
        return _npz_bytes({name: arr[indices] for name, arr in table.items()})
    import pyarrow as pa

    part = table.take(pa.array(indices, type=pa.int64()))
    buf = io.BytesIO()
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(part, buf)
    else:
        import pyarrow.csv as pacsv

        pacsv.write_csv(part, buf)
    return buf.getvalue()


def _write_atomic(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    if "file" in _protocols(fs):
        # Local: write aside and rename, so a crash never leaves a half-written file under the
        # final name. Object stores (S3) publish a PUT atomically already.
        fs.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with fs.open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    else:
        fs.pipe_file(path, data)


def _protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def shard_name(index: int, num_shards: int, fmt: str) -> str:
    return f"shard-{index:05d}-of-{num_shards:05d}{_SUFFIX[fmt]}"


# -- the whole job ----------------------------------------------------------------------------------
def read_manifest(uri: str, storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """Load and check the manifest at ``uri``."""
    data = _read_bytes(uri, storage_options, "shard manifest")
    try:
        return Manifest.from_dict(json.loads(data))
    except (ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, DatasetError):
            raise
        raise DatasetError(
            f"{uri!r} is not a valid shard manifest ({exc}); it should be the manifest.json written by "
            "ShardDatasetOperator"
        ) from exc


def _reusable(fs: AbstractFileSystem, manifest_path: str, request: Mapping[str, Any]) -> Manifest | None:
    """The finished manifest already at ``manifest_path`` when it answers exactly this request."""
    if not fs.exists(manifest_path):
        return None
    try:
        with fs.open(manifest_path, "rb") as f:
            existing = Manifest.from_dict(json.loads(f.read()))
    except (ValueError, KeyError, TypeError):
        return None
    if existing.request() != dict(request):
        return None
    for piece in (*existing.shards, *([existing.eval] if existing.eval else [])):
        path = fs._strip_protocol(piece.uri)
        try:
            if fs.size(path) != piece.bytes:
                return None
        except FileNotFoundError:
            return None
    return existing


def shard_dataset(
    source_uri: str,
    output_uri: str,
    num_shards: int,
    *,
    eval_fraction: float = 0.1,
    seed: int = 0,
    format: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> ShardResult:
    """Split ``source_uri`` into ``num_shards`` shards plus an evaluation split under ``output_uri``.

    Checks the request before writing anything: unknown format, missing file, empty dataset and
    more shards than training rows raise :class:`DatasetError`. Idempotent: when ``output_uri``
    already holds a finished manifest for the same source bytes and parameters it is reused;
    otherwise every file is (re)written and the manifest last.

    :param source_uri: The dataset: a local path, ``file://...`` or ``s3://...`` URI of one
        Parquet, CSV or ``.npz`` file. For ``.npz`` every array is split along its first axis.
    :param output_uri: Directory (prefix) for the shards, the evaluation split and the manifest.
    :param num_shards: How many training shards (normally the training task's world size).
    :param eval_fraction: Share of rows held out for evaluation, in ``[0, 1)``.
    :param seed: Seed of the row permutation.
    :param format: ``"parquet"``, ``"csv"`` or ``"npz"``; by default from the extension.
    :param storage_options: Passed to fsspec for both URIs (e.g. ``{"endpoint_url": ...}`` for S3).
    """
    problems = check_request(num_shards, eval_fraction, seed)
    if problems:
        raise DatasetError("cannot shard the dataset:\n" + "\n".join(f"  - {p}" for p in problems))
    fmt = detect_format(source_uri, format)
    source_uri = absolute_uri(source_uri)
    output_uri = absolute_uri(output_uri)

    data = _read_bytes(source_uri, storage_options, "dataset")
    source_sha = hashlib.sha256(data).hexdigest()
    out_fs, out_path = _filesystem(output_uri, storage_options)
    manifest_uri = join(output_uri, MANIFEST_NAME)
    manifest_path = join(out_path, MANIFEST_NAME)
    request = {
        "source_uri": source_uri,
        "source_sha256": source_sha,
        "format": fmt,
        "seed": seed,
        "eval_fraction": float(eval_fraction),
        "num_shards": num_shards,
    }
    existing = _reusable(out_fs, manifest_path, request)
    if existing is not None:
        log.info("Reusing the finished shard manifest %s (%d shards)", manifest_uri, existing.num_shards)
        return ShardResult(manifest_uri=manifest_uri, manifest=existing, reused=True)

    table = parse_table(data, fmt, uri=source_uri)
    del data
    num_rows = _row_count(table, fmt, source_uri)
    shard_idx, eval_idx = split_indices(num_rows, num_shards, float(eval_fraction), seed)
    columns, dtypes = _schema(table, fmt)

    # A manifest from another request must not outlive the files it describes being replaced.
    if out_fs.exists(manifest_path):
        log.info("Replacing the shard manifest %s: the dataset or the sharding parameters changed", manifest_uri)
        out_fs.rm_file(manifest_path)

    def write(name: str, indices: np.ndarray) -> ShardFile:
        payload = encode_rows(table, fmt, indices)
        _write_atomic(out_fs, join(out_path, name), payload)
        return ShardFile(
            uri=join(output_uri, name),
            rows=len(indices),
            bytes=len(payload),
            sha256=hashlib.sha256(payload).hexdigest(),
        )

    shards = tuple(write(shard_name(i, num_shards, fmt), idx) for i, idx in enumerate(shard_idx))
    eval_file = write(f"{EVAL_NAME}{_SUFFIX[fmt]}", eval_idx) if len(eval_idx) else None
    manifest = Manifest(
        source_uri=source_uri,
        source_sha256=source_sha,
        format=fmt,
        seed=seed,
        eval_fraction=float(eval_fraction),
        num_rows=num_rows,
        columns=columns,
        dtypes=dtypes,
        shards=shards,
        eval=eval_file,
    )
    _write_atomic(out_fs, manifest_path, manifest.to_json().encode())
    log.info(
        "Wrote %d shards (%s rows) and an evaluation split of %d rows from %s to %s",
        num_shards,
        "/".join(str(s.rows) for s in shards),
        len(eval_idx),
        source_uri,
        manifest_uri,
    )
    return ShardResult(manifest_uri=manifest_uri, manifest=manifest, reused=False)


# -- reading shards back ----------------------------------------------------------------------------
def read_shard(
    piece: ShardFile,
    manifest: Manifest,
    *,
    verify: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> Columns:
    """The rows of one shard (or the evaluation split) as one NumPy array per column.

    With ``verify`` the file's SHA-256 is checked against the manifest first.
    """
    data = _read_bytes(piece.uri, storage_options, "shard")
    if verify:
        actual = hashlib.sha256(data).hexdigest()
        if actual != piece.sha256:
            raise ShardIntegrityError(
                f"shard {piece.uri!r} is corrupt or was changed after sharding: SHA-256 {actual} but the "
                f"manifest records {piece.sha256}. Re-run the sharding task (clear it in Airflow) to rewrite it"
            )
    table = parse_table(data, manifest.format, uri=piece.uri, dtypes=manifest.dtypes)
    if manifest.format == "npz":
        columns: Columns = table
    else:
        columns = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
    rows = len(next(iter(columns.values()))) if columns else 0
    if rows != piece.rows:
        raise ShardIntegrityError(
            f"shard {piece.uri!r} holds {rows} rows but the manifest records {piece.rows}; re-run the sharding task"
        )
    return columns


def concat_columns(parts: Sequence[Columns]) -> Columns:
    """Concatenate several shards' columns (in the given order)."""
    if not parts:
        return {}
    if len(parts) == 1:
        return parts[0]
    import numpy as np

    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
