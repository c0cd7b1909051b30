"""Launch overhead and failure teardown of the local backend, as ratios measured in one run.

1. Wall time of the same job (``bench/job.py``) through the operator (``dag.test()``: the task
   instance's own start -> end, and the whole DAG run) vs bare ``torchrun`` with identical settings
   (2 agents x 1 rank and 2 agents x 2 ranks, static rendezvous on loopback, same thread count);
   the fixed overhead in seconds is the median of the paired differences. Goal: ratio <= 1.02 on
   2x1, overhead <= 0.15 s.
2. Time from one rank's death (SIGKILL) to every other process of the group gone. Goal: median
   < 1 s, max < 1.5 s.

Each repeat runs every measurement once, the operator and bare torchrun in alternating order.

Run: ``.venv/bin/python bench/bench_group.py [--repeats 3] [--steps 400] [--json rows.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

from job import first_steps
from rows import Samples, row, write_json

ROOT = Path(__file__).resolve().parent.parent
JOB = Path(__file__).resolve().parent / "job.py"
WORK = Path(tempfile.mkdtemp(prefix="bench-group-"))
os.environ.update(
    {
        "AIRFLOW_HOME": str(WORK / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(WORK / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__TORCHRUN__STATE_DIR": str(WORK / "torchrun"),
    }
)
_BEGAN = time.monotonic()


def progress(bench: str, what: str, value: object) -> None:
    """One line per measurement while a benchmark runs (``make bench`` streams it)."""

    def short(v: object) -> object:
        return round(v, 2) if isinstance(v, float) else v

    if isinstance(value, tuple):
        value = tuple(short(v) for v in value)
    elif hasattr(value, "__dict__"):
        value = {k: short(v) for k, v in vars(value).items() if v not in (None, "")}
    print(f"  [bench:{bench} +{time.monotonic() - _BEGAN:4.0f}s] {what}: {short(value)}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def first_step_at(events: Path) -> float:
    """When the job's first incarnation trained its first step (``bench/job.py`` wrote it)."""
    steps = first_steps(events)
    if not steps:
        raise SystemExit(f"the job wrote no first step to {events}")
    return float(steps[0]["t"])


def bare_torchrun(nproc: int, steps: int, tag: str) -> tuple[float, float]:
    """Bare torchrun's wall time and its launch -> first training step."""
    port = free_port()
    events = WORK / f"events-{tag}.jsonl"
    env = {**os.environ, "STEPS": str(steps), "OMP_NUM_THREADS": "1", "EVENTS": str(events)}
    launched = time.time()
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--nproc-per-node={nproc}",
                f"--node-rank={n}",
                "--rdzv-backend=static",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "--max-restarts=0",
                "--monitor-interval=0.1",
                str(JOB),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for n in range(2)
    ]
    codes = [p.wait() for p in procs]
    elapsed = time.perf_counter() - start
    if codes != [0, 0]:
        raise SystemExit(f"bare torchrun failed: {codes}")
    return elapsed, first_step_at(events) - launched


