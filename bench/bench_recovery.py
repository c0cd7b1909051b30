"""Time from a rank's death to training progressing again: in-try restart and Airflow retry.

The example trainer (2 nodes x 1 rank, checkpoint every 20 steps) SIGKILLs rank 1 at step 40; the
retry resumes from step 40's committed checkpoint... or the newest committed one. Measured:

- recovery: the death (the trainer records it just before the kill) -> the first step the next
  launch trains (its progress line), by an in-try restart (``max_restarts=1``, ``retries=0``) and
  by Airflow's retry in ``dag.test()`` (``retries=1``, ``retry_delay`` 0), interleaved;
- baseline, same run: a fresh group's launch -> its first step (the unavoidable start-up cost).

Run: ``.venv/bin/python bench/bench_recovery.py [--repeats 3] [--json rows.json]``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from datetime import datetime

from bench_group import ROOT, WORK, write_dag
from rows import row, write_json

TRAINER = ROOT / "images" / "trainer" / "train.py"
STEP_LINE = re.compile(r"\[node 0 rank 0\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank0 train INFO step (\d+)/")


def first_step_time(log: str, after_step: int) -> float:
    for match in STEP_LINE.finditer(log):
        if int(match.group(2)) > after_step:
            # The trainer logs in local time; this machine's local time is what time.time() counts.
            return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    raise SystemExit("no progress line after the resume step")


MODES = {"restart": ("retries=0, max_restarts=1", "t1-r1"), "retry": ("retries=1, retry_delay=timedelta(0)", "t2")}


def one_run(i: int, mode: str) -> tuple[float, float]:
    args = [
        "--epochs",
        "3",
        "--checkpoint-every",
        "20",
        "--log-every",
        "1",
        "--fail-at-step",
        "40",
        "--fail-rank",
        "1",
        "--fail-mode",
        "kill",
    ]
    policy, second_suffix = MODES[mode]
    extra = f"script_args={args!r}, {policy}, track=False"
    dag = write_dag(f"bench_recover_{mode}_{i}", TRAINER, {}, extra)
    dr = dag.test()  # type: ignore[attr-defined]
    if str(getattr(dr.state, "value", dr.state)) != "success":
        raise SystemExit(f"recovery run failed: {dr.state}")
    groups = WORK / "torchrun" / "groups"
    first = next(groups.glob(f"bench-recover-{mode}-{i}-train-*-t1"))
    second = next(groups.glob(f"bench-recover-{mode}-{i}-train-*-{second_suffix}"))
    checkpoints = WORK / "torchrun" / "checkpoints" / f"bench_recover_{mode}_{i}"
    marker = next(checkpoints.rglob("simulated-failure-at-step-*"))
    died = marker.stat().st_mtime
    resumed_log = (second / "node-0" / "node.log").read_text()
    resumed_step = int(re.search(r"Resumed from \S+ at step (\d+)", resumed_log).group(1))  # type: ignore[union-attr]
    recovery = first_step_time(resumed_log, resumed_step) - died
    launched = json.loads((first / "group.json").read_text())["launched_at"]
    fresh = first_step_time((first / "node-0" / "node.log").read_text(), 0) - launched
    return recovery, fresh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="also write the report rows (bench/rows.py) to PATH")
    args = parser.parse_args()
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True)
    runs: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    for i in range(args.repeats):  # interleaved: the machine's noise falls on both alike
        for mode in MODES:
            runs[mode].append(one_run(i, mode))
    med = statistics.median
    fresh = [f for pairs in runs.values() for _, f in pairs]
    recovery = {mode: [r for r, _ in pairs] for mode, pairs in runs.items()}
    results: dict[str, float | int] = {
        "in_try_restart_s": med(recovery["restart"]),
        "airflow_retry_s": med(recovery["retry"]),
        "fresh_launch_to_first_step_s": med(fresh),
        "restart_minus_fresh_start_s": med(recovery["restart"]) - med(fresh),
        "retry_minus_fresh_start_s": med(recovery["retry"]) - med(fresh),
        "repeats": args.repeats,
    }
    for key, value in results.items():
        print(f"{key:<34}{value:>10.3f}" if isinstance(value, float) else f"{key:<34}{value:>10}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_recovery.json").write_text(
        json.dumps({"raw": {"recovery": recovery, "fresh": fresh}, **results}, indent=2)
    )
    anchor = "fresh group launch -> first step, same run"
    rows = [
        row("rank death -> training again, in-try restart", med(recovery["restart"]), anchor, med(fresh), "s"),
        row("rank death -> training again, Airflow retry", med(recovery["retry"]), anchor, med(fresh), "s"),
    ]
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
