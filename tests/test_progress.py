"""Progress records: written by the worker helpers, read back from interleaved and partial log
text, turned into one summary line, starvation and straggler warnings, and progress evidence for
``progress_timeout``. Pure parts with tables; the helpers with a fake clock."""

from __future__ import annotations

import itertools
import logging

import pytest

from airflow_torchrun.backends.handles import LocalHandle
from airflow_torchrun.contract.progress import MARKER, ProgressRecord, RecordStream, parse_line, parse_records
from airflow_torchrun.progress import STARVATION, STRAGGLER, ProgressBoard, ProgressThresholds, replay
from airflow_torchrun.status import NodeObservation, NodePhase, ProgressMark
from airflow_torchrun.watch import Outcome, Watch, WatchConfig
from airflow_torchrun.worker.progress import ProgressLogger, ProgressRecorder


def log(size: object) -> ProgressMark:
    """A node log that holds output and has grown to ``size`` (as a backend's mark says it)."""
    return ProgressMark(("log", size), output=True)


T0 = 1_800_000_000.0


def rec(rank: int, step: int, t: float = T0, **kw: float) -> ProgressRecord:
    return ProgressRecord(rank=rank, step=step, time=t, total_steps=kw.pop("total", 100), **kw)  # type: ignore[arg-type]


# -- the record on the wire --------------------------------------------------------------------
def test_a_record_round_trips_through_its_line() -> None:
    record = rec(3, 120, samples_per_s=5120.5, step_time=0.0125, data_wait=0.12, loss=0.34)
    line = record.to_line()
    assert line.startswith(MARKER) and "\n" not in line and len(line) < 512  # one atomic pipe write
    assert parse_line(line) == [record]


@pytest.mark.parametrize(
    "text",
    [
        "[node 1 rank 3] " + rec(3, 120).to_line(),  # the backend's prefix
        "some output without newline" + rec(3, 120).to_line() + "more output",  # another write spliced in
        rec(3, 120).to_line() + " trailing",
    ],
)
def test_records_are_found_amid_other_output_on_the_line(text: str) -> None:
    assert parse_line(text) == [rec(3, 120)]


def test_two_records_on_one_line_give_both_unless_the_line_is_one_ranks() -> None:
    line = rec(0, 10).to_line()[:-1] + "garbage" + rec(1, 11).to_line()
    # The first is cut short by the splice (not valid JSON): skipped; the second is whole.
    assert parse_line(line) == [rec(1, 11)]
    line = rec(0, 10).to_line() + rec(1, 11).to_line()
    assert parse_line(line) == [rec(0, 10), rec(1, 11)]
    # A line of rank 0's (the launcher's prefix) reports rank 0 only: rank 1's is a forgery.
    assert parse_line("[node 0 rank 0] " + line) == [rec(0, 10)]


@pytest.mark.parametrize(
    "bad",
    [
        MARKER,
        MARKER + '{"rank": 0, "step": 3',  # cut short
        MARKER + '{"rank": "0", "step": 3, "time": 1}',  # wrong type
        MARKER + '{"rank": -1, "step": 3, "time": 1}',
        MARKER + '{"rank": 0, "step": 3, "time": NaN}',
        MARKER + "[1, 2, 3]",
        MARKER + '{"rank": true, "step": 3, "time": 1}',
        "no marker here",
    ],
)
def test_malformed_records_are_skipped_never_raised(bad: str) -> None:
    assert parse_line(bad) == []


def test_a_record_split_across_reads_is_read_once_whole() -> None:
    line = "[node 0 rank 1] " + rec(1, 7).to_line() + "\n"
    stream = RecordStream()
    got = []
    cuts = [0, 5, 30, len(line) - 1]  # arbitrary chunk boundaries, some inside the JSON
    for start, end in itertools.pairwise(cuts):
        got += stream.feed(line[start:end])
    assert got == []  # no newline yet
    got += stream.feed(line[cuts[-1] :])
    assert got == [rec(1, 7)]


