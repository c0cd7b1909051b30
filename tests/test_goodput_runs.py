"""The resume audit and the goodput ledger on real groups through ``dag.test()``: DDP at world size 4
with and without primed buckets, and a script that replays its epoch after a resume.

A rank is killed once, mid-run; the in-try restart (``max_restarts=1``) resumes from the last committed
checkpoint and recomputes the steps past it, which the audit compares with the ones reported before.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.conftest import _SESSION_DIR

pytestmark = pytest.mark.slow

# Linear-ReLU-Linear with SGD and momentum, data a function of (step, rank): a job whose DDP gradient
# buckets change order after the first step unless primed.
DDP_SCRIPT = textwrap.dedent(
    """
    import hashlib, os
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from airflow_torchrun.worker import (
        ProgressLogger, load_checkpoint, prime_ddp_buckets, resume_step, save_checkpoint, save_if_stopping,
    )

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = load_checkpoint()
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    start = resume_step()
    ddp = DistributedDataParallel(model)

    def batch(step):
        g = torch.Generator().manual_seed(step * 1000 + rank)
        return torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)

    if os.environ.get("PRIME") == "1":
        prime_ddp_buckets(ddp, batch(0)[0])
    steps, save_at, fail_at = int(os.environ["STEPS"]), int(os.environ["SAVE_AT"]), int(os.environ["FAIL_AT"])
    progress = ProgressLogger(steps, start_step=start, every=10)
    for step in range(start + 1, steps + 1):
        if step == fail_at and rank == dist.get_world_size() - 1 and start == 0:
            os.kill(os.getpid(), 9)  # once: the restart resumed from SAVE_AT, past 0
        x, y = batch(step)
        optimizer.zero_grad(set_to_none=True)
        loss = ((ddp(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        progress.update(step, loss=loss.item())
        state_fn = lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        save_if_stopping(state_fn, step)
        if step == save_at:
            save_checkpoint(state_fn(), step)
    if rank == 0:
        digest = hashlib.sha256(b"".join(v.numpy().tobytes() for _, v in sorted(model.state_dict().items())))
        print("FINAL", digest.hexdigest(), flush=True)
    dist.destroy_process_group()
    """
)

# Trains from a ShardLoader but, after a resume, starts its epoch from zero: the bug the audit exists for.
REPLAY_SCRIPT = textwrap.dedent(
    """
    import os
    import numpy as np
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from airflow_torchrun.worker import (
        ProgressLogger, ShardLoader, load_checkpoint, resume_step, save_checkpoint, save_if_stopping,
    )

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    rows = np.random.default_rng(rank).normal(size=(640, 8)).astype("float32")
    loader = ShardLoader({"x": rows, "y": rows.sum(axis=1, keepdims=True)}, batch_size=16, seed=0, rank=rank)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    state = load_checkpoint()
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if os.environ.get("RESTORE_POSITION") == "1":
            loader.load_state_dict(state["data"])
    start = resume_step()
    ddp = DistributedDataParallel(model)
    progress = ProgressLogger(40, start_step=start, every=10)
    step = start
    for batch in loader:  # one epoch of 40 batches; after a resume it begins again at batch 0
        step += 1
        if step > 40:
            break
        if step == 30 and rank == 1 and start == 0:
            os.kill(os.getpid(), 9)
        if step == 35 and rank == 1 and start > 0 and os.environ.get("FAIL_AFTER_RESUME") == "1":
            raise SystemExit(3)
        optimizer.zero_grad(set_to_none=True)
        loss = ((ddp(torch.as_tensor(batch["x"])) - torch.as_tensor(batch["y"])) ** 2).mean()
        loss.backward()
        optimizer.step()
        progress.update(step, loss=loss.item())
        state_fn = lambda: {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "data": loader.state_dict()
        }
        save_if_stopping(state_fn, step)
        if step == 20:
            save_checkpoint(state_fn(), step)
    dist.destroy_process_group()
    """
)


def _script(name: str, text: str) -> Path:
    path = _SESSION_DIR / "scripts" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize("prime", [True, False], ids=["primed", "unprimed"])
def test_ddp_at_world_size_4_resumes_exactly_with_primed_buckets(run_dag, prime: bool) -> None:
    script = _script("ddp_world4.py", DDP_SCRIPT)
    env = {"STEPS": "40", "SAVE_AT": "5", "FAIL_AT": "36", "PRIME": "1" if prime else "0"}
    result = run_dag(
        f"""
        DistributedTrainingOperator(task_id="train", script={str(script)!r}, num_nodes=2, nproc_per_node=2,
                                    env={env!r} | {{"AIRFLOW_TORCHRUN_PROGRESS_INTERVAL": "0.2"}},
                                    track=False, max_restarts=1, retries=0)
        """
    )
    assert result.state == "success", result.log[-4000:]
    audit = result.xcom("train", key="resume_audit")
    assert audit is not None, result.log[-4000:]
    assert audit["resumed_step"] == 5 and audit["compared"] >= 4 * 20, audit
    if prime:
        assert audit["status"] == "exact", audit
        assert "Resume audit (resumed from step 5): exact" in result.log
    else:  # float rounding in another summation order: never bit-exact, never another computation
        assert audit["status"] in ("close", "diverged"), audit
        assert audit["first_difference"]["step"] > 5, audit
    goodput = result.xcom("train", key="goodput")
    this = goodput["try"]
    assert this["launches"] == 2 and this["lost_steps"] >= 25, this
    assert abs(sum(this["categories"].values()) - this["wall_s"]) <= 0.02 * this["wall_s"], this


@pytest.mark.parametrize(
    ("restore", "fail_after"),
    [(False, False), (True, False), (False, True)],
    ids=["replays-its-epoch", "restores-its-position", "replays-then-fails"],
)
def test_a_script_that_replays_its_epoch_after_a_resume_is_caught(run_dag, restore: bool, fail_after: bool) -> None:
    # replays-then-fails: the resumed launch diverges, then a rank fails at step 35; the divergence
    # still fails the task without a retry (a retry would resume from the diverged run's checkpoint).
    script = _script("replay_epoch.py", REPLAY_SCRIPT)
    env = {
        "RESTORE_POSITION": "1" if restore else "0",
        "AIRFLOW_TORCHRUN_PROGRESS_INTERVAL": "0.2",
        "FAIL_AFTER_RESUME": "1" if fail_after else "0",
    }
    result = run_dag(
        f"""
        DistributedTrainingOperator(task_id="train", script={str(script)!r}, num_nodes=2, nproc_per_node=1,
                                    env={env!r}, track=False, max_restarts=1, retries=1, resume_audit="fail")
        """
    )
    audit = result.xcom("train", key="resume_audit")
    assert audit is not None, result.log[-4000:]
    if restore:
        assert result.state == "success", result.log[-4000:]
        assert audit["status"] == "exact", audit
        return
    assert result.state == "failed", result.log[-4000:]
    assert audit["status"] == "diverged" and audit["first_divergence"]["step"] == 21, audit
    assert "diverged at step 21" in result.log and "resume_audit='fail'" in result.log
    assert result.try_number("train") == 1, "a diverged resume is not retried: the retry would resume from it"
