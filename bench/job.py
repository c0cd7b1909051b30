"""The one training job every launcher in the benchmarks runs: bare ``torchrun``, the operator,
``torchrun --max-restarts`` and Ray Train's ``TorchTrainer`` (which calls :func:`train`).

A DDP MLP on fixed random data (gloo, CPU). Only torch and the standard library: it runs in the
Ray virtualenv as well. Driven by environment variables, so that every launcher passes the same:

- ``STEPS``: training steps; ``CKPT_EVERY``: rank 0 saves model + optimizer + step to ``CKPT``
  (``torch.save``, write then rename) every N steps; a new incarnation resumes from it;
- ``EVENTS``: rank 0 appends one JSON line ``{"event", "t", "step"}`` per moment of an incarnation
  (``time.time()``, the clock the harness reads): ``started`` (the script began, before its
  imports), ``joined`` (the process group stood), ``first_step`` (it trained its first step) and
  ``last_step``; at its first step rank 0 also prints a progress record (the operator's watch reads
  it: ``airflow_torchrun.contract.progress``, written out here as the job imports only torch);
- ``KILL_AT``/``KILL_MARK``: rank 1 SIGKILLs itself at that step, once: it first writes the time of
  death to ``KILL_MARK``; a later incarnation that finds the file trains on;
- ``PIDS``: a directory where each rank leaves its pid (so a harness can reap a hung group: torchrun
  starts its workers in sessions of their own).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def _append(path: str, record: dict[str, object]) -> None:
    with open(path, "a") as fp:
        fp.write(json.dumps(record) + "\n")


_STARTED = time.time()
PROGRESS_MARKER = "@torchrun-progress "  # airflow_torchrun.contract.progress.MARKER


def train() -> None:
    import torch
    import torch.distributed as dist

    if os.environ.get("PIDS"):  # before the rendezvous: a re-initialisation may hang in it
        Path(os.environ["PIDS"], f"{os.getpid()}").write_text(os.environ.get("RANK", "?"))
    if not dist.is_initialized():  # Ray Train has set the process group up already
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    events = os.environ.get("EVENTS", "")
    if rank == 0 and events:
        _append(events, {"event": "started", "t": _STARTED, "step": None})
        _append(events, {"event": "joined", "t": time.time(), "step": None})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(512, 64), torch.randint(0, 10, (512,))
    ckpt, every = os.environ.get("CKPT", ""), int(os.environ.get("CKPT_EVERY", "0"))
    start = 0
    if ckpt and os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
    kill_at, mark = int(os.environ.get("KILL_AT", "-1")), os.environ.get("KILL_MARK", "")
    step = start
    for step in range(start + 1, int(os.environ["STEPS"]) + 1):
        if step == kill_at and rank == 1 and mark and not os.path.exists(mark):
            Path(mark).write_text(repr(time.time()))
            os.kill(os.getpid(), 9)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        if rank == 0 and step == start + 1:
            now = time.time()
            print(PROGRESS_MARKER + json.dumps({"rank": 0, "step": step, "time": now}), flush=True)
            if events:
                _append(events, {"event": "first_step", "t": now, "step": step})
        if rank == 0 and ckpt and every and step % every == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    if rank == 0 and events:
        _append(events, {"event": "last_step", "t": time.time(), "step": step})
    if os.environ.get("DESTROY", "1") == "1":
        dist.destroy_process_group()


def job_events(events: Path, kind: str | None = None) -> list[dict[str, float]]:
    """Every record the job wrote (of one ``kind``), in order (none while the file is absent)."""
    if not events.exists():
        return []
    found = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    return [e for e in found if kind is None or e.get("event") == kind]


def first_steps(events: Path) -> list[dict[str, float]]:
    """Every ``first_step`` record the job wrote, in order (none while the file is absent)."""
    return job_events(events, "first_step")


if __name__ == "__main__":
    train()
