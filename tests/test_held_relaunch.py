"""A relaunch held at a gate: started during the failed group's teardown, released once it is gone.

What must hold: the held ranks pay for their interpreter and imports while the group before them
is torn down, and run nothing of the script until the engine opens their gate with the rank
contract resolved after that group is completely gone (so the resume point is what its last
process committed); a held group torn down, or never released, leaves no process; the goodput
ledger counts the overlapped time once. The pure parts first; then real torchrun agents and gloo
ranks, under ``dag.test()``.
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest

from airflow_torchrun.backends.local.backend import LocalBackend
from airflow_torchrun.backends.local.procs import group_pids
from airflow_torchrun.contract.launch import GATE_TIMEOUT_VAR, GATE_VAR, HELD_FILE
from airflow_torchrun.goodput import LAUNCHING, RESTART_GAP, account_launch, try_ledger
from airflow_torchrun.naming import GroupIdentity
from airflow_torchrun.spec import GroupSpec
from airflow_torchrun.status import NodePhase
from airflow_torchrun.timeline import Mark, Timeline
from airflow_torchrun.wiring import gate_env, holds_at_gate, plan
from airflow_torchrun.worker.gate import GateError, read_gate, wait_for_gate
from tests.conftest import unique_run
from tests.test_goodput import _failed_then_resumed
from tests.test_local_backend import _until


# -- the pure parts -----------------------------------------------------------------------------------
def _spec(tmp_path: Path, **kw: object) -> GroupSpec:
    script = tmp_path / "train.py"
    script.write_text("")
    return GroupSpec.create(script=str(script), num_nodes=2, **kw)  # type: ignore[arg-type]


def test_only_a_gated_plan_holds_its_ranks_and_only_our_launchers_can_be_held(tmp_path: Path) -> None:
    spec = _spec(tmp_path, startup_timeout=90)
    identity = GroupIdentity("d", "t", "r")
    held = plan(spec, identity, master_addr="h", master_port=1, gate="/g/gate.json")
    assert all(n.env[GATE_VAR] == "/g/gate.json" and n.env[GATE_TIMEOUT_VAR] == "90" for n in held.nodes)
    plain = plan(spec, identity, master_addr="h", master_port=1)
    assert not any(GATE_VAR in n.env or GATE_TIMEOUT_VAR in n.env for n in plain.nodes)
    command = GroupSpec.create(command=["python", "-c", "pass"], num_nodes=2)
    assert holds_at_gate(spec) and not holds_at_gate(command)
    with pytest.raises(ValueError, match="a gate needs ranks that run a launcher of ours"):
        plan(command, identity, master_addr="h", master_port=1, gate="/g/gate.json")


def test_the_gate_hands_the_contract_over_but_the_users_env_still_wins(tmp_path: Path) -> None:
    """As in a plan: the user's env overrides storage variables of the operator's, never the contract."""
    spec = _spec(tmp_path, env={"AWS_REGION": "mine", "OTHER": "x"})
    given = {"AWS_REGION": "the operator's", "TRAIN_RESUME_FROM": "file:///c/step-00000020", "AWS_PROFILE": "p"}
    assert gate_env(spec, given) == {"TRAIN_RESUME_FROM": "file:///c/step-00000020", "AWS_PROFILE": "p"}
    planned = plan(spec, GroupIdentity("d", "t", "r"), master_addr="h", master_port=1, extra_env=given).nodes[0].env
    assert {k: planned[k] for k in given} == {**given, **gate_env(spec, given), "AWS_REGION": "mine"}


def test_a_held_rank_waits_for_its_gate_and_leaves_when_nobody_will_open_it(tmp_path: Path) -> None:
    gate = tmp_path / "gate.json"
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds
        if now[0] >= 1.0 and not gate.exists():
            gate.write_text(json.dumps({"env": {"TRAIN_RESUME_FROM": "x"}}))

    env = wait_for_gate(str(gate), 5.0, parent=7, parent_now=lambda: 7, clock=lambda: now[0], sleep=sleep)
    assert env == {"TRAIN_RESUME_FROM": "x"} and 1.0 <= now[0] < 1.1
    gate.unlink()
    now[0] = 0.0

    def tick(seconds: float) -> None:
        now[0] += seconds

    with pytest.raises(GateError, match=r"held at the gate .* for 0.5s \(startup_timeout\) and it was never opened"):
        wait_for_gate(str(gate), 0.5, parent=7, parent_now=lambda: 7, clock=lambda: now[0], sleep=tick)
    assert 0.5 <= now[0] < 0.6
    with pytest.raises(GateError, match=r"its torchrun agent \(pid 7\) is gone"):
        wait_for_gate(str(gate), 5.0, parent=7, parent_now=lambda: 1, clock=lambda: now[0], sleep=tick)
    gate.write_text("{not json")
    with pytest.raises(GateError, match="not valid JSON"):
        read_gate(str(gate))
    gate.write_text(json.dumps({"env": {"A": 1}}))
    with pytest.raises(GateError, match="holds no"):
        read_gate(str(gate))


def _held_relaunch() -> Timeline:
    """Launch 0 fails at 14; launch 1 started held at 14.2, the teardown done at 15, its gate at 15.3."""
    first, _, _ = _failed_then_resumed()
    t = Timeline([e for e in first.events if e.launch != 1 and e.mark is not Mark.TRY_ENDED])
    t.mark(Mark.LAUNCH_STARTED, 14.2, 1, held=True)
    t.mark(Mark.LAUNCHED, 14.5, 1, held=True)
    t.mark(Mark.RELAUNCH, 15.1, 0)
    t.mark(Mark.CONTRACT_STARTED, 15.1, 1)
    t.mark(Mark.CONTRACT_READY, 15.2, 1)
    t.mark(Mark.GATE_OPENED, 15.3, 1)
    t.mark(Mark.RANKS_STARTED, 14.9, 1)  # the ranks' interpreters: before the gate
    t.mark(Mark.RUNNING, 15.4, 1)
    t.mark(Mark.FIRST_OUTPUT, 15.5, 1)
    t.mark(Mark.ENDED, 34.0, 1, outcome="succeeded")
    t.mark(Mark.TRY_ENDED, 36.0, outcome="succeeded")
    return t


def test_the_ledger_counts_a_held_relaunch_once_its_gap_ending_at_the_gate() -> None:
    _, first, second = _failed_then_resumed()
    a0 = account_launch(0, first, None)
    a1 = account_launch(1, second, a0.max_step)
    ledger = try_ledger(_held_relaunch(), {0: a0, 1: a1}, try_number=1, now=99.0, started_at=0.0)
    assert sum(ledger.categories.values()) == pytest.approx(ledger.wall)
    # From launch 0's end to the gate: the teardown, the held group's start and imports hidden in it.
    assert ledger.categories[RESTART_GAP] == pytest.approx(15.3 - 14.0)
    assert ledger.categories[LAUNCHING] == pytest.approx(2.0 + 0.9)  # launch 0's only: nothing after the gate
    assert ledger.launches == 2 and not ledger.coarse


def test_a_withdrawn_launch_is_no_launch_of_the_ledger() -> None:
    _, first, _ = _failed_then_resumed()
    t = Timeline([e for e in _held_relaunch().events if e.launch != 1 and e.mark is not Mark.TRY_ENDED])
    t.mark(Mark.LAUNCH_STARTED, 14.2, 1, held=True)
    t.mark(Mark.LAUNCHED, 14.5, 1, held=True)
    t.mark(Mark.WITHDRAWN, 15.1, 1, why="no relaunch after all")
    t.mark(Mark.TRY_ENDED, 16.0, outcome="failed")
    assert t.launches() == [0]
    ledger = try_ledger(t, {0: account_launch(0, first, None)}, try_number=1, now=99.0, started_at=0.0)
    assert ledger.launches == 1 and not ledger.coarse and ledger.outcome == "failed"
    assert ledger.categories[RESTART_GAP] == pytest.approx(2.0)  # launch 0's end to the try's


# -- held groups of real torchrun agents (the local backend) ------------------------------------------
HELD_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print(f"RAN rank={dist.get_rank()} resume={os.environ.get('TRAIN_RESUME_FROM')} argv={sys.argv[1:]}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def _launch_held(tmp_path: Path, **spec: object) -> tuple[LocalBackend, object]:
    script = tmp_path / "held.py"
    script.write_text(HELD_SCRIPT)
    backend = LocalBackend(tmp_path / "state")
    group = GroupSpec.create(
        script=str(script),
        num_nodes=2,
        script_args=["--from", "${TRAIN_RESUME_FROM}"],
        **{"teardown_grace": 5, **spec},  # type: ignore[arg-type]
    )
    plan_ = backend.plan_gated(group, GroupIdentity("d", "t", unique_run(tmp_path.name)))
    assert plan_ is not None
    return backend, backend.launch(plan_, watch_caller=True)


def _ready(handle: object) -> list[Path]:
    """The held ranks' ``held.json``: their imports are done, they wait at the gate."""
    return sorted(Path(handle.group_dir).glob(f"node-*/torchrun/*/attempt_*/*/{HELD_FILE}"))  # type: ignore[attr-defined]


