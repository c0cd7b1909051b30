"""Lightning's ``LightningCLI`` script (tests/ecosystem/lightning_cli.py), unmodified, through the
operator on 2 local nodes: resume through the integration callback (added on the command line)
and through Lightning's own ``last.ckpt`` in ``${TRAIN_CHECKPOINT_DIR}``; a mistyped flag fails
once, its reason first."""

from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT, group_processes

pytest.importorskip("lightning")
pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "ecosystem" / "lightning_cli.py"
TRAINER = [
    "fit",
    "--trainer.accelerator=cpu",
    "--trainer.strategy=ddp",
    "--trainer.devices=1",
    "--trainer.num_nodes=2",
    "--trainer.max_steps=12",
    "--trainer.logger=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    # LightningCLI saves config.yaml there and refuses to overwrite it: one directory per try.
    "--trainer.default_root_dir=${TRAIN_CHECKPOINT_DIR}/try-{{ ti.try_number }}",
]
INTEGRATION = [
    "--trainer.enable_checkpointing=false",
    "--trainer.callbacks+=airflow_torchrun.integrations.lightning.TorchrunCheckpoint",
    "--trainer.callbacks.every_n_train_steps=4",
]
# Lightning's own checkpointing, handed the task's checkpoint location.
OWN = [
    "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
    "--trainer.callbacks.dirpath=${TRAIN_CHECKPOINT_DIR}/lightning",
    "--trainer.callbacks.save_last=true",
    "--trainer.callbacks.every_n_train_steps=4",
    "--ckpt_path=last",
]
ENV = {"HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def _task(args: list[str], env: dict[str, str], retries: int) -> str:
    return f"""
    DistributedTrainingOperator(
        task_id="train", script={str(SCRIPT)!r}, num_nodes=2, nproc_per_node=1, script_args={args!r},
        env={env!r}, retries={retries}, retry_delay=timedelta(0), rdzv_timeout=120, startup_timeout=300,
    )
    """


def _starts(log: str) -> list[int]:
    return [int(s) for s in re.findall(r"START global_step=(\d+) world_size=2", log)]


def test_lightning_retry_resumes_through_the_integration(run_dag, tmp_path):
    env = {**ENV, "FAIL_ONCE_MARKER": str(tmp_path / "failed"), "FAIL_ONCE_AT_STEP": "6"}
    result = run_dag(_task(TRAINER + INTEGRATION, env, retries=1), imports="from datetime import timedelta")
    assert result.state == "success", result.log[-6000:]
    assert (tmp_path / "failed").exists(), "the first try did not fail as planned"
    assert result.try_number("train") == 2
    resumed = result.xcom("train", key="resumed_from")
    assert resumed and resumed["step"] == 4 and resumed["uri"].endswith("/step-00000004"), resumed
    # The retry started where the committed step 4 left off, and ran to the end.
    assert 4 in _starts(result.node_logs("train")), result.node_logs("train")[-3000:]
    assert "END global_step=12" in result.node_logs("train")
    summary = result.xcom("train")
    assert summary["final_checkpoint"].endswith("/step-00000012")
    assert "every rank joined one process group of world size 2" in result.log
    assert group_processes(summary["group_id"]) == []


def test_lightning_retry_resumes_from_its_own_last_ckpt(run_dag, tmp_path):
    env = {**ENV, "FAIL_ONCE_MARKER": str(tmp_path / "failed"), "FAIL_ONCE_AT_STEP": "6"}
    result = run_dag(_task(TRAINER + OWN, env, retries=1), imports="from datetime import timedelta")
    assert result.state == "success", result.log[-6000:]
    assert result.try_number("train") == 2
    resumed = result.xcom("train", key="resumed_from")
    assert resumed and resumed["framework"] == "lightning" and resumed["uri"].endswith("/lightning/last.ckpt")
    assert re.search(r"the script's own lightning checkpoint \S+/lightning/last.ckpt", result.log)
    assert 4 in _starts(result.node_logs("train")), result.node_logs("train")[-3000:]
    assert "END global_step=12" in result.node_logs("train")


def test_a_mistyped_lightning_flag_fails_once_with_its_reason_first(run_dag):
    result = run_dag(
        _task([*TRAINER, "--trainer.max_stepz=3"], ENV, retries=2), imports="from datetime import timedelta"
    )
    assert result.state == "failed"
    assert result.try_number("train") == 1, "a command-line error must not be retried"
    headline = re.search(r"Training group \S+ failed: (.*)", result.log)
    assert headline, result.log[-4000:]
    assert "exited with code 2, a command-line error: error:" in headline.group(1)
    assert "--trainer.max_stepz=3" in headline.group(1)
    assert "A retry cannot fix this" in result.log
