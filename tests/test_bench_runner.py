"""``bench/run.py``'s report assembly. A real ``bench/run.py --quick`` takes about 90 s on 2 cores
(three benchmarks, each starting torchrun groups under ``dag.test()``), too slow for the suite:
these tests cover the row shape and the report built from it."""

from __future__ import annotations

import json
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
    assert tuple(r) == rows.FIELDS == ("measure", "ours", "anchor", "anchor_value", "ratio", "unit")
    assert r["ratio"] == 1.5
    assert rows.row("m", 3.0, "none", None, "s")["ratio"] is None


def test_the_report_holds_every_benchmark_s_rows_in_order():
    report = run.assemble(SAMPLE, ["bench_recovery"], date="2026-12-01T00:00:00+00:00", quick=True)
    assert set(report) == {"date", "quick", "failed", "rows"}
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


def test_every_benchmark_the_runner_names_exists_and_takes_json():
    for bench in run.BENCHES:
        source = (BENCH / bench.script).read_text()
        assert '"--json"' in source and "write_json(args.json" in source, bench.script


def test_the_checkpoint_benchmark_reports_throughput_and_training_rows():
    pytest.importorskip("torch")
    import bench_checkpoint

    io_rows = [bench_checkpoint.Row("file", "write", 100.0, ours_s=2.0, raw_s=1.0)]
    train_rows = [
        bench_checkpoint.TrainRow("no checkpointing", 10.0, 0.0, 10.0),
        bench_checkpoint.TrainRow("sync, default interval", 11.0, 0.5, 10.0),
    ]
    report = bench_checkpoint.report_rows(io_rows, train_rows)
    assert rows.check(report) == report
    assert [(r["unit"], r["ratio"]) for r in report] == [("MB/s", 0.5), ("s", 1.1)]


def test_make_bench_runs_the_runner():
    makefile = (BENCH.parent / "Makefile").read_text()
    assert "bench/run.py" in makefile and (BENCH / "run.py").is_file()
