"""Run every benchmark one after another and write one report (``make bench``).

Each benchmark runs in a process of its own (each sets up its own Airflow home and state) with
``--json``, so its rows (``bench/rows.py``) are read back, never parsed from printed text. Writes
``<out>/report.json`` (``{"date", "quick", "failed", "rows": [{"measure", "ours", "anchor",
"anchor_value", "ratio", "unit"}]}``) and ``<out>/report.md``.

Run: ``.venv/bin/python bench/run.py [--quick] [--only bench_group] [--out .state/bench]``.
``--quick`` is a smoke run (one repeat, short jobs, small state): it checks that every benchmark
still runs, its figures are not worth quoting.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rows import check

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


@dataclass(frozen=True)
class Bench:
    script: str
    args: tuple[str, ...]
    quick_args: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.script.removesuffix(".py")


BENCHES = (
    Bench("bench_group.py", ("--repeats", "3"), ("--repeats", "1", "--steps", "50")),
    Bench("bench_recovery.py", ("--repeats", "3"), ("--repeats", "1")),
    Bench("bench_checkpoint.py", ("--repeat", "3"), ("--size-mb", "8", "--repeat", "1", "--epochs", "2")),
)


def assemble(results: dict[str, list[dict[str, Any]]], failed: list[str], *, date: str, quick: bool) -> dict[str, Any]:
    """The report: every benchmark's rows in run order, each checked against the row shape."""
    rows: list[dict[str, Any]] = []
    for name, bench_rows in results.items():
        try:
            rows += check(bench_rows)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc
    return {"date": date, "quick": quick, "failed": list(failed), "rows": rows}


def markdown(report: dict[str, Any]) -> str:
    def num(value: float | None) -> str:
        return "-" if value is None else f"{value:.3g}"

    lines = [
        f"# Benchmarks, {report['date']}" + (" (quick smoke run: do not quote)" if report["quick"] else ""),
        "",
        "`ratio` is ours / anchor; in `s` lower is better, in `MB/s` higher is better.",
        "",
        "| measure | ours | anchor | anchor value | ratio | unit |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['measure']} | {num(r['ours'])} | {r['anchor']} | {num(r['anchor_value'])} | {num(r['ratio'])} "
        f"| {r['unit']} |"
        for r in report["rows"]
    ]
    if report["failed"]:
        lines += ["", f"Failed (no rows): {', '.join(report['failed'])}; see the run's output."]
    return "\n".join(lines) + "\n"


def run_one(bench: Bench, quick: bool, scratch: Path, index: int, total: int) -> list[dict[str, Any]] | None:
    """Run one benchmark, its output streaming through; its rows, or None when it failed."""
    out = scratch / f"{bench.name}.json"
    argv = [sys.executable, str(BENCH / bench.script), *(bench.quick_args if quick else bench.args), "--json", str(out)]
    print(f"[{index}/{total}] {bench.script} {' '.join(argv[2:])}", flush=True)
    started = time.perf_counter()
    code = subprocess.run(argv, cwd=ROOT, check=False).returncode
    elapsed = time.perf_counter() - started
    if code != 0 or not out.is_file():
        print(f"[{index}/{total}] {bench.script} FAILED (exit {code}) after {elapsed:.0f} s", flush=True)
        return None
    print(f"[{index}/{total}] {bench.script} done in {elapsed:.0f} s", flush=True)
    return list(json.loads(out.read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: one repeat, short jobs, small state")
    parser.add_argument("--only", action="append", choices=[b.name for b in BENCHES], help="run only these")
    parser.add_argument("--out", default=str(ROOT / ".state" / "bench"), help="report directory")
    args = parser.parse_args(argv)
    chosen = [b for b in BENCHES if not args.only or b.name in args.only]
    date = datetime.now(UTC).isoformat(timespec="seconds")
    results: dict[str, list[dict[str, Any]]] = {}
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-run-") as scratch:
        for i, bench in enumerate(chosen, 1):
            rows = run_one(bench, args.quick, Path(scratch), i, len(chosen))
            if rows is None:
                failed.append(bench.name)
            else:
                results[bench.name] = rows
    report = assemble(results, failed, date=date, quick=args.quick)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(markdown(report))
    print(f"Report: {out / 'report.md'} and report.json ({len(report['rows'])} rows)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
