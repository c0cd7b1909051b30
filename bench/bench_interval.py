"""Goodput under injected failures: ``worker.should_checkpoint`` (Young/Daly) against fixed intervals.

The shipped example trainer (``images/trainer/train.py``, 2 gloo ranks as 2 "nodes" x 1, a wider
model than the pipeline's so that a save costs something) runs as one operator task under
``dag.test()`` with in-try restarts (``retries=0, max_restarts=50``). While it runs, rank 1 is
SIGKILLed at seeded, exponentially distributed wall times (mean ``--mtbf`` seconds, counted from
the task's start): the same failure times for every policy of one repeat, so a policy that trains
longer also meets more failures, as on a real cluster. The policies, interleaved per repeat:

- ``auto, mtbf``: ``--checkpoint-every auto`` with the operator's ``mtbf`` set to the injected mean;
- ``auto, observed``: ``--checkpoint-every auto`` without ``mtbf`` (the lineage's observed failures);
- ``every N steps`` for each ``--fixed`` N (a fixed interval, what a script without the helper does).

What is compared is the task's ETTR from the operator's own goodput ledger (XCom ``goodput``:
productive / wall; higher is better), plus the wall time to finish the same steps. A kill that
finds no rank running (the group is being relaunched) is skipped and counted.

Run: ``.venv/bin/python bench/bench_interval.py [--repeats 2] [--mtbf 25] [--fixed 5,400] [--json rows.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rows import Samples, row, write_json

ROOT = Path(__file__).resolve().parent.parent
TRAINER = ROOT / "images" / "trainer" / "train.py"
MARK = "BENCH_INTERVAL_RUN"  # in every rank's environment: how the injector finds them


@dataclass
class Run:
    policy: str
    ok: bool
    ettr: float | None = None
    wall_s: float | None = None
    lost_steps: int | None = None
    stall_s: float | None = None
    kills: int = 0
    skipped: int = 0
    reason: str = ""


@dataclass
class Injector:
    """SIGKILL rank 1 of the run tagged ``tag`` at ``times`` (seconds after ``start()``)."""

    tag: str
    times: list[float]
    kills: int = 0
    skipped: int = 0
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        began = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(began,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self.join()

    def join(self, timeout: float | None = None) -> None:
        """Until every time has come (or ``stop``, or ``timeout`` seconds)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self, began: float) -> None:
        for at in self.times:
            if self._done.wait(max(0.0, began + at - time.monotonic())):
                return
            pid = rank_pid(self.tag, "1")
            if pid is None:
                self.skipped += 1
                continue
            try:
                os.kill(pid, signal.SIGKILL)
                self.kills += 1
            except ProcessLookupError:
                self.skipped += 1


def rank_pid(tag: str, rank: str) -> int | None:
    """The pid of the training process of ``rank`` in the run ``tag``: a process with the run's mark
    whose rank the local backend's own record gives (an exec'd rank's ``RANK`` and ``LOCAL_RANK``, or
    the record of the ranks its agent forked: ``procs.ranks_of``), so an agent is never taken for a rank."""
    from airflow_torchrun.backends.local.procs import ranks_of

    mark = f"{MARK}={tag}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            environ = set(Path(f"/proc/{name}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if mark in environ and (found := ranks_of(int(name))) is not None and found[0] == int(rank):
            return int(name)
    return None


def failure_times(seed: int, mtbf: float, horizon: float) -> list[float]:
    """Exponential inter-arrival times of mean ``mtbf``, up to ``horizon`` seconds."""
    rng, at, times = random.Random(seed), 0.0, []
    while True:
        at += rng.expovariate(1.0 / mtbf)
        if at > horizon:
            return times
        times.append(round(at, 3))


