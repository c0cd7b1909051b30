"""Launch overhead and failure teardown of the local backend, as ratios measured in one run.

1. Wall time of the same job (``bench/job.py``) through the operator (``dag.test()``: the task
   instance's own start -> end, and the whole DAG run) vs bare ``torchrun`` with identical settings
   (2 agents x 1 rank, 2 x 2 and 4 x 1, static rendezvous on loopback, same thread count). The
   fixed overhead in seconds is the mean of the paired differences (operator - bare, one pair per
   repeat, alternating which goes first), with its 95% interval: pairs are added until that
   interval is within +/- 0.1 s (``--half-width``), or a cap of pairs or seconds is reached
   (``bench/stats.py``); the row says how many pairs it took and why it stopped. Goals: ratio
   <= 1.02 on 2x1, overhead <= 0.15 s at every layout. The operator runs twice per repeat: as a
   user runs it (its agents forked from a zygote, its ranks from their agent, torch imported
   once) and with ``AIRFLOW_TORCHRUN_RANK_START=exec`` and ``AIRFLOW_TORCHRUN_AGENT_START=exec``
   (each agent and rank a new interpreter, as bare torchrun starts them): the first is what a user
   gets, the second isolates the operator's own fixed cost, the overhead rows' figure and the one
   the repeat rule follows. The same cost is also read from the try's own timeline: all of the
   task's wall time but its group's life (task start -> launched, group exited -> task end), the
   "operator's own time" rows (mean and 95% interval; goal <= 0.15 s): no launcher in it, so none of
   the interpreters' start-up noise that widens the paired rows.
2. Where the time goes, phase by phase, for 2x1 and 2x2: the operator's phases from the try's own
   timeline (XCom ``timeline``, ``airflow_torchrun/timeline.py``), the job's moments (started,
   process group joined, first and last step) from its events file, the same for bare torchrun.
3. Time from one rank's death (SIGKILL) to every other process of the group gone. Goal: median
   < 1 s, max < 1.5 s.
4. One node's agent alone (1 rank that SIGKILLs itself once torch is imported): its death -> the
   agent's exit, the local backend's agent (``airflow_torchrun.backends.local.agent``) against
   ``python -m torch.distributed.run``, alternated, the same arguments.

Run: ``.venv/bin/python bench/bench_group.py [--repeats 3] [--max-pairs 12] [--steps 200] [--json rows.json]``.
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from job import first_steps, job_events
from rows import Samples, row, write_json
from stats import RepeatRule, mean_interval

from airflow_torchrun.backends.local.backend import free_port
from airflow_torchrun.contract.launch import AGENT_START_VAR, RANK_START_VAR

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("bare", "ours", "ours, exec")
JOB = Path(__file__).resolve().parent / "job.py"
WORK = Path(tempfile.mkdtemp(prefix="bench-group-"))
atexit.register(shutil.rmtree, WORK, ignore_errors=True)  # its Airflow home, state and logs
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


def first_step_at(events: Path) -> float:
    """When the job's first incarnation trained its first step (``bench/job.py`` wrote it)."""
    steps = first_steps(events)
    if not steps:
        raise SystemExit(f"the job wrote no first step to {events}")
    return float(steps[0]["t"])


Layout = tuple[int, int]  # (agents, ranks per agent)


def bare_torchrun(layout: Layout, steps: int, tag: str) -> tuple[float, float, dict[str, float]]:
    """Bare torchrun's wall time, its launch -> first training step and its phases."""
    nnodes, nproc = layout
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
                f"--nnodes={nnodes}",
                f"--nproc-per-node={nproc}",
                f"--node-rank={n}",
                "--rdzv-backend=static",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "--max-restarts=0",
                "--monitor-interval=0.1",
                f"--log-dir={WORK / 'torchrun-logs' / tag}",
                str(JOB),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # A session per agent, as the local backend gives each node: with the kernel's
            # autogroup scheduling, agents sharing this process's session got half the CPU each
            # on a loaded machine (measured 2026-12-02, load average 22: 21.6 s vs 10.7 s to the
            # ranks' start).
            start_new_session=True,
        )
        for n in range(nnodes)
    ]
    codes = [p.wait() for p in procs]
    elapsed = time.perf_counter() - start
    exited = time.time()
    if any(codes):
        raise SystemExit(f"bare torchrun failed: {codes}")
    return elapsed, first_step_at(events) - launched, job_phases(events, launched, exited)


