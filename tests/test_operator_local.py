"""The training operator on the local backend, through ``dag.test()``: real torchrun, real gloo."""

from __future__ import annotations

import os
import re
import signal
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import group_processes

pytestmark = pytest.mark.slow


def _wait_for_group(state_dir: Path, earlier: set[Path], timeout: float = 60.0) -> str:
    """The id of the first group not in ``earlier`` (those on disk before) once all its nodes are running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for group_dir in set((state_dir / "groups").glob("*")) - earlier:
            nodes = list(group_dir.glob("node-*"))
            if nodes and all((n / "supervisor.json").exists() for n in nodes):
                return group_dir.name
        time.sleep(0.1)
    raise AssertionError("no group started")


def _wait_for_ranks(group_dir: Path, ranks: int, timeout: float = 60.0) -> None:
    """Every rank of the group has joined it and printed its first line (tiny_ddp's ``rank=N``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = "".join(p.read_text(errors="replace") for p in group_dir.glob("node-*/node.log"))
        if all(f"rank={rank} " in text for rank in range(ranks)):
            return
        time.sleep(0.1)
    raise AssertionError(f"the ranks of {group_dir.name} never all started")


@pytest.mark.parametrize("deferrable", [False, True], ids=["sync", "deferrable"])
def test_2x2_all_ranks_see_world_size_4_and_all_reduce(run_dag, tiny_script, deferrable):
    result = run_dag(
        f"""
        DistributedTrainingOperator(task_id="train", script={str(tiny_script)!r}, num_nodes=2, nproc_per_node=2,
                                    deferrable={deferrable}, defer_after=0)
        """
    )
    assert result.state == "success", result.log[-3000:]
    # The deferred path really ran: watched by the trigger, not by this process.
    assert ("deferring: the triggerer watches it" in result.log) is deferrable
    # 1+2+3+4 = 10 on every rank, and every rank's output reached the task log with its origin
    for rank in range(4):
        node = rank // 2
        assert re.search(rf"\[node {node} rank {rank}\] rank={rank} world=4 WORLD_SIZE=4 .*sum=10", result.log)
        assert f"[node {node} rank {rank}] rank {rank} done" in result.log
    xcom = result.xcom("train")
    assert xcom["world_size"] == 4
    assert xcom["node_exit_codes"] == [0, 0]
    assert len(xcom["logs"]) == 2 and all(Path(p).is_file() for p in xcom["logs"])
    assert group_processes(xcom["group_id"]) == []


def test_2x1_group_ranks_follow_node_rank(run_dag, tiny_script):
    result = run_dag(
        f"""
        DistributedTrainingOperator(task_id="train", script={str(tiny_script)!r}, num_nodes=2, nproc_per_node=1)
        """
    )
    assert result.state == "success", result.log[-3000:]
    assert "[node 1 rank 1] rank=1 world=2 WORLD_SIZE=2 LOCAL_RANK=0 GROUP_RANK=1 sum=3" in result.log


def test_unmodified_torchrun_script_uses_only_standard_variables(run_dag, tmp_path):
    # No airflow_torchrun import, no @record: the plain env:// recipe from the torch docs.
    script = tmp_path / "plain.py"
    script.write_text(
        textwrap.dedent(
            """
            import os
            import torch, torch.distributed as dist
            dist.init_process_group(backend="gloo", init_method="env://")
            assert dist.get_rank() == int(os.environ["RANK"])
            assert os.environ["MASTER_ADDR"] and int(os.environ["MASTER_PORT"]) > 0
            assert os.environ["TORCHELASTIC_RUN_ID"]
            t = torch.tensor([1.0]); dist.all_reduce(t)
            print("PLAIN-OK", int(os.environ["LOCAL_WORLD_SIZE"]), int(t.item()), flush=True)
            dist.destroy_process_group()
            """
        )
    )
    result = run_dag(
        f"""
        DistributedTrainingOperator(task_id="train", script={str(script)!r}, num_nodes=2, nproc_per_node=1,
                                    script_args=["--not-parsed", "{{{{ ds }}}}"])
        """
    )
    assert result.state == "success", result.log[-3000:]
    assert result.log.count("PLAIN-OK 1 2") == 2


@pytest.mark.parametrize("deferrable", [False, True], ids=["sync", "deferrable"])
def test_rank_exit_code_7_fails_the_task_naming_rank_and_code(run_dag, tiny_script, deferrable):
    result = run_dag(
        f"""
        DistributedTrainingOperator(
            task_id="train", script={str(tiny_script)!r}, num_nodes=2, nproc_per_node=2, retries=0,
            deferrable={deferrable}, defer_after=0,
            env={{"FAIL_RANK": "3", "FAIL_STEP": "2", "STEPS": "200"}},
        )
        """
    )
    assert result.state == "failed"
    assert "rank 3 (node 1, local rank 1) exited with code 7" in result.log
    assert "SystemExit: 7" in result.log
    assert "rank 3 failing at step 2" in result.log  # the log tail of the failing rank
    # Airflow resolves the extra links after a failed try too: neither link's XCom is missing (a
    # missing one is an error line, "XCom not found", at the end of the task log).
    assert "XCom not found" not in result.log
    assert result.xcom("train", key="checkpoint_url") is None
    group_id = result.xcom("train", key="group")["group_id"]
    assert group_processes(group_id) == []
    # How the group ended, for the training view once the group is gone (XCom group_end).
    end = result.xcom("train", key="group_end")
    assert (end["group_id"], end["outcome"]) == (group_id, "failed"), end
    assert "rank 3 (node 1, local rank 1) exited with code 7" in end["failure"]
    assert {n["node_rank"]: n["phase"] for n in end["nodes"]}[1] == "failed", end["nodes"]


@pytest.mark.parametrize("deferrable", [False, True], ids=["sync", "deferrable"])
def test_rank_killed_by_sigkill_names_the_signal(run_dag, tiny_script, deferrable):
    result = run_dag(
        f"""
        DistributedTrainingOperator(
            task_id="train", script={str(tiny_script)!r}, num_nodes=2, nproc_per_node=1, retries=0,
            deferrable={deferrable}, defer_after=0,
            env={{"FAIL_RANK": "0", "FAIL_MODE": "kill", "STEPS": "200"}},
        )
        """
    )
    assert result.state == "failed"
    assert "rank 0 (node 0, local rank 0) was killed by signal SIGKILL" in result.log
    group_id = result.xcom("train", key="group")["group_id"]
    assert group_processes(group_id) == []


@pytest.mark.parametrize("deferrable", [False, True], ids=["sync", "deferrable"])
def test_execution_timeout_leaves_nothing_running(run_dag, tiny_script, deferrable):
    result = run_dag(
        f"""
        DistributedTrainingOperator(
            task_id="train", script={str(tiny_script)!r}, num_nodes=2, nproc_per_node=1, retries=0,
            deferrable={deferrable}, defer_after=0,
            env={{"STEPS": "100000", "STEP_SECONDS": "0.1"}}, execution_timeout=timedelta(seconds=12),
        )
        """,
        imports="from datetime import timedelta",
    )
    assert result.state == "failed"
    group_id = result.xcom("train", key="group")["group_id"]
    assert group_processes(group_id) == []


def test_on_kill_tears_the_group_down(run_dag, tiny_script):
    state_dir = Path(os.environ["AIRFLOW__TORCHRUN__STATE_DIR"])
    earlier = set((state_dir / "groups").glob("*"))
    seen: dict[str, list[int]] = {}

    def kill_when_running() -> None:
        group_id = _wait_for_group(state_dir, earlier)
        _wait_for_ranks(state_dir / "groups" / group_id, ranks=2)
        seen["pids"] = group_processes(group_id)
        # What Airflow's task runner receives when the task is cleared or marked failed in the UI.
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=kill_when_running, daemon=True)
    killer.start()
    result = run_dag(
        f"""
        DistributedTrainingOperator(
            task_id="train", script={str(tiny_script)!r}, num_nodes=2, nproc_per_node=1, retries=0,
            env={{"STEPS": "100000", "STEP_SECONDS": "0.1"}},
        )
        """
    )
    killer.join(5)
    assert seen["pids"], "the group was running before the kill"
    assert result.state == "failed"
    assert "on_kill" in result.log
    group_id = result.xcom("train", key="group")["group_id"]
    assert group_processes(group_id) == []


