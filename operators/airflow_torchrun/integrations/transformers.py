"""Hugging Face Trainer: save through the checkpoint store, resume from ``TRAIN_RESUME_FROM``.

Two lines in a Trainer script (the Trainer has no command-line way to add a callback)::

    from airflow_torchrun.integrations.transformers import TorchrunCallback, resume_checkpoint

    trainer = Trainer(..., callbacks=[TorchrunCallback()])
    trainer.train(resume_from_checkpoint=resume_checkpoint(training_args.output_dir))

Each time the Trainer saves (``save_strategy``/``save_steps``), :class:`TorchrunCallback` puts
that ``checkpoint-N`` directory (weights, optimizer, scheduler, every rank's RNG state, trainer
state) into the store as step ``N``: every rank calls :func:`airflow_torchrun.worker.save_checkpoint`,
rank 0's copy of the files is written, the commit marker comes last. :func:`resume_checkpoint`
loads the committed step ``TRAIN_RESUME_FROM`` names (verified), writes its files back as
``<output_dir>/checkpoint-N`` (on every node, so local disks work) and returns that path; None on a
fresh start, which ``trainer.train`` takes as "from scratch". ``output_dir`` may be any local
directory, a temporary one included: the store is what survives.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

_FORMAT = "transformers-checkpoint-dir"


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _read_dir(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


class TorchrunCallback(TrainerCallback):
    """Copies each ``checkpoint-N`` the Trainer saves into the airflow-torchrun checkpoint store."""

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        from airflow_torchrun.worker.checkpoint import save_checkpoint

        step = int(state.global_step)
        folder = Path(str(args.output_dir)) / f"checkpoint-{step}"
        _barrier()  # every rank wrote its rng_state_<rank>.pth
        files = _read_dir(folder) if _rank() == 0 else {}
        save_checkpoint({"format": _FORMAT, "files": files}, step, meta={"framework": "transformers"})


def resume_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The ``checkpoint-N`` directory to pass to ``trainer.train(resume_from_checkpoint=...)``, written
    from the store's committed step; None on a fresh start. Called by every rank."""
    from airflow_torchrun.worker.checkpoint import load_checkpoint, resume_step

    state = load_checkpoint()
    if state is None:
        return None
    if state.get("format") != _FORMAT:
        raise ValueError(
            f"the checkpoint to resume from ({os.environ.get('TRAIN_RESUME_FROM')}) was not saved by "
            "TorchrunCallback; load it with airflow_torchrun.worker.load_checkpoint() instead"
        )
    target = Path(output_dir) / f"checkpoint-{resume_step()}"
    # The names come from the checkpoint, which whoever can write the store chose: every one must
    # land inside the target, checked for all before any is written.
    files = {_inside(target, name): data for name, data in state["files"].items()}
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # ranks sharing a disk write the same bytes: the last rename wins
    _barrier()
    return str(target)


def _inside(target: Path, name: object) -> Path:
    """``target / name`` when ``name`` is a relative path that stays inside ``target``; raises otherwise."""
    parts = PurePosixPath(name).parts if isinstance(name, str) and "\0" not in name else ()
    if not parts or PurePosixPath(str(name)).is_absolute() or ".." in parts:
        raise ValueError(
            f"the checkpoint to resume from ({os.environ.get('TRAIN_RESUME_FROM')}) names a file {name!r} outside "
            f"{target}; none of its files was written. TorchrunCallback never writes such a name: resume from "
            "another checkpoint (resume=...), or remove this one from the store"
        )
    path = target.joinpath(*parts)
    # A symbolic link already inside the target could still lead out of it.
    if not path.resolve().is_relative_to(target.resolve()):
        raise ValueError(f"{path} resolves outside {target} (through a symbolic link); none of the files was written")
    return path