def write_dag(
    dag_id: str,
    script: Path,
    env: dict[str, str],
    extra: str = "",
    *,
    nproc: int = 1,
    nnodes: int = 2,
    folder: Path | None = None,
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
                DistributedTrainingOperator(task_id="train", script={str(script)!r}, num_nodes={nnodes},
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


def try_timeline(dag_id: str, run_id: str) -> list[dict[str, object]]:
    """The task's timeline (XCom ``timeline``), as the engine pushed it."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        found = session.scalars(
            XComModel.get_many(run_id=run_id, key="timeline", task_ids="train", dag_ids=dag_id)
        ).first()
        value = None if found is None else XComModel.deserialize_value(found)
    return list(value) if isinstance(value, list) else []


def job_phases(events: Path, launched: float, exited: float) -> dict[str, float]:
    """The job's own moments (bench/job.py's events) as phases from ``launched`` to ``exited``."""
    at = {e["event"]: float(e["t"]) for e in reversed(job_events(events))}  # each one's first
    marks = [("launched", launched)] + [(k, at[k]) for k in ("started", "joined", "first_step", "last_step") if k in at]
    marks.append(("exited", exited))
    return {f"{a} -> {b}": tb - ta for (a, ta), (b, tb) in itertools.pairwise(marks)}


# The operator's phases: (name, from, to), each a timeline mark of launch 0 ("task_start"/"task_end":
# the task instance's own start and end as Airflow recorded them; "job:*": the job's events).
OPERATOR_PHASES = (
    ("Airflow: task start -> our execute()", "task_start", "try_started"),
    ("render and check the spec, make the contract", "try_started", "prepared"),
    ("stop earlier tries", "prepared", "contract_started"),
    ("preflight (rank contract)", "contract_started", "contract_ready"),
    ("plan", "contract_ready", "launch_started"),
    ("spawn (supervisors)", "launch_started", "launched"),
    ("agents up -> first output", "launched", "first_output"),
    ("launched -> ranks started", "launched", "ranks_started"),
    ("ranks started -> rendezvous", "ranks_started", "rendezvous"),
    ("rendezvous -> first step", "rendezvous", "first_step"),
    ("first step -> last step (training)", "job:first_step", "job:last_step"),
    ("last step -> group exited", "job:last_step", "exited"),
    ("exited -> watch's verdict", "exited", "ended"),
    ("teardown", "teardown_started", "teardown_done"),
    ("finish (contract)", "finish_started", "try_ended"),
    ("try ended -> task end (our timeline and goodput XComs, then Airflow's)", "try_ended", "task_end"),
)
BARE_PHASES = (
    ("launched -> ranks started", "launched -> started"),
    ("ranks started -> rendezvous", "started -> joined"),
    ("rendezvous -> first step", "joined -> first_step"),
    ("first step -> last step (training)", "first_step -> last_step"),
    ("last step -> group exited", "last_step -> exited"),
)


# The operator's own time in a try: all of the task's wall time but its group's life (from every
# node spawned to the group's exit, as the nodes recorded it), Airflow's start and end included.
OWN = "operator's own time (task start -> group launched, group exited -> task end)"


def operator_phases(timeline: list[dict[str, object]], events: Path, start: float, end: float) -> dict[str, float]:
    at: dict[str, float] = {"task_start": start, "task_end": end}
    for e in timeline:
        name, launch = str(e.get("mark")), e.get("launch")
        if launch in (0, -1) and name not in at and isinstance(e.get("at"), int | float):
            at[name] = float(e["at"])  # type: ignore[arg-type]
    for e in reversed(job_events(events)):
        at[f"job:{e['event']}"] = float(e["t"])
    phases = {name: at[b] - at[a] for name, a, b in OPERATOR_PHASES if a in at and b in at}
    if "launched" in at and "exited" in at:
        phases[OWN] = (at["launched"] - start) + (end - at["exited"])
    return phases


def through_operator(
    layout: Layout, steps: int, i: int, start: str = "fork"
) -> tuple[float, float, float, dict[str, float]]:
    """The task's wall time, the whole ``dag.test()``, the task's start -> first training step and
    the task's phases; ``start``: how its agents and ranks start (fork, or exec as bare torchrun's)."""
    nnodes, nproc = layout
    dag_id = f"bench_ok_{nnodes}x{nproc}_{start}_{i}"
    events = WORK / f"events-{dag_id}.jsonl"
    env = {
        "STEPS": str(steps),
        "OMP_NUM_THREADS": "1",
        "EVENTS": str(events),
        RANK_START_VAR: start,
        AGENT_START_VAR: start,
    }
    dag = write_dag(dag_id, JOB, env, nproc=nproc, nnodes=nnodes)
    start = time.perf_counter()
    dr = dag.test()  # type: ignore[attr-defined]
    whole = time.perf_counter() - start
    if str(getattr(dr.state, "value", dr.state)) != "success":
        raise SystemExit(f"operator run failed: {dr.state}")
    started, ended = task_times(dag_id, dr.run_id)
    phases = operator_phases(try_timeline(dag_id, dr.run_id), events, started, ended)
    return ended - started, whole, first_step_at(events) - started, phases


def death_to_gone(i: int) -> float:
    from airflow_torchrun.backends.local.procs import group_pids

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


AGENT_WORKER = textwrap.dedent(
    """
    import os, signal, time
    import torch  # what a rank holds when it dies
    with open(os.environ["DEATH"], "w") as fp:
        fp.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def agent_exit(module: str, i: int) -> float:
    """A worker's death -> its agent's exit, for one node whose agent runs ``python -m module``."""
    run = WORK / f"agent-exit-{i}-{module.rsplit('.', 1)[-1]}"
    run.mkdir(parents=True)
    (run / "worker.py").write_text(AGENT_WORKER)
    argv = [sys.executable, "-m", module, "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=static"]
    argv += [f"--master-port={free_port()}", "--max-restarts=0", "--monitor-interval=0.1"]
    argv += ["--tee=3", f"--log-dir={run / 'logs'}", str(run / "worker.py")]
    env = {**os.environ, "DEATH": str(run / "death"), "OMP_NUM_THREADS": "1"}
    with open(run / "agent.log", "wb") as log:
        subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=300, check=False)
    exited = time.time()
    return exited - float((run / "death").read_text())


