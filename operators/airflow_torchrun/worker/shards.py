"""Inside a rank: read this rank's shard(s) of the dataset named by ``TRAIN_SHARD_MANIFEST``.

``ShardDatasetOperator`` writes the shards and a manifest; the training operator passes the
manifest's URI to every rank as ``TRAIN_SHARD_MANIFEST``. Typical use in a training script::

    from airflow_torchrun.worker.shards import load_shard

    data = load_shard()              # this rank's rows: {"x": ndarray, "y": ndarray, ...}
    features = torch.from_numpy(data["x"])

No Airflow import here. S3 credentials and endpoint come from the usual AWS variables
(``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...) or ``storage_options``.

**Batches that resume where they stopped.** :class:`ShardLoader` yields this rank's rows in
batches, in an order that depends only on (seed, epoch, rank), and knows its position (epoch,
offset, seed). Put :meth:`ShardLoader.state_dict` into the checkpoint and give it back to
:meth:`ShardLoader.load_state_dict` after loading: the resumed run reads the very batches the
interrupted one would have read next, instead of starting its epoch from zero (which the resume
audit reports as ``diverged``)::

    loader = ShardLoader.from_manifest(batch_size=32, seed=0)
    state = load_checkpoint()
    if state is not None:
        loader.load_state_dict(state["data"])
    while loader.epoch < epochs:
        for batch in loader:             # the rest of the current epoch, then the next one begins
            ...
            save_checkpoint({"model": ..., "data": loader.state_dict()}, step)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from airflow_torchrun.contract import SHARD_MANIFEST
from airflow_torchrun.errors import TorchrunError
from airflow_torchrun.sharding import Columns, Manifest, concat_columns, read_manifest, read_shard

log = logging.getLogger(__name__)

MANIFEST_ENV = SHARD_MANIFEST


class ShardAssignmentError(TorchrunError, ValueError):
    """This rank cannot be given a shard (no manifest, or more ranks than shards)."""


def manifest_uri() -> str:
    """The manifest URI from ``TRAIN_SHARD_MANIFEST``; a clear error when it is not set."""
    uri = os.environ.get(MANIFEST_ENV, "").strip()
    if not uri:
        raise ShardAssignmentError(
            f"{MANIFEST_ENV} is not set, so this rank does not know which dataset shards to read. "
            "Run the script through DistributedTrainingOperator after a ShardDatasetOperator task "
            f"(it sets {MANIFEST_ENV}), or set {MANIFEST_ENV} to a manifest.json URI yourself"
        )
    return uri


def load_manifest(uri: str | None = None, *, storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """The shard manifest at ``uri`` (default: ``TRAIN_SHARD_MANIFEST``)."""
    return read_manifest(uri or manifest_uri(), storage_options)


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    def from_env(name: str, default: int) -> int:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            return default
        try:
            return int(raw)
        except ValueError as exc:
            raise ShardAssignmentError(f"{name}={raw!r} is not a whole number") from exc

    r = from_env("RANK", 0) if rank is None else rank
    w = from_env("WORLD_SIZE", 1) if world_size is None else world_size
    if w < 1 or not 0 <= r < w:
        raise ShardAssignmentError(f"rank {r} is not within world size {w}")
    return r, w


def assigned_shards(rank: int, world_size: int, num_shards: int) -> list[int]:
    """Indices of the shards rank ``rank`` reads: ``rank, rank + world_size, rank + 2*world_size, ...``.

    Round-robin, so ranks get disjoint shards that together cover all of them. With as many
    shards as ranks (the default of ``ShardDatasetOperator``) every rank gets exactly its own.
    More ranks than shards cannot work (some ranks would get no data and stall the collective
    ops of the others) and raises :class:`ShardAssignmentError`.
    """
    if world_size > num_shards:
        raise ShardAssignmentError(
            f"the manifest has {num_shards} shard(s) but the world size is {world_size}: ranks "
            f"{num_shards}..{world_size - 1} would get no data. Shard the dataset into at least "
            f"{world_size} shards (num_shards = num_nodes * nproc_per_node of the training task)"
        )
    return list(range(rank, num_shards, world_size))


def shard_paths(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    manifest: Manifest | None = None,
) -> list[str]:
    """URIs of the shard files this rank reads (see :func:`assigned_shards` for the rule).

    ``rank`` and ``world_size`` default to torchrun's ``RANK`` and ``WORLD_SIZE``.
    """
    m = manifest or load_manifest()
    r, w = _rank_and_world(rank, world_size)
    return [m.shards[i].uri for i in assigned_shards(r, w, m.num_shards)]


def load_shard(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    manifest: Manifest | None = None,
    verify: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> Columns:
    """This rank's training rows, as ``{column: numpy array}`` (first axis = rows).

    For Parquet and CSV one array per column; for ``.npz`` the file's arrays by name (an array
    of shape ``(n, 32)`` stays two-dimensional). Shards are disjoint across ranks. When the world
    size differs from the number of shards, shards are assigned round-robin (rank ``r`` reads
    shards ``r, r + world_size, ...``, concatenated in that order); ranks may then hold
    different numbers of rows, which is logged. Each file's SHA-256 is checked against the
    manifest (``verify=False`` skips that).

    :param rank: Defaults to ``RANK``.
    :param world_size: Defaults to ``WORLD_SIZE``.
    :param manifest: A manifest already loaded; by default the one at ``TRAIN_SHARD_MANIFEST``.
    :param verify: Check checksums (raises ``ShardIntegrityError`` on a mismatch).
    :param storage_options: fsspec options for the shard files (e.g. an S3 endpoint).
    """
    m = manifest or load_manifest(storage_options=storage_options)
    r, w = _rank_and_world(rank, world_size)
    indices = assigned_shards(r, w, m.num_shards)
    if m.num_shards % w:
        log.warning(
            "Rank %d of %d reads %d of %d shards (round-robin): ranks hold different numbers of rows",
            r,
            w,
            len(indices),
            m.num_shards,
        )
    parts = [read_shard(m.shards[i], m, verify=verify, storage_options=storage_options) for i in indices]
    return concat_columns(parts)


def load_eval_split(
    *,
    manifest: Manifest | None = None,
    verify: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> Columns:
    """The held-out evaluation rows (the same on every rank), as ``{column: numpy array}``."""
    m = manifest or load_manifest(storage_options=storage_options)
    if m.eval is None:
        raise ShardAssignmentError(
            "the shard manifest has no evaluation split (it was written with eval_fraction=0); "
            "re-shard with eval_fraction > 0 to hold rows out for evaluation"
        )
    return read_shard(m.eval, m, verify=verify, storage_options=storage_options)


class ShardLoader:
    """This rank's rows in batches, a seeded order per epoch, its position saved and restored.

    :param columns: the rows (``{column: ndarray}``, first axis = rows), e.g. :func:`load_shard`'s.
    :param batch_size: rows per batch.
    :param seed: the order's seed; epoch ``e`` of rank ``r`` is a permutation seeded by ``(seed, e, r)``.
    :param rank: default ``RANK``.
    :param num_samples: rows one epoch uses (default all; give every rank the same, e.g. the
        smallest shard's size, so that every rank takes the same number of steps).
    :param shuffle: False: the rows in their order, every epoch.

    Iterating yields the batches left in the current epoch (from :attr:`offset`), each a
    ``{column: ndarray}``, and then moves to the next epoch (:attr:`epoch` + 1, offset 0). A batch
    counts as taken once it was yielded, so the state saved after a step resumes with the next one.
    The last partial batch of an epoch is dropped.
    """

    def __init__(
        self,
        columns: Mapping[str, Any],
        *,
        batch_size: int,
        seed: int = 0,
        rank: int | None = None,
        num_samples: int | None = None,
        shuffle: bool = True,
    ) -> None:
        import numpy as np

        self.columns = {name: np.asarray(values) for name, values in columns.items()}
        sizes = {len(v) for v in self.columns.values()}
        if len(sizes) > 1:
            raise ShardAssignmentError(f"the shard's columns have different numbers of rows: {sorted(sizes)}")
        rows = sizes.pop() if sizes else 0
        self.rank = _rank_and_world(None, None)[0] if rank is None else int(rank)
        self.num_samples = rows if num_samples is None else int(num_samples)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a whole number >= 1, got {batch_size!r}")
        if not 0 < self.num_samples <= rows:
            raise ShardAssignmentError(f"num_samples must be between 1 and the shard's {rows} rows, got {num_samples}")
        self.batch_size, self.seed, self.shuffle = batch_size, int(seed), shuffle
        self.epoch, self.offset = 0, 0

    @classmethod
    def from_manifest(
        cls,
        *,
        batch_size: int,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        num_samples: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> ShardLoader:
        """This rank's shard of ``TRAIN_SHARD_MANIFEST`` (:func:`load_shard`), in batches."""
        r, w = _rank_and_world(rank, world_size)
        columns = load_shard(r, w, storage_options=storage_options)
        return cls(columns, batch_size=batch_size, seed=seed, rank=r, num_samples=num_samples)

    def __len__(self) -> int:
        """Batches per epoch."""
        return self.num_samples // self.batch_size

    def order(self, epoch: int) -> Any:
        """The rows of ``epoch``, in the order they are read (the same on every try)."""
        import numpy as np

        rows = len(next(iter(self.columns.values()))) if self.columns else 0
        if not self.shuffle:
            return np.arange(self.num_samples)
        generator = np.random.default_rng([self.seed, epoch, self.rank])
        return generator.permutation(rows)[: self.num_samples]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        order = self.order(self.epoch)
        while self.offset < len(self):
            rows = order[self.offset * self.batch_size : (self.offset + 1) * self.batch_size]
            self.offset += 1
            yield {name: values[rows] for name, values in self.columns.items()}
        self.epoch, self.offset = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        """The position (epoch, offset: batches taken in it, seed) and what the order depends on."""
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a position :meth:`state_dict` gave; one taken with another seed, batch size
        or epoch length would read other batches than the run it came from, and is refused."""
        for name in ("seed", "batch_size", "num_samples"):
            if name in state and int(state[name]) != getattr(self, name):
                raise ValueError(
                    f"the saved data position was taken with {name}={state[name]}, this loader has "
                    f"{name}={getattr(self, name)}: resuming would read other batches than the interrupted run"
                )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset <= len(self):
            raise ValueError(f"the saved data position (epoch {epoch}, offset {offset}) is not one of this loader")
        if offset == len(self):  # saved after an epoch's last batch: the next epoch is next
            epoch, offset = epoch + 1, 0
        self.epoch, self.offset = epoch, offset
        log.info("Data position restored: epoch %d, batch %d of %d (seed %d)", epoch, offset, len(self), self.seed)
