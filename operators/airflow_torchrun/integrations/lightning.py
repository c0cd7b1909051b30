"""Lightning: save through the checkpoint store, resume from ``TRAIN_RESUME_FROM``.

Add it without editing a ``LightningCLI`` script::

    script_args=["fit", "--trainer.callbacks+=airflow_torchrun.integrations.lightning.TorchrunCheckpoint",
                 "--trainer.callbacks.every_n_train_steps=50"]

or ``Trainer(callbacks=[TorchrunCheckpoint(every_n_train_steps=50)])`` in code. Every
``every_n_train_steps`` optimizer steps (and when training ends) every rank hands Lightning's own
checkpoint dictionary (model, optimizers, schedulers, loops, callbacks: what ``trainer.save_checkpoint``
writes) to :func:`airflow_torchrun.worker.save_checkpoint`: rank 0 writes it, the commit marker comes
last, the lineage is recorded, old steps are pruned. On a retry, when ``TRAIN_RESUME_FROM`` names a
committed step, the callback loads it (verified) in ``setup`` and Lightning restores from it exactly
as from ``ckpt_path``: the model and callbacks before the strategy's setup, optimizers and loop
progress after. A ``ckpt_path`` given to ``fit`` wins over it.

Tested with Lightning 2.6. It uses the trainer's checkpoint connector (``dump_checkpoint``, the
pre-loaded checkpoint), the same calls ``trainer.save_checkpoint`` and ``ckpt_path`` make.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

log = logging.getLogger(__name__)


class TorchrunCheckpoint(Callback):
    """Save Lightning's checkpoint through the airflow-torchrun store; resume from ``TRAIN_RESUME_FROM``.

    :param every_n_train_steps: save every this many optimizer steps (``trainer.global_step``);
        0: only when training ends.
    :param save_on_train_end: save the last step when ``fit`` ends.
    :param weights_only: ``torch.load``'s safe mode when resuming (tensors, numbers, strings,
        containers); set False only for a store you trust whose checkpoints hold other objects
        (e.g. hyper-parameters that are arbitrary classes).
    """

    def __init__(
        self, every_n_train_steps: int = 50, save_on_train_end: bool = True, weights_only: bool = True
    ) -> None:
        if every_n_train_steps < 0:
            raise ValueError(f"every_n_train_steps must be >= 0, got {every_n_train_steps}")
        self.every_n_train_steps = every_n_train_steps
        self.save_on_train_end = save_on_train_end
        self.weights_only = weights_only
        self.resumed_from: str | None = None
        self._last_saved: int | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        from airflow_torchrun.worker.checkpoint import load_checkpoint, resume_from, resume_step

        if not resume_from():
            return
        state = load_checkpoint(weights_only=self.weights_only)  # every rank; verified, RNG restored
        if state is None:  # the one named was damaged and nothing earlier verifies
            return
        # Restored by the trainer right after the setup hooks, as from ``fit(ckpt_path=...)``.
        trainer._checkpoint_connector._loaded_checkpoint = state
        self.resumed_from = resume_from()
        self._last_saved = resume_step()
        if trainer.is_global_zero:
            log.info("Resuming Lightning from %s (global step %s)", self.resumed_from, state.get("global_step"))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        step = trainer.global_step
        if self.every_n_train_steps and step > 0 and step % self.every_n_train_steps == 0:
            self._save(trainer, step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.save_on_train_end and trainer.global_step > 0:
            self._save(trainer, trainer.global_step)

    def _save(self, trainer: Trainer, step: int) -> None:
        if step == self._last_saved:  # gradient accumulation: several batches end one step
            return
        from airflow_torchrun.worker.checkpoint import save_checkpoint

        state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)  # every rank
        save_checkpoint(state, step, meta={"framework": "lightning", "epoch": trainer.current_epoch})
        self._last_saved = step
