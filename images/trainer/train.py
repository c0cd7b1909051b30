"""Example torchrun training script: an MLP on scikit-learn's bundled digits, exactly resumable.

Runs as an ordinary torchrun script, with or without Airflow::

    torchrun --standalone --nproc-per-node 2 images/trainer/train.py --epochs 10

When ``TRAIN_CHECKPOINT_URI`` is set (the operator sets it) it checkpoints every
``--checkpoint-every`` steps (``auto``: ``worker.should_checkpoint``, Young/Daly from the measured save
cost and the MTBF) and resumes from ``TRAIN_RESUME_FROM``. Every resume is bit-identical to the
uninterrupted run, at any world size: the data comes from a ``worker.shards.ShardLoader`` (an order
that is a function of (seed, epoch, rank), its position saved in every checkpoint and restored), and
DDP's gradient buckets are primed before the first step (``worker.prime_ddp_buckets``: a fresh DDP
otherwise sums its first step's gradients in another order than a long-running one, which changes the
last bits at world size 3 or more). The last line on rank 0 is::

    FINAL step=<n> weights_sha256=<hex> test_accuracy=<acc>

``--fail-at-step N --fail-rank R --fail-mode {exit,kill}`` makes rank R fail when it reaches step N
on a run that started before N (a fresh start, or a resume from an earlier step). With checkpointing
on, the failure is recorded next to the checkpoints (``simulated-failure-at-step-N``) and happens only
once, so a retry that resumes from an earlier checkpoint gets past it.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import random
import signal
import sys
import time
from typing import TYPE_CHECKING

# Deterministic cuBLAS needs this before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

from airflow_torchrun.worker import (
    ProgressLogger,
    ShardLoader,
    load_checkpoint,
    prime_ddp_buckets,
    resume_step,
    save_checkpoint,
    save_if_stopping,
    should_checkpoint,
    wait_for_checkpoint,
)
from airflow_torchrun.worker.tracking import RunLogger, StepTimer

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

log = logging.getLogger("train")


AUTO = "auto"


def _interval(text: str) -> int | str:
    return AUTO if text == AUTO else int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10, help="passes over the training split (default 10)")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per rank (default 32)")
    parser.add_argument("--hidden", type=int, default=128, help="width of the two hidden layers (default 128)")
    parser.add_argument(
        "--checkpoint-every",
        type=_interval,
        default=50,
        help="save a checkpoint every N steps (default 50; 0: only at the end; auto: should_checkpoint)",
    )
    parser.add_argument(
        "--async-checkpoint",
        action="store_true",
        help="write checkpoints in a background thread while training goes on",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, the split and the data order")
    parser.add_argument("--log-every", type=int, default=20, help="progress line every N steps on rank 0")
    parser.add_argument(
        "--fail-at-step", type=int, default=None, help="simulate a failure when reaching this step (0: never)"
    )
    parser.add_argument("--fail-rank", type=int, default=0, help="the rank that fails (default 0)")
    parser.add_argument(
        "--fail-mode", choices=("exit", "kill"), default="exit", help="exit with an error, or SIGKILL the rank"
    )
    parser.add_argument("--output", default=None, help="where rank 0 writes the final weights (path or fsspec URI)")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "hidden", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.checkpoint_every != AUTO and args.checkpoint_every < 0:
        parser.error("--checkpoint-every must be 0 or more, or auto")
    if args.fail_at_step is not None and args.fail_at_step < 0:
        parser.error("--fail-at-step must be 0 (no failure) or more")
    if args.fail_at_step == 0:
        args.fail_at_step = None
    return args


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def load_data(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """The digits (1797 8x8 images, shipped with scikit-learn), split 80/20 by a seeded permutation."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def rank_rows(rank: int, world_size: int, seed: int) -> dict[str, np.ndarray]:
    """This rank's training rows: its shard of the sharding task's manifest (``TRAIN_SHARD_MANIFEST``),
    else every ``world_size``-th row of the digits' training split."""
    if os.environ.get("TRAIN_SHARD_MANIFEST"):
        from airflow_torchrun.worker.shards import load_shard

        shard = load_shard(rank=rank, world_size=world_size)
        return {"x": np.asarray(shard["x"], dtype=np.float32), "y": np.asarray(shard["y"], dtype=np.int64)}
    train, _ = load_data(seed)
    x, y = train.tensors
    return {"x": x[rank::world_size].numpy(), "y": y[rank::world_size].numpy()}