def test_optional_fields_that_are_not_numbers_are_dropped() -> None:
    line = MARKER + '{"rank": 0, "step": 3, "time": 1.5, "loss": "x", "data_wait": 0.5, "total_steps": 0}'
    assert parse_line(line) == [ProgressRecord(rank=0, step=3, time=1.5, data_wait=0.5)]


# -- the helpers that write them ---------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def test_recorder_emits_one_record_per_window_with_the_window_means() -> None:
    clock, lines = Clock(), []
    recorder = ProgressRecorder(rank=2, interval=2.0, emit=lines.append, clock=clock)
    for step in range(1, 11):
        clock.now += 0.5
        # Both helpers report each step: it counts once; the timing says 20% was data wait.
        recorder.note(step, total_steps=10, samples=64, loss=1.0 / step)
        recorder.note(step, samples=64, loss=1.0 / step, step_seconds=0.5, data_seconds=0.1)
    records = parse_records(lines)
    assert [r.step for r in records] == [1, 5, 9, 10]  # the first step's, one per 2 s, and the last
    assert all(r.rank == 2 and r.total_steps == 10 for r in records)
    second = records[1]
    assert second.step_time == pytest.approx(0.5) and second.data_wait == pytest.approx(0.2)
    assert second.samples_per_s == pytest.approx(128.0) and second.loss == pytest.approx(0.2)


def test_recorder_without_timings_measures_step_time_by_the_clock() -> None:
    clock, lines = Clock(), []
    recorder = ProgressRecorder(rank=0, interval=1.0, emit=lines.append, clock=clock)
    for step in range(1, 6):
        clock.now += 0.25
        recorder.note(step, total_steps=100)
    records = parse_records(lines)
    assert records[-1].step_time == pytest.approx(0.25) and records[-1].data_wait is None


def test_interval_zero_turns_records_off() -> None:
    lines: list[str] = []
    recorder = ProgressRecorder(rank=0, interval=0, emit=lines.append)
    assert recorder.note(10, total_steps=10) is None and lines == []


def test_progress_logger_feeds_records_on_every_rank_and_lines_on_rank_0() -> None:
    for rank in (0, 1):
        clock, lines = Clock(), []
        recorder = ProgressRecorder(rank=rank, interval=0.1, emit=lines.append, clock=clock)
        logger = ProgressLogger(10, every=5, rank=rank, records=recorder, logger=logging.getLogger("t"))
        said = []
        for step in range(1, 11):
            clock.now += 0.2
            said.append(logger.update(step, loss=0.5))
        assert [r.step for r in parse_records(lines)][-1] == 10
        assert (said[4] is not None) is (rank == 0)


# -- the board ---------------------------------------------------------------------------------
def looks(board: ProgressBoard, per_look: list[list[ProgressRecord]]) -> list[str]:
    raised = []
    for records in per_look:
        up, _down = board.add(records)
        raised += [a.kind for a in up]
    return raised


def healthy(step: int, t: float) -> list[ProgressRecord]:
    return [rec(r, step, t, step_time=0.10 + 0.01 * r, data_wait=0.05) for r in range(4)]


def test_a_healthy_run_raises_neither_warning() -> None:
    board = ProgressBoard(nproc_per_node=2)
    assert looks(board, [healthy(s, T0 + s) for s in range(1, 20)]) == []
    assert board.alerts == {}


def test_sustained_data_wait_raises_starvation_once_with_what_to_try() -> None:
    board = ProgressBoard(nproc_per_node=2)
    starved = [[rec(r, s, T0 + s, step_time=0.2, data_wait=0.6) for r in range(4)] for s in range(1, 6)]
    # After the warm-up record, it must hold for `sustain` (3) rounds of records.
    assert looks(board, starved[:3]) == []
    assert looks(board, starved[3:]) == [STARVATION]
    message = board.alerts[STARVATION].message
    assert "60%" in message and "30%" in message and "num_workers" in message and "pin_memory" in message
    _up, down = board.add(healthy(9, T0 + 9))
    assert [a.kind for a in down] == [STARVATION] and board.alerts == {}


