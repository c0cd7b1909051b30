"""The collectives checkpointing needs: a gloo group of its own, and one for the stop flag.

What ranks tell each other (file names, sizes and checksums, problems, a flag) travels as JSON in
byte tensors, never pickled: ``all_gather_object`` unpickles whatever a peer sent, so one rank that
runs code it should not (a bad checkpoint, a bad dependency) would run it in every other rank too.
"""

from __future__ import annotations

import io
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


# -- process group ----------------------------------------------------------------------------
@dataclass
class Comm:
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
        """Everyone's ``obj`` (JSON: dicts, lists, strings, numbers, booleans, None) on every rank."""
        if self.group is None:
            return [obj]
        return [_from_json(raw) for raw in self._exchange(json.dumps(obj, allow_nan=False).encode(), everyone=True)]

    def gather(self, obj: Any) -> list[Any]:
        """Everyone's ``obj`` (JSON) on rank 0 (an empty list elsewhere)."""
        if self.group is None:
            return [obj]
        return [_from_json(raw) for raw in self._exchange(json.dumps(obj, allow_nan=False).encode(), everyone=False)]

    def gather_states(self, obj: Any) -> list[Any]:
        """Everyone's ``obj`` of tensors, numbers and containers (RNG states) on rank 0: written by
        ``torch.save`` and read back with ``weights_only=True``, which builds no other objects."""
        if self.group is None:
            return [obj]
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        out = []
        for raw in self._exchange(buffer.getvalue(), everyone=False):
            try:
                out.append(torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True))
            except Exception as exc:
                raise _foreign(len(raw), exc) from None
        return out

    def _exchange(self, data: bytes, *, everyone: bool) -> list[bytes]:
        """Every rank's ``data``: on every rank, or (``everyone`` False) on rank 0 only."""
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.long), group=self.group)
        counts = [int(t.item()) for t in sizes]
        width = max(counts)
        mine = torch.zeros(width, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if everyone:
            out: list[torch.Tensor] | None = [torch.zeros(width, dtype=torch.uint8) for _ in counts]
            dist.all_gather(out, mine, group=self.group)
        else:
            out = [torch.zeros(width, dtype=torch.uint8) for _ in counts] if self.rank == 0 else None
            dist.gather(mine, out, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return [bytes(t[:n].tolist()) for t, n in zip(out, counts, strict=True)] if out is not None else []


def _from_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise _foreign(len(raw), exc) from None


def _foreign(size: int, exc: Exception) -> RuntimeError:
    return RuntimeError(
        f"a peer rank sent {size} bytes that are not what the checkpoint helpers exchange ({exc}); every rank "
        "must run the same airflow-torchrun version, and only its helpers may use the checkpoint process group"
    )


_COMM_LOCK = threading.Lock()

_COMM_CACHE: dict[int, Comm] = {}


def checkpoint_comm() -> Comm:
    if not (dist.is_available() and dist.is_initialized()):
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if world > 1:
            raise RuntimeError(
                f"WORLD_SIZE is {world} but torch.distributed is not initialised: call "
                "torch.distributed.init_process_group() before save_checkpoint/load_checkpoint so that the "
                "ranks can agree on a commit"
            )
        return Comm()
    key = id(dist.group.WORLD)
    with _COMM_LOCK:
        comm = _COMM_CACHE.get(key)
        if comm is None:
            # Collective: every rank gets here in its first save_checkpoint.
            group = dist.new_group(backend="gloo")
            comm = Comm(rank=dist.get_rank(), world_size=dist.get_world_size(), group=group)
            _COMM_CACHE.clear()
            _COMM_CACHE[key] = comm
    return comm


_STOP_GROUP_CACHE: dict[int, Any] = {}


def stop_group() -> Any:
    """The stop flag's own gloo group (None when not distributed). :func:`save_if_stopping` runs its
    all-reduce on the main thread at every step while an async save's thread runs its collectives
    on :func:`checkpoint_comm`'s group; two threads issuing collectives on one group pair different operations
    across ranks (seen: the example trainer with ``--async-checkpoint`` hung at its first save, each
    rank's main thread in the flag's all-reduce and its save thread in the commit barrier)."""
    if checkpoint_comm().group is None:
        return None
    key = id(dist.group.WORLD)
    with _COMM_LOCK:
        if key not in _STOP_GROUP_CACHE:
            # Collective: every rank gets here in its first save_if_stopping (on the main thread).
            _STOP_GROUP_CACHE.clear()
            _STOP_GROUP_CACHE[key] = dist.new_group(backend="gloo")
        return _STOP_GROUP_CACHE[key]


def agree(ok: bool) -> bool:
    """True when every rank says ``ok`` (just ``ok`` outside a process group), so that all ranks
    load the same step."""
    if not (dist.is_available() and dist.is_initialized()):
        return ok
    return all(checkpoint_comm().all_gather(ok))
