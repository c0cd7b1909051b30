"""The example trainer (``images/trainer/train.py``) as the resume and restart tests run it.

Small and quick: 2 epochs of digits on 2 ranks, a checkpoint every 10 steps. It prints
``FINAL ... weights_sha256=<digest>``; a run that loses a rank and resumes must end with the
digest of the same job run without a failure (the session fixture ``uninterrupted``).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAINER = ROOT / "images" / "trainer" / "train.py"
ARGS = ["--epochs", "2", "--batch-size", "32", "--checkpoint-every", "10", "--log-every", "10"]
IMPORTS = "from datetime import timedelta"
DIGEST = re.compile(r"FINAL step=(\d+) weights_sha256=([0-9a-f]{64})")


def train_task(extra_args: list[str], **kwargs: object) -> str:
    """The training task's source (inside ``with DAG(...)``): the trainer with ``extra_args``."""
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return f"""
    DistributedTrainingOperator(
        task_id="train", script={str(TRAINER)!r}, num_nodes=2, nproc_per_node=1,
        script_args={[*ARGS, *extra_args]!r}, retry_delay=timedelta(0), {args}
    )
    """


def digest(log: str) -> str:
    """The final weights' digest the trainer printed last."""
    found = DIGEST.findall(log)
    assert found, "the trainer printed no FINAL line"
    return str(found[-1][1])
