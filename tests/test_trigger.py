"""``GroupTrigger`` and ``GroupEvent``: serialization, and watching real local groups.

The groups are real: torchrun agents under the local backend's supervisors, ranks on gloo over
loopback, launched without a watched caller (as the deferrable operator launches them). The
trigger runs under ``asyncio.run`` exactly as the triggerer would drive it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from airflow._shared.module_loading import import_string  # what the triggerer resolves classpaths with

from airflow_torchrun.backends.handles import GroupHandle, LocalHandle
from airflow_torchrun.backends.kubernetes.backend import KubernetesBackend
from airflow_torchrun.backends.kubernetes.runtimes import BUILTIN_RUNTIMES
from airflow_torchrun.backends.local.backend import LocalBackend
from airflow_torchrun.naming import GroupIdentity
from airflow_torchrun.spec import GroupSpec
from airflow_torchrun.status import GroupStatus, NodeObservation, NodePhase, Outcome
from airflow_torchrun.triggers import GroupEvent, GroupTrigger
from airflow_torchrun.watch import Verdict

from .k8s.fake_api import FakeKubeAPI

# Every rank: join the group, one all_reduce, then act on argv[1]:
#   ok      - finish at once
#   fail    - rank 1 exits with code 7, rank 0 sleeps until torn down
#   release - wait until the file argv[2] exists, then finish (the test decides when)
SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"rank {rank} joined, sum={int(t.item())}", flush=True)
    mode = sys.argv[1]
    if mode == "fail":
        if rank == 1:
            # Leave the group first: exiting with a live gloo group intermittently ends in
            # SIGABRT ("terminate called without an active exception") instead of the exit code.
            dist.destroy_process_group()
            sys.exit(7)
        time.sleep(120)  # rank 0 stays healthy (no collective to fail in): torn down by the test
    if mode == "release":
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()
    """
)

POLL = 0.1


def handle_dict(**overrides: Any) -> dict[str, Any]:
    base = LocalHandle(
        group_id="g-0123456789-t1",
        num_nodes=2,
        world_size=4,
        launched_at=1_767_225_600.5,
        group_dir="/var/lib/torchrun/groups/g-0123456789-t1",
        startup_timeout=600.0,
        teardown_grace=10.0,
        master_port=29511,
    ).to_dict()
    return {**base, **overrides}


async def first_event(trigger: GroupTrigger) -> GroupEvent:
    async for event in trigger.run():
        return GroupEvent.from_payload(event.payload)
    raise AssertionError("the trigger stopped without an event")


