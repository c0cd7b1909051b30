"""``bench/run.py``'s report assembly. A real ``bench/run.py --quick`` takes minutes on 2 cores
(three benchmarks, each starting torchrun groups under ``dag.test()``, and Ray), too slow for the
suite: these tests cover the row shape, the report, the chart and the README section built from it,
and the Ray-virtualenv step (never run here: no Ray in ``make test``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import rows  # noqa: E402
import run  # noqa: E402

SAMPLE = {
    "bench_group": [rows.row("operator task wall time", 10.4, "bare torchrun", 10.0, "s")],
    "bench_checkpoint": [rows.row("checkpoint write, file", 150.0, "raw copy", 300.0, "MB/s")],
}


def test_a_row_has_the_report_fields_and_ratio_ours_over_anchor():
    r = rows.row("m", 3.0, "a", 2.0, "s")
    assert tuple(r)[:6] == rows.FIELDS == ("measure", "ours", "anchor", "anchor_value", "ratio", "unit")
    assert tuple(r)[6:] == rows.DETAIL
    assert r["ratio"] == 1.5
    assert rows.row("m", 3.0, "none", None, "s")["ratio"] is None


def test_samples_give_medians_min_max_and_success_over_the_attempts():
    r = rows.row("recovery", rows.Samples([3.0, 1.0, 2.0], 4), "torchrun", rows.Samples([], 4), "s")
    assert (r["ours"], r["ours_min"], r["ours_max"], r["repeats"]) == (2.0, 1.0, 3.0, 4)
    assert (r["ours_success"], r["anchor_success"]) == ("3/4", "0/4")
    assert r["anchor_value"] is None and r["ratio"] is None and "anchor: no successful run of 4" in r["note"]
    assert rows.check([r]) == [r]


def test_a_failed_anchor_is_a_row_saying_why():
    r = rows.failed_row("launch", rows.Samples([5.0]), "Ray Train", "pip failed: no network", "s")
    assert r["anchor"] == "Ray Train (FAILED)" and r["anchor_value"] is None
    assert r["note"] == "anchor failed: pip failed: no network"
    assert "| Ray Train (FAILED) |" in run.markdown(run.assemble({"b": [r]}, [], date="d", quick=False))


def test_no_successful_run_of_ours_is_a_null_with_a_note_not_a_crash():
    r = rows.row("recovery", rows.Samples([], 3), "fresh", rows.Samples([4.0]), "s")
    assert r["ours"] is None and r["note"] == "ours: no successful run of 3"
    assert rows.check([r]) == [r]
    with pytest.raises(ValueError, match="ours a number"):
        rows.check([{**r, "note": ""}])


def test_the_report_holds_every_benchmark_s_rows_in_order():
    report = run.assemble(SAMPLE, ["bench_recovery"], date="2026-12-01T00:00:00+00:00", quick=True)
    assert set(report) == {"date", "quick", "failed", "machine", "rows"}
    assert [r["measure"] for r in report["rows"]] == ["operator task wall time", "checkpoint write, file"]
    assert report["failed"] == ["bench_recovery"]
    assert json.loads(json.dumps(report)) == report


def test_a_malformed_row_is_refused_naming_its_benchmark():
    with pytest.raises(ValueError, match=r"bench_group: a row must have exactly the fields"):
        run.assemble({"bench_group": [{"measure": "x", "ours": 1}]}, [], date="d", quick=False)


def test_rows_round_trip_through_the_json_file(tmp_path):
    path = tmp_path / "sub" / "rows.json"
    rows.write_json(path, SAMPLE["bench_group"])
    assert rows.check(json.loads(path.read_text())) == SAMPLE["bench_group"]


def test_the_markdown_lists_every_row_and_says_what_failed():
    report = run.assemble(SAMPLE, ["bench_recovery"], date="2026-12-01", quick=True)
    text = run.markdown(report)
    assert "quick smoke run" in text and "Failed (no rows): bench_recovery" in text
    assert "| operator task wall time | 10.4 | bare torchrun | 10 | 1.04 | s |" in text
    assert "| checkpoint write, file | 150 | raw copy | 300 | 0.5 | MB/s |" in text


def test_the_markdown_says_repeats_spread_and_noise():
    ours = rows.Samples([10.0, 11.0, 12.0])
    r = rows.row("operator task wall time, 2 agents x 1", ours, "bare torchrun", rows.Samples([9.0, 10.0, 11.0]), "s")
    machine = {"cpus": 2, "load_start": 1.0, "load_end": 2.0, "wall_s": 60, "command": "make bench"}
    text = run.markdown(run.assemble({"b": [r]}, [], date="d", quick=False, machine=machine))
    # repeats, ours min-max, 95% interval (none: not a paired row), anchor min-max, noise, success
    assert "| 3 | 10-12 | - | 9-11 | 18% / 20% | 3/3 / 3/3 |" in text
    assert "Repeats per row: 3" in text and "median 19%, largest 20%" in text
    assert "load average 1.0 at the start" in text
    # 1.1 by the medians, but the repeats overlap: the goal fails only within the noise
    assert "| operator wall / bare torchrun <= 1.02 (2x1) |" in text
    assert "| NO, by the medians only (within noise) |" in text


def test_the_goals_are_checked_against_the_rows():
    rec = "rank death -> training again, in-try restart"
    report_rows = [
        rows.row(rec, rows.Samples([2.0], 2), "torchrun --max-restarts 3, defaults", rows.Samples([], 2), "s"),
        rows.row(rec, rows.Samples([2.0, 2.2]), "Ray Train FailureConfig(max_failures=1)", rows.Samples([9.0]), "s"),
        rows.row(rec, rows.Samples([2.0, 2.2]), "fresh group launch -> first step", rows.Samples([1.8]), "s"),
        # paired rows: the mean of the differences with its 95% interval
        rows.row("operator fixed overhead, 2x2", 0.12, "goal", None, "s", repeats=8, interval=(0.05, 0.19)),
        rows.row("operator fixed overhead, 4x1", 0.08, "goal", None, "s", repeats=8, interval=(0.02, 0.11)),
        rows.row("operator's own time per try, 2x1, (its timeline)", 0.12, "goal", 0.15, "s", interval=(0.11, 0.13)),
        rows.row("operator's own time per try, 4x1, (its timeline)", 0.14, "goal", 0.15, "s", interval=(0.12, 0.16)),
    ]
    lines = run.goal_lines(report_rows)
    met: dict[str, list[str]] = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        met.setdefault(cells[0], []).append(cells[-1])
    # torchrun: ours failed one of its two kills; Ray: faster in every repeat; fresh: within 0.5 s
    assert met["in-try recovery faster than the anchor's, 100% success"] == [
        "NO: ours recovered 1/2",
        "yes, in every repeat",
    ]
    assert met["in-try recovery <= fresh launch + 0.5 s (issue 11)"] == ["yes, in every repeat"]
    # a mean under the goal whose interval crosses it holds by the mean only; one inside it, with it
    assert met["fixed overhead <= 0.15 s (2x2)"] == ["yes, by the mean only (95% interval 0.05 to 0.19)"]
    assert met["fixed overhead <= 0.15 s (4x1)"] == ["yes, with its 95% interval (0.02 to 0.11)"]
    assert met["operator's own time per try <= 0.15 s (2x1)"] == ["yes, with its 95% interval (0.11 to 0.13)"]
    assert met["operator's own time per try <= 0.15 s (4x1)"] == ["yes, by the mean only (95% interval 0.12 to 0.16)"]
    assert met["operator's own time per try <= 0.15 s (2x2)"] == ["-"]
    assert met["operator wall / bare torchrun <= 1.02 (2x1)"] == ["-"]
    assert "(not measured in this run)" in lines[2]


def test_a_goal_is_met_against_an_anchor_that_never_recovered():
    goal = next(g for g in run.GOALS if g.anchor == "torchrun")
    r = rows.row(
        "rank death -> training again, in-try restart", rows.Samples([5.0]), "torchrun", rows.Samples([], 3), "s"
    )
    assert run.verdict(goal, r) == "yes: the anchor never recovered"


def test_a_report_is_rendered_again_without_measuring(tmp_path):
    report = run.assemble(SAMPLE, [], date="2026-12-01", quick=False)
    source = tmp_path / "in.json"
    source.write_text(json.dumps(report))
    assert run.main(["--from-report", str(source), "--out", str(tmp_path / "out")]) == 0
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"report.json", "report.md", "report.png"}


def test_the_readme_names_the_runs_a_merged_report_came_from():
    whole = run.assemble(SAMPLE, [], date="2026-12-01", quick=False, machine={"command": "make bench"})
    assert "Measured by `make bench` on 2026-12-01" in run.readme_section(whole)
    merged = {
        **whole,
        "machine": {"command": "bench/run.py --only bench_group, with the rest from the last make bench"},
    }
    section = run.readme_section(merged)
    assert "Measured by bench/run.py --only bench_group, with the rest from the last make bench on" in section
    assert "`make bench`" not in section


def test_the_chart_is_one_png_with_a_bar_per_row(tmp_path):
    pytest.importorskip("matplotlib")
    report = run.assemble(SAMPLE, [], date="2026-12-01", quick=False)
    report["rows"].append(rows.failed_row("launch", 1.0, "Ray", "not installed", "s"))
    path = run.chart(report, tmp_path / "report.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_readme_section_is_regenerated_between_its_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{run.README_BEGIN}\nold\n{run.README_END}\nrest\n")
    run.update_readme(readme, run.assemble(SAMPLE, [], date="2026-12-01T10:00:00+00:00", quick=False))
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("rest\n") and "old" not in text
    assert "Measured by `make bench` on 2026-12-01T10:00:00+00:00" in text
    # repeats and the 95% interval are "-" for a single unpaired value
    assert "| checkpoint write, file | 150 | raw copy | 300 | 0.5 | MB/s | - | - | - / - |" in text
    assert "Goals:" in text and "| checkpoint write/read >= 0.9 of raw |" in text
    readme.write_text("no markers")
    with pytest.raises(SystemExit, match="no"):
        run.update_readme(readme, run.assemble(SAMPLE, [], date="d", quick=False))


def test_the_readme_of_the_repository_has_the_generated_section():
    text = (BENCH.parent / "README.md").read_text()
    assert run.README_BEGIN in text and run.README_END in text


def test_the_ray_venv_step_is_skippable_and_runs_nothing(tmp_path, monkeypatch):
    import ray_venv

    def refuse(*args, **kwargs):
        raise AssertionError("nothing may run when the step is skipped")

    monkeypatch.setattr(ray_venv.subprocess, "run", refuse)
    result = ray_venv.ensure(tmp_path / "ray-venv", skip="skipped (--no-ray)")
    assert result.python is None and result.reason == "skipped (--no-ray)"
    # A finished venv (its stamp) is reused without running pip again.
    (tmp_path / "ray-venv" / "bin").mkdir(parents=True)
    (tmp_path / "ray-venv" / "bin" / "python").write_text("")
    ray_venv.stamp(tmp_path / "ray-venv").write_text("")
    assert ray_venv.ensure(tmp_path / "ray-venv").python == tmp_path / "ray-venv" / "bin" / "python"


def test_the_ray_venv_pins_the_cpu_torch_and_ray():
    import ray_venv

    installs = [argv for argv in ray_venv.commands(Path("/v")) if "install" in argv]
    assert all(ray_venv.TORCH_PIN in argv for argv in installs), "an unpinned torch is a multi-GB CUDA build"
    if ray_venv.TORCH_WHEELS is not None and any(ray_venv.TORCH_WHEELS.glob("torch-2.13.0+cpu-*.whl")):
        # Where the CPU wheel is at hand, PyPI's torch==2.13.0 (the CUDA build) must not be asked for.
        assert ray_venv.TORCH_PIN == "torch==2.13.0+cpu"
        assert all(str(ray_venv.TORCH_WHEELS) in argv for argv in installs)
    assert any(arg.startswith("ray[train]==") for arg in installs[-1])


def test_a_failed_ray_install_is_a_reason_not_a_crash(tmp_path, monkeypatch):
    import subprocess

    import ray_venv

    def fail(argv, **kwargs):
        return subprocess.CompletedProcess(argv, 1, "", "WARNING: x\nERROR: No matching distribution for ray\n")

    monkeypatch.setattr(ray_venv.subprocess, "run", fail)
    result = ray_venv.ensure(tmp_path / "v")
    assert result.python is None and "ERROR: No matching distribution for ray" in result.reason


def test_every_benchmark_the_runner_names_exists_and_takes_json():
    for bench in run.BENCHES:
        source = (BENCH / bench.script).read_text()
        assert '"--json"' in source and "write_json(args.json" in source, bench.script


def test_the_checkpoint_benchmark_reports_throughput_and_training_rows():
    pytest.importorskip("torch")
    import bench_checkpoint

    io_rows = [bench_checkpoint.Row("file", "write", 100.0, ours_s=2.0, raw_s=1.0, ours_all=[2.0], raw_all=[1.0])]
    train_rows = [
        bench_checkpoint.TrainRow("no checkpointing", 10.0, 0.0, 10.0),
        bench_checkpoint.TrainRow("sync, default interval", 11.0, 0.5, 10.0),
    ]
    report = bench_checkpoint.report_rows(io_rows, train_rows)
    assert rows.check(report) == report
    assert [(r["unit"], r["ratio"]) for r in report] == [("MB/s", 0.5), ("x raw", 0.5556), ("s", 1.1)]


def test_the_checkpoint_rows_are_paired_fractions_of_raw_on_the_log_scale():
    pytest.importorskip("torch")
    import bench_checkpoint

    # Two pairs: ours twice as slow, then twice as fast. Their arithmetic mean of raw/ours is 1.25;
    # the geometric mean, 1: a lucky pair of ours weighs no more than an unlucky one.
    r = bench_checkpoint.Row("file", "write", 100.0, 1.5, 1.5, ours_all=[2.0, 1.0], raw_all=[1.0, 2.0])
    assert r.fraction is not None and r.fraction.mean == pytest.approx(1.0) and r.fraction.n == 2
    # A save on SIGTERM pairs the same way; ours at 0.8 of raw in every pair: a narrow interval there.
    stop = bench_checkpoint.StopRow(1000, 1049.0, [1.25, 2.5, 1.875], [1.0, 2.0, 1.5], "3 pairs")
    report = bench_checkpoint.report_rows([r], [], [stop])
    assert rows.check(report) == report
    paired = {x["measure"]: x for x in report if x["anchor"] == "goal"}
    io = paired["checkpoint write (verified), file, 100 MB: ours / raw throughput (paired; geometric mean)"]
    assert io["ours"] == pytest.approx(1.0) and io["repeats"] == 2 and io["ci_low"] < 1.0 < io["ci_high"]
    sigterm = paired["save on SIGTERM, file://, 1000 MB state: ours / raw throughput (paired; geometric mean)"]
    assert sigterm["ours"] == pytest.approx(0.8) and sigterm["ci_low"] == pytest.approx(0.8)
    assert sigterm["note"] == "3 pairs"
    both = next(x for x in report if x["measure"].startswith("save on SIGTERM") and x["anchor"] != "goal")
    assert both["measure"] == "save on SIGTERM, file://, 1000 MB state (1049 MB written): signal to committed"
    assert (both["ours"], both["anchor_value"], both["repeats"]) == (1.875, 1.5, 3)
    # The goals: the write at 1.0 of raw holds by its mean only (the interval reaches below 0.9); the save
    # on SIGTERM at 0.8 misses in every pair; its median 1.875 s misses the 1.5 s of issue 26, but its best
    # repeat (1.25 s) meets it: within the noise.
    met = {(line.split(" | ")[0], line.split(" | ")[1]): line.split(" | ")[-1] for line in run.goal_lines(report)}
    assert met[("| checkpoint write/read >= 0.9 of raw", io["measure"] + " vs goal")].startswith(
        "yes, by the mean only (95% interval"
    )
    assert met[("| save on SIGTERM at >= 0.9 of a raw write's throughput", sigterm["measure"] + " vs goal")].startswith(
        "NO, with its 95% interval"
    )
    sigterm_goal = ("| save on SIGTERM of 1 GB within 1.5 s (issue 26)", both["measure"] + " vs " + both["anchor"])
    assert met[sigterm_goal] == "NO, by the medians only (within noise) |"


def test_the_save_on_sigterm_on_a_tmpfs_is_a_row_and_a_goal_of_its_own():
    pytest.importorskip("torch")
    import bench_checkpoint

    # The same 1 GB save on the disk (1.85 s, like the disk's raw 1.92 s) and on a tmpfs (0.46 s).
    disk = bench_checkpoint.StopRow(1000, 1049.0, [1.8, 1.85, 1.9], [1.9, 1.92, 1.95], "3 pairs")
    memory = bench_checkpoint.StopRow(1000, 1049.0, [0.45, 0.46, 0.47], [0.43, 0.44, 0.45], "3 pairs", "tmpfs")
    report = bench_checkpoint.report_rows([], [], [disk, memory])
    assert rows.check(report) == report
    timed = [x["measure"] for x in report if x["anchor"] != "goal"]
    assert timed == [
        "save on SIGTERM, file://, 1000 MB state (1049 MB written): signal to committed",
        "save on SIGTERM, file:// on tmpfs, 1000 MB state (1049 MB written): signal to committed",
    ]
    met = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")[-1] for line in run.goal_lines(report)}
    # Each row is checked by its own goal: the disk's misses 1.5 s in every repeat, the tmpfs's meets it.
    assert met["save on SIGTERM of 1 GB within 1.5 s (issue 26)"] == "NO, in every repeat |"
    tmpfs = "save on SIGTERM of 1 GB within 1.5 s where the disk is not the limit (tmpfs)"
    assert met[tmpfs] == "yes, in every repeat |"
    # Without a tmpfs row (a machine without one) its goal says it was not measured.
    lines = run.goal_lines(bench_checkpoint.report_rows([], [], [disk]))
    assert f"| {tmpfs} | (not measured in this run) | - | - | - | - |" in lines


def test_the_tmpfs_of_the_save_on_sigterm_is_a_tmpfs_with_room_or_none(tmp_path: Path):
    pytest.importorskip("torch")
    import bench_checkpoint

    assert bench_checkpoint.memory_root(1, tmp_path) is None  # no file system is mounted there
    made = bench_checkpoint.memory_root(1)
    if made is None:
        pytest.skip(f"no tmpfs at {bench_checkpoint.MEMORY_ROOT}")
    try:
        assert made.parent.samefile(bench_checkpoint.MEMORY_ROOT) and made.is_dir() and not any(made.iterdir())
        assert bench_checkpoint.memory_root(10**9) is None  # a petabyte: no room
    finally:
        made.rmdir()


def test_a_paired_row_repeats_until_its_interval_is_narrow_or_a_cap():
    pytest.importorskip("torch")
    import bench_checkpoint
    from stats import RepeatRule

    # Ours at 0.9 of raw in every pair: no spread, so the interval is narrow after the fewest pairs.
    ours_t, raw_t, why = bench_checkpoint.paired(
        lambda: 1.0, lambda: 0.9, RepeatRule(minimum=3, half_width=0.05, cap=20, unit="")
    )
    assert len(ours_t) == len(raw_t) == 3 and why == "3 pairs: the 95% interval reached +/-0.05"
    # Ours alternately twice as slow and twice as fast: it never narrows; the cap stops it.
    noisy = iter([2.0, 0.5] * 50)
    ours_t, raw_t, why = bench_checkpoint.paired(
        lambda: next(noisy), lambda: 1.0, RepeatRule(minimum=3, half_width=0.05, cap=6, unit="")
    )
    assert len(ours_t) == 6 and why.startswith("6 pairs, stopped by the cap of 6 pairs (95% interval +/-")


def test_the_repeat_rule_and_the_t_interval():
    from stats import RepeatRule, mean_interval, t95

    assert t95(1) == 12.706 and t95(30) == 2.042 and t95(100) == 1.96
    with pytest.raises(ValueError):
        t95(0)
    interval = mean_interval([1.0, 2.0, 3.0])  # mean 2, sd 1: 2 +/- 4.303 / sqrt(3)
    assert interval.mean == 2.0 and interval.half_width == pytest.approx(4.303 / 3**0.5)
    assert mean_interval([5.0]).half_width is None
    rule = RepeatRule(minimum=3, half_width=0.1, cap=5, budget_s=10.0)
    assert rule.more([0.1, 0.1], 0.0)  # fewer than the minimum
    assert not rule.more([0.1, 0.1, 0.1], 0.0)  # no spread: narrow enough
    assert rule.more([0.0, 1.0, 0.0], 0.0)  # wide
    assert not rule.more([0.0, 1.0, 0.0, 1.0, 0.0], 0.0)  # the cap
    assert not rule.more([0.0, 1.0, 0.0], 10.0)  # the budget
    assert rule.stopped_by([0.0, 1.0, 0.0], 10.0).startswith("3 pairs, stopped by the time budget of 10 s")
    assert RepeatRule(unit="").stopped_by([0.1] * 3, 1.0) == "3 pairs: the 95% interval reached +/-0.1"


class FakeCluster:
    """``bench/run.py``'s view of the cluster of ``make cluster``: what it started and stopped, and
    which benchmarks ran while it was up."""

    def __init__(self, up: bool = False, starts: bool = True, fails: str = "") -> None:
        self.up, self.starts, self.fails = up, starts, fails
        self.calls: list[str] = []

    def processes(self) -> list[str]:
        return ["etcd", "kube-apiserver"] if self.up else []

    def command(self, what: str, logs: Path) -> bool:
        self.calls.append(f"cluster {what}")
        self.up = what == "up" and self.starts
        return what != "up" or self.starts

    def run_one(self, bench, quick, scratch, logs, index, total, extra):
        self.calls.append(f"{bench.name} (cluster {'up' if self.up else 'down'})")
        if bench.name == self.fails:
            raise KeyboardInterrupt  # the user's Ctrl-C in the middle of it
        return []

    def patch(self, monkeypatch: pytest.MonkeyPatch) -> FakeCluster:
        monkeypatch.setattr(run, "cluster_processes", self.processes)
        monkeypatch.setattr(run, "cluster_command", self.command)
        monkeypatch.setattr(run, "run_one", self.run_one)
        return self


def test_cluster_up_starts_the_cluster_for_its_benchmark_only_and_stops_it_even_when_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    argv = ["--only", "bench_group", "--only", "bench_cluster", "--out", str(tmp_path), "--cluster-up"]
    fake = FakeCluster().patch(monkeypatch)
    assert run.main(argv) == 0
    assert fake.calls == ["bench_group (cluster down)", "cluster up", "bench_cluster (cluster up)", "cluster down"]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["machine"]["cluster"] == "started for its rows only, stopped after them"
    assert "The cluster of `make cluster`: started for its rows only" in (tmp_path / "report.md").read_text()
    # Interrupted in the middle of its benchmark, the cluster started for it is stopped all the same.
    fake = FakeCluster(fails="bench_cluster").patch(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        run.main(argv)
    assert fake.calls[-2:] == ["bench_cluster (cluster up)", "cluster down"]


def test_a_cluster_that_runs_already_is_used_and_left_running_and_none_is_started_without_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    argv = ["--only", "bench_group", "--only", "bench_cluster", "--out", str(tmp_path)]
    # Running (ready or not): the user's. It is neither started nor stopped, and the report says so.
    fake = FakeCluster(up=True).patch(monkeypatch)
    run.main([*argv, "--cluster-up"])
    assert fake.calls == ["bench_group (cluster up)", "bench_cluster (cluster up)"]
    assert json.loads((tmp_path / "report.json").read_text())["machine"]["cluster"].startswith("already running")
    fake = FakeCluster().patch(monkeypatch)
    run.main(argv)
    assert fake.calls == ["bench_group (cluster down)", "bench_cluster (cluster down)"]
    assert json.loads((tmp_path / "report.json").read_text())["machine"]["cluster"].startswith("none")


def test_a_cluster_that_fails_to_start_is_cleaned_up_and_its_rows_say_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    fake = FakeCluster(starts=False).patch(monkeypatch)
    run.main(["--only", "bench_cluster", "--out", str(tmp_path), "--cluster-up"])
    # What the failed start left is stopped by PID, then its benchmark finds no cluster (its rows: not run).
    assert fake.calls == ["cluster up", "cluster down", "bench_cluster (cluster down)"]
    assert json.loads((tmp_path / "report.json").read_text())["machine"]["cluster"].startswith("failed to start")


def test_the_cluster_s_running_components_are_those_whose_recorded_process_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    import os

    from cluster import proc, up

    monkeypatch.setenv("AIRFLOW_TORCHRUN_CLUSTER_STATE", str(tmp_path / "cluster"))
    assert up.running() == []  # never made here: nothing runs
    pids = up.state().pids
    pids.mkdir(parents=True)
    me = os.getpid()  # a process that surely runs: this one
    (pids / "etcd.pid").write_text(f"{me} {proc._start_time(me)}\n")
    (pids / "kube-apiserver.pid").write_text(f"{me} 0\n")  # that PID, but another process's start time
    assert up.running() == ["etcd"]
    (pids / "etcd.pid").unlink()
    assert up.running() == []


def test_make_bench_runs_the_runner():
    makefile = (BENCH.parent / "Makefile").read_text()
    assert "bench/run.py" in makefile and (BENCH / "run.py").is_file()
    assert "ray" not in (BENCH.parent / "pyproject.toml").read_text().lower(), "Ray is no dependency"
    assert "$(if $(filter 1,$(CLUSTER)),--cluster-up)" in makefile  # CLUSTER=0 starts nothing
    # The group's paired rows get the pairs their 0.15 s goals need (issue 26).
    group = next(b for b in run.BENCHES if b.name == "bench_group")
    assert group.args == ("--repeats", "3", "--max-pairs", "30", "--budget-s", "600")


# -- bench_interval: the failure times, the injector (on real processes) and its rows -----------------
def test_the_interval_bench_injects_the_same_failure_times_for_every_policy():
    import bench_interval

    times = bench_interval.failure_times(7, 25.0, horizon=900.0)
    assert times == bench_interval.failure_times(7, 25.0, horizon=900.0)  # seeded: every policy alike
    assert times != bench_interval.failure_times(8, 25.0, horizon=900.0)
    assert times == sorted(times) and times[0] > 0 and times[-1] <= 900.0
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert 15.0 < sum(gaps) / len(gaps) < 40.0  # exponential of mean 25 s (about 36 draws)


def _fake_process(tag: str, env: dict[str, str]):
    import os
    import subprocess

    full = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    full.update({"BENCH_INTERVAL_RUN": tag, **env})
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=full)


@pytest.mark.slow  # starts processes
def test_the_interval_bench_finds_a_forked_rank_by_its_agents_record(tmp_path):
    """A forked rank's environment is its agent's (no ``RANK``): the injector found none, and the
    interval bench's runs met no failure at all (``kills: 0`` in every run of 2026-12-05's first
    make bench after the ranks were forked)."""
    import json
    import time

    import bench_interval

    from airflow_torchrun.contract.launch import RANKS_FILE_VAR

    ranks = tmp_path / "ranks.json"
    agent = _fake_process("run-f", {RANKS_FILE_VAR: str(ranks)})
    rank1 = _fake_process("run-f", {RANKS_FILE_VAR: str(ranks)})
    rank0 = _fake_process("run-f", {RANKS_FILE_VAR: str(ranks)})
    try:
        ranks.write_text(json.dumps({str(rank1.pid): [1, 0], str(rank0.pid): [0, 0]}))
        deadline = time.monotonic() + 10
        while bench_interval.rank_pid("run-f", "1") != rank1.pid and time.monotonic() < deadline:
            time.sleep(0.05)  # until its environment is readable
        assert bench_interval.rank_pid("run-f", "1") == rank1.pid
        assert bench_interval.rank_pid("run-f", "0") == rank0.pid
        assert bench_interval.rank_pid("run-f", "2") is None
    finally:
        for p in (agent, rank1, rank0):
            p.kill()
            p.wait()


@pytest.mark.slow  # starts processes
def test_the_interval_bench_kills_rank_1_of_its_run_only_never_its_agent():
    import time

    import bench_interval

    rank1 = _fake_process("run-a", {"RANK": "1", "LOCAL_RANK": "0"})
    rank0 = _fake_process("run-a", {"RANK": "0", "LOCAL_RANK": "0"})
    agent = _fake_process("run-a", {"RANK": "1"})  # no LOCAL_RANK: torchrun sets it for workers only
    other = _fake_process("run-b", {"RANK": "1", "LOCAL_RANK": "0"})
    try:
        deadline = time.monotonic() + 10
        while bench_interval.rank_pid("run-a", "1") != rank1.pid and time.monotonic() < deadline:
            time.sleep(0.05)  # until its environment is readable
        assert bench_interval.rank_pid("run-a", "1") == rank1.pid
        injector = bench_interval.Injector("run-a", [0.1, 0.6])
        injector.start()
        assert rank1.wait(timeout=10) == -9
        injector.join(timeout=30)  # its second time came (not cut short by stop(), however late its thread ran)
        injector.stop()
        # The second failure time found no rank 1 (being relaunched): skipped, nothing else killed.
        assert (injector.kills, injector.skipped) == (1, 1)
        assert all(p.poll() is None for p in (rank0, agent, other))
    finally:
        for p in (rank1, rank0, agent, other):
            p.kill()
            p.wait()


def test_the_interval_bench_compares_each_should_checkpoint_policy_with_each_fixed_interval():
    import bench_interval

    run_ = bench_interval.Run
    runs = {
        "auto, mtbf": [run_("a", True, ettr=0.5, wall_s=60.0, kills=2), run_("a", False, kills=3)],
        "auto, observed": [run_("o", True, ettr=0.45, wall_s=64.0, kills=2), run_("o", True, ettr=0.4, wall_s=70.0)],
        "every 5 steps": [run_("f", True, ettr=0.25, wall_s=90.0, kills=4), run_("f", True, ettr=0.3, wall_s=80.0)],
    }
    report = bench_interval.report_rows(runs, 25.0, repeats=2)
    assert rows.check(report) == report
    ettr = [r for r in report if r["unit"] == "ETTR"]
    assert [(r["measure"].split(", ")[-1], r["anchor"]) for r in ettr] == [
        ("should_checkpoint (mtbf)", "every 5 steps"),
        ("should_checkpoint (observed)", "every 5 steps"),
    ]
    mtbf = ettr[0]
    assert (mtbf["ours"], mtbf["anchor_value"], mtbf["ours_success"]) == (0.5, 0.275, "1/2")
    assert mtbf["ratio"] == pytest.approx(0.5 / 0.275, abs=1e-3) and "5 kills in 2 runs" in mtbf["note"]
    # The report's goal reads these rows (ETTR: higher is better).
    lines = run.goal_lines(report)
    goal = [line for line in lines if line.startswith("| should_checkpoint's goodput")]
    assert len(goal) == 2 and all("| yes" in line for line in goal), goal
    assert run.better(mtbf) and not run.better({**mtbf, "ratio": 0.9})  # the chart colours it by this


# -- bench_cluster: the rows when no cluster runs, and containerd's log timestamps -----------------
def test_the_cluster_benchmark_says_not_run_without_a_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import bench_cluster

    monkeypatch.setattr(bench_cluster.kube, "api_ready", lambda: False)
    assert bench_cluster.main(["--json", str(tmp_path / "rows.json")]) == 0
    written = rows.check(json.loads((tmp_path / "rows.json").read_text()))
    assert [r["measure"] for r in written] == [m for m, _ in bench_cluster.MEASURES]
    assert all(r["ours"] is None and "not run: no cluster running" in r["note"] for r in written)


def test_a_kubectl_log_timestamp_is_read_to_the_nanosecond():
    import bench_cluster

    line = "2026-12-03T09:01:02.123456789Z [node 0 rank 0] step 1/270"
    assert bench_cluster.timestamp(line) == pytest.approx(1796288462.123456789, abs=1e-6)
    assert bench_cluster.timestamp("2026-12-03T09:01:02Z x") == pytest.approx(1796288462.0)


@pytest.mark.slow
def test_the_cpu_profile_counts_a_commands_processes_by_kind(capsys):
    """``bench/cpu_profile.py``: a process that burns CPU is counted under its kind (its command line
    names torchrun, so it is filed with the local nodes' agents), and the command's exit code is kept."""
    import cpu_profile

    burn = [sys.executable, "-c", "import time; end = time.process_time() + 1.5\nwhile time.process_time() < end: pass"]
    assert cpu_profile.main(["--every", "0.1", "--", *burn, "torchrun"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| local nodes' agents"))
    assert float(row.split("|")[2]) >= 1.0, out
    assert cpu_profile.main(["--", sys.executable, "-c", "raise SystemExit(3)"]) == 3


@pytest.mark.slow  # starts a process
def test_the_recovery_benchmark_finds_the_standalone_helper_as_make_bench_runs_it():
    """``make bench`` runs each benchmark as a script, with ``bench/`` first on its path and not the
    repository's root: the standalone rows' helper, which imports ``tests.ports``, must still import
    (a run lost every recovery row to a ModuleNotFoundError there)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import bench_recovery; print(bench_recovery.standalone_starter().__module__)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=BENCH, env=env, capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "tests.standalone", done.stdout