HANGING = textwrap.dedent(
    """
    import os, signal, time
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in range(100000):
        if rank == 1 and step == 5:
            print("rank 1 stopping itself (SIGSTOP)", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)  # a hang: alive, silent, holding every collective
        dist.all_reduce(torch.ones(1))
        print(f"rank {rank} step {step}", flush=True)
        time.sleep(0.2)
    """
)


@pytest.mark.parametrize("deferrable", [False, True], ids=["sync", "deferrable"])
def test_a_stopped_rank_is_caught_by_progress_timeout_and_nothing_is_left(run_dag, tmp_path, deferrable):
    script = tmp_path / "hanging.py"
    script.write_text(HANGING)
    started = time.monotonic()
    result = run_dag(
        f"""
        DistributedTrainingOperator(
            task_id="train", script={str(script)!r}, num_nodes=2, nproc_per_node=1, retries=0,
            deferrable={deferrable}, defer_after=0, progress_timeout=6, teardown_grace=2,
        )
        """
    )
    assert result.state == "failed", result.log[-3000:]
    assert "no progress for" in result.log and "progress_timeout=6s" in result.log, result.log[-3000:]
    assert "rank 1 stopping itself" in result.log
    group_id = result.xcom("train", key="group")["group_id"]
    assert group_processes(group_id) == [], "a stopped rank must be killed, not left behind"
    # Detected in seconds, not after torchrun's 30-minute collective timeout.
    assert time.monotonic() - started < 120


def test_a_deferrable_group_of_seconds_never_defers(run_dag, tiny_script):
    # Default defer_after (60 s): the worker watches it to the end, no trigger, no race to lose.
    result = run_dag(
        f"""
        DistributedTrainingOperator(task_id="train", script={str(tiny_script)!r}, num_nodes=2, deferrable=True)
        """
    )
    assert result.state == "success", result.log[-3000:]
    assert "deferring" not in result.log and "trigger reported" not in result.log
    assert result.xcom("train")["node_exit_codes"] == [0, 0]