def weights_digest(model: nn.Module) -> str:
    """SHA-256 over every parameter and buffer, in name order: equal digests = bit-identical weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _failure_marker(step: int) -> tuple[AbstractFileSystem, str] | None:
    """Where a simulated failure is recorded so that it happens once per checkpoint location."""
    root = os.environ.get("TRAIN_CHECKPOINT_URI", "").strip()
    if not root:
        return None
    from airflow_torchrun.storage.checkpoints import CheckpointStore

    store = CheckpointStore(root)
    return store.fs, f"{store.location.path}/simulated-failure-at-step-{step:08d}"


def maybe_fail(args: argparse.Namespace, step: int, start_step: int, rank: int) -> None:
    """Fail at --fail-at-step once: not when this run resumed at or past it, and not again after a
    retry (recorded next to the checkpoints), so that an Airflow retry gets through."""
    if args.fail_at_step is None or step != args.fail_at_step or start_step >= step or rank != args.fail_rank:
        return
    marker = _failure_marker(step)
    if marker is not None:
        fs, path = marker
        if fs.exists(path):
            log.info("Step %d: the simulated failure already happened in an earlier try; going on", step)
            return
        fs.pipe_file(path, f"rank {rank} failed here ({args.fail_mode})\n".encode())
    log.warning("Simulated failure (%s) of rank %d at step %d", args.fail_mode, rank, step)
    sys.stdout.flush()
    sys.stderr.flush()
    if args.fail_mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(f"simulated failure of rank {rank} at step {step}")


def _due(every: int | str, step: int) -> bool:
    """Whether to checkpoint at ``step``: every N steps, never (0), or as ``should_checkpoint`` says."""
    if every == AUTO:
        return should_checkpoint(step)
    return bool(every) and step % int(every) == 0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    distributed = "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s",
    )
    # One GPU per rank (NCCL refuses two ranks on one device); otherwise train on CPU with gloo.
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() and local_world <= torch.cuda.device_count()
    if torch.cuda.is_available() and not use_cuda and rank == 0:
        log.warning(
            "%d ranks per node but %d GPU(s): training on CPU with gloo", local_world, torch.cuda.device_count()
        )
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if distributed:
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    world_size = dist.get_world_size() if distributed else 1
    torch.use_deterministic_algorithms(True)

    # Same seed on every rank: identical initial weights, as DDP expects.
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)

    _, test_set = load_data(args.seed)
    rows = rank_rows(rank, world_size, args.seed)
    # Every rank must take the same number of steps: the smallest shard decides.
    smallest = torch.tensor([len(rows["y"])])
    if distributed:
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    if int(smallest.item()) < args.batch_size:
        raise SystemExit(
            f"--batch-size {args.batch_size} is larger than the smallest rank's {int(smallest.item())} training rows; "
            "use a smaller batch size"
        )
    loader = ShardLoader(rows, batch_size=args.batch_size, seed=args.seed, rank=rank, num_samples=int(smallest.item()))
    if os.environ.get("TRAIN_SHARD_MANIFEST"):
        log.info("Data: %d rows of this rank's shard (%s)", len(rows["y"]), os.environ["TRAIN_SHARD_MANIFEST"])
    steps_per_epoch = len(loader)
    total_steps = args.epochs * steps_per_epoch

    model = MLP(args.hidden).to(device)
    ddp: nn.Module = model
    if distributed:
        ddp = DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
        # Rebuild DDP's gradient buckets before the first step (one pass of an example batch, no trace
        # left), so that a resumed launch sums every step's gradients in the order the uninterrupted run did.
        example = torch.as_tensor(rows["x"][: args.batch_size]).to(device)
        prime_ddp_buckets(ddp, example)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    checkpointing = bool(os.environ.get("TRAIN_CHECKPOINT_URI"))
    start_step = 0
    if checkpointing:
        state = load_checkpoint(map_location=device)
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start_step = resume_step()
            if "data" in state:  # where the data loader stood: epoch, offset, seed
                loader.load_state_dict(state["data"])
            else:  # a checkpoint of an older trainer: the position follows from the step
                loader.load_state_dict({"epoch": start_step // steps_per_epoch, "offset": start_step % steps_per_epoch})
            log.info("Resumed from %s at step %d", os.environ.get("TRAIN_RESUME_FROM"), start_step)
    if start_step > total_steps:
        raise SystemExit(f"the checkpoint is at step {start_step}, past the end of training ({total_steps} steps)")
    log.info(
        "Training: %d ranks, %d steps per epoch, %d epochs, %d steps, global batch %d, from step %d",
        world_size,
        steps_per_epoch,
        args.epochs,
        total_steps,
        args.batch_size * world_size,
        start_step,
    )

    def state_dict() -> dict[str, object]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "data": loader.state_dict()}

    progress = ProgressLogger(
        total_steps,
        start_step=start_step,
        every=args.log_every,
        samples_per_step=args.batch_size * world_size,
        logger=log,
        rank=rank,
    )
    tracker = RunLogger()  # rank 0 with MLFLOW_RUN_ID set logs; elsewhere every call is a no-op
    tracker.log_params({**vars(args), "world_size": world_size, "total_steps": total_steps})
    timer = StepTimer()
    checkpoint_time = 0.0
    started = time.monotonic()
    batches = iter(())
    step = start_step
    while step < total_steps:
        with timer.data():
            batch = next(batches, None)
            if batch is None:  # the epoch is done: the loader moves on to the next one
                batches = iter(loader)
                batch = next(batches)
        epoch = loader.epoch
        step += 1
        maybe_fail(args, step, start_step, rank)
        x, y = torch.as_tensor(batch["x"]).to(device), torch.as_tensor(batch["y"]).to(device)
        with timer.compute():
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(x), y)
            loss.backward()
            optimizer.step()
        progress.update(step, loss=loss.item())
        tracker.log_step(step, loss=loss.item(), samples=args.batch_size * world_size, timing=timer.lap())
        if checkpointing:
            # Asked to stop (SIGTERM)? Every rank saves this step and exits 75; the retry resumes here.
            save_if_stopping(state_dict, step, meta={"epoch": epoch})
        if checkpointing and step < total_steps and _due(args.checkpoint_every, step):
            tick = time.monotonic()
            save_checkpoint(state_dict(), step, blocking=not args.async_checkpoint, meta={"epoch": epoch})
            checkpoint_time += time.monotonic() - tick
    train_time = time.monotonic() - started
    if checkpointing:
        tick = time.monotonic()
        wait_for_checkpoint()
        save_checkpoint(state_dict(), total_steps, meta={"epoch": args.epochs, "final": True})
        checkpoint_time += time.monotonic() - tick

    accuracy = float("nan")
    if rank == 0:
        model.eval()
        with torch.no_grad():
            x_test, y_test = test_set.tensors
            predicted = model(x_test.to(device)).argmax(dim=1).cpu()
            accuracy = (predicted == y_test).float().mean().item()
        tracker.log_metrics({"test_accuracy": accuracy}, step=total_steps)
        tracker.log_loss_curve()
        tracker.log_model(model, input_example=test_set.tensors[0][:2].numpy(), pip_requirements=["torch"])
        if args.output:
            import fsspec

            with fsspec.open(args.output, "wb") as fp:
                torch.save(model.state_dict(), fp)
            log.info("Wrote final weights to %s", args.output)
        log.info(
            "Trained %d steps in %.2fs (of which checkpointing %.2fs, %.1f%%)",
            total_steps - start_step,
            train_time,
            checkpoint_time,
            100.0 * checkpoint_time / train_time if train_time > 0 else 0.0,
        )
        print(
            f"FINAL step={total_steps} weights_sha256={weights_digest(model)} test_accuracy={accuracy:.4f} "
            f"train_s={train_time:.3f} checkpoint_s={checkpoint_time:.3f}",
            flush=True,
        )
    tracker.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
