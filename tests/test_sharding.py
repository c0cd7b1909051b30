"""Sharding: deterministic, disjoint, complete; three formats; S3 through moto's server; bad inputs."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from airflow_torchrun.sharding import (
    DatasetError,
    Manifest,
    read_manifest,
    read_shard,
    shard_dataset,
    split_indices,
)
from tests.s3_fixtures import ACCESS_KEY, SECRET_KEY, MotoS3

N_ROWS = 103


def _table(n: int = N_ROWS) -> pa.Table:
    rng = np.random.default_rng(7)
    w = np.floor(rng.uniform(0, 5, size=n))
    w[:1] = 0.5
    return pa.table(
        {
            "row_id": np.arange(n, dtype=np.int64),
            "x": rng.normal(size=n),
            # Whole numbers but for row 0: a shard without row 0 would read back as int from CSV.
            "w": w,
            "label": [f"c{i % 3}" for i in range(n)],
        }
    )


def write_dataset(path: Path, fmt: str, n: int = N_ROWS) -> Path:
    table = _table(n)
    if fmt == "parquet":
        pq.write_table(table, path)
    elif fmt == "csv":
        pacsv.write_csv(table, path)
    else:
        x = np.stack([table.column("x").to_numpy(), table.column("w").to_numpy()], axis=1)
        np.savez(path, row_id=table.column("row_id").to_numpy(), x=x, y=np.arange(n) % 3)
    return path


def row_ids(columns: dict[str, np.ndarray]) -> list[int]:
    return [int(v) for v in columns["row_id"]]


def all_pieces(manifest: Manifest) -> list[dict[str, np.ndarray]]:
    pieces = [read_shard(s, manifest) for s in manifest.shards]
    return [*pieces, read_shard(manifest.eval, manifest)] if manifest.eval else pieces


@pytest.mark.parametrize("fmt", ["parquet", "csv", "npz"])
def test_every_row_lands_in_exactly_one_shard_or_the_eval_split(tmp_path: Path, fmt: str) -> None:
    src = write_dataset(tmp_path / f"data.{fmt}", fmt)
    result = shard_dataset(str(src), str(tmp_path / "out"), 4, eval_fraction=0.1, seed=3)
    m = result.manifest
    assert not result.reused
    assert m.num_rows == N_ROWS and m.format == fmt and m.num_shards == 4
    assert m.eval is not None and m.eval.rows == 10
    assert sorted(s.rows for s in m.shards) == [23, 23, 23, 24]

    ids = [row_ids(p) for p in all_pieces(m)]
    flat = [i for piece in ids for i in piece]
    assert sorted(flat) == list(range(N_ROWS))  # complete and disjoint: no row twice, none missing
    assert all(len(set(a) & set(b)) == 0 for k, a in enumerate(ids) for b in ids[k + 1 :])
    assert len(set(ids[-1])) == 10  # eval split

    # Values travel with their row, and types survive (CSV: the whole-number float column too).
    table = _table()
    shard0 = read_shard(m.shards[0], m)
    first = row_ids(shard0)
    if fmt == "npz":
        assert shard0["x"].shape == (len(first), 2)
        assert np.allclose(shard0["x"][:, 0], table.column("x").to_numpy()[first])
    else:
        assert np.allclose(shard0["x"], table.column("x").to_numpy()[first])
        assert all(piece["w"].dtype == np.float64 for piece in all_pieces(m))
        assert list(shard0["label"]) == [f"c{i % 3}" for i in first]

    manifest_json = json.loads(Path(result.manifest_uri).read_text())
    assert manifest_json["seed"] == 3 and manifest_json["source_uri"] == str(src)
    assert manifest_json["columns"][0] == "row_id"
    assert all(len(s["sha256"]) == 64 for s in manifest_json["shards"])


@pytest.mark.parametrize("fmt", ["parquet", "csv", "npz"])
def test_same_inputs_give_the_same_bytes_and_a_new_seed_a_new_split(tmp_path: Path, fmt: str) -> None:
    src = write_dataset(tmp_path / f"data.{fmt}", fmt)
    a = shard_dataset(str(src), str(tmp_path / "a"), 3, seed=11).manifest
    b = shard_dataset(str(src), str(tmp_path / "b"), 3, seed=11).manifest
    c = shard_dataset(str(src), str(tmp_path / "c"), 3, seed=12).manifest
    assert [s.sha256 for s in a.shards] == [s.sha256 for s in b.shards]
    assert a.eval and b.eval and a.eval.sha256 == b.eval.sha256
    assert [Path(s.uri).read_bytes() for s in a.shards] == [Path(s.uri).read_bytes() for s in b.shards]
    assert [row_ids(read_shard(s, a)) for s in a.shards] != [row_ids(read_shard(s, c)) for s in c.shards]


def test_split_is_a_pure_function_of_its_inputs() -> None:
    shards, ev = split_indices(1000, 8, 0.2, seed=5)
    again, ev2 = split_indices(1000, 8, 0.2, seed=5)
    assert all(np.array_equal(x, y) for x, y in zip(shards, again, strict=True)) and np.array_equal(ev, ev2)
    assert len(ev) == 200 and {len(s) for s in shards} == {100}
    assert sorted(np.concatenate([*shards, ev]).tolist()) == list(range(1000))


def test_retry_reuses_a_finished_manifest_and_rewrites_a_torn_one(tmp_path: Path) -> None:
    src = write_dataset(tmp_path / "data.parquet", "parquet")
    out = tmp_path / "out"
    first = shard_dataset(str(src), str(out), 2)
    second = shard_dataset(str(src), str(out), 2)
    assert second.reused and second.manifest == first.manifest

    # A try that died before writing the manifest: the next one writes the same files again.
    manifest_file = Path(first.manifest_uri)
    manifest_bytes = manifest_file.read_bytes()
    manifest_file.unlink()
    Path(first.manifest.shards[1].uri).write_bytes(b"torn")
    third = shard_dataset(str(src), str(out), 2)
    assert not third.reused and manifest_file.read_bytes() == manifest_bytes
    assert read_shard(third.manifest.shards[1], third.manifest)["row_id"].size == first.manifest.shards[1].rows

    # Different parameters for the same place: rewritten for the new request, not reused.
    fourth = shard_dataset(str(src), str(out), 3)
    assert not fourth.reused and read_manifest(str(manifest_file)).num_shards == 3


def test_changed_shard_fails_checksum(tmp_path: Path) -> None:
    from airflow_torchrun.sharding import ShardIntegrityError

    src = write_dataset(tmp_path / "data.npz", "npz")
    m = shard_dataset(str(src), str(tmp_path / "out"), 2).manifest
    path = Path(m.shards[0].uri)
    data = bytearray(path.read_bytes())
    data[-30] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ShardIntegrityError, match="SHA-256"):
        read_shard(m.shards[0], m)


def test_npz_entries_carry_no_wall_clock_time(tmp_path: Path) -> None:
    src = write_dataset(tmp_path / "data.npz", "npz")
    m = shard_dataset(str(src), str(tmp_path / "out"), 2).manifest
    with zipfile.ZipFile(m.shards[0].uri) as zf:
        assert {i.date_time for i in zf.infolist()} == {(1980, 1, 1, 0, 0, 0)}


# -- bad inputs -----------------------------------------------------------------------------------
def test_empty_dataset(tmp_path: Path) -> None:
    src = tmp_path / "empty.parquet"
    pq.write_table(_table(0), src)
    with pytest.raises(DatasetError, match="no rows"):
        shard_dataset(str(src), str(tmp_path / "out"), 2)
    assert not (tmp_path / "out").exists()


def test_more_shards_than_rows(tmp_path: Path) -> None:
    src = write_dataset(tmp_path / "small.csv", "csv", n=5)
    with pytest.raises(DatasetError, match=r"more shards than rows: 8 shards requested but only 4 training rows"):
        shard_dataset(str(src), str(tmp_path / "out"), 8)
    assert not (tmp_path / "out").exists()


def test_unknown_format(tmp_path: Path) -> None:
    src = tmp_path / "data.json"
    src.write_text("[]")
    with pytest.raises(DatasetError, match=r"cannot tell the format .*'\.json'.*format="):
        shard_dataset(str(src), str(tmp_path / "out"), 2)
    with pytest.raises(DatasetError, match="unknown dataset format 'xlsx'"):
        shard_dataset(str(src), str(tmp_path / "out"), 2, format="xlsx")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"dataset .*nope\.parquet' does not exist"):
        shard_dataset(str(tmp_path / "nope.parquet"), str(tmp_path / "out"), 2)


def test_npz_arrays_of_different_lengths(tmp_path: Path) -> None:
    src = tmp_path / "bad.npz"
    np.savez(src, x=np.zeros((10, 2)), y=np.zeros(9))
    with pytest.raises(DatasetError, match=r"different lengths \(x: 10, y: 9\)"):
        shard_dataset(str(src), str(tmp_path / "out"), 2)


def test_bad_parameters_are_listed_together(tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as info:
        shard_dataset(str(tmp_path / "x.csv"), str(tmp_path / "out"), 0, eval_fraction=1.5, seed=-1)
    text = str(info.value)
    assert "num_shards" in text and "eval_fraction" in text and "seed" in text


# -- S3 through moto's HTTP server ------------------------------------------------------------------
@pytest.fixture
def s3_endpoint(moto_s3: MotoS3) -> dict[str, Any]:
    """s3fs options for the session's moto server (each test makes its own bucket)."""
    return {"endpoint_url": moto_s3.endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY}


