"""A Hugging Face Trainer script (tests/ecosystem/hf_trainer.py: a tiny BERT built from a config,
nothing downloaded) through the operator on 2 local nodes: a retry resumes through the integration
and through the Trainer's own ``checkpoint-N`` in ``${TRAIN_CHECKPOINT_DIR}``; without ``--use_cpu``
every rank trains alone, and the task says so instead of succeeding."""

from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "ecosystem" / "hf_trainer.py"
ARGS = [
    "--max_steps",
    "12",
    "--per_device_train_batch_size",
    "4",
    "--save_strategy",
    "steps",
    "--save_steps",
    "4",
    "--logging_steps",
    "4",
    "--report_to",
    "none",
    "--disable_tqdm",
    "true",
    "--dataloader_num_workers",
    "0",
]
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _task(args: list[str], env: dict[str, str], retries: int) -> str:
    return f"""
    DistributedTrainingOperator(
        task_id="train", script={str(SCRIPT)!r}, num_nodes=2, nproc_per_node=1, script_args={args!r},
        env={env!r}, retries={retries}, retry_delay=timedelta(0), rdzv_timeout=120, startup_timeout=300,
    )
    """


def _starts(log: str) -> list[int]:
    return [int(s) for s in re.findall(r"START global_step=(\d+) world_size=2", log)]


def test_trainer_retry_resumes_through_the_integration(run_dag, tmp_path):
    env = {**ENV, "FAIL_ONCE_MARKER": str(tmp_path / "failed"), "FAIL_ONCE_AT_STEP": "6"}
    # A throwaway output_dir per try: what survives is the store.
    args = [*ARGS, "--use_cpu", "--torchrun_store", "--output_dir", f"{tmp_path}/out-try-{{{{ ti.try_number }}}}"]
    result = run_dag(_task(args, env, retries=1), imports="from datetime import timedelta")
    assert result.state == "success", result.log[-6000:]
    assert result.try_number("train") == 2 and (tmp_path / "failed").exists()
    resumed = result.xcom("train", key="resumed_from")
    assert resumed and resumed["step"] == 4 and resumed["uri"].endswith("/step-00000004"), resumed
    logs = result.node_logs("train")
    assert 4 in _starts(logs), logs[-3000:]
    assert "END global_step=12 world_size=2" in logs
    assert (tmp_path / "out-try-2" / "checkpoint-4" / "trainer_state.json").exists()  # written back from the store
    assert result.xcom("train")["final_checkpoint"].endswith("/step-00000012")


def test_trainer_retry_resumes_from_its_own_checkpoint_dir(run_dag, tmp_path):
    env = {**ENV, "FAIL_ONCE_MARKER": str(tmp_path / "failed"), "FAIL_ONCE_AT_STEP": "6"}
    args = [*ARGS, "--use_cpu", "--output_dir", "${TRAIN_CHECKPOINT_DIR}/hf"]
    result = run_dag(_task(args, env, retries=1), imports="from datetime import timedelta")
    assert result.state == "success", result.log[-6000:]
    assert result.try_number("train") == 2
    resumed = result.xcom("train", key="resumed_from")
    assert resumed == {"uri": resumed["uri"], "step": 4, "framework": "transformers"}, resumed
    assert resumed["uri"].endswith("/hf/checkpoint-4")
    assert "the script's own transformers checkpoint" in result.log
    logs = result.node_logs("train")
    assert 4 in _starts(logs) and "END global_step=12 world_size=2" in logs


def test_trainer_without_use_cpu_is_not_reported_as_a_distributed_success(run_dag, tmp_path):
    args = [*ARGS, "--max_steps", "4", "--save_strategy", "no", "--output_dir", str(tmp_path / "out")]
    result = run_dag(_task(args, ENV, retries=2), imports="from datetime import timedelta")
    assert result.state == "failed"
    assert result.try_number("train") == 1, "a retry would run the same way"
    said = re.search(r"AirflowFailException: (.*)", result.log)
    assert said, result.log[-4000:]
    assert "did not form one process group of world size 2" in said.group(1)
    assert "--use_cpu" in result.log
