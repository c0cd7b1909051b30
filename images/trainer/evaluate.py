"""Evaluate a checkpoint of ``train.py`` (the digits MLP): accuracy and loss on held-out data.

Run by ``EvaluateModelOperator`` (1 rank by default, any number works): ``TRAIN_RESUME_FROM`` names
the checkpoint, ``load_checkpoint()`` returns it. The held-out data is the sharding task's
evaluation split when ``TRAIN_SHARD_MANIFEST`` is set, else the trainer's own test split. Rank 0
reports ``accuracy``, ``loss`` and ``samples`` with ``report_metrics()``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import MLP, load_data

from airflow_torchrun.worker import load_checkpoint
from airflow_torchrun.worker.metrics import report_metrics


def held_out(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    if os.environ.get("TRAIN_SHARD_MANIFEST"):
        from airflow_torchrun.worker.shards import load_eval_split

        split = load_eval_split()
        return torch.as_tensor(split["x"], dtype=torch.float32), torch.as_tensor(split["y"], dtype=torch.int64)
    _, test = load_data(seed)
    x, y = test.tensors
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of the trainer's split (no shard manifest)")
    args = parser.parse_args()

    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    state = load_checkpoint()
    if state is None:
        raise SystemExit("no checkpoint to evaluate: TRAIN_RESUME_FROM is empty")
    weights = state["model"]
    model = MLP(hidden=weights["net.0.weight"].shape[0])
    model.load_state_dict(weights)
    model.eval()

    x, y = held_out(args.seed)
    # Each rank scores a strided slice; the sums are all-reduced.
    mine = slice(rank, None, world)
    with torch.no_grad():
        logits = model(x[mine])
        totals = torch.tensor(
            [
                float((logits.argmax(dim=1) == y[mine]).sum()),
                float(nn.functional.cross_entropy(logits, y[mine], reduction="sum")),
                float(len(y[mine])),
            ],
            dtype=torch.float64,
        )
    if distributed:
        dist.all_reduce(totals)
    correct, loss_sum, count = totals.tolist()
    metrics = {"accuracy": correct / count, "loss": loss_sum / count, "samples": count}
    if rank == 0:
        print(f"EVAL accuracy={metrics['accuracy']:.4f} loss={metrics['loss']:.4f} samples={int(count)}", flush=True)
        report_metrics(metrics)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
