"""The deferred half reads progress records too: the trigger logs the summary line and the
straggler warning from the ranks' logs, as the sync watch does (one watch core)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from airflow_torchrun.backends.handles import LocalHandle
from airflow_torchrun.contract.progress import ProgressRecord
from airflow_torchrun.triggers import GroupEvent, GroupTrigger
from airflow_torchrun.watch import Outcome


def test_trigger_logs_the_summary_and_a_straggler_from_the_records(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    group = tmp_path / "groups" / "g-progress-t1"
    now = time.time()
    for node in range(2):
        node_dir = group / f"node-{node}"
        node_dir.mkdir(parents=True)
        lines = [
            f"[node {node} rank {node}] "
            + ProgressRecord(
                rank=node,
                step=10 * s,
                time=now - 10 + s,
                total_steps=50,
                step_time=0.3,
                own_time=0.28 if node == 1 else 0.1,
            ).to_line()
            for s in range(1, 6)
        ]
        (node_dir / "node.log").write_text("some output\n" + "\n".join(lines) + "\n")
        (node_dir / "exit.json").write_text(json.dumps({"returncode": 0, "finished_at": now}))
    handle = LocalHandle(
        group_id="g-progress-t1",
        num_nodes=2,
        world_size=2,
        launched_at=now - 20,
        startup_timeout=600.0,
        teardown_grace=1.0,
        group_dir=str(group),
        master_port=1,
    )

    async def first() -> GroupEvent:
        async for event in GroupTrigger(handle.to_dict(), poll_interval=0.05).run():
            return GroupEvent.from_payload(event.payload)
        raise AssertionError("no event")

    caplog.set_level("INFO")
    event = asyncio.run(first())
    assert event.status is Outcome.SUCCEEDED
    said = capfd.readouterr().out + caplog.text
    assert "step 50/50 (100%)" in said, said
    assert "straggler: rank 1 on node 1" in said, said