def _logs(backend: LocalBackend, handle: object) -> str:
    return "".join(Path(p).read_text() for p in backend.log_locations(handle) if Path(p).exists())  # type: ignore[arg-type]


def _phases(backend: LocalBackend, handle: object) -> list[NodePhase] | None:
    nodes = backend.observe(handle)  # type: ignore[arg-type]
    ended = (NodePhase.SUCCEEDED, NodePhase.FAILED, NodePhase.LOST)
    return [n.phase for n in nodes] if all(n.phase in ended for n in nodes) else None


@pytest.mark.slow
def test_held_ranks_import_then_wait_and_run_with_the_gates_variables(tmp_path: Path) -> None:
    backend, handle = _launch_held(tmp_path)
    try:
        _until(lambda: len(_ready(handle)) == 2, timeout=120, what="both ranks ready at the gate")
        time.sleep(1.0)
        assert "RAN" not in _logs(backend, handle), "a held rank ran its script before its gate opened"
        opened = time.time()
        backend.open_gate(handle, {"TRAIN_RESUME_FROM": "file:///c/step-00000007"})  # type: ignore[arg-type]
        phases = _until(lambda: _phases(backend, handle), timeout=120, what="the group to end")
        assert phases == [NodePhase.SUCCEEDED, NodePhase.SUCCEEDED], _logs(backend, handle)
        ran = _logs(backend, handle)
        for rank in (0, 1):  # the gate's variables, and the arguments expanded from them
            expected = f"RAN rank={rank} resume=file:///c/step-00000007 argv=['--from', 'file:///c/step-00000007']"
            assert expected in ran, ran
        records = backend.process_groups(handle) or []  # type: ignore[arg-type]
        assert len(records) == 2 and all(r["joined"] for r in records), records
        for record in records:
            assert record["started_at"] <= record["held"]["imported_at"] < opened <= record["held"]["released_at"]
        gate = Path(handle.group_dir) / "gate.json"  # type: ignore[attr-defined]
        assert gate.stat().st_mode & 0o777 == 0o600
    finally:
        backend.teardown(handle)  # type: ignore[arg-type]
    assert group_pids(handle.group_id) == []  # type: ignore[attr-defined]