def test_parquet_on_s3(tmp_path: Path, s3_endpoint: dict[str, Any], moto_s3: MotoS3) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(**s3_endpoint)
    bucket = moto_s3.make_bucket("datasets")
    local = write_dataset(tmp_path / "data.parquet", "parquet")
    fs.put_file(str(local), f"{bucket}/train/data.parquet")

    result = shard_dataset(
        f"s3://{bucket}/train/data.parquet", f"s3://{bucket}/shards/run-1", 3, storage_options=s3_endpoint
    )
    m = result.manifest
    assert result.manifest_uri == f"s3://{bucket}/shards/run-1/manifest.json"
    assert all(s.uri.startswith(f"s3://{bucket}/shards/run-1/shard-") for s in m.shards)
    assert sorted(fs.ls(f"{bucket}/shards/run-1", detail=False))[-1].endswith("shard-00002-of-00003.parquet")
    ids = [row_ids(read_shard(p, m, storage_options=s3_endpoint)) for p in (*m.shards, m.eval) if p]
    assert sorted(i for piece in ids for i in piece) == list(range(N_ROWS))
    # Same bytes as the local run of the same request.
    local_m = shard_dataset(str(local), str(tmp_path / "out"), 3).manifest
    assert [s.sha256 for s in local_m.shards] == [s.sha256 for s in m.shards]
    again = shard_dataset(
        f"s3://{bucket}/train/data.parquet", f"s3://{bucket}/shards/run-1", 3, storage_options=s3_endpoint
    )
    assert again.reused


