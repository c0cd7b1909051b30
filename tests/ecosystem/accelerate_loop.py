"""A training loop in accelerate's style (as in accelerate's examples): ``Accelerator()``,
``prepare``, ``accelerator.backward``, ``gather`` for the metric. Nothing in it knows about
Airflow; launched by torchrun it reads torchrun's variables (on CPU only with
``ACCELERATE_USE_CPU=1``)."""

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    accelerator = Accelerator()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=g)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.print(f"START num_processes={accelerator.num_processes} distributed={accelerator.distributed_type}")
    for epoch in range(2):
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
        losses = accelerator.gather(loss.detach().reshape(1))
        accelerator.print(f"epoch {epoch} mean loss over {losses.numel()} process(es): {losses.mean().item():.4f}")
    accelerator.wait_for_everyone()
    accelerator.print(f"END num_processes={accelerator.num_processes}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