@pytest.mark.slow
def test_a_held_group_torn_down_before_its_gate_opens_leaves_no_process(tmp_path: Path) -> None:
    # A grace far above a SIGTERM'd stop even at a load of 7 on 2 cores: one that took it is the SIGKILL's.
    backend, handle = _launch_held(tmp_path, teardown_grace=30)
    try:
        _until(lambda: len(_ready(handle)) == 2, timeout=120, what="both ranks ready at the gate")
        assert len(group_pids(handle.group_id)) == 6  # type: ignore[attr-defined] # per node: supervisor, agent, rank
    finally:
        started = time.monotonic()
        backend.teardown(handle)  # type: ignore[arg-type]
        took = time.monotonic() - started
    assert group_pids(handle.group_id) == []  # type: ignore[attr-defined]
    assert took < 20.0, f"held ranks took {took:.1f}s to stop: they must end on SIGTERM, not on the grace's SIGKILL"
    exits = [json.loads(p.read_text()) for p in sorted(Path(handle.group_dir).glob("node-*/exit.json"))]  # type: ignore[attr-defined]
    assert len(exits) == 2 and all(e["stopped_by"] and not e["killed_stragglers"] for e in exits), exits
    assert "RAN" not in _logs(backend, handle)


@pytest.mark.slow
def test_a_gate_never_opened_ends_the_group_by_itself_after_startup_timeout(tmp_path: Path) -> None:
    """Whoever was to open it is gone (a worker SIGKILLed in deferrable mode: no --watch-pid): the
    held ranks leave once startup_timeout has passed, with a message saying why; nothing is left."""
    backend, handle = _launch_held(tmp_path, startup_timeout=3)
    try:
        phases = _until(lambda: _phases(backend, handle), timeout=120, what="the group to end by itself")
        assert NodePhase.FAILED in phases
        # Every process gone first: a node's log is whole once its agent has copied its ranks' output.
        _until(lambda: group_pids(handle.group_id) == [], timeout=30, what="every process to exit")  # type: ignore[attr-defined]
        assert "for 3s (startup_timeout) and it was never opened" in _logs(backend, handle)
        assert "RAN" not in _logs(backend, handle)
    finally:
        backend.teardown(handle)  # type: ignore[arg-type]