class Groups:
    """Launches real local groups and makes sure none outlives its test."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.backend = LocalBackend(tmp_path / "state")
        self.handles: list[GroupHandle] = []
        self.script = tmp_path / "tiny_dist.py"
        self.script.write_text(SCRIPT)

    def launch(self, *args: str, num_nodes: int = 2, command: list[str] | None = None) -> GroupHandle:
        spec = GroupSpec.create(
            num_nodes=num_nodes,
            nproc_per_node=1,
            script=None if command else str(self.script),
            command=command,
            script_args=list(args),
            teardown_grace=3.0,
            threads_per_proc=1,
        )
        identity = GroupIdentity("trigger_test", "train", f"run-{uuid.uuid4().hex[:8]}")
        plan = self.backend.plan(spec, identity, {})
        handle = self.backend.launch(plan, watch_caller=False)
        self.handles.append(handle)
        return handle

    def wait_running(self, handle: GroupHandle, deadline_s: float = 120.0) -> None:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if all(n.phase is NodePhase.RUNNING for n in self.backend.observe(handle)):
                return
            time.sleep(0.05)
        raise AssertionError(f"group {handle.group_id} did not start: {self.backend.observe(handle)}")


@pytest.fixture
def groups(tmp_path: Path) -> Iterator[Groups]:
    g = Groups(tmp_path)
    yield g
    for handle in g.handles:
        g.backend.teardown(handle)
        assert g.backend.running_pids(handle) == [], f"group {handle.group_id} left processes behind"


# -- serialization ----------------------------------------------------------------------------


def make_event(status: Outcome) -> GroupEvent:
    nodes = (
        NodeObservation(0, NodePhase.FAILED, exit_code=-15, signal="SIGTERM", started_at=1.0, stopped_by="SIGTERM"),
        NodeObservation(1, NodePhase.FAILED, exit_code=1, started_at=1.0, finished_at=2.5, reason="OOMKilled"),
    )
    return GroupEvent(
        status=status,
        group_id="g-0123456789-t1",
        handle=GroupHandle.from_dict(handle_dict()),
        failed_node=1,
        reason="node 1 exited with code 1 (OOMKilled)",
        nodes=nodes,
    )


@pytest.mark.parametrize("status", [o for o in Outcome if o.terminal])
def test_event_payload_round_trips_through_json_and_airflow(status: Outcome) -> None:
    from airflow.serialization.serialized_objects import BaseSerialization

    event = make_event(status)
    payload = event.to_payload()
    assert payload["status"] == status.value
    assert payload["nodes"][1]["phase"] == "failed"
    assert GroupEvent.from_payload(json.loads(json.dumps(payload))) == event
    stored = BaseSerialization.deserialize(BaseSerialization.serialize(payload))
    assert GroupEvent.from_payload(stored) == event
    assert event.node_exit_codes == [-15, 1]


def test_event_maps_back_to_the_group_status_explain_needs() -> None:
    status = GroupStatus(Outcome.STARTUP_TIMEOUT, (NodeObservation(0, NodePhase.PENDING),), 0, "node(s) 0 ...")
    event = GroupEvent.from_status(GroupHandle.from_dict(handle_dict()), status)
    assert event.status is Outcome.STARTUP_TIMEOUT
    assert GroupEvent.from_payload(event.to_payload()).group_status() == status
    assert make_event(Outcome.PROGRESS_TIMEOUT).group_status().state is Outcome.FAILED
    with pytest.raises(ValueError, match="still running"):
        GroupEvent.from_status(GroupHandle.from_dict(handle_dict()), GroupStatus(Outcome.RUNNING))


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        ({"status": "failed"}, r"missing \['group_id', 'handle'\]"),
        ({**make_event(Outcome.FAILED).to_payload(), "status": "exploded"}, "malformed.*exploded"),
        ({**make_event(Outcome.FAILED).to_payload(), "rank": 3}, r"unknown \['rank'\]"),
        ("succeeded", "is a dict"),
    ],
)
def test_event_rejects_foreign_payloads(payload: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GroupEvent.from_payload(payload)


def test_trigger_serialize_round_trips_and_classpath_imports() -> None:
    from airflow.serialization.serialized_objects import BaseSerialization

    carry = {"launches": {"restarts": 1, "history": [{"kind": "restart"}]}, "contract": {"mlflow_run_id": "abc"}}
    trigger = GroupTrigger(handle_dict(), poll_interval=2, progress_timeout=900, deadline=1796050000.5, carry=carry)
    classpath, kwargs = trigger.serialize()
    assert classpath == "airflow_torchrun.triggers.GroupTrigger"
    assert import_string(classpath) is GroupTrigger
    assert kwargs == {
        "handle": handle_dict(),
        "poll_interval": 2.0,
        "progress_timeout": 900.0,
        "deadline": 1796050000.5,
        "error_budget": 300.0,
        "not_before": None,
        "carry": carry,
    }
    # as the triggerer does it: stored, read back, re-instantiated
    stored = BaseSerialization.deserialize(BaseSerialization.serialize(kwargs))
    again = import_string(classpath)(**stored)
    assert again.serialize() == (classpath, kwargs)
    assert again.handle == GroupHandle.from_dict(handle_dict())


def test_the_event_hands_the_carry_back_so_the_re_entry_reads_nothing_from_xcom() -> None:
    """What the operator gave the trigger when it deferred (the try's launches, its contract's
    state) comes back in the event, through Airflow's own serialisation of the payload."""
    from airflow.serialization.serialized_objects import BaseSerialization

    carry = {"launches": {"port_races": 0, "preemptions": 2, "restarts": 1}, "contract": {"mlflow_run_id": "r-1"}}
    event = GroupEvent.from_verdict(
        GroupHandle.from_dict(handle_dict()), Verdict(Outcome.FAILED, "node 1 exited with code 1"), carry
    )
    stored = BaseSerialization.deserialize(BaseSerialization.serialize(event.to_payload()))
    again = GroupEvent.from_payload(stored)
    assert again.carry == carry and again.status is Outcome.FAILED


def test_trigger_rejects_bad_arguments_with_every_problem() -> None:
    with pytest.raises(ValueError) as err:
        GroupTrigger(handle_dict(backend="slurm"), poll_interval=0, progress_timeout=-1)
    text = str(err.value)
    assert "backend 'slurm'" in text
    assert "poll_interval must be a positive number" in text
    assert "progress_timeout must be a positive number" in text
    with pytest.raises(ValueError, match=r"GroupHandle.to_dict\(\)"):
        GroupTrigger({"group_id": "x"})


# -- watching on-disk state without processes -------------------------------------------------


def test_startup_timeout_when_no_node_ever_starts(tmp_path: Path) -> None:
    # A group directory whose supervisors never came up (nothing recorded on disk).
    location = tmp_path / "state" / "groups" / "g-never-t1"
    (location / "node-0").mkdir(parents=True)
    handle = handle_dict(
        group_id="g-never-t1", num_nodes=1, group_dir=str(location), launched_at=time.time(), startup_timeout=0.3
    )
    event = asyncio.run(first_event(GroupTrigger(handle, poll_interval=0.05)))
    assert event.status is Outcome.STARTUP_TIMEOUT
    assert event.failed_node == 0
    assert "did not start within startup_timeout=0.3s" in event.reason