LAYOUTS: tuple[Layout, ...] = ((2, 1), (2, 2), (4, 1))
PHASE_LAYOUTS: tuple[Layout, ...] = ((2, 1), (2, 2))


def name(layout: Layout) -> str:
    return f"{layout[0]}x{layout[1]}"


@dataclass
class Side:
    """Every measurement of one side of one layout."""

    wall: list[float] = field(default_factory=list)
    whole: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    phases: list[dict[str, float]] = field(default_factory=list)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="pairs per layout at least (and rank deaths)")
    parser.add_argument("--max-pairs", type=int, default=12, help="pairs per layout at most")
    parser.add_argument("--half-width", type=float, default=0.1, help="stop once the overhead's 95%% interval is this")
    parser.add_argument("--budget-s", type=float, default=300.0, help="seconds of pairs per layout at most")
    parser.add_argument("--steps", type=int, default=200, help="training steps of the job (sets its length)")
    parser.add_argument("--json", metavar="PATH", help="also write the report rows (bench/rows.py) to PATH")
    args = parser.parse_args()

    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True)
    warm_up()
    rule = RepeatRule(minimum=args.repeats, half_width=args.half_width, cap=args.max_pairs, budget_s=args.budget_s)
    bare: dict[Layout, Side] = {layout: Side() for layout in LAYOUTS}
    ours: dict[Layout, Side] = {layout: Side() for layout in LAYOUTS}
    execd: dict[Layout, Side] = {layout: Side() for layout in LAYOUTS}  # agents and ranks exec'd, as bare torchrun's
    stopped: dict[Layout, str] = {}
    kill: list[float] = []
    for layout in LAYOUTS:
        began, i = time.monotonic(), 0
        while rule.more(differences(execd[layout], bare[layout]), time.monotonic() - began):
            # Rotate which side goes first, so that drift in load hits every side alike.
            for side in SIDES[i % 3 :] + SIDES[: i % 3]:
                if side == "bare":
                    b, f, ph = bare_torchrun(layout, args.steps, f"bare-{name(layout)}-{i}")
                    bare[layout].wall.append(b)
                    bare[layout].first.append(f)
                    bare[layout].phases.append(ph)
                    progress("group", f"{name(layout)} pair {i + 1} bare torchrun wall, first step", (b, f))
                else:
                    into = ours[layout] if side == "ours" else execd[layout]
                    t, w, f, ph = through_operator(layout, args.steps, i, "fork" if side == "ours" else "exec")
                    for got, value in ((into.wall, t), (into.whole, w), (into.first, f)):
                        got.append(value)
                    into.phases.append(ph)
                    progress("group", f"{name(layout)} pair {i + 1} {side}: task, dag.test, first step", (t, w, f))
            so_far = mean_interval(differences(execd[layout], bare[layout]))
            progress("group", f"{name(layout)} overhead (agents and ranks exec'd) so far", str(so_far))
            i += 1
        stopped[layout] = rule.stopped_by(differences(execd[layout], bare[layout]), time.monotonic() - began)
    for i in range(args.repeats):
        kill.append(death_to_gone(i))
        progress("group", f"repeat {i + 1}/{args.repeats} rank death -> all gone", kill[-1])
    from airflow_torchrun.backends.local.backend import AGENT_MODULE

    agents: dict[str, list[float]] = {AGENT_MODULE: [], "torch.distributed.run": []}
    for i in range(max(args.repeats, 5)):
        for module in list(agents) if i % 2 == 0 else list(agents)[::-1]:
            agents[module].append(agent_exit(module, i))
        progress("group", f"pair {i + 1} worker death -> agent exited (ours, torchrun)", tuple(agents.values()))

    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    raw = {
        "bare": {name(k): vars(v) for k, v in bare.items()},
        "ours": {name(k): vars(v) for k, v in ours.items()},
        "ours_exec": {name(k): vars(v) for k, v in execd.items()},
        "kill": kill,
        "agent_exit": agents,
        "steps": args.steps,
    }
    (out / "bench_group.json").write_text(json.dumps(raw, indent=2))
    if args.json:
        write_json(args.json, report_rows(bare, ours, execd, kill, stopped, list(agents.values())))
        Path(args.json).with_suffix(".phases.json").write_text(json.dumps(phase_table(bare, ours), indent=2))