def test_a_slow_rank_is_named_with_its_node() -> None:
    board = ProgressBoard(nproc_per_node=2)
    slow = [
        [rec(r, s, T0 + s, step_time=0.35 if r == 3 else 0.1, data_wait=0.0) for r in range(4)] for s in range(1, 5)
    ]
    # The first record of a rank is its warm-up; then three in a row.
    assert looks(board, slow[:3]) == []
    assert looks(board, slow[3:]) == [STRAGGLER]
    alert = next(iter(board.alerts.values()))
    assert alert.rank == 3 and alert.node_rank == 1
    assert "rank 3 on node 1" in alert.message and "3.5x" in alert.message
    assert board.summary_line() == "step 4/100 (4%) | ETA 34s | data wait 0% | slowest rank 3 (3.5x median step)"


def test_a_rank_just_above_the_median_is_no_straggler_and_the_factor_is_configurable() -> None:
    rounds = [[rec(r, s, T0 + s, step_time=0.12 if r == 0 else 0.1) for r in range(3)] for s in range(1, 6)]
    assert looks(ProgressBoard(), rounds) == []
    strict = ProgressBoard(thresholds=ProgressThresholds(straggler_factor=1.1))
    assert looks(strict, rounds) == [STRAGGLER]


def test_a_blip_of_one_record_or_only_other_ranks_reporting_raises_nothing() -> None:
    board = ProgressBoard()
    steady = [[rec(r, s, T0 + s, step_time=0.1) for r in range(2)] for s in range(1, 4)]
    blip = [[rec(1, 4, T0 + 4, step_time=0.5)], [rec(0, 4, T0 + 4, step_time=0.1)], [rec(0, 5, T0 + 5, step_time=0.1)]]
    # Rank 1 was slow in one record; rank 0's records after it are no evidence against rank 1.
    assert looks(board, steady + blip) == []


def test_straggler_uses_the_time_not_spent_waiting_for_peers() -> None:
    # Synchronous training: every rank's wall step time is the slowest's; own_time tells them apart.
    rounds = [
        [rec(r, s, T0 + s, step_time=0.3, own_time=0.28 if r == 1 else 0.1) for r in range(3)] for s in range(1, 5)
    ]
    board = ProgressBoard()
    assert looks(board, rounds) == [STRAGGLER]
    assert next(iter(board.alerts.values())).rank == 1


