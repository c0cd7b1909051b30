"""Framework integrations: save through the checkpoint store and resume from ``TRAIN_RESUME_FROM``.

* :mod:`airflow_torchrun.integrations.lightning`: ``TorchrunCheckpoint``, a Lightning callback,
  addable without editing a ``LightningCLI`` script
  (``--trainer.callbacks+=airflow_torchrun.integrations.lightning.TorchrunCheckpoint``).
* :mod:`airflow_torchrun.integrations.transformers`: ``TorchrunCallback`` (a Hugging Face
  ``TrainerCallback``) and ``resume_checkpoint(output_dir)``.
* :mod:`airflow_torchrun.integrations.detect`: the Airflow side (no torch): a framework's own
  checkpoints (Lightning ``*.ckpt``, Trainer ``checkpoint-N/``, accelerate ``checkpoint_N/``)
  found under a task's checkpoint location, so the log and ``resumed_from`` tell the truth.

Each module imports its framework only when used; none of them is a required dependency (extra
``ecosystem``).
"""
