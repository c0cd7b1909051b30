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
    # The flags' all-reduce sent at the last check (its work, its tensor), read at the next one,
    # on this group (another process group starts the checks over).
    group: Any = None
    sent: tuple[Any, torch.Tensor] | None = None
    skip: int = 0  # calls left before the next check (the same on every rank)
    every: int = 1  # calls from the last check to the next one
    checked_at: float | None = None  # time.monotonic() of this rank's last check


# The ranks check the flags about this often, every step when a step takes longer, and at least
# every MAX_CALLS_BETWEEN_CHECKS steps (a pace that slows down after a fast stretch is met soon).
CHECK_EVERY_S = 0.05
MAX_CALLS_BETWEEN_CHECKS = 16


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


def _agreed_before(group: Any, mine: int) -> int:
    """At a check: send this rank's flag with the calls it proposes until the next check (as many
    as take about :data:`CHECK_EVERY_S` at its pace), and return the ranks' agreement on what they
    sent at the check before: any flag raised, the fewest calls proposed. The first check has
    nothing to read (0; the next call checks again), nor has a call between checks (0). Every rank
    reads the same agreement at the same call, so every rank checks, and acts, at the same calls:
    the all-reduces are issued in the same order on one group of their own."""
    if group is not _STOP.group:
        _STOP.group, _STOP.sent, _STOP.skip, _STOP.every, _STOP.checked_at = group, None, 0, 1, None
    if _STOP.skip > 0:
        _STOP.skip -= 1
        return 0
    now = time.monotonic()
    propose = 1
    if _STOP.checked_at is not None:
        pace = max(now - _STOP.checked_at, 1e-9) / _STOP.every
        propose = max(1, min(MAX_CALLS_BETWEEN_CHECKS, int(CHECK_EVERY_S / pace)))
    _STOP.checked_at = now
    # MAX over (flag, -calls): any flag, the fewest calls.
    tensor = torch.tensor([mine, -propose], dtype=torch.int64)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)
    sent, _STOP.sent = _STOP.sent, (work, tensor)
    if sent is None:  # the first check since the reset above: every is 1
        return 0
    sent[0].wait()
    flag = int(sent[1][0].item())
    # Bounded whatever a peer sent: every rank computes the same from the same agreement.
    every = min(MAX_CALLS_BETWEEN_CHECKS, max(1, -int(sent[1][1].item())))
    _STOP.every, _STOP.skip = every, every - 1
    return 1 if flag else 0


def save_if_stopping(state: Mapping[str, Any] | Any, step: int, **save_kwargs: Any) -> None:
    """Call at every step boundary, on every rank: when the group is asked to stop, save and exit.

    The first call makes SIGTERM (an eviction or preemption with its grace period, a teardown
    before a relaunch, the task being killed) only *note* the request. The ranks agree on one flag,
    one check behind: a check sends this rank's flag (a small all-reduce that runs while training
    goes on) and reads what the ranks sent at the check before. Checks come about every 50 ms, and
    at every step when steps are longer (never more than 16 steps apart). Once any rank was
    signalled, every rank saves checkpoint ``step`` at the same call (:func:`save_checkpoint`,
    blocking, marker ``"stopped": true``) and the process exits with
    :data:`STOPPED_TO_SAVE_EXIT_CODE` (75); the retry or relaunch resumes from that step, so no
    finished step is lost. ``state``: the state to save, or a callable returning it (only called
    when saving). A script that never calls it is stopped by SIGTERM as before. The save (which
    comes up to two checks after the signal) must finish within the grace period
    (``teardown_grace`` locally, the runtime's termination grace period on Kubernetes).

    Waiting for the flags at every step instead cost the example trainer (2 gloo ranks on 2
    cores, 3 ms steps) a quarter of its training time: 0.53 s of 2.08 s.
    """
    if not _STOP.installed:
        _install_stop_handler()
    comm = checkpoint_comm()  # collective on first use: create the groups now, while the store is up
    group = stop_group()
    flag = 1 if _STOP.signalled_at is not None else 0
    if group is not None:
        flag = _agreed_before(group, flag)
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
    wait_for_checkpoint()  # the files of the steps its retention pruned: this exit joins no thread
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
