"""Save on SIGTERM: the example trainer under torchrun (2 real gloo ranks), SIGTERM to the agent at
a random step (torchrun forwards it to the workers), then a resumed run.

What must hold: the ranks agree at the next step boundary and commit that step (marker
``"stopped": true``) within the grace period, the ranks exit with the "stopped to save" code, no
completed step is lost, and the resumed run ends with the uninterrupted run's weights, bit for bit.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from airflow_torchrun.checkpoint import CheckpointStore
from airflow_torchrun.contract import STOPPED_TO_SAVE_EXIT_CODE
from airflow_torchrun.diagnosis import RankFailure

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
TRAINER = ROOT / "images" / "trainer" / "train.py"
# Long enough (about 1000 steps) to signal it in the middle; no periodic checkpoint at all, so the
# only step a resume can start from is the one saved on SIGTERM.
ARGS = [str(TRAINER), "--epochs", "40", "--hidden", "256", "--checkpoint-every", "0", "--log-every", "1"]
FINAL = re.compile(r"FINAL step=(\d+) weights_sha256=([0-9a-f]{64})")
PROGRESS = re.compile(r"rank0 train INFO step (\d+)/(\d+)")
GRACE_S = 10.0  # teardown_grace's default
CONTRACT_VARS = ("TRAIN_CHECKPOINT_URI", "TRAIN_RESUME_FROM", "TRAIN_CHECKPOINT_LINEAGE")


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CONTRACT_VARS}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def _torchrun_cmd() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *ARGS]


def _final(out: str) -> tuple[int, str]:
    match = FINAL.search(out)
    assert match, out[-5000:]
    return int(match.group(1)), match.group(2)


def test_sigterm_saves_the_next_step_and_the_resume_is_bit_identical(tmp_path: Path) -> None:
    straight = subprocess.run(
        _torchrun_cmd(),
        env=_env({"TRAIN_CHECKPOINT_URI": f"file://{tmp_path}/straight"}),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert straight.returncode == 0, straight.stderr[-5000:]
    total, digest = _final(straight.stdout + straight.stderr)

    root = f"file://{tmp_path}/stopped"
    target = random.Random().randint(50, total - 200)
    proc = subprocess.Popen(
        _torchrun_cmd(),
        env=_env({"TRAIN_CHECKPOINT_URI": root}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    seen: list[str] = []
    last_done = 0
    signalled_at = 0.0
    try:
        for line in proc.stdout:
            seen.append(line)
            match = PROGRESS.search(line)
            if match and int(match.group(1)) >= target:
                last_done = int(match.group(1))
                signalled_at = time.time()
                proc.send_signal(signal.SIGTERM)  # the agent; torchrun forwards it to its workers
                break
        assert signalled_at, "".join(seen)[-5000:]
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(seen) + rest
    assert proc.returncode != 0, out[-3000:]
    assert "FINAL" not in out

    store = CheckpointStore(root)
    committed = store.committed()
    assert len(committed) == 1, out[-5000:]
    saved = committed[0].step
    marker = store.read_marker(saved)
    assert marker["stopped"] is True and store.verify(saved) == []
    # The next step boundary after the signal: no completed step is lost (the one in flight at most).
    assert last_done <= saved <= last_done + 5, (last_done, saved)
    assert marker["committed_at"] - signalled_at < GRACE_S, marker["committed_at"] - signalled_at
    assert "Stopped to save: checkpoint" in out
    # (torchrun's agent, itself signalled, prints no summary of its workers' exit codes.)
    assert f"exiting with code {STOPPED_TO_SAVE_EXIT_CODE}" in out
    # The operator's diagnosis counts it as collateral and retryable, with its own wording.
    failure = RankFailure(node_rank=0, rank=0, exit_code=STOPPED_TO_SAVE_EXIT_CODE)
    assert failure.collateral and failure.retryable and "stopped to save a checkpoint" in failure.headline()

    resumed = subprocess.run(
        _torchrun_cmd(),
        env=_env({"TRAIN_CHECKPOINT_URI": root, "TRAIN_RESUME_FROM": committed[0].uri}),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert f"at step {saved}" in resumed.stdout + resumed.stderr
    assert _final(resumed.stdout + resumed.stderr) == (total, digest)