def test_ranks_read_s3_shards_with_the_aws_environment(
    tmp_path: Path, s3_endpoint: dict[str, Any], moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    from airflow_torchrun.worker.shards import MANIFEST_ENV, load_eval_split, load_shard

    bucket = moto_s3.make_bucket("ranks")
    local = write_dataset(tmp_path / "data.csv", "csv")
    s3fs.S3FileSystem(**s3_endpoint).put_file(str(local), f"{bucket}/data.csv")
    uri = shard_dataset(f"s3://{bucket}/data.csv", f"s3://{bucket}/out", 2, storage_options=s3_endpoint).manifest_uri
    # What a rank has: the manifest URI and the standard AWS variables, no storage_options.
    monkeypatch.setenv(MANIFEST_ENV, uri)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    ids = [row_ids(load_shard(rank=r, world_size=2)) for r in (0, 1)] + [row_ids(load_eval_split())]
    assert sorted(i for piece in ids for i in piece) == list(range(N_ROWS))


# -- the operator ---------------------------------------------------------------------------------
class _TI(SimpleNamespace):
    """The few TaskInstance attributes the operator reads, and its XCom pushes."""

    def xcom_push(self, key: str, value: Any) -> None:
        self.pushed[key] = value


def _ti(**kw: Any) -> _TI:
    return _TI(
        dag_id="pipe", run_id="manual__2026-01-01T00:00:00+00:00", task_id="shard", map_index=-1, pushed={}, **kw
    )


def test_operator_defaults_one_shard_per_rank_under_the_state_dir(tmp_path: Path) -> None:
    from airflow_torchrun.naming import lineage_path
    from airflow_torchrun.operators.shard import ShardDatasetOperator, default_output_root

    src = write_dataset(tmp_path / "data.csv", "csv")
    op = ShardDatasetOperator(task_id="shard", source_uri=str(src), num_nodes=2, nproc_per_node=2)
    ti = _ti()
    uri = op.execute({"ti": ti})  # type: ignore[arg-type]
    assert uri.startswith(default_output_root())
    # The lineage's path, as for checkpoints: a run id that needs sanitising gets ~<hash>, so two
    # run ids that clean up alike ("a:b", "a+b") never share shards.
    assert uri.endswith(f"/{lineage_path('pipe', ti.run_id, 'shard')}/manifest.json")
    assert "/pipe/manual__2026-01-01T00_00_00_00_00~" in uri
    assert read_manifest(uri).num_shards == 4
    assert ti.pushed["summary"]["rows_per_shard"] == [24, 23, 23, 23]


def test_operator_rejects_bad_arguments_when_the_dag_is_parsed(tmp_path: Path) -> None:
    from airflow_torchrun.operators.shard import ShardDatasetOperator

    with pytest.raises(DatasetError, match="unknown dataset format 'hdf5'"):
        ShardDatasetOperator(task_id="s", source_uri="/data/x.h5", format="hdf5", num_shards=2)
    with pytest.raises(DatasetError, match="give num_shards, or num_nodes and nproc_per_node"):
        ShardDatasetOperator(task_id="s", source_uri="/data/x.parquet")
    with pytest.raises(DatasetError, match="num_shards must be a whole number >= 1"):
        ShardDatasetOperator(task_id="s", source_uri="/data/x.parquet", num_shards=0)
    # Templates are checked once rendered, not at parse time.
    ShardDatasetOperator(task_id="s", source_uri="{{ params.data }}", num_shards="{{ params.n }}")


def test_operator_bad_data_fails_without_retry(tmp_path: Path) -> None:
    from airflow_torchrun.compat import AirflowFailException
    from airflow_torchrun.operators.shard import ShardDatasetOperator

    src = write_dataset(tmp_path / "tiny.parquet", "parquet", n=3)
    op = ShardDatasetOperator(task_id="shard", source_uri=str(src), num_shards=8, output_uri=str(tmp_path / "o"))
    with pytest.raises(AirflowFailException, match="more shards than rows"):
        op.execute({"ti": _ti()})  # type: ignore[arg-type]


@pytest.mark.slow
def test_operator_through_dag_test_with_templated_shard_count(run_dag: Any, tmp_path: Path) -> None:
    src = write_dataset(tmp_path / "data.npz", "npz")
    result = run_dag(
        f"""
        ShardDatasetOperator(
            task_id="shard",
            source_uri={str(src)!r},
            output_uri={str(tmp_path / "shards")!r} + "/{{{{ run_id }}}}",
            num_nodes="{{{{ params.num_nodes }}}}",
            nproc_per_node="{{{{ params.nproc_per_node }}}}",
            seed=1,
        )
        """,
        imports="from airflow_torchrun.operators.shard import ShardDatasetOperator",
        params={"num_nodes": 2, "nproc_per_node": 1},
    )
    assert result.state == "success", result.log[-3000:]
    uri = result.xcom("shard")
    assert uri.endswith("/manifest.json") and result.run_id in uri
    m = read_manifest(uri)
    assert m.num_shards == 2 and m.seed == 1
    assert result.xcom("shard", key="summary")["eval_rows"] == 10


@pytest.mark.slow
def test_importing_the_operators_stays_cheap() -> None:
    # DAG parsing imports these modules: none of the heavy packages may come along.
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import airflow_torchrun.operators.shard, airflow_torchrun.operators.register, airflow_torchrun.tracking\n"
        "print(sorted({'torch', 'kubernetes', 's3fs', 'mlflow', 'numpy', 'pyarrow', 'matplotlib'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]