def test_thresholds_are_validated() -> None:
    for bad in ({"data_wait_threshold": 1.5}, {"straggler_factor": 0.9}, {"sustain": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ProgressThresholds(**bad)  # type: ignore[arg-type]


def test_summary_line_reads_as_the_issue_describes() -> None:
    board = ProgressBoard(nproc_per_node=1)
    for step in (1100, 1200):  # a warm-up record, then the one judged
        board.add(
            [
                rec(0, step, total=5000, samples_per_s=3400, step_time=0.2, data_wait=0.12),
                rec(1, step + 1, total=5000, samples_per_s=3500, step_time=0.2, data_wait=0.12),
                rec(3, step, total=5000, samples_per_s=3400, step_time=0.28, data_wait=0.12),
            ]
        )
    assert board.summary_line() == (
        "step 1200/5000 (24%) | 3,400 samples/s | ETA 17m | data wait 12% | slowest rank 3 (1.4x median step)"
    )


def test_replay_of_a_whole_log_finds_what_a_watch_would_have_warned_about() -> None:
    records = [rec(r, s, T0 + s + r / 10, step_time=0.3 if r == 1 else 0.1) for s in range(1, 6) for r in range(2)]
    # Two ranks: the median is between them; rank 1 at 0.3 s vs a median of 0.2 s is 1.5x.
    _board, history = replay(records, nproc_per_node=1)
    assert [a.kind for a in history] == [STRAGGLER] and history[0].rank == 1


# -- the watch core reads them -----------------------------------------------------------------
def handle() -> LocalHandle:
    return LocalHandle(
        group_id="g-1",
        num_nodes=2,
        world_size=4,
        launched_at=T0,
        startup_timeout=600.0,
        teardown_grace=1.0,
        group_dir="/nonexistent",
        master_port=1,
    )


RUNNING = [NodeObservation(0, NodePhase.RUNNING), NodeObservation(1, NodePhase.RUNNING)]


def test_watch_logs_a_summary_every_progress_every_seconds_and_warns_of_a_straggler() -> None:
    watch = Watch.of(handle(), WatchConfig(progress_every=30.0), T0)
    messages = []
    for s in range(1, 70):
        records = [rec(r, s, T0 + s, step_time=0.4 if r == 3 else 0.1) for r in range(4)]
        messages += [n.message for n in watch.observed(RUNNING, None, T0 + s, records).notes]
    summaries = [m for m in messages if ": step " in m]
    assert len(summaries) == 3, summaries  # at 1 s, 31 s, 61 s
    assert summaries[0].startswith("Group g-1: step 1/100 (1%)")
    warnings = [m for m in messages if "straggler" in m]
    assert len(warnings) == 1 and "rank 3 on node 1" in warnings[0]


def test_a_phase_without_steps_that_still_writes_is_not_a_hang_silence_is() -> None:
    # After its records, a script evaluates or uploads for longer than progress_timeout, printing
    # as it goes: not hung (steps alone would tear a healthy group down, again on every retry).
    watch = Watch.of(handle(), WatchConfig(progress_timeout=10.0), T0)
    records = [rec(r, 5, T0) for r in range(4)]
    assert watch.observed(RUNNING, log(1), T0 + 1, records).verdict is None
    assert all(watch.observed(RUNNING, log(t), T0 + t).verdict is None for t in range(2, 40))
    # Neither a step nor a line for progress_timeout: hung.
    verdict = None
    for t in range(40, 60):
        verdict = watch.observed(RUNNING, log(39), T0 + t).verdict
        if verdict:
            break
    assert verdict is not None and verdict.outcome is Outcome.PROGRESS_TIMEOUT


def test_progress_timeout_without_records_still_uses_log_growth() -> None:
    watch = Watch.of(handle(), WatchConfig(progress_timeout=10.0), T0)
    for t in range(1, 30):
        assert watch.observed(RUNNING, log(t), T0 + t).verdict is None
    assert watch.observed(RUNNING, log(29), T0 + 45).verdict is not None


def test_steps_advancing_keep_a_quiet_log_alive() -> None:
    watch = Watch.of(handle(), WatchConfig(progress_timeout=10.0), T0)
    for t in range(1, 40, 5):
        assert watch.observed(RUNNING, log(1), T0 + t, [rec(0, t, T0 + t)]).verdict is None


def test_a_warm_up_record_names_no_slowest_rank() -> None:
    # The demo's first records: rank 1 connected the group in its first step (2.6 s vs 0.01 s).
    board = ProgressBoard(nproc_per_node=1)
    board.add([rec(0, 1, T0, total=110, step_time=0.01), rec(1, 1, T0, total=110, step_time=2.635)])
    summary = board.summary()
    assert summary is not None and summary.slowest_rank is None
    assert "slowest" not in (board.summary_line() or "")
    board.add([rec(0, 40, T0 + 2, total=110, step_time=0.01), rec(1, 40, T0 + 2, total=110, step_time=0.012)])
    assert board.summary_line() == "step 40/110 (36%) | ETA 1s | slowest rank 1 (1.2x median step)"