def differences(ours: Side, bare: Side) -> list[float]:
    return [x - y for x, y in zip(ours.wall, bare.wall, strict=False)]


def phase_table(bare: dict[Layout, Side], ours: dict[Layout, Side]) -> list[dict[str, object]]:
    """Per layout, every phase: the median of ours and, where bare torchrun has the same phase, of it."""
    table: list[dict[str, object]] = []
    for layout in PHASE_LAYOUTS:
        bare_of = dict(BARE_PHASES)
        for phase, _, _ in OPERATOR_PHASES:
            mine = [p[phase] for p in ours[layout].phases if phase in p]
            theirs = [p[bare_of[phase]] for p in bare[layout].phases if phase in bare_of and bare_of[phase] in p]
            if not mine:
                continue
            table.append(
                {
                    "layout": name(layout),
                    "phase": phase,
                    "ours": round(statistics.median(mine), 3),
                    "bare": round(statistics.median(theirs), 3) if theirs else None,
                    "repeats": len(mine),
                }
            )
    return table


def _within_goal(measure: str, values: list[float], note: str = "") -> dict[str, object]:
    """A row of the mean of ``values`` (seconds) with its 95% interval, against the 0.15 s goal."""
    ci = mean_interval(values)
    return row(measure, ci.mean, "goal", 0.15, "s", repeats=len(values), interval=(ci.low, ci.high), note=note)


def report_rows(
    bare: dict[Layout, Side],
    ours: dict[Layout, Side],
    execd: dict[Layout, Side],
    kill: list[float],
    stopped: dict[Layout, str],
    agents: list[list[float]],
) -> list[dict[str, object]]:
    anchor = "bare torchrun, same job and settings"
    first = (2, 1)
    rows = [
        row(
            "launch -> first training step, 2x1 (ours: from the task's start)",
            Samples(ours[first].first),
            "bare torchrun (static rendezvous), from its start",
            Samples(bare[first].first),
            "s",
        )
    ]
    for layout in LAYOUTS:
        b, t = Samples(bare[layout].wall), Samples(ours[layout].wall)
        label = f"{layout[0]} agents x {layout[1]}"
        rows.append(row(f"operator task wall time, {label}", t, anchor, b, "s"))
        exec_wall = Samples(execd[layout].wall)
        execd_label = f"operator task wall time, {label}, agents and ranks exec'd as torchrun's"
        rows.append(row(execd_label, exec_wall, anchor, b, "s"))
        paired = f"operator fixed overhead, {name(layout)} (task with agents and ranks exec'd - bare, paired; mean)"
        rows.append(_within_goal(paired, differences(execd[layout], bare[layout]), stopped.get(layout, "")))
        own = [p[OWN] for p in execd[layout].phases if OWN in p]
        if own:
            own_label = (
                f"operator's own time per try, {name(layout)}, agents and ranks exec'd "
                "(its timeline: all but the group's life; mean)"
            )
            rows.append(_within_goal(own_label, own))
        rows.append(row(f"whole dag.test() run, {name(layout)}", Samples(ours[layout].whole), anchor, b, "s"))
    k = Samples(kill)
    rows.append(row("rank SIGKILLed -> every group process gone (median)", k, "goal (median)", 1.0, "s"))
    rows.append(
        row("rank SIGKILLed -> every group process gone (max)", max(kill), "goal (max)", 1.5, "s", repeats=len(kill))
    )
    local, torchrun = agents
    rows.append(
        row(
            "worker SIGKILLed -> its node's agent exited (local backend's agent)",
            Samples(local),
            "python -m torch.distributed.run, same arguments",
            Samples(torchrun),
            "s",
        )
    )
    return rows


if __name__ == "__main__":
    main()
