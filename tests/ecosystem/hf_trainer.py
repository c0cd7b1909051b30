"""A Hugging Face Trainer script in the style of transformers' examples: a tiny BERT built from a
config (nothing downloaded), command line parsed by ``HfArgumentParser`` into ``TrainingArguments``,
resuming from the last ``checkpoint-N`` in ``--output_dir`` as the examples do.

``--torchrun_store`` switches to the airflow-torchrun integration (its two lines are below). The
only test hook: with ``FAIL_ONCE_MARKER`` set, rank 1 is killed at ``FAIL_ONCE_AT_STEP`` the first
time.
"""

import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint


@dataclass
class ScriptArguments:
    torchrun_store: bool = field(default=False, metadata={"help": "save and resume through airflow-torchrun"})
    samples: int = field(default=64)


class ToyTokens(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 60, (n, 16), generator=g)
        self.labels = (self.ids.sum(dim=1) % 2).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(16, dtype=torch.long), "labels": self.labels[i]}


class Report(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        print(f"START global_step={state.global_step} world_size={args.world_size}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        marker = os.environ.get("FAIL_ONCE_MARKER")
        at = int(os.environ.get("FAIL_ONCE_AT_STEP", "-1"))
        if marker and state.global_step == at and args.process_index == 1 and not Path(marker).exists():
            Path(marker).write_text("failed once")
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_end(self, args, state, control, **kwargs):
        print(f"END global_step={state.global_step} world_size={args.world_size}", flush=True)


def main() -> None:
    script_args, training_args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    config = BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=2,
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    callbacks: list = [Report()]
    if script_args.torchrun_store:
        from airflow_torchrun.integrations.transformers import TorchrunCallback, resume_checkpoint

        callbacks.append(TorchrunCallback())
    trainer = Trainer(
        model=model, args=training_args, train_dataset=ToyTokens(script_args.samples), callbacks=callbacks
    )
    if script_args.torchrun_store:
        resume = resume_checkpoint(training_args.output_dir)
    else:
        out = training_args.output_dir
        resume = get_last_checkpoint(out) if out and os.path.isdir(out) else None
    trainer.train(resume_from_checkpoint=resume)


if __name__ == "__main__":
    main()
