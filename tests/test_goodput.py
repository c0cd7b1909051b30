"""The goodput ledger, the resume audit, the shard loader's position and the checkpoint interval: their
pure parts, with tables of real-shaped records and timelines (the runs through Airflow are in
tests/test_goodput_runs.py)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from airflow_torchrun.audit import RTOL, AuditMode, AuditStatus, ResumeAudit, audit, parse_mode
from airflow_torchrun.books import TryBooks
from airflow_torchrun.contract.progress import (
    MAX_LOSSES,
    ProgressRecord,
    float_to_hex,
    hex_to_float,
    parse_bound_records,
    parse_line,
    thin_losses,
)
from airflow_torchrun.goodput import (
    CATEGORIES,
    LOST_WORK,
    PRODUCTIVE,
    RESTART_GAP,
    TRAINING,
    LaunchAccount,
    TryLedger,
    account_launch,
    task_ledger,
    try_ledger,
)
from airflow_torchrun.timeline import Mark, Timeline
from airflow_torchrun.worker.interval import CheckpointInterval, mtbf_from_env, young_daly
from airflow_torchrun.worker.progress import ProgressRecorder
from airflow_torchrun.worker.shards import ShardLoader


# -- the record --------------------------------------------------------------------------------------
def test_a_loss_travels_bit_exactly_as_a_short_hex_float() -> None:
    for value in (0.1, 2.310781955718994, 1e-30, -3.0, float(np.float32(0.3))):
        text = float_to_hex(value)
        assert hex_to_float(text) == value and float.fromhex(text) == value
    assert float_to_hex(float(np.float32(2.310781955718994))) == "0x1.27c7b4p+1"  # 8 digits of float32
    assert hex_to_float("nan") is None and hex_to_float("0x1p+2000") is None and hex_to_float("x") is None


def test_the_record_round_trips_its_new_fields() -> None:
    record = ProgressRecord(
        rank=1, step=9, time=10.5, since=9.0, data_s=0.25, save_s=0.5, losses=((8, "0x1.8p+0"), (9, "0x1p+0"))
    )
    assert parse_line(record.to_line()) == [record]
    event = ProgressRecord(rank=0, step=20, time=3.0, event="start")
    (back,) = parse_line(event.to_line())
    assert back == event and not back.window
    # Losses that are not (step, hex float) are dropped, an unknown event is none.
    (odd,) = parse_line('@torchrun-progress {"rank":0,"step":1,"time":1,"losses":[[1,"zz"],[2,"0x1p+0"]],"event":"x"}')
    assert odd.losses == ((2, "0x1p+0"),) and odd.event is None


def test_a_rank_cannot_speak_for_another() -> None:
    mine = ProgressRecord(rank=2, step=5, time=1.0).to_line()
    forged = ProgressRecord(rank=0, step=999, time=1.0).to_line()
    lines = [f"[node 1 rank 2] {mine}", f"[node 1 rank 2] {forged}", mine, f"[node 0 rank 0] hello {mine}"]
    assert [(r.rank, r.step) for r in parse_bound_records(lines)] == [(2, 5)]


def test_thinning_keeps_one_power_of_two_grid_whatever_the_window() -> None:
    losses = [(s, "0x1p+0") for s in range(1, 1001)]
    kept = thin_losses(losses)
    assert len(kept) <= MAX_LOSSES and all(s % 4 == 0 for s, _ in kept)
    assert thin_losses(losses[:200]) == tuple(losses[:200])
    # Two windows cut elsewhere (another try) keep the same steps where they overlap.
    a = {s for s, _ in thin_losses(losses[100:700])}
    b = {s for s, _ in thin_losses(losses[300:1000])}
    assert {s for s in a & b if s % 4 == 0} == {s for s in range(301, 701) if s % 4 == 0}


def test_the_recorder_marks_the_start_times_saves_and_prints_what_is_left() -> None:
    lines: list[str] = []
    now = [100.0]
    recorder = ProgressRecorder(rank=0, interval=1.0, emit=lines.append, clock=lambda: now[0])
    recorder.started(20)
    for step in range(21, 28):
        now[0] += 0.3
        recorder.note(step, loss=1.0 / step, total_steps=100)
        if step == 24:
            recorder.saved(0.2)
    assert recorder.flush() is not None  # what an exiting rank prints (atexit)
    assert recorder.flush() is None  # nothing new
    records = [r for line in lines for r in parse_line(line)]
    assert records[0].event == "start" and records[0].step == 20
    windows = [r for r in records if r.window]
    assert [s for r in windows for s, _ in r.losses] == list(range(21, 28))
    assert windows[0].since == 100.0 and all(b.since == a.time for a, b in itertools.pairwise(windows))
    assert sum(r.save_s or 0.0 for r in windows) == pytest.approx(0.2)
    assert recorder.last_save_s == 0.2


# -- the audit -----------------------------------------------------------------------------------------
def _series(values: dict[int, float], rank: int = 0) -> dict[int, dict[int, str]]:
    return {rank: {step: float_to_hex(v) for step, v in values.items()}}


@pytest.mark.parametrize(
    ("after", "status", "first"),
    [
        ({21: 1.0, 22: 0.9, 23: 0.8}, AuditStatus.EXACT, None),
        ({21: 1.0, 22: 0.9 * (1 + 1e-7), 23: 0.8}, AuditStatus.CLOSE, 22),
        ({21: 1.0, 22: 0.9, 23: 0.5}, AuditStatus.DIVERGED, 23),
    ],
)
def test_the_audit_tells_exact_close_and_diverged(after, status, first) -> None:
    before = _series({20: 1.1, 21: 1.0, 22: 0.9, 23: 0.8, 24: 0.7})
    result = audit(before, _series(after), 20)
    assert result.status is status
    assert result.compared == 3 and (result.first_step, result.last_step) == (21, 23)
    if first is None:
        assert result.first_difference is None and "bit-identical" in result.line()
    else:
        assert result.first_difference is not None and result.first_difference.step == first
    if status is AuditStatus.DIVERGED:
        assert result.first_divergence is not None and result.first_divergence.after == 0.5
        assert "diverged at step 23" in result.line() and "0.8 before, 0.5 now" in result.line()
    assert ResumeAudit.from_dict(result.to_dict()) == result


def test_nothing_to_audit_is_said_so() -> None:
    before = _series({21: 1.0})
    assert audit(before, _series({21: 1.0}), 0).status is AuditStatus.NONE  # a fresh start
    assert audit(before, _series({25: 1.0}), 24).status is AuditStatus.NONE  # no common step past 24
    assert audit(before, _series({21: 1.0}, rank=1), 20).status is AuditStatus.NONE  # another rank
    assert RTOL == 1e-3


def test_resume_audit_is_checked_strictly() -> None:
    problems: list[str] = []
    assert parse_mode("FAIL", problems) is AuditMode.FAIL and parse_mode("off", problems) is AuditMode.OFF
    parse_mode("sometimes", problems)
    parse_mode(True, problems)
    assert len(problems) == 2 and "resume_audit must be 'warn', 'fail' or 'off'" in problems[0]


# -- accounts and ledgers ---------------------------------------------------------------------------
def _window(rank: int, first: int, last: int, since: float, at: float, **kw: float) -> ProgressRecord:
    losses = tuple((s, float_to_hex(1.0 / s)) for s in range(first, last + 1))
    return ProgressRecord(rank=rank, step=last, time=at, since=since, losses=losses, **kw)  # type: ignore[arg-type]


def _failed_then_resumed() -> tuple[Timeline, list[ProgressRecord], list[ProgressRecord]]:
    """Try timeline: launch 0 (fresh, fails after step 29), launch 1 (resumes from 20, succeeds)."""
    t = Timeline()
    t.mark(Mark.TRY_STARTED, 0.0)
    for launch, base, outcome in ((0, 0.0, "failed"), (1, 20.0, "succeeded")):
        t.mark(Mark.CONTRACT_STARTED, base + 1.0, launch)
        t.mark(Mark.LAUNCHED, base + 2.0, launch)
        t.mark(Mark.RUNNING, base + 2.1, launch)
        t.mark(Mark.FIRST_OUTPUT, base + 3.0, launch)
        t.mark(Mark.ENDED, base + 14.0, launch, outcome=outcome)
        t.mark(Mark.TEARDOWN_DONE, base + 15.0, launch)
    t.mark(Mark.TRY_ENDED, 36.0, outcome="succeeded")
    first = [
        ProgressRecord(rank=0, step=0, time=4.0, event="rendezvous"),
        ProgressRecord(rank=0, step=0, time=5.0, event="start"),
        _window(0, 1, 20, 5.0, 9.0, data_s=0.5, save_s=1.0),
        _window(0, 21, 29, 9.0, 12.0),
    ]
    second = [
        ProgressRecord(rank=0, step=0, time=24.0, event="rendezvous"),
        ProgressRecord(rank=0, step=20, time=26.0, event="start"),
        _window(0, 21, 25, 26.0, 28.0),  # all recomputed (<= 29)
        _window(0, 26, 33, 28.0, 32.0),  # 26-29 recomputed, 30-33 new: half and half
    ]
    return t, first, second


def test_the_ledger_puts_every_second_in_one_category_and_counts_lost_steps() -> None:
    timeline, first, second = _failed_then_resumed()
    a0 = account_launch(0, first, None)
    a1 = account_launch(1, second, a0.max_step)
    assert (a0.max_step, a1.start_step, a1.lost_steps) == (29, 20, 9)
    ledger = try_ledger(timeline, {0: a0, 1: a1}, try_number=1, now=99.0, started_at=-0.5)
    assert ledger.wall == pytest.approx(36.5)
    assert sum(ledger.categories.values()) == pytest.approx(ledger.wall)
    c = ledger.categories
    assert c["launching"] == pytest.approx(2.5 + 0.9 + 1.0 + 0.9)  # each launch: to launched, running to output
    assert c["admission"] == pytest.approx(0.2)
    assert c["rendezvous"] == pytest.approx(1.0 + 1.0) and c["setup"] == pytest.approx(1.0 + 2.0)
    assert c["data_wait"] == pytest.approx(0.5) and c["checkpoint_stall"] == pytest.approx(1.0)
    # launch 0: 7 s of steps, less 1.5 of data and saves, all new; then 2 s after its last record, lost.
    # launch 1: 2 s recomputed, then 4 s of which 4/8 recomputed; 2 s of tail after the last record.
    assert c[PRODUCTIVE] == pytest.approx(5.5 + 2.0)
    assert c[LOST_WORK] == pytest.approx(2.0 + 2.0 + 2.0)
    assert c["tail"] == pytest.approx(2.0 + 2.0)  # last record to the end, the end to try_ended
    assert c[RESTART_GAP] == pytest.approx(7.0)  # launch 0 ended at 14, launch 1's contract at 21
    assert ledger.ettr == pytest.approx(7.5 / 36.5) and ledger.lost_steps == 9 and ledger.outcome == "succeeded"
    assert TryLedger.from_dict(ledger.to_dict()) is not None


def test_a_script_without_helpers_gets_the_coarse_categories() -> None:
    timeline, first, _ = _failed_then_resumed()
    only_rendezvous = [r for r in first if r.event == "rendezvous"]
    account = account_launch(0, only_rendezvous, None)
    assert not account.fine
    ledger = try_ledger(timeline, {0: account}, try_number=1, now=40.0)
    assert ledger.coarse and ledger.ettr is None
    assert ledger.categories[TRAINING] > 0 and ledger.categories[PRODUCTIVE] == 0
    assert sum(ledger.categories.values()) == pytest.approx(ledger.wall)


@pytest.mark.parametrize("started_loop", [True, False], ids=["killed-before-its-first-window", "killed-in-setup"])
def test_a_launch_killed_before_its_first_window_keeps_the_ledger_fine(started_loop: bool) -> None:
    """Failures every few seconds (bench/bench_interval.py) kill launches before they print a window:
    that must not turn the whole try coarse (ETTR None) when the script uses the helpers."""
    timeline, first, second = _failed_then_resumed()
    early = [r for r in first if r.event == "rendezvous" or (started_loop and r.event == "start")]
    a0 = account_launch(0, early, None)
    assert not a0.fine and (a0.stepping_from == 5.0) is started_loop
    a1 = account_launch(1, second, a0.max_step)
    ledger = try_ledger(timeline, {0: a0, 1: a1}, try_number=1, now=99.0, started_at=-0.5)
    assert not ledger.coarse and ledger.ettr is not None and ledger.categories[TRAINING] == 0
    assert sum(ledger.categories.values()) == pytest.approx(ledger.wall)
    c = ledger.categories
    # launch 0: rendezvous at 4, then setup to the loop's start at 5 and lost work to its end at 14
    # (or setup all the way when it never started its loop); launch 1 resumed from step 20 of nothing
    # reported before: all 12 s of its steps are new.
    assert c["setup"] == pytest.approx((1.0 if started_loop else 10.0) + 2.0)
    assert c[LOST_WORK] == pytest.approx((9.0 if started_loop else 0.0) + 0.0)
    assert c[PRODUCTIVE] == pytest.approx(6.0) and ledger.ettr == pytest.approx(6.0 / 36.5)


def test_a_relaunch_with_nothing_left_to_do_keeps_the_ledger_fine() -> None:
    """A rank killed after the last step (in the script's final save or logging): the relaunch resumes
    from the last step's checkpoint, prints its loop's start and no window, and succeeds. make bench
    (2026-12-03) had the whole try's ETTR n/a ("no step records") for it."""
    timeline, first, second = _failed_then_resumed()
    done = [r for r in second if r.event == "rendezvous"] + [ProgressRecord(rank=0, step=29, time=26.0, event="start")]
    a0 = account_launch(0, first, None)
    a1 = account_launch(1, done, a0.max_step)
    assert a0.fine and not a1.fine and a1.start_step == 29
    ledger = try_ledger(timeline, {0: a0, 1: a1}, try_number=1, now=99.0, started_at=-0.5)
    assert not ledger.coarse and ledger.ettr is not None and ledger.categories[TRAINING] == 0
    assert sum(ledger.categories.values()) == pytest.approx(ledger.wall)
    c = ledger.categories
    # launch 1: rendezvous at 24, setup to its loop's start at 26, then nothing to compute: the tail
    # to its end at 34 (and 34 -> 36, the try's end); no step of it is productive or lost.
    assert c["setup"] == pytest.approx(1.0 + 2.0) and c["tail"] == pytest.approx(8.0 + 2.0)
    assert c[PRODUCTIVE] == pytest.approx(5.5) and c[LOST_WORK] == pytest.approx(2.0)
    assert ledger.lost_steps == 0 and ledger.outcome == "succeeded"


def test_a_watch_that_first_looked_late_does_not_swallow_the_training() -> None:
    """A triggerer killed while deferred: the new one's watch saw the nodes running and their output
    for the first time at 31.8 s, after the ranks had trained from 12.5 s (chaos row: ETTR 0.000)."""
    t = Timeline()
    t.mark(Mark.TRY_STARTED, 0.0)
    t.mark(Mark.CONTRACT_STARTED, 0.0, 0)
    t.mark(Mark.LAUNCHED, 0.1, 0)
    t.mark(Mark.RANKS_STARTED, 3.2, 0)
    t.mark(Mark.RENDEZVOUS, 6.1, 0)
    t.mark(Mark.RUNNING, 31.8, 0)
    t.mark(Mark.FIRST_OUTPUT, 31.8, 0)
    t.mark(Mark.ENDED, 30.0, 0, outcome="succeeded")
    t.mark(Mark.TRY_ENDED, 34.0, outcome="succeeded")
    records = [
        ProgressRecord(rank=0, step=0, time=6.1, event="rendezvous"),
        ProgressRecord(rank=0, step=0, time=7.0, event="start"),
        _window(0, 1, 100, 7.0, 29.0),
    ]
    ledger = try_ledger(t, {0: account_launch(0, records, None)}, try_number=1, now=40.0)
    c = ledger.categories
    assert c["admission"] == pytest.approx(3.1) and c[PRODUCTIVE] == pytest.approx(22.0)
    assert sum(c.values()) == pytest.approx(ledger.wall) and ledger.ettr == pytest.approx(22.0 / 34.0)


def test_the_task_ledger_adds_the_gap_between_tries() -> None:
    one = TryLedger(1, 0.0, 10.0, {k: 0.0 for k in CATEGORIES} | {PRODUCTIVE: 6.0, RESTART_GAP: 4.0}, "failed")
    two = TryLedger(2, 12.0, 30.0, {k: 0.0 for k in CATEGORIES} | {PRODUCTIVE: 18.0}, "succeeded")
    task = task_ledger([one, two, two])
    assert task.wall == 30.0 and task.categories[RESTART_GAP] == 4.0 + 2.0
    assert task.ettr == pytest.approx(24.0 / 30.0) and len(task.tries) == 2


def test_books_audit_a_resumed_launch_against_the_earlier_try_kept_in_the_store() -> None:
    timeline, first, second = _failed_then_resumed()

    class Store(dict):  # the task state store's get/set
        def set(self, key, value):  # type: ignore[no-untyped-def]
            self[key] = value

    store = Store()
    books1 = TryBooks(try_number=1, mode=AuditMode.WARN, store=store)
    lines = [f"[node 0 rank 0] {r.to_line()}" for r in first]
    assert books1.close_launch(0, lines) is None  # a fresh start: nothing to audit
    books1.make_ledger(timeline, 36.0)
    books1.keep()
    books2 = TryBooks(try_number=2, mode=AuditMode.WARN, store=store)
    assert books2.failures_observed(now=0.0) == (1, 36.0)  # try 1: two launches, one failed, in 36 s
    result = books2.close_launch(0, [f"[node 0 rank 0] {r.to_line()}" for r in second])
    assert result is not None and result.status is AuditStatus.EXACT and result.compared == 9
    published = books2.make_ledger(timeline, 36.0)
    assert published["task"]["tries"] == 2 and published["resume_audit"]["status"] == "exact"
    # A replayed epoch (other losses for the same steps) diverges.
    replay = [
        ProgressRecord(rank=0, step=20, time=26.0, event="start"),
        ProgressRecord(rank=0, step=25, time=28.0, losses=tuple((s, float_to_hex(2.0 / s)) for s in range(21, 26))),
    ]
    books3 = TryBooks(try_number=2, mode=AuditMode.FAIL, store=store)
    result3 = books3.close_launch(0, [f"[node 0 rank 0] {r.to_line()}" for r in replay])
    assert result3 is not None and result3.status is AuditStatus.DIVERGED and books3.diverged() is result3
    carried = TryBooks(try_number=2, mode=AuditMode.FAIL, store=store)
    carried.restore(books3.carry())
    assert carried.diverged() == result3 and carried.accounts[0].max_step == 25
    assert LaunchAccount.from_dict(books3.accounts[0].to_dict()) == books3.accounts[0]


# -- the shard loader --------------------------------------------------------------------------------
def test_the_shard_loader_resumes_with_the_batches_the_interrupted_run_would_have_read() -> None:
    columns = {"x": np.arange(100, dtype=np.float32).reshape(50, 2), "y": np.arange(50)}

    def run(loader: ShardLoader, steps: int) -> list[list[int]]:
        out: list[list[int]] = []
        while len(out) < steps:
            for batch in loader:
                out.append(batch["y"].tolist())
                if len(out) == steps:
                    return out
        return out

    whole = run(ShardLoader(columns, batch_size=8, seed=3, rank=1), 15)  # 6 batches per epoch: 2.5 epochs
    first = ShardLoader(columns, batch_size=8, seed=3, rank=1)
    done = run(first, 8)
    state = first.state_dict()
    assert state == {"epoch": 1, "offset": 2, "seed": 3, "batch_size": 8, "num_samples": 50}
    resumed = ShardLoader(columns, batch_size=8, seed=3, rank=1)
    resumed.load_state_dict(state)
    assert done + run(resumed, 7) == whole
    # Starting the epoch from zero (what the audit catches) reads other batches.
    assert run(ShardLoader(columns, batch_size=8, seed=3, rank=1), 7) != whole[8:]
    with pytest.raises(ValueError, match="seed=3, this loader has seed=4"):
        ShardLoader(columns, batch_size=8, seed=4, rank=1).load_state_dict(state)
    end_of_epoch = ShardLoader(columns, batch_size=8, seed=3, rank=1)
    end_of_epoch.load_state_dict({"epoch": 0, "offset": 6})
    assert (end_of_epoch.epoch, end_of_epoch.offset) == (1, 0)


# -- the checkpoint interval -------------------------------------------------------------------------
def test_young_daly_picks_sqrt_2_c_m_in_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAIN_CHECKPOINT_MTBF", "200")
    now = [0.0]
    recorder = ProgressRecorder(rank=0, interval=0, emit=lambda _: None)
    interval = CheckpointInterval(warmup_steps=5, records=recorder, clock=lambda: now[0], agree=lambda v: v, rank=0)
    saves = []
    for step in range(1, 400):
        now[0] += 0.1  # 0.1 s per step
        if interval(step):
            recorder.saved(1.0)  # every save blocks for 1 s
            now[0] += 1.0
            saves.append(step)
    tau = young_daly(1.0, 200.0)  # 20 s: 200 steps of 0.1 s
    assert saves[0] == 5 and math.isclose(tau, 20.0)
    assert interval.interval_steps == 200 and saves[1] == 205
    assert "Young/Daly sqrt(2 x 1s save x 200s MTBF (the task's mtbf))" in interval.reason


def test_the_mtbf_comes_from_the_argument_or_the_observed_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAIN_CHECKPOINT_MTBF", raising=False)
    monkeypatch.setenv("TRAIN_FAILURES_OBSERVED", '{"failures": 2, "seconds": 90}')
    assert mtbf_from_env(10.0).seconds == 50.0
    monkeypatch.setenv("TRAIN_FAILURES_OBSERVED", '{"failures": 0, "seconds": 90}')
    m = mtbf_from_env(10.0)
    assert m.seconds == 100.0 and "no failure yet" in m.why
    monkeypatch.setenv("TRAIN_CHECKPOINT_MTBF", "3600")
    assert mtbf_from_env(10.0).seconds == 3600.0
