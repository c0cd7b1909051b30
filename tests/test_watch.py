"""The watch core: tables of real-shaped observations and errors -> decisions; then both drivers.

The core is pure (no clock, no I/O), so time is a number here. The drivers are exercised against
real local groups, with the failures of a look injected at the backend's boundary.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path

import pytest

from airflow_torchrun.backends.handles import LocalHandle
from airflow_torchrun.backends.kubernetes.backend import last_lines_mark
from airflow_torchrun.backends.local.backend import LocalBackend
from airflow_torchrun.backends.local.backend import log_sizes_mark as sizes
from airflow_torchrun.errors import StorageError
from airflow_torchrun.naming import GroupIdentity
from airflow_torchrun.spec import GroupSpec
from airflow_torchrun.status import NodeObservation, NodePhase, Outcome
from airflow_torchrun.watch import Note, Watch, WatchConfig, watch_sync

T0 = 1_800_000_000.0
RUNNING = [NodeObservation(0, NodePhase.RUNNING), NodeObservation(1, NodePhase.RUNNING)]
DONE = [NodeObservation(0, NodePhase.SUCCEEDED, exit_code=0), NodeObservation(1, NodePhase.SUCCEEDED, exit_code=0)]
FAILED = [NodeObservation(0, NodePhase.RUNNING), NodeObservation(1, NodePhase.FAILED, exit_code=7, finished_at=T0)]


class ApiDown(Exception):
    """What a Kubernetes client raises for a 503 (an ``ApiException`` carries ``status``)."""

    status = 503


class Forbidden(Exception):
    status = 403


def handle(**kw: float) -> LocalHandle:
    return LocalHandle(
        group_id="g-1",
        num_nodes=2,
        world_size=2,
        launched_at=T0,
        startup_timeout=kw.get("startup_timeout", 600.0),
        teardown_grace=1.0,
        group_dir="/nonexistent",
        master_port=1,
    )


def core(**config: float | None) -> Watch:
    return Watch.of(handle(), WatchConfig(**config), T0)  # type: ignore[arg-type]


def test_terminal_states_end_the_watch_with_the_first_failure_named() -> None:
    assert core().observed(RUNNING, None, T0 + 1).verdict is None
    assert core().observed(DONE, None, T0 + 1).verdict.outcome is Outcome.SUCCEEDED  # type: ignore[union-attr]
    verdict = core().observed(FAILED, None, T0 + 1).verdict
    assert verdict is not None and verdict.outcome is Outcome.FAILED and verdict.failed_node == 1
    assert "exited with code 7" in verdict.reason


def test_transient_errors_are_ridden_out_within_the_budget_then_the_group_is_seen_again() -> None:
    w = core(error_budget=60.0)
    w.observed(RUNNING, None, T0)
    notes: list[Note] = []
    for t in range(1, 59):  # a minute of 503s, one look a second
        step = w.failed(ApiDown("503 Service Unavailable"), T0 + t)
        assert step.verdict is None, f"gave up after {t}s of a 60s budget"
        notes += step.notes
    # One warning when it starts and one every 30 s while it lasts, not one per look.
    assert 1 <= len(notes) <= 3 and all(n.level == logging.WARNING for n in notes)
    assert "keeps running" in notes[0].message and "transient" in notes[0].message
    back = w.observed(RUNNING, None, T0 + 59)
    assert back.verdict is None and "observing again after 58 failed look(s)" in back.notes[0].message
    # The budget counts failures *in a row*: a fresh run of errors starts from zero.
    assert w.failed(ApiDown(), T0 + 100).verdict is None


def test_past_the_budget_the_watch_gives_up_saying_the_state_is_unknown() -> None:
    w = core(error_budget=30.0)
    w.observed(RUNNING, None, T0)
    assert w.failed(ConnectionResetError("reset by peer"), T0 + 1).verdict is None
    verdict = w.failed(ConnectionResetError("reset by peer"), T0 + 31).verdict
    assert verdict is not None and verdict.outcome is Outcome.ERROR
    assert "observe_error_budget of 30s" in verdict.reason and "state is unknown" in verdict.reason
    assert [n.phase for n in verdict.nodes] == [NodePhase.RUNNING, NodePhase.RUNNING]


@pytest.mark.parametrize("exc", [Forbidden("forbidden"), ValueError("malformed"), StorageError("no access")])
def test_a_permanent_error_gives_up_at_once(exc: Exception) -> None:
    verdict = core(error_budget=600.0).failed(exc, T0 + 1).verdict
    assert verdict is not None and verdict.outcome is Outcome.ERROR and "permanent" in verdict.reason


def test_the_deadline_passes_even_while_the_group_cannot_be_seen() -> None:
    w = core(deadline=T0 + 10, error_budget=600.0)
    assert w.observed(RUNNING, None, T0 + 9).verdict is None
    verdict = w.failed(ApiDown(), T0 + 10).verdict
    assert verdict is not None and verdict.outcome is Outcome.TIMEOUT


def test_progress_timeout_counts_from_the_last_change_of_the_mark() -> None:
    w = core(progress_timeout=30.0)
    assert w.observed(RUNNING, sizes((10, 10)), T0 + 1).verdict is None
    assert w.observed(RUNNING, sizes((20, 10)), T0 + 25).verdict is None  # progress at +25
    assert w.observed(RUNNING, sizes((20, 10)), T0 + 54).verdict is None
    verdict = w.observed(RUNNING, sizes((20, 10)), T0 + 55).verdict
    assert verdict is not None and verdict.outcome is Outcome.PROGRESS_TIMEOUT
    assert "progress_timeout=30s" in verdict.reason and "hung" in verdict.reason


def test_a_slow_start_is_not_a_hang_but_silence_past_startup_timeout_is() -> None:
    """Before its first output a group gets startup_timeout, not progress_timeout (imports, data
    loading, rendezvous on a busy machine took 20 s here with nothing printed)."""
    w = Watch.of(handle(startup_timeout=120.0), WatchConfig(progress_timeout=10.0), T0)
    assert all(w.observed(RUNNING, sizes((0, 0)), T0 + t).verdict is None for t in range(1, 120))
    verdict = w.observed(RUNNING, sizes((0, 0)), T0 + 121).verdict
    assert verdict is not None and verdict.outcome is Outcome.PROGRESS_TIMEOUT
    assert "since launch, with no output at all" in verdict.reason and "startup_timeout=120s" in verdict.reason
    # Logs that appear, empty, as the nodes start (size -1, then 0) are no output either.
    w = Watch.of(handle(startup_timeout=120.0), WatchConfig(progress_timeout=10.0), T0)
    for t, mark in ((1, (-1, -1)), (2, (0, -1)), (3, (0, 0)), (60, (0, 0))):
        assert w.observed(RUNNING, sizes(mark), T0 + t).verdict is None, (t, mark)
    # Once it has said anything, progress_timeout alone applies.
    w = Watch.of(handle(startup_timeout=120.0), WatchConfig(progress_timeout=10.0), T0)
    assert w.observed(RUNNING, sizes((0, 0)), T0 + 1).verdict is None
    assert w.observed(RUNNING, sizes((5, 0)), T0 + 30).verdict is None
    assert w.observed(RUNNING, sizes((5, 0)), T0 + 39).verdict is None
    verdict = w.observed(RUNNING, sizes((5, 0)), T0 + 40).verdict
    assert verdict is not None and "since its last progress (progress_timeout=10s)" in verdict.reason
    # A watch that starts on a group that has written already (after a deferral, a triggerer
    # restart): progress_timeout alone applies from its first look.
    for mark in (sizes((120, 40)), last_lines_mark(((0, "2026-12-01T10:00:00Z"), (1, "")))):
        w = Watch.of(handle(startup_timeout=120.0), WatchConfig(progress_timeout=10.0), T0)
        assert w.observed(RUNNING, mark, T0 + 1).verdict is None
        assert w.observed(RUNNING, mark, T0 + 11).verdict is not None, mark
    assert not sizes((-1, 0)).output and not last_lines_mark(((0, ""), (1, ""))).output


def test_a_backend_that_cannot_tell_progress_is_never_called_hung() -> None:
    w = core(progress_timeout=5.0)
    first = w.observed(RUNNING, None, T0 + 1)
    assert any("cannot tell progress" in n.message for n in first.notes)
    assert all(w.observed(RUNNING, None, T0 + t).verdict is None for t in range(2, 100))


def test_state_changes_and_heartbeats_are_noted_once_each() -> None:
    w = core(heartbeat=60.0)
    notes = [n.message for t in range(0, 130) for n in w.observed(RUNNING, None, T0 + t).notes]
    assert notes == [
        "Group g-1 nodes: running, running",
        "Group g-1 still running, 60s since launch",
        "Group g-1 still running, 120s since launch",
    ]


def test_startup_timeout_is_a_verdict_of_its_own() -> None:
    w = Watch.of(handle(startup_timeout=5.0), WatchConfig(), T0)
    pending = [NodeObservation(0, NodePhase.RUNNING), NodeObservation(1, NodePhase.PENDING, reason="Unschedulable")]
    assert w.observed(pending, None, T0 + 4).verdict is None
    verdict = w.observed(pending, None, T0 + 6).verdict
    assert verdict is not None and verdict.outcome is Outcome.STARTUP_TIMEOUT and "Unschedulable" in verdict.reason


# -- the drivers, against real groups -------------------------------------------------------------

SCRIPT = """
import sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
time.sleep(float(sys.argv[1]))
dist.barrier()
dist.destroy_process_group()
"""


class FlakyLocalBackend(LocalBackend):
    """A real local backend whose looks fail (like an API answering 503) until ``healthy_at``."""

    healthy_at = 0.0
    failures = 0

    def observe(self, handle: LocalHandle) -> list[NodeObservation]:  # type: ignore[override]
        if time.time() < self.healthy_at:
            self.failures += 1
            raise ApiDown("503 Service Unavailable")
        return super().observe(handle)


def launch(tmp_path: Path, seconds: float) -> tuple[FlakyLocalBackend, LocalHandle]:
    script = tmp_path / "sleepy.py"
    script.write_text(SCRIPT)
    backend = FlakyLocalBackend(tmp_path / "state")
    spec = GroupSpec.create(num_nodes=2, script=str(script), script_args=[str(seconds)], teardown_grace=2.0)
    plan = backend.plan(spec, GroupIdentity("watch_test", "train", uuid.uuid4().hex[:8]), {})
    return backend, backend.launch(plan, watch_caller=False)  # type: ignore[return-value]


@pytest.mark.slow
def test_sync_driver_rides_out_failed_looks_and_the_group_finishes(tmp_path: Path) -> None:
    backend, h = launch(tmp_path, seconds=6.0)
    try:
        backend.healthy_at = time.time() + 4.0  # 4 s of 503s while every rank is healthy
        notes: list[Note] = []
        verdict = watch_sync(
            backend, h, Watch.of(h, WatchConfig(poll_interval=0.1, error_budget=20), time.time()), emit=notes.append
        )
        assert backend.failures >= 4  # looks 0.2, 0.4, 0.8, 1.6, 2 s apart (backing off)
        assert verdict is not None and verdict.outcome is Outcome.SUCCEEDED, verdict
        assert [n.exit_code for n in verdict.nodes] == [0, 0]
        assert any("could not look at the group" in n.message for n in notes)
    finally:
        backend.teardown(h)
    assert backend.running_pids(h) == []


@pytest.mark.slow
def test_async_trigger_rides_out_failed_looks_the_same_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_torchrun import triggers
    from airflow_torchrun.triggers import GroupEvent, GroupTrigger

    backend, h = launch(tmp_path, seconds=6.0)
    backend.healthy_at = time.time() + 4.0
    monkeypatch.setattr(triggers, "backend_from_handle", lambda handle: backend)

    async def first() -> GroupEvent:
        async for event in GroupTrigger(h.to_dict(), poll_interval=0.1, error_budget=20.0).run():
            return GroupEvent.from_payload(event.payload)
        raise AssertionError("no event")

    try:
        event = asyncio.run(first())
        assert backend.failures >= 4  # looks 0.2, 0.4, 0.8, 1.6, 2 s apart (backing off)
        assert event.status is Outcome.SUCCEEDED, event.reason
    finally:
        backend.teardown(h)
    assert backend.running_pids(h) == []


@pytest.mark.slow
def test_the_trigger_fires_no_sooner_than_not_before(tmp_path: Path) -> None:
    from airflow_torchrun.triggers import GroupEvent, GroupTrigger

    backend, h = launch(tmp_path, seconds=0.0)
    not_before = time.time() + 8.0

    async def first() -> tuple[GroupEvent, float]:
        async for event in GroupTrigger(h.to_dict(), poll_interval=0.1, not_before=not_before).run():
            return GroupEvent.from_payload(event.payload), time.time()
        raise AssertionError("no event")

    try:
        event, fired_at = asyncio.run(first())
    finally:
        backend.teardown(h)
    assert event.status is Outcome.SUCCEEDED, event.reason
    assert fired_at >= not_before


def test_failed_looks_back_off_and_a_good_look_resets_the_pace() -> None:
    """An API server answering 5xx is looked at less and less often (the sync and the deferred
    watch both sleep ``pause()``), never less than every BACKOFF_CAP seconds, and once a look
    succeeds the watch polls at poll_interval again."""
    from airflow_torchrun.watch import BACKOFF_CAP

    w = Watch.of(handle(), WatchConfig(poll_interval=0.1, error_budget=600.0), T0)
    assert w.pause() == 0.1
    pauses = []
    for n in range(1, 10):
        assert w.failed(ConnectionError("503 from the API"), T0 + n).verdict is None
        pauses.append(w.pause())
    assert pauses[:4] == [0.2, 0.4, 0.8, 1.6] and pauses[4:] == [BACKOFF_CAP] * 5
    assert sum(pauses) > 10 * 0.1  # far fewer looks than at poll_interval
    w.observed(RUNNING, None, T0 + 20)
    assert w.pause() == 0.1
    # A poll_interval above the cap is kept as it is.
    slow = Watch.of(handle(), WatchConfig(poll_interval=5.0), T0)
    slow.failed(ConnectionError("503"), T0 + 1)
    assert slow.pause() == 5.0


def test_why_pending_nodes_wait_is_noted_when_it_changes() -> None:
    # A queued group's nodes wait for Kueue (the reason the Kubernetes backend reads from the
    # Workload): the task log must say so while it waits, not only at the startup timeout.
    w = Watch.of(handle(startup_timeout=600.0), WatchConfig(), T0)
    quota = "waiting for Kueue admission in queue training: couldn't assign flavors: insufficient unused quota"
    queued = [NodeObservation(0, NodePhase.PENDING, reason=quota), NodeObservation(1, NodePhase.PENDING, reason=quota)]
    placed = [NodeObservation(0, NodePhase.RUNNING), NodeObservation(1, NodePhase.PENDING, reason="ContainerCreating")]
    seen = [
        [n.message for n in w.observed(nodes, None, T0 + t).notes] for t, nodes in enumerate([queued, queued, placed])
    ]
    assert seen == [
        ["Group g-1 nodes: pending, pending", f"Group g-1 waiting: nodes 0,1: {quota}"],
        [],
        ["Group g-1 nodes: running, pending", "Group g-1 waiting: node 1: ContainerCreating"],
    ]