def test_error_event_when_the_group_cannot_be_read(tmp_path: Path) -> None:
    location = tmp_path / "state" / "groups" / "g-corrupt-t1"
    (location / "node-0").mkdir(parents=True)
    (location / "node-0" / "exit.json").write_text('{"returncode": "not a number"}')
    handle = handle_dict(group_id="g-corrupt-t1", num_nodes=1, group_dir=str(location), launched_at=time.time())
    event = asyncio.run(first_event(GroupTrigger(handle, poll_interval=0.01)))
    # A malformed record is no passing hiccup: the watch gives up at once, and says so.
    assert event.status is Outcome.ERROR
    assert "looking at the group failed with a permanent error" in event.reason
    assert "not a number" in event.reason and "state is unknown" in event.reason


# -- watching real groups ---------------------------------------------------------------------


@pytest.mark.slow
def test_success(groups: Groups) -> None:
    handle = groups.launch("ok")
    event = asyncio.run(first_event(GroupTrigger(handle.to_dict(), poll_interval=POLL)))
    assert event.status is Outcome.SUCCEEDED, event.reason
    assert event.group_id == handle.group_id
    assert event.node_exit_codes == [0, 0]
    assert event.handle == handle
    # A supervisor records exit.json just before it exits: the re-entry's teardown waits it out.
    groups.backend.teardown(event.handle)
    assert groups.backend.running_pids(handle) == []


@pytest.mark.slow
def test_rank_exiting_with_code_7_names_the_node(groups: Groups) -> None:
    handle = groups.launch("fail")
    event = asyncio.run(first_event(GroupTrigger(handle.to_dict(), poll_interval=POLL)))
    assert event.status is Outcome.FAILED
    assert event.failed_node == 1
    # Seen from the agent's first report (the rank's own code), or once the agent exited (its code 1).
    assert event.reason.startswith(("node 1 failed (local rank 0 exited with code 7", "node 1 exited with code 1"))
    # What the operator's re-entry does with the event: tear down, then explain.
    groups.backend.teardown(event.handle)
    assert groups.backend.running_pids(handle) == []
    report = groups.backend.explain(event.handle, event.group_status())
    assert "rank 1 (node 1, local rank 0) exited with code 7" in report.message


@pytest.mark.slow
def test_triggerer_restart_resumes_watching_and_never_touches_the_group(groups: Groups) -> None:
    release = groups.tmp_path / "release"
    handle = groups.launch("release", str(release))
    first = GroupTrigger(handle.to_dict(), poll_interval=POLL)

    async def restart() -> tuple[bool, GroupEvent]:
        watching = asyncio.create_task(first_event(first))
        await asyncio.to_thread(groups.wait_running, handle)
        await asyncio.sleep(3 * POLL)  # a few polls of a running group
        watching.cancel()  # what a triggerer shutting down does
        with pytest.raises(asyncio.CancelledError):
            await watching
        await asyncio.sleep(1.0)  # time for a wrongly stopped group to show it
        still_running = bool(groups.backend.running_pids(handle)) and not any(
            (Path(handle.group_dir) / f"node-{n}" / "exit.json").exists() for n in range(handle.num_nodes)
        )
        classpath, kwargs = first.serialize()
        second = import_string(classpath)(**json.loads(json.dumps(kwargs)))  # a new triggerer's copy
        resumed = asyncio.create_task(first_event(second))
        await asyncio.sleep(3 * POLL)
        release.touch()
        return still_running, await resumed

    still_running, event = asyncio.run(restart())
    assert still_running, "cancelling the trigger stopped the group"
    assert event.status is Outcome.SUCCEEDED, event.reason
    assert event.node_exit_codes == [0, 0]


