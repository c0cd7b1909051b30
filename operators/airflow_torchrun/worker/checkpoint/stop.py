"""Save on SIGTERM: the signal only notes the request; at the next step boundary every rank saves and exits 75."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from airflow_torchrun import contract
from airflow_torchrun.worker.checkpoint.comm import checkpoint_comm, stop_group
from airflow_torchrun.worker.checkpoint.save import save_checkpoint, wait_for_checkpoint

log = logging.getLogger(__name__)


# -- save on SIGTERM --------------------------------------------------------------------------
STOPPED_TO_SAVE_EXIT_CODE = contract.STOPPED_TO_SAVE_EXIT_CODE


@dataclass
class _StopRequest:
    installed: bool = False
    signalled_at: float | None = None  # time.time() of the first SIGTERM
    signum: int | None = None


_STOP = _StopRequest()


def _on_stop_signal(signum: int, _frame: Any) -> None:
    # Only note it: the ranks agree at the next step boundary, and save there.
    if _STOP.signalled_at is None:
        _STOP.signalled_at = time.time()
        _STOP.signum = signum


def _install_stop_handler() -> None:
    if _STOP.installed:
        return
    _STOP.installed = True
    if threading.current_thread() is not threading.main_thread():
        log.warning("save_if_stopping is not called from the main thread: SIGTERM cannot be caught, no save on stop")
        return
    signal.signal(signal.SIGTERM, _on_stop_signal)


def stop_requested() -> bool:
    """True once this rank received SIGTERM (after the first :func:`save_if_stopping` call)."""
    return _STOP.signalled_at is not None


def save_if_stopping(state: Mapping[str, Any] | Any, step: int, **save_kwargs: Any) -> None:
    """Call at every step boundary, on every rank: when the group is asked to stop, save and exit.

    The first call makes SIGTERM (an eviction or preemption with its grace period, a teardown
    before a relaunch, the task being killed) only *note* the request. Each call, the ranks agree
    on one flag (one small collective): if any rank was signalled, every rank saves checkpoint
    ``step`` (:func:`save_checkpoint`, blocking, marker ``"stopped": true``) and the process exits
    with :data:`STOPPED_TO_SAVE_EXIT_CODE` (75); the retry or relaunch resumes from that step, so
    at most the step in progress is lost. ``state``: the state to save, or a callable returning it
    (only called when saving). A script that never calls it is stopped by SIGTERM as before.
    The save must finish within the grace period (``teardown_grace`` locally, the runtime's
    termination grace period on Kubernetes).
    """
    if not _STOP.installed:
        _install_stop_handler()
    comm = checkpoint_comm()  # collective on first use: create the groups now, while the store is up
    group = stop_group()
    flag = 1 if _STOP.signalled_at is not None else 0
    if group is not None:
        tensor = torch.tensor([flag], dtype=torch.int32)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        flag = int(tensor.item())
    if not flag:
        return
    wait_for_checkpoint()
    payload = state() if callable(state) else state
    meta = {**dict(save_kwargs.pop("meta", None) or {}), "stopped": True}
    uri = save_checkpoint(payload, step, blocking=True, meta=meta, **save_kwargs)
    since = time.time() - _STOP.signalled_at if _STOP.signalled_at is not None else None
    if comm.rank == 0:
        log.warning(
            "Stopped to save: checkpoint %s (step %d) committed%s; exiting with code %d so that the retry resumes "
            "from it",
            uri,
            step,
            f" {since:.2f}s after SIGTERM" if since is not None else " (another rank was signalled)",
            STOPPED_TO_SAVE_EXIT_CODE,
        )
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # the peers may be gone already; the checkpoint is committed
            pass
    os._exit(STOPPED_TO_SAVE_EXIT_CODE)
