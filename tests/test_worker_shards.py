"""The rank side: each rank reads its own shard(s) from TRAIN_SHARD_MANIFEST, checksum-verified."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from airflow_torchrun.sharding import ShardIntegrityError, shard_dataset
from airflow_torchrun.worker.shards import (
    MANIFEST_ENV,
    ShardAssignmentError,
    assigned_shards,
    load_eval_split,
    load_shard,
    shard_paths,
)

N = 200


@pytest.fixture
def manifest_uri(tmp_path: Path) -> str:
    src = tmp_path / "data.npz"
    np.savez(src, row_id=np.arange(N), x=np.arange(N * 3, dtype=np.float32).reshape(N, 3))
    return shard_dataset(str(src), str(tmp_path / "shards"), 4, eval_fraction=0.1).manifest_uri


@pytest.mark.slow
def test_ranks_read_disjoint_shards_in_separate_processes(manifest_uri: str) -> None:
    # Two real processes per world, ranks given by torchrun's variables: no Airflow, no torch.
    reader = textwrap.dedent(
        """
        import json
        from airflow_torchrun.worker.shards import load_shard
        data = load_shard()
        assert "airflow" not in __import__("sys").modules
        print(json.dumps(data["row_id"].tolist()))
        """
    )
    seen: dict[int, list[int]] = {}
    for world in (4, 2):
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", reader],
                env={**os.environ, MANIFEST_ENV: manifest_uri, "RANK": str(r), "WORLD_SIZE": str(world)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(world)
        ]
        rows = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            rows.append(json.loads(out))
        flat = [i for r in rows for i in r]
        assert len(flat) == len(set(flat)) == N - 20  # disjoint, and all training rows
        seen[world] = flat
    assert sorted(seen[4]) == sorted(seen[2])


def test_round_robin_when_world_size_differs(manifest_uri: str) -> None:
    assert assigned_shards(0, 2, 4) == [0, 2] and assigned_shards(1, 2, 4) == [1, 3]
    assert assigned_shards(1, 3, 4) == [1]
    os.environ[MANIFEST_ENV] = manifest_uri
    try:
        paths = shard_paths(rank=0, world_size=2)
        assert [Path(p).name for p in paths] == ["shard-00000-of-00004.npz", "shard-00002-of-00004.npz"]
        both = load_shard(rank=0, world_size=2)
        own = [load_shard(rank=r, world_size=4)["row_id"] for r in (0, 2)]
        assert np.array_equal(both["row_id"], np.concatenate(own))
        assert both["x"].shape == (len(both["row_id"]), 3)
        ev = load_eval_split()
        assert len(ev["row_id"]) == 20 and not set(ev["row_id"]) & set(both["row_id"])
        with pytest.raises(ShardAssignmentError, match=r"4 shard\(s\) but the world size is 5"):
            load_shard(rank=0, world_size=5)
    finally:
        del os.environ[MANIFEST_ENV]


def test_without_the_manifest_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MANIFEST_ENV, raising=False)
    with pytest.raises(ShardAssignmentError, match="TRAIN_SHARD_MANIFEST is not set"):
        load_shard(rank=0, world_size=1)


def test_rank_reads_are_checksum_verified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # CSV has no internal checksum (npz's zip CRC would catch this itself): only ours can.
    src = tmp_path / "data.csv"
    src.write_text("row_id,v\n" + "".join(f"{i},{i * 10}\n" for i in range(40)))
    uri = shard_dataset(str(src), str(tmp_path / "shards"), 4, eval_fraction=0.0).manifest_uri
    monkeypatch.setenv(MANIFEST_ENV, uri)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    [path] = shard_paths()
    original = load_shard()
    text = Path(path).read_text()
    Path(path).write_text(text.replace(f",{original['v'][0]}\n", f",{original['v'][0] + 1}\n", 1))
    with pytest.raises(ShardIntegrityError, match=r"shard-00001-of-00004\.csv' is corrupt or was changed"):
        load_shard()
    damaged = load_shard(verify=False)
    assert damaged["v"][0] == original["v"][0] + 1
    with pytest.raises(ShardAssignmentError, match="no evaluation split"):
        load_eval_split()
