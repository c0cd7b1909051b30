"""In-try restarts with the relaunch held at a gate, through ``dag.test()`` (real torchrun agents, gloo).

What must hold: the relaunched group's ranks did their interpreter start and imports while the
failed group was still being torn down, and yet resume from what the failed group's last process
committed on its way out (the resume point is read once it is completely gone); a SIGTERM save of
the failed group is the step the restart resumes from;
``on_kill`` while the relaunch is held leaves no process of either group. (The pure parts and the
backend's held groups: tests/test_held_relaunch.py.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import textwrap
import threading
import time
from pathlib import Path

import pytest

from airflow_torchrun.backends.local.procs import group_pids, rank_pid
from tests.example_trainer import IMPORTS
from tests.example_trainer import train_task as _train_task

pytestmark = pytest.mark.slow

STATE_DIR = Path(os.environ["AIRFLOW__TORCHRUN__STATE_DIR"])
HELD_GLOB = "node-*/torchrun/*/attempt_*/*/held.json"

# One node of two ranks. Rank 1 is SIGKILLed at step 3 of the first launch. Rank 0 then stands for
# a slow save on the way out: it ignores its agent's SIGTERM and commits checkpoint 777 only once the
# relaunch's ranks are ready at their gate (or after 25 s, when there is no held relaunch) and LINGER
# seconds more, then exits (the agent SIGKILLs it 30 s after its SIGTERM). One node: the engine lets
# the agent of a node whose rank failed stop that node on its own, signalling it only once.
SLOW_SAVE_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    import torch
    import torch.distributed as dist

    resume = os.environ.get("TRAIN_RESUME_FROM", "")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"rank {rank} resuming from {resume!r}", flush=True)
    mark = Path(os.environ["MARK"])
    first = not mark.exists()
    if first and rank == 0:
        # From the start, not once its all_reduce fails: under load the agent's SIGTERM can come
        # first, and a rank 0 that died of it made no slow save (the relaunch's gate then opened
        # at once, before the test could kill the task while it was held: CI 2026-12-04).
        signal.signal(signal.SIGTERM, lambda *_: None)
    dist.barrier()
    try:
        for step in range(1, 20):
            if first and rank == 1 and step == 3:
                mark.write_text("killed")
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(torch.ones(1))
            time.sleep(0.05)
    except Exception:
        if rank != 0:
            raise
        groups = Path(os.environ["AIRFLOW__TORCHRUN__STATE_DIR"], "groups")
        held = groups / (os.environ["AIRFLOW_TORCHRUN_GROUP_ID"] + "-r1")
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline and len(list(held.glob("HELD_GLOB"))) < 2:
            time.sleep(0.1)
        time.sleep(float(os.environ.get("LINGER", "0")))
        dist.destroy_process_group()
        os.environ["WORLD_SIZE"] = "1"  # the peer is gone: rank 0 saves alone
        from airflow_torchrun.worker import save_checkpoint
        uri = save_checkpoint({"w": torch.zeros(1)}, 777)
        print(f"COMMITTED {uri} at {time.time()!r}", flush=True)
        sys.exit(1)
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)
    """
).replace("HELD_GLOB", HELD_GLOB)


def _timeline(result, task_id: str = "train") -> list[dict]:  # type: ignore[no-untyped-def]
    return list(result.xcom(task_id, key="timeline") or [])


def _at(events: list[dict], mark: str, launch: int) -> float:
    found = [e["at"] for e in events if e["mark"] == mark and e["launch"] == launch]
    assert found, (mark, launch, [(e["mark"], e["launch"]) for e in events])
    return float(found[0])


def _group_dirs(result, task_id: str = "train") -> list[Path]:  # type: ignore[no-untyped-def]
    launches = result.xcom(task_id, key="launches") or {}
    ids = [h["group_id"] for h in launches.get("history", [])] + [result.xcom(task_id, key="group")["group_id"]]
    return [STATE_DIR / "groups" / group_id for group_id in ids]


def test_the_relaunch_imports_during_the_teardown_and_resumes_from_the_last_commit(run_dag, tmp_path) -> None:
    script = tmp_path / "slow_save.py"
    script.write_text(SLOW_SAVE_SCRIPT)
    result = run_dag(
        f"""
        DistributedTrainingOperator(
            task_id="train", script={str(script)!r}, num_nodes=1, nproc_per_node=2, track=False,
            max_restarts=1, retries=0, teardown_grace=60, env={{"MARK": {str(tmp_path / "killed")!r}}},
        )
        """
    )
    assert result.state == "success", result.log[-6000:]
    assert result.try_number("train") == 1
    old, new = _group_dirs(result)
    # The relaunch resumed from what the old group's last process committed on its way out...
    committed = re.search(r"COMMITTED (\S+) at ([0-9.]+)", (old / "node-0" / "node.log").read_text())
    assert committed, (old / "node-0" / "node.log").read_text()[-3000:]
    assert f"resuming from {committed.group(1)} (step 777)" in result.log
    assert f"rank 0 resuming from '{committed.group(1)}'" in (new / "node-0" / "node.log").read_text()
    # ... though its ranks were ready (interpreter and imports done) before that process committed,
    # and so before the old group's last process exited.
    ready = [json.loads(p.read_text())["imported_at"] for p in new.glob(HELD_GLOB)]
    assert len(ready) == 2, list(new.rglob("*"))
    (old_exit,) = [json.loads(p.read_text())["finished_at"] for p in old.glob("node-*/exit.json")]
    assert max(ready) < float(committed.group(2)) < old_exit
    events = _timeline(result)
    launched, opened = _at(events, "launched", 1), _at(events, "gate_opened", 1)
    assert launched < min(ready) and old_exit <= _at(events, "teardown_done", 0) <= opened
    for group in (old, new):
        assert group_pids(group.name) == [], group


