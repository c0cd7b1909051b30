"""The try's timeline (XCom ``timeline``): every moment of a real run, in order, also through a
deferral and an in-try restart; and its pure parts (round trip, spans)."""

from __future__ import annotations

import time

import pytest

from airflow_torchrun.timeline import Mark, Timeline


def _marks(result, task_id: str = "train") -> list[tuple[str, int]]:
    events = Timeline.from_list(result.xcom(task_id, key="timeline")).events
    return [(e.mark.value, e.launch) for e in events]


def _in_order(marks: list[tuple[str, int]], *wanted: tuple[str, int]) -> bool:
    at = 0
    for item in wanted:
        try:
            at = marks.index(item, at) + 1
        except ValueError:
            return False
    return True


# Marks read after the fact, each at the moment it names (the ranks' clocks, the backend's record).
AFTER_THE_FACT = {Mark.FIRST_STEP, Mark.RANKS_STARTED, Mark.RENDEZVOUS, Mark.EXITED}


@pytest.mark.slow
@pytest.mark.parametrize("deferrable", [False, True], ids=["sync", "deferrable"])
def test_a_try_marks_each_moment_in_order(run_dag, tiny_script, deferrable: bool, monkeypatch) -> None:
    from airflow_torchrun.operators import one_try

    rendered: list[float] = []
    render = one_try._rendered_spec

    def timed_render(op):
        rendered.append(time.time())
        return render(op)

    monkeypatch.setattr(one_try, "_rendered_spec", timed_render)
    result = run_dag(
        f"""
        DistributedTrainingOperator(task_id="train", script={str(tiny_script)!r}, num_nodes=2, nproc_per_node=1,
                                    env={{"STEPS": "40", "STEP_SECONDS": "0.05"}}, track=False,
                                    deferrable={deferrable}, defer_after=0, progress_timeout=120)
        """
    )
    assert result.state == "success", result.log[-3000:]
    marks = _marks(result)
    expected = [
        ("try_started", -1),
        ("prepared", -1),
        ("contract_started", 0),
        ("contract_ready", 0),
        ("launch_started", 0),
        ("launched", 0),
        *([("deferred", 0)] if deferrable else []),
        ("ended", 0),
        ("teardown_started", 0),
        ("teardown_done", 0),
        ("finish_started", 0),
        ("try_ended", -1),
    ]
    assert _in_order(marks, *expected), marks
    assert ("first_output", 0) in marks, marks  # seen by the watch (the trigger's, when deferred)
    timeline = Timeline.from_list(result.xcom("train", key="timeline"))
    ended = timeline.first(Mark.ENDED, 0)
    assert ended is not None and ended.detail["outcome"] == "succeeded"
    # The ranks' own moments (their clocks, read after the fact) and the group's exit as the backend
    # recorded it: each launch has them, before the watch's verdict.
    for mark in (Mark.RANKS_STARTED, Mark.RENDEZVOUS, Mark.EXITED):
        event = timeline.first(mark, 0)
        assert event is not None, (mark, marks)
        assert timeline.first(Mark.LAUNCH_STARTED, 0).at <= event.at <= ended.at, (mark, timeline.events)
    started, stood = timeline.first(Mark.RANKS_STARTED, 0), timeline.first(Mark.RENDEZVOUS, 0)
    assert started.at <= stood.at
    # What the watch and the engine mark as it happens is in time order.
    own = [e for e in timeline.events if e.mark not in AFTER_THE_FACT]
    assert own == sorted(own, key=lambda e: e.at), "the watch's and the engine's marks are in time order"
    # The try starts with execute(): rendering and checking its spec is the try's own time, not Airflow's.
    assert rendered and timeline.first(Mark.TRY_STARTED).at <= rendered[0] <= timeline.first(Mark.PREPARED).at


@pytest.mark.slow
def test_an_in_try_restart_is_a_second_launch_on_the_timeline(run_dag, tiny_script) -> None:
    result = run_dag(
        f"""
        DistributedTrainingOperator(task_id="train", script={str(tiny_script)!r}, num_nodes=2, nproc_per_node=1,
                                    env={{"FAIL_RANK": "1", "FAIL_STEP": "2", "FAIL_MODE": "kill"}}, track=False,
                                    max_restarts=1, retries=0)
        """
    )
    # The script fails at step 2 on every launch: the restart is spent, then the try fails.
    assert result.state == "failed", result.log[-3000:]
    marks = _marks(result)
    # The relaunch is started held during launch 0's teardown; its gate opens once the teardown is
    # done and the rank contract (the resume point) was resolved.
    assert _in_order(
        marks,
        ("launched", 0),
        ("ended", 0),
        ("launch_started", 1),
        ("launched", 1),
        ("teardown_done", 0),
        ("relaunch", 0),
        ("contract_started", 1),
        ("contract_ready", 1),
        ("gate_opened", 1),
        ("ended", 1),
        ("try_ended", -1),
    ), marks
    assert ("withdrawn", 1) not in marks and ("launched", 2) not in marks, marks  # no budget left: none held
    relaunch = Timeline.from_list(result.xcom("train", key="timeline")).first(Mark.RELAUNCH)
    assert (
        relaunch is not None
        and relaunch.detail["kind"] == "restart"
        and "restart 1 of max_restarts=1" in relaunch.detail["why"]
    )


def test_the_timeline_round_trips_and_measures_spans() -> None:
    t = Timeline()
    t.mark(Mark.LAUNCH_STARTED, 10.0, 0)
    t.mark(Mark.LAUNCHED, 10.5, 0, group_id="g")
    assert t.mark_once(Mark.FIRST_OUTPUT, 12.0, 0) is not None
    assert t.mark_once(Mark.FIRST_OUTPUT, 13.0, 0) is None  # a watch seeing it again adds nothing
    again = Timeline.from_list(t.to_list())
    assert again == t
    assert again.between(Mark.LAUNCH_STARTED, Mark.FIRST_OUTPUT, 0) == 2.0
    assert again.between(Mark.LAUNCH_STARTED, Mark.ENDED, 0) is None
    assert again.launches() == [0]
    assert Timeline.from_list({"not": "a list"}) == Timeline()
    assert Timeline.from_list([{"mark": "no such mark", "at": 1}, {"mark": "launched", "at": 2}]).events[0].at == 2.0
