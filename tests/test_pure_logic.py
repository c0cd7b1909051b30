"""Pure layers: wiring, status reduction, failure diagnosis. Tables of real-shaped inputs."""

from __future__ import annotations

import re

import pytest

from airflow_torchrun import diagnosis
from airflow_torchrun.naming import GroupIdentity
from airflow_torchrun.spec import GroupSpec
from airflow_torchrun.status import NodeObservation, NodePhase, Outcome, group_status
from airflow_torchrun.wiring import plan

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@pytest.fixture
def spec(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    return GroupSpec.create(
        script=str(script), num_nodes=3, nproc_per_node=2, script_args=["--lr", "0.1"], env={"FOO": "bar"}
    )


def test_plan_renders_one_torchrun_command_per_node(spec):
    identity = GroupIdentity("dag", "train", "manual__2026", 2)
    p = plan(
        spec,
        identity,
        master_addr="10.0.0.1",
        master_port=29400,
        python="py",
        cpus_per_node=8,
        extra_env={"TRAIN_CHECKPOINT_URI": "file:///ck"},
    )
    assert [n.node_rank for n in p.nodes] == [0, 1, 2]
    argv = p.nodes[1].argv
    assert argv[:3] == ("py", "-m", "torch.distributed.run")
    for flag in (
        "--nnodes=3",
        "--nproc-per-node=2",
        "--node-rank=1",
        "--rdzv-backend=static",
        "--master-addr=10.0.0.1",
        "--master-port=29400",
        "--max-restarts=0",
    ):
        assert flag in argv
    assert argv[-5:] == ("-m", "airflow_torchrun.worker.launch", spec.script, "--lr", "0.1")
    env = p.nodes[1].env
    assert env["OMP_NUM_THREADS"] == "4"  # 8 cores / 2 ranks
    assert env["FOO"] == "bar" and env["TRAIN_CHECKPOINT_URI"] == "file:///ck"
    assert env["AIRFLOW_TORCHRUN_GROUP_ID"] == p.group_id and env["AIRFLOW_TORCHRUN_NODE_RANK"] == "1"
    # every node runs the same command but for its node rank
    strip = [tuple(a for a in n.argv if not a.startswith("--node-rank")) for n in p.nodes]
    assert len(set(strip)) == 1


def test_user_threads_win_over_the_default(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    s = GroupSpec.create(script=str(script), nproc_per_node=4, env={"OMP_NUM_THREADS": "3"})
    assert (
        plan(s, GroupIdentity("d", "t", "r"), master_addr="h", master_port=1, cpus_per_node=2)
        .nodes[0]
        .env["OMP_NUM_THREADS"]
        == "3"
    )
    s = GroupSpec.create(script=str(script), nproc_per_node=4)
    assert (
        plan(s, GroupIdentity("d", "t", "r"), master_addr="h", master_port=1, cpus_per_node=2)
        .nodes[0]
        .env["OMP_NUM_THREADS"]
        == "1"
    )


def test_command_runs_with_no_python():
    s = GroupSpec.create(command=["bash", "-c", "echo hi"], script_args=["x"])
    argv = plan(s, GroupIdentity("d", "t", "r"), master_addr="h", master_port=1).nodes[0].argv
    assert argv[-5:] == ("--no-python", "bash", "-c", "echo hi", "x")


@pytest.mark.parametrize(
    "identity",
    [
        GroupIdentity("d", "t", "r"),
        GroupIdentity("My_DAG.with.Dots", "Train__Model", "manual__2026-11-30T14:08:55+00:00", 3),
        GroupIdentity("x" * 200, "y" * 200, "z" * 200, 12, 7),
    ],
)
def test_group_ids_are_dns_labels(identity):
    gid = identity.group_id
    assert len(gid) <= 63 and DNS_LABEL.match(gid), gid
    assert gid.endswith(f"-t{identity.try_number}")


def test_group_ids_differ_for_long_ids_that_share_a_prefix():
    a = GroupIdentity("x" * 100, "train", "run-a").group_id
    b = GroupIdentity("x" * 100, "train", "run-b").group_id
    assert a != b


def _node(rank, phase, **kw):
    return NodeObservation(node_rank=rank, phase=phase, **kw)


@pytest.mark.parametrize(
    ("nodes", "now", "state", "failed_node"),
    [
        ([_node(0, NodePhase.RUNNING), _node(1, NodePhase.RUNNING)], 5, Outcome.RUNNING, None),
        ([_node(0, NodePhase.SUCCEEDED), _node(1, NodePhase.SUCCEEDED)], 5, Outcome.SUCCEEDED, None),
        ([_node(0, NodePhase.SUCCEEDED), _node(1, NodePhase.RUNNING)], 5, Outcome.RUNNING, None),
        (
            [_node(0, NodePhase.RUNNING), _node(1, NodePhase.FAILED, exit_code=1, finished_at=3)],
            5,
            Outcome.FAILED,
            1,
        ),
        # the first to fail is named, not one that was stopped afterwards
        (
            [
                _node(0, NodePhase.FAILED, exit_code=1, finished_at=2, stopped_by="SIGTERM"),
                _node(1, NodePhase.FAILED, exit_code=1, finished_at=3),
            ],
            5,
            Outcome.FAILED,
            1,
        ),
        ([_node(0, NodePhase.LOST, finished_at=1), _node(1, NodePhase.RUNNING)], 5, Outcome.FAILED, 0),
        (
            [_node(0, NodePhase.RUNNING), _node(1, NodePhase.PENDING, reason="Unschedulable")],
            5,
            Outcome.RUNNING,
            None,
        ),
        (
            [_node(0, NodePhase.RUNNING), _node(1, NodePhase.PENDING, reason="Unschedulable")],
            11,
            Outcome.STARTUP_TIMEOUT,
            1,
        ),
    ],
)
def test_group_status(nodes, now, state, failed_node):
    status = group_status(nodes, launched_at=0, now=now, startup_timeout=10)
    assert status.state is state
    assert status.failed_node == failed_node
    if state is Outcome.STARTUP_TIMEOUT:
        assert "Unschedulable" in status.reason and "startup_timeout=10s" in status.reason


AGENT_REPORT = """
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
t.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-30_14:04:33
  host      : localhost
  rank      : 2 (local_rank: 0)
  exitcode  : -15 (pid: 2668)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 2668
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_14:04:32
  host      : localhost
  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 2670)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 2670
============================================================
"""


def test_agent_report_is_parsed():
    failures = {f.rank: f for f in diagnosis.parse_agent_report(1, AGENT_REPORT)}
    assert failures[3].signal == "SIGKILL" and failures[3].local_rank == 1 and failures[3].node_rank == 1
    assert failures[2].signal == "SIGTERM" and failures[2].collateral


def _error_file(rank, message, when):
    import json

    return json.dumps(
        {
            "message": {
                "message": message,
                "extraInfo": {
                    "py_callstack": f"Traceback...\n{message}\n",
                    "timestamp": str(int(when)),
                    "airflow_torchrun_time": repr(when),
                    "rank": str(rank),
                },
            }
        }
    )


def test_root_cause_is_the_first_real_failure_not_the_cascade():
    reported = [
        *diagnosis.parse_agent_report(1, AGENT_REPORT),
        diagnosis.RankFailure(node_rank=0, rank=0, local_rank=0, exit_code=1),
        diagnosis.RankFailure(node_rank=0, rank=1, local_rank=1, exit_code=1),
    ]
    files = [
        # ranks on node 0 raised *earlier* than the kill was reported, but only because they lost a peer
        (0, _error_file(0, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:222", 100.0)),
        (0, _error_file(1, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:223", 100.1)),
    ]
    failures = diagnosis.merge(reported, files)
    cause = diagnosis.root_cause(failures)
    assert cause is not None and cause.rank == 3 and cause.signal == "SIGKILL"
    msg = diagnosis.failure_message("g", failures, node_headline="", log_tail=["[node 1 rank 3] boom"], log_path="p")
    assert "rank 3 (node 1, local rank 1) was killed by signal SIGKILL" in msg
    assert "ranks 0,1: exit code 1: RuntimeError: [gloo] Connection closed by peer" in msg
    assert "[node 1 rank 3] boom" in msg


def test_a_real_exception_beats_an_earlier_collateral_one():
    reported = [
        diagnosis.RankFailure(node_rank=0, rank=0, exit_code=1),
        diagnosis.RankFailure(node_rank=1, rank=1, exit_code=1),
    ]
    files = [
        (0, _error_file(0, "RuntimeError: Connection reset by peer", 5.0)),
        (1, _error_file(1, "ValueError: bad batch shape", 6.0)),
    ]
    cause = diagnosis.root_cause(diagnosis.merge(reported, files))
    assert cause is not None and cause.rank == 1 and cause.retryable


def test_import_errors_are_not_retryable():
    reported = [diagnosis.RankFailure(node_rank=0, rank=0, exit_code=1)]
    files = [(0, _error_file(0, "ModuleNotFoundError: No module named 'transformerz'", 5.0))]
    cause = diagnosis.root_cause(diagnosis.merge(reported, files))
    assert cause is not None and not cause.retryable


def test_a_chosen_exit_code_wins_over_an_abort_on_the_way_out():
    reported = [diagnosis.RankFailure(node_rank=1, rank=1, exit_code=-6, signal="SIGABRT")]
    files = [(1, _error_file(1, "SystemExit: 7", 5.0))]
    cause = diagnosis.root_cause(diagnosis.merge(reported, files))
    assert cause is not None and cause.exit_code == 7 and cause.signal is None
    assert cause.headline() == "rank 1 (node 1) exited with code 7"


def test_a_full_disk_is_not_retried_and_says_what_to_do() -> None:
    from airflow_torchrun.diagnosis import RankFailure, failure_message

    full = RankFailure(node_rank=0, rank=0, exit_code=1, message="OSError: [Errno 28] No space left on device")
    assert full.retryable is False and full.out_of_space
    text = failure_message("g", [full], node_headline="node 0 failed", log_tail=[], log_path="x")
    assert "free space, lower keep_last" in text
    assert RankFailure(node_rank=0, rank=0, exit_code=1, message="RuntimeError: boom").retryable
    chained = RankFailure(
        node_rank=0,
        rank=0,
        exit_code=1,
        message="RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 18476736 vs 18476628",
        traceback="OSError: [Errno 28] No space left on device\n\nDuring handling of the above exception...",
    )
    assert chained.out_of_space and not chained.retryable
