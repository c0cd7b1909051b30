"""A LightningCLI script as users write them: a BoringModel-style model on random data.

Nothing in it knows about Airflow. The only test hook: with ``FAIL_ONCE_MARKER`` set, rank 1 is
killed at ``FAIL_ONCE_AT_STEP`` the first time (the marker file records that it happened).
"""

import os
import signal
from pathlib import Path

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, Dataset


class RandomDataset(Dataset):
    def __init__(self, size: int = 32, length: int = 64) -> None:
        self.data = torch.randn(length, size, generator=torch.Generator().manual_seed(0))

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]

    def __len__(self) -> int:
        return len(self.data)


class BoringModel(LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(32, 2)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        fail_at = int(os.environ.get("FAIL_ONCE_AT_STEP", "-1"))
        marker = os.environ.get("FAIL_ONCE_MARKER")
        if marker and self.global_step == fail_at and self.global_rank == 1 and not Path(marker).exists():
            Path(marker).write_text("failed once")
            os.kill(os.getpid(), signal.SIGKILL)
        loss = self.layer(batch).sum()
        self.log("loss", loss)
        return loss

    def on_train_start(self) -> None:
        print(f"START global_step={self.global_step} world_size={self.trainer.world_size}", flush=True)

    def on_train_end(self) -> None:
        print(f"END global_step={self.global_step} weight_sum={self.layer.weight.sum().item():.6f}", flush=True)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(), batch_size=4)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.layer.parameters(), lr=self.hparams.lr)


if __name__ == "__main__":
    LightningCLI(BoringModel)