@pytest.mark.slow
def test_progress_timeout_tears_the_hung_group_down_at_once(groups: Groups) -> None:
    # One node whose only rank says it is up, then hangs silently: its log stops growing.
    hang = "import time; print('rank up', flush=True); time.sleep(120)"
    handle = groups.launch(num_nodes=1, command=[sys.executable, "-c", hang])
    log = Path(groups.backend.log_locations(handle)[0])
    deadline = time.monotonic() + 120
    while not (log.exists() and "rank up" in log.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"the rank never came up; log: {log}"
        time.sleep(0.05)
    trigger = GroupTrigger(handle.to_dict(), poll_interval=POLL, progress_timeout=1.5)
    event = asyncio.run(first_event(trigger))
    assert event.status is Outcome.PROGRESS_TIMEOUT
    assert "progress_timeout=1.5s" in event.reason
    # Decided by the watch: stopped now, not when a worker slot frees for the re-entry (which may
    # never come if the task is marked failed meanwhile).
    assert groups.backend.running_pids(handle) == []
    asyncio.run(trigger.on_kill())  # the user marks the deferred task failed too: harmless
    assert groups.backend.running_pids(handle) == []


@pytest.mark.slow
def test_importing_the_trigger_loads_no_heavy_library() -> None:
    code = (
        "import sys, airflow_torchrun.triggers\n"
        "heavy = sorted({'torch', 'kubernetes', 's3fs', 'mlflow'} & set(sys.modules))\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- watching a Kubernetes group (the fake API server of tests/k8s, through the provider's hooks) --

K8S_NS = "ml"


@dataclass
class K8sGroup:
    fake: FakeKubeAPI
    backend: KubernetesBackend
    handle: GroupHandle

    @property
    def job(self) -> str:
        return str(self.handle.job_name)

    def job_deletes(self) -> list[Any]:
        return [c for c in self.fake.calls_to("DELETE", "jobs") if c.path.endswith(f"/jobs/{self.job}")]


@pytest.fixture
def k8s_group(tmp_path: Path) -> Iterator[K8sGroup]:
    fake = FakeKubeAPI().start()
    try:
        kubeconfig = tmp_path / "kubeconfig.yaml"
        kubeconfig.write_text(yaml.safe_dump(fake.kubeconfig(K8S_NS)))
        backend = KubernetesBackend(
            namespace=K8S_NS, config_file=str(kubeconfig), watch_seconds=0.5, runtimes=BUILTIN_RUNTIMES
        )
        spec = GroupSpec.create(
            num_nodes=2, nproc_per_node=1, script="/opt/trainer/train.py", backend="kubernetes", runtime="cpu"
        )
        plan = backend.plan(spec, GroupIdentity("trigger_test", "train", "run-k8s"), {})
        handle = backend.launch(plan, watch_caller=False)
        fake.create_pods(K8S_NS, str(handle.job_name))
        yield K8sGroup(fake, backend, handle)
    finally:
        fake.stop()


def test_k8s_rank_oom_killed_names_the_node(k8s_group: K8sGroup) -> None:
    g = k8s_group

    async def scenario() -> GroupEvent:
        watching = asyncio.create_task(first_event(GroupTrigger(g.handle.to_dict(), poll_interval=POLL)))
        g.fake.set_running(K8S_NS, g.job)
        await asyncio.sleep(3 * POLL)
        g.fake.set_terminated(K8S_NS, g.job, 1, exit_code=137, reason="OOMKilled")
        return await watching

    event = asyncio.run(scenario())
    assert event.status is Outcome.FAILED
    assert event.failed_node == 1
    assert "OOMKilled" in event.reason
    assert g.job_deletes() == [], "the trigger only watches; the operator tears down"


def test_k8s_triggerer_restart_resumes_watching(k8s_group: K8sGroup) -> None:
    g = k8s_group
    first = GroupTrigger(g.handle.to_dict(), poll_interval=POLL)

    async def scenario() -> GroupEvent:
        g.fake.set_running(K8S_NS, g.job)
        watching = asyncio.create_task(first_event(first))
        await asyncio.sleep(5 * POLL)
        watching.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watching
        classpath, kwargs = first.serialize()
        resumed = asyncio.create_task(first_event(import_string(classpath)(**json.loads(json.dumps(kwargs)))))
        await asyncio.sleep(3 * POLL)
        g.fake.set_terminated(K8S_NS, g.job, None, exit_code=0, reason="Completed")
        return await resumed

    event = asyncio.run(scenario())
    assert event.status is Outcome.SUCCEEDED, event.reason
    assert event.node_exit_codes == [0, 0]
    assert g.job_deletes() == []
    assert len(g.fake.pods(K8S_NS, g.job)) == 2


def test_k8s_progress_timeout_deletes_the_hung_group(k8s_group: K8sGroup) -> None:
    g = k8s_group
    g.fake.set_running(K8S_NS, g.job)
    pod0 = g.fake.pod(K8S_NS, g.job, 0)["metadata"]["name"]
    g.fake.add_log(pod0, "[node 0 rank 0] step 1")
    trigger = GroupTrigger(g.handle.to_dict(), poll_interval=POLL, progress_timeout=1.0)
    event = asyncio.run(first_event(trigger))
    assert event.status is Outcome.PROGRESS_TIMEOUT
    assert g.job_deletes() and all(c.propagation_policy == "Foreground" for c in g.job_deletes())
    asyncio.run(trigger.on_kill())  # idempotent
    assert g.fake.pods(K8S_NS, g.job) == []
