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
    ``1`` when the operator was told to trust sharded checkpoints outside ``TRAIN_CHECKPOINT_URI`` (their
    metadata is pickled).

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

from airflow_torchrun.worker.checkpoint.env import (
    ENV_CHECKPOINT_URI,
    ENV_KEEP_LAST,
    ENV_LINEAGE,
    ENV_RESUME_FROM,
    ENV_STORAGE_OPTIONS,
    ENV_TRUST_SHARDED,
    resume_from,
    resume_step,
)
from airflow_torchrun.worker.checkpoint.load import load_checkpoint
from airflow_torchrun.worker.checkpoint.save import save_checkpoint, wait_for_checkpoint
from airflow_torchrun.worker.checkpoint.stop import STOPPED_TO_SAVE_EXIT_CODE, save_if_stopping, stop_requested

__all__ = [
    "ENV_CHECKPOINT_URI",
    "ENV_KEEP_LAST",
    "ENV_LINEAGE",
    "ENV_RESUME_FROM",
    "ENV_STORAGE_OPTIONS",
    "ENV_TRUST_SHARDED",
    "STOPPED_TO_SAVE_EXIT_CODE",
    "load_checkpoint",
    "resume_from",
    "resume_step",
    "save_checkpoint",
    "save_if_stopping",
    "stop_requested",
    "wait_for_checkpoint",
]
