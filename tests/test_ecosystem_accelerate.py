"""An accelerate-style loop (tests/ecosystem/accelerate_loop.py) through the operator on 2 local
nodes: with ``ACCELERATE_USE_CPU=1`` one group of 2; without it every rank trains alone, and the
task fails saying so; ``check_process_group=False`` turns that into a warning."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT, group_processes

pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "ecosystem" / "accelerate_loop.py"


def _task(env: dict[str, str], **kwargs: object) -> str:
    extra = "".join(f", {k}={v!r}" for k, v in kwargs.items())
    return f"""
    DistributedTrainingOperator(
        task_id="train", script={str(SCRIPT)!r}, num_nodes=2, nproc_per_node=1, env={env!r},
        retries=1, retry_delay=timedelta(0), rdzv_timeout=120, startup_timeout=300{extra},
    )
    """


def test_accelerate_loop_runs_as_one_group_of_two(run_dag):
    result = run_dag(_task({"ACCELERATE_USE_CPU": "1"}), imports="from datetime import timedelta")
    assert result.state == "success", result.log[-6000:]
    logs = result.node_logs("train")
    assert "START num_processes=2 distributed=DistributedType.MULTI_CPU" in logs, logs[-3000:]
    assert "mean loss over 2 process(es)" in logs and "END num_processes=2" in logs
    assert "every rank joined one process group of world size 2" in result.log
    summary = result.xcom("train")
    assert summary["world_size"] == 2 and summary["mlflow_run_id"] is None  # no tracking configured
    assert group_processes(summary["group_id"]) == []


def test_accelerate_without_use_cpu_fails_once_saying_why(run_dag):
    result = run_dag(_task({}), imports="from datetime import timedelta")
    assert result.state == "failed"
    assert result.try_number("train") == 1
    assert "START num_processes=1" in result.node_logs("train")
    assert "did not form one process group of world size 2" in result.log
    assert "ACCELERATE_USE_CPU=1" in result.log


def test_check_process_group_false_only_warns(run_dag, tmp_path):
    script = tmp_path / "alone.py"
    script.write_text("print('each rank on its own', flush=True)\n")  # no torch at all: quick
    result = run_dag(
        f"""
        DistributedTrainingOperator(task_id="train", script={str(script)!r}, num_nodes=2, check_process_group=False)
        """
    )
    assert result.state == "success", result.log[-4000:]
    assert "rank(s) 0,1 never joined a process group" in result.log
    assert "check_process_group=False: not failing the task" in result.log