def test_a_sigterm_save_of_the_failed_group_is_where_the_restart_resumes(run_dag) -> None:
    """Rank 1 is sent SIGTERM mid-run (a preemption notice, say): every rank saves the next step and
    exits 75, a retryable failure; the restart, held during that teardown, resumes from that step."""
    target = 20
    seen: dict[str, object] = {}

    def sigterm_rank_1() -> None:
        deadline = time.monotonic() + 180
        earlier = set((STATE_DIR / "groups").glob("*"))
        while time.monotonic() < deadline:
            for node_log in (STATE_DIR / "groups").glob("*/node-0/node.log"):
                if node_log.parent.parent in earlier:
                    continue
                steps = [int(m) for m in re.findall(r"step (\d+)/\d+", node_log.read_text(errors="replace"))]
                if steps and max(steps) >= target:
                    rank_1 = rank_pid(node_log.parent.parent.name, 1)
                    if rank_1 is None:
                        continue
                    seen.update(group=node_log.parent.parent.name, last_done=max(steps))
                    os.kill(rank_1, signal.SIGTERM)
                    return
            time.sleep(0.05)

    thread = threading.Thread(target=sigterm_rank_1, daemon=True)
    thread.start()
    result = run_dag(
        _train_task(
            # 40 epochs (880 steps, about 3 s): a SIGTERM seen at step 20 must find rank 1 still training. With
            # 8 (176 steps, 0.5 s) it came after the last step under CI's load and the group just succeeded.
            ["--epochs", "40", "--checkpoint-every", "0", "--log-every", "1"],
            retries=0,
            max_restarts=1,
            track=False,
        ),
        imports=IMPORTS,
    )
    thread.join(timeout=5)
    assert seen, "rank 1 was never signalled"
    assert result.state == "success", result.log[-6000:]
    assert result.try_number("train") == 1
    old, _ = _group_dirs(result)
    saved = re.search(
        r"Stopped to save: checkpoint (\S+) \(step (\d+)\) committed", (old / "node-0" / "node.log").read_text()
    )
    assert saved, (old / "node-0" / "node.log").read_text()[-4000:]
    assert int(saved.group(2)) >= int(str(seen["last_done"]))
    assert f"resuming from {saved.group(1)} (step {saved.group(2)})" in result.log
    events = _timeline(result)
    assert _at(events, "launched", 1) < _at(events, "teardown_done", 0) <= _at(events, "gate_opened", 1)
    assert result.xcom("train", key="launches")["restarts"] == 1


def test_killing_the_task_while_the_relaunch_is_held_leaves_nothing(run_dag, tmp_path) -> None:
    """``on_kill`` (the task marked failed in the UI) while the failed group is torn down and the
    relaunch waits at its gate: both groups are stopped, the gate never opens."""
    script = tmp_path / "slow_save.py"
    script.write_text(SLOW_SAVE_SCRIPT)
    killed: dict[str, object] = {}
    earlier = set((STATE_DIR / "groups").glob("*"))  # held groups of earlier tests stay on disk

    def kill_when_held() -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            fresh = set((STATE_DIR / "groups").glob("*-r1")) - earlier
            held = [g for g in fresh if len(list(g.glob(HELD_GLOB))) == 2]
            if held:
                killed.update(group=held[0].name, at=time.time())
                os.kill(os.getpid(), signal.SIGTERM)  # what Airflow's task runner receives
                return
            time.sleep(0.05)

    thread = threading.Thread(target=kill_when_held, daemon=True)
    thread.start()
    result = run_dag(
        f"""
        DistributedTrainingOperator(
            task_id="train", script={str(script)!r}, num_nodes=1, nproc_per_node=2, track=False,
            max_restarts=1, retries=0, teardown_grace=60,
            env={{"MARK": {str(tmp_path / "killed")!r}, "LINGER": "5"}},
        )
        """
    )
    thread.join(timeout=5)
    assert killed, "the relaunch was never held"
    assert result.state == "failed", result.log[-4000:]
    assert f"on_kill: tearing down group {killed['group']}" in result.log
    marks = [(e["mark"], e["launch"]) for e in _timeline(result)]
    assert ("withdrawn", 1) in marks and ("gate_opened", 1) not in marks, marks
    held = STATE_DIR / "groups" / str(killed["group"])
    assert not (held / "gate.json").exists()
    assert group_pids(held.name) == [] and group_pids(held.name.removesuffix("-r1")) == []
    assert not list(held.glob("node-*/torchrun/*/attempt_*/*/process_group.json")), "a held rank ran its script"