def goodput(dag_id: str, run_id: str) -> dict[str, object] | None:
    """The task's goodput ledger (XCom ``goodput``), as the operator pushed it."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        found = session.scalars(
            XComModel.get_many(run_id=run_id, key="goodput", task_ids="train", dag_ids=dag_id)
        ).first()
        return None if found is None else XComModel.deserialize_value(found)


def policies(mtbf: float, fixed: list[int]) -> dict[str, tuple[str, str]]:
    """Policy name -> (``--checkpoint-every``, the operator's extra arguments)."""
    base = "retries=0, max_restarts=50"
    out = {"auto, mtbf": ("auto", f"{base}, mtbf={mtbf!r}"), "auto, observed": ("auto", base)}
    out.update({f"every {n} steps": (str(n), base) for n in fixed})
    return out


def one_run(tag: str, every: str, extra: str, args: argparse.Namespace, times: list[float]) -> Run:
    from bench_group import write_dag  # sets up the benchmark's Airflow home on import

    script_args = [
        "--epochs", str(args.epochs), "--hidden", str(args.hidden), "--log-every", "1000",
        "--checkpoint-every", every,
    ]  # fmt: skip
    env = {MARK: tag, "OMP_NUM_THREADS": "1"}
    dag_id = tag.replace("-", "_")
    dag = write_dag(dag_id, TRAINER, env, f"script_args={script_args!r}, {extra}")
    injector = Injector(tag, times)
    injector.start()
    try:
        dr = dag.test()  # type: ignore[attr-defined]
    finally:
        injector.stop()
    state = str(getattr(dr.state, "value", dr.state))
    ledger = goodput(dag_id, dr.run_id)
    task = ledger.get("task") if isinstance(ledger, dict) else None
    if state != "success" or not isinstance(task, dict):
        return Run(tag, False, kills=injector.kills, skipped=injector.skipped, reason=f"DAG run {state}")
    categories = task.get("categories") or {}
    return Run(
        tag,
        True,
        ettr=task.get("ettr"),
        wall_s=task.get("wall_s"),
        lost_steps=task.get("lost_steps"),
        stall_s=categories.get("checkpoint_stall") if isinstance(categories, dict) else None,
        kills=injector.kills,
        skipped=injector.skipped,
    )


def report_rows(runs: dict[str, list[Run]], mtbf: float, repeats: int) -> list[dict[str, object]]:
    def side(policy: str, value: str) -> Samples:
        got = [getattr(r, value) for r in runs[policy] if r.ok and getattr(r, value) is not None]
        return Samples(got, repeats)

    def kills(policy: str) -> str:
        done = [r.kills for r in runs[policy]]
        return f"{policy}: {sum(done)} kills in {len(done)} runs (median {statistics.median(done):g})"

    rows = []
    for ours in ("auto, mtbf", "auto, observed"):
        for anchor in (p for p in runs if p.startswith("every ")):
            failures = f"kill -9 of a rank every ~{mtbf:g}s"
            note = f"{kills(ours)}; {kills(anchor)}"
            name = f"should_checkpoint ({ours.removeprefix('auto, ')})"
            rows.append(
                row(f"goodput (ETTR) under {failures}, {name}", side(ours, "ettr"), anchor, side(anchor, "ettr"),
                    "ETTR", note=note)
            )  # fmt: skip
            rows.append(
                row(f"wall time to finish under {failures}, {name}", side(ours, "wall_s"), anchor,
                    side(anchor, "wall_s"), "s")
            )  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each policy (interleaved)")
    parser.add_argument("--mtbf", type=float, default=25.0, help="mean seconds between injected kills")
    parser.add_argument("--fixed", default="5,400", help="fixed intervals to compare with, in steps")
    # Long enough that a run meets failures at the default MTBF: with forked ranks 40 epochs took about 25 s,
    # and most runs of a repeat met none.
    parser.add_argument("--epochs", type=int, default=100, help="trainer epochs (22 steps each at 2 ranks)")
    parser.add_argument("--hidden", type=int, default=1024, help="trainer width: a save's cost grows with it")
    parser.add_argument("--seed", type=int, default=24, help="seed of the failure times")
    parser.add_argument("--json", metavar="PATH", help="also write the report rows (bench/rows.py) to PATH")
    args = parser.parse_args()
    fixed = [int(n) for n in args.fixed.split(",") if n.strip()]
    if args.repeats < 1 or args.mtbf <= 0 or not fixed or min(fixed) < 1:
        parser.error("--repeats >= 1, --mtbf > 0 and at least one --fixed interval >= 1 are needed")
    import subprocess

    from bench_group import progress, warm_up  # sets up the benchmark's Airflow home on import

    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True)
    warm_up()
    plan = policies(args.mtbf, fixed)
    runs: dict[str, list[Run]] = {p: [] for p in plan}
    for i in range(args.repeats):
        times = failure_times(args.seed + i, args.mtbf, horizon=900.0)
        for n, (policy, (every, extra)) in enumerate(plan.items()):
            tag = f"interval-{i}-{n}"
            got = one_run(tag, every, extra, args, times)
            got.policy = policy
            runs[policy].append(got)
            progress("interval", f"repeat {i + 1}/{args.repeats} {policy}", got)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    raw = {p: [vars(r) for r in got] for p, got in runs.items()}
    (out / "bench_interval.json").write_text(json.dumps({"mtbf": args.mtbf, "runs": raw}, indent=2))
    write_json(args.json, report_rows(runs, args.mtbf, args.repeats))


if __name__ == "__main__":
    main()