def write_dag(
    dag_id: str, script: Path, env: dict[str, str], extra: str = "", *, nproc: int = 1, folder: Path | None = None
) -> object:
    """Write a one-task DAG to ``folder`` (the dags folder) and load it; the DAG object."""
    import importlib.util

    dags = folder or WORK / "dags"
    dags.mkdir(parents=True, exist_ok=True)
    path = dags / f"{dag_id}.py"
    path.write_text(
        textwrap.dedent(
            f"""
            import pendulum
            from datetime import timedelta
            from airflow.sdk import DAG
            from airflow_torchrun import DistributedTrainingOperator
            with DAG({dag_id!r}, schedule=None, start_date=pendulum.datetime(2026, 1, 1)) as dag:
                DistributedTrainingOperator(task_id="train", script={str(script)!r}, num_nodes=2,
                                            nproc_per_node={nproc}, env={env!r}, {extra or "retries=0"})
            """
        )
    )
    spec = importlib.util.spec_from_file_location(dag_id, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dag


def task_times(dag_id: str, run_id: str) -> tuple[float, float]:
    """The task instance's start and end, as Airflow recorded them."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        query = select(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id)
        ti = session.scalars(query).one()
        if ti.start_date is None or ti.end_date is None:
            raise SystemExit(f"{dag_id} {run_id}: the task has no start or end ({ti.state})")
        return float(ti.start_date.timestamp()), float(ti.end_date.timestamp())


def warm_up() -> None:
    """One unmeasured ``dag.test()`` of a plain Python task: the first one in a process sets up
    Airflow's in-process execution API (seconds), which a running Airflow worker has already done.
    It runs none of our code, so the operator's own first-use costs stay in the measurements."""
    import importlib.util

    dags = WORK / "dags"
    dags.mkdir(parents=True, exist_ok=True)
    path = dags / "bench_warm_up.py"
    path.write_text(
        textwrap.dedent(
            """
            import pendulum
            from airflow.sdk import DAG, task
            with DAG("bench_warm_up", schedule=None, start_date=pendulum.datetime(2026, 1, 1)) as dag:
                task(lambda: None, task_id="noop")()
            """
        )
    )
    spec = importlib.util.spec_from_file_location("bench_warm_up", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.dag.test()


def through_operator(nproc: int, steps: int, i: int) -> tuple[float, float, float]:
    """The task's wall time, the whole ``dag.test()`` and the task's start -> first training step."""
    dag_id = f"bench_ok_{nproc}_{i}"
    events = WORK / f"events-{dag_id}.jsonl"
    env = {"STEPS": str(steps), "OMP_NUM_THREADS": "1", "EVENTS": str(events)}
    dag = write_dag(dag_id, JOB, env, nproc=nproc)
    start = time.perf_counter()
    dr = dag.test()  # type: ignore[attr-defined]
    whole = time.perf_counter() - start
    if str(getattr(dr.state, "value", dr.state)) != "success":
        raise SystemExit(f"operator run failed: {dr.state}")
    started, ended = task_times(dag_id, dr.run_id)
    return ended - started, whole, first_step_at(events) - started


def death_to_gone(i: int) -> float:
    from airflow_torchrun.backends.procs import group_pids

    death_file = WORK / f"death-{i}.txt"
    dag = write_dag(
        f"bench_kill_{i}",
        JOB,
        {"STEPS": "100000", "KILL_AT": "30", "KILL_MARK": str(death_file), "OMP_NUM_THREADS": "1"},
    )
    gone_at: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        # Poll every process of any bench_kill_i group; note when none is left after the death.
        prefix = f"bench-kill-{i}-train-"
        while not stop.is_set():
            if death_file.exists():
                groups = [g.name for g in (WORK / "torchrun" / "groups").glob(f"{prefix}*")]
                if groups and not any(group_pids(g) for g in groups):
                    gone_at.append(time.time())
                    return
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    dag.test()  # type: ignore[attr-defined]
    watcher.join(30)
    stop.set()
    if not gone_at:
        raise SystemExit("group processes outlived the failed task")
    return gone_at[0] - float(death_file.read_text())


LAYOUTS = (1, 2)  # ranks per agent: 2x1 and 2x2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400, help="training steps of the job (sets its length)")
    parser.add_argument("--json", metavar="PATH", help="also write the report rows (bench/rows.py) to PATH")
    args = parser.parse_args()

    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True)
    warm_up()
    bare: dict[int, list[float]] = {n: [] for n in LAYOUTS}
    task: dict[int, list[float]] = {n: [] for n in LAYOUTS}
    whole: dict[int, list[float]] = {n: [] for n in LAYOUTS}
    kill: list[float] = []
    first: dict[str, list[float]] = {"bare": [], "ours": []}  # launch -> first step, 2x1
    for i in range(args.repeats):
        # Interleave (and alternate which side goes first) so that drift in load hits both alike.
        for nproc in LAYOUTS:
            for side in ("bare", "ours") if i % 2 == 0 else ("ours", "bare"):
                if side == "bare":
                    b, f = bare_torchrun(nproc, args.steps, f"bare-{nproc}-{i}")
                    bare[nproc].append(b)
                    progress("group", f"repeat {i + 1}/{args.repeats} bare torchrun 2x{nproc} wall, first step", (b, f))
                else:
                    t, w, f = through_operator(nproc, args.steps, i)
                    task[nproc].append(t)
                    whole[nproc].append(w)
                    progress(
                        "group",
                        f"repeat {i + 1}/{args.repeats} operator 2x{nproc} task, dag.test, first step",
                        (t, w, f),
                    )
                if nproc == 1:
                    first[side].append(f)
        kill.append(death_to_gone(i))
        progress("group", f"repeat {i + 1}/{args.repeats} rank death -> all gone", kill[-1])

    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    raw = {"bare": bare, "task": task, "whole": whole, "kill": kill, "first": first, "steps": args.steps}
    (out / "bench_group.json").write_text(json.dumps(raw, indent=2))
    write_json(args.json, report_rows(bare, task, whole, kill, first))


def report_rows(
    bare: dict[int, list[float]],
    task: dict[int, list[float]],
    whole: dict[int, list[float]],
    kill: list[float],
    first: dict[str, list[float]],
) -> list[dict[str, object]]:
    anchor = "bare torchrun, same job and settings"
    rows = [
        row(
            "launch -> first training step, 2x1 (ours: from the task's start)",
            Samples(first["ours"]),
            "bare torchrun (static rendezvous), from its start",
            Samples(first["bare"]),
            "s",
        )
    ]
    for nproc in sorted(bare):
        b, t = Samples(bare[nproc]), Samples(task[nproc])
        rows.append(row(f"operator task wall time, 2 agents x {nproc}", t, anchor, b, "s"))
        overhead = Samples([x - y for x, y in zip(task[nproc], bare[nproc], strict=True)])
        rows.append(row(f"operator fixed overhead, 2x{nproc} (task - bare, paired)", overhead, "goal", 0.15, "s"))
        rows.append(row(f"whole dag.test() run, 2x{nproc}", Samples(whole[nproc]), anchor, b, "s"))
    k = Samples(kill)
    rows.append(row("rank SIGKILLed -> every group process gone (median)", k, "goal (median)", 1.0, "s"))
    rows.append(row("rank SIGKILLed -> every group process gone (max)", max(kill), "goal (max)", 1.5, "s"))
    return rows


if __name__ == "__main__":
    main()
