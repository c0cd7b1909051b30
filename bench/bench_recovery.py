"""Rank death -> training progressing again, and launch -> first step, for every launcher, one run.

The same job (``bench/job.py``: 2 ranks as 2 "nodes" x 1, gloo, its own checkpoint every
``CKPT_EVERY`` steps) is started by each launcher; rank 1 SIGKILLs itself once at ``KILL_AT``,
writing the time of death first; rank 0 writes the time each incarnation trains its first step.
Recovery = death -> the next first step. Interleaved, one run of each per repeat:

- ``restart``: the operator under ``dag.test()``, ``max_restarts=1, retries=0`` (in-try restart);
- ``retry``: the operator under ``dag.test()``, ``retries=1, retry_delay=0`` (Airflow's retry);
- ``torchrun``: bare ``torchrun --max-restarts 3`` (2 agents, c10d rendezvous) on its defaults;
- ``torchrun-noshare``: the same with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``;
- ``ray``: Ray Train ``TorchTrainer``, 2 CPU workers, ``FailureConfig(max_failures=1)``, in the
  benchmark's Ray virtualenv (``--ray-python``); without one, its rows say why (``--ray-missing``).

A launcher that has not trained again ``--hang-s`` after the death counts as failed for that kill
(a torchrun re-rendezvous can otherwise hang for its 30-minute default): it is killed, workers
included. Launch -> first step: the operator from the task's start, bare torchrun and Ray from
their process start; the fresh group's own launch -> first step is the anchor of issue 11. Then,
in one ``airflow standalone`` (scheduler + triggerer; ``tests/standalone.py``), the Airflow retry
again, ``--standalone-repeats`` times, against the same server's fresh launch -> first step.

Run: ``.venv/bin/python bench/bench_recovery.py [--repeats 3] [--ray-python PATH] [--json rows.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_group import ROOT, WORK, free_port, progress, task_times, warm_up, write_dag
from job import first_steps
from rows import Samples, failed_row, row, write_json

BENCH = Path(__file__).resolve().parent
JOB = BENCH / "job.py"
STEPS, KILL_AT, CKPT_EVERY = 600, 150, 50


@dataclass
class Outcome:
    """One kill: did training progress again, how fast, and the launch -> first step of the first try."""

    recovered: bool
    recovery_s: float | None = None
    launch_to_first_s: float | None = None  # from the launcher's start (the task's start for ours)
    fresh_group_s: float | None = None  # ours only: the group's own launch -> first step
    reason: str = ""
    phases: dict[str, float] = field(default_factory=dict)  # the standalone retry's, death -> first step


def job_env(tag: str) -> dict[str, str]:
    run = WORK / "runs" / tag
    (run / "pids").mkdir(parents=True, exist_ok=True)
    return {
        "STEPS": str(STEPS),
        "KILL_AT": str(KILL_AT),
        "CKPT_EVERY": str(CKPT_EVERY),
        "CKPT": str(run / "ckpt.pt"),
        "KILL_MARK": str(run / "killed"),
        "EVENTS": str(run / "events.jsonl"),
        "PIDS": str(run / "pids"),
        "OMP_NUM_THREADS": "1",
    }


def read_outcome(env: dict[str, str], started: float | None) -> Outcome:
    """What the job's files say: death time, first steps before and after it."""
    mark, events = Path(env["KILL_MARK"]), first_steps(Path(env["EVENTS"]))
    launch = events[0]["t"] - started if events and started is not None else None
    if not mark.exists():
        return Outcome(False, launch_to_first_s=launch, reason="the rank was never killed")
    died = float(mark.read_text())
    after = [e["t"] for e in events if e["t"] > died]
    if not after:
        return Outcome(False, launch_to_first_s=launch, reason="no training step after the death")
    return Outcome(True, after[0] - died, launch)


def reap(mark: str) -> None:
    """SIGKILL every process of one run still alive, found by its ``KILL_MARK`` in its environment
    (torchrun starts its workers in sessions of their own; a hung one has not even written its pid)."""
    want = f"KILL_MARK={mark}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if want in environ:
            try:
                os.kill(int(name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def watched(argvs: list[list[str]], env: dict[str, str], hang_s: float, log: Path) -> tuple[float, str]:
    """Start the processes, wait for them; kill them all when training has not resumed ``hang_s``
    after the death (or after 240 s in all). The start time and why they were killed ("" if not)."""
    mark, events = Path(env["KILL_MARK"]), Path(env["EVENTS"])
    full_env = {**os.environ, **env}
    with open(log, "ab") as out:
        started = time.time()
        procs = [
            subprocess.Popen(a, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            for a in argvs
        ]
    reason = ""
    while any(p.poll() is None for p in procs):
        now = time.time()
        if mark.exists():
            died = float(mark.read_text() or now)
            if now - died > hang_s and not any(e["t"] > died for e in first_steps(events)):
                reason = f"no training step {hang_s:.0f} s after the death (hung, killed)"
        if now - started > 240:
            reason = reason or "still running after 240 s (killed)"
        if reason:
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            break
        time.sleep(0.2)
    for p in procs:
        p.wait()
    reap(env["KILL_MARK"])
    if not reason and any(p.returncode for p in procs):
        reason = f"exit codes {[p.returncode for p in procs]}"
    return started, reason


def torchrun_run(tag: str, hang_s: float, share: bool) -> Outcome:
    env = job_env(tag)
    if not share:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={tag}",
        "--max-restarts=3",
        f"--log-dir={WORK / 'runs' / tag / 'torchrun-logs'}",
        str(JOB),
    ]
    started, reason = watched([argv, argv], env, hang_s, WORK / "runs" / tag / "launcher.log")
    return judged(read_outcome(env, started), reason)


def judged(outcome: Outcome, reason: str) -> Outcome:
    """A launcher that was killed, or exited non-zero, failed that kill even if it trained again."""
    if reason:
        outcome.recovered, outcome.recovery_s, outcome.reason = False, None, reason
    return outcome


def ray_run(tag: str, hang_s: float, ray_python: str) -> Outcome:
    env = job_env(tag)
    env.update(
        {
            "RAY_MAX_FAILURES": "1",
            "RAY_STORAGE": str(WORK / "runs" / tag / "ray"),
            "PYTHONPATH": str(BENCH),
            "RAY_AUTH_MODE": "disabled",
        }
    )
    started, reason = watched([[ray_python, str(BENCH / "ray_job.py")]], env, hang_s, WORK / "runs" / tag / "ray.log")
    return judged(read_outcome(env, started), reason)


def launched_at(dag_id: str, suffix: str) -> float:
    groups = WORK / "torchrun" / "groups"
    group = next(groups.glob(f"{dag_id.replace('_', '-')}-train-*-{suffix}"))
    return float(json.loads((group / "group.json").read_text())["launched_at"])


POLICIES = {"restart": "retries=0, max_restarts=1", "retry": "retries=1, retry_delay=timedelta(0)"}


def operator_run(tag: str, mode: str) -> Outcome:
    env = job_env(tag)
    dag_id = tag.replace("-", "_")
    dag = write_dag(dag_id, JOB, env, POLICIES[mode])
    dr = dag.test()  # type: ignore[attr-defined]
    outcome = read_outcome(env, None)
    first = first_steps(Path(env["EVENTS"]))
    if first:
        outcome.fresh_group_s = first[0]["t"] - launched_at(dag_id, "t1")
        if mode == "restart":
            outcome.launch_to_first_s = first[0]["t"] - task_times(dag_id, dr.run_id)[0]
    state = str(getattr(dr.state, "value", dr.state))
    if state != "success":
        outcome.recovered, outcome.reason = False, outcome.reason or f"DAG run {state}"
    return outcome


def standalone_starter() -> Callable[..., Any]:
    """``tests/standalone.py``'s ``start_standalone``, imported as the tests import it: from the
    repository's root (it imports ``tests.ports``), which a benchmark run as a script lacks."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.standalone import start_standalone

    return start_standalone


def standalone_runs(repeats: int) -> list[Outcome]:
    """The Airflow retry under a real scheduler: one ``airflow standalone``, ``repeats`` DAG runs."""
    start_standalone = standalone_starter()
    dags = WORK / "standalone-dags"
    dags.mkdir(parents=True, exist_ok=True)
    envs = []
    for i in range(repeats):
        env = job_env(f"standalone-{i}")
        envs.append(env)
        write_dag(f"bench_sa_{i}", JOB, env, POLICIES["retry"], folder=dags)
    outcomes = []
    with start_standalone(WORK / "standalone", dags, "bench_sa_0", "train") as server:
        for i, env in enumerate(envs):
            server.dag_id = f"bench_sa_{i}"
            if i:
                deadline = time.monotonic() + 120
                while server.request("GET", f"/api/v2/dags/bench_sa_{i}")[0] != 200:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"bench_sa_{i} was never parsed")
                    time.sleep(1)
            server.unpause()
            run_id = server.trigger({})
            state = server.wait_run_state(run_id, {"success", "failed"})
            outcome = read_outcome(env, None)
            first = first_steps(Path(env["EVENTS"]))
            if first:
                groups = server.state_dir / "groups"
                group = next(groups.glob(f"bench-sa-{i}-train-*-t1"))
                outcome.fresh_group_s = first[0]["t"] - json.loads((group / "group.json").read_text())["launched_at"]
            if state != "success":
                outcome.recovered, outcome.reason = False, outcome.reason or f"DAG run {state}"
            elif outcome.recovered:
                outcome.phases = retry_phases(server, run_id, env)
            progress("recovery", f"standalone retry {i + 1}/{repeats}", outcome)
            outcomes.append(outcome)
    phased = [o.phases for o in outcomes if o.phases]
    if phased:
        print("Where the Airflow retry's time goes under airflow standalone (medians, s):", flush=True)
        for name in phased[0]:
            values = [p[name] for p in phased if name in p]
            print(f"  {name:<58} {statistics.median(values):6.2f}  ({', '.join(f'{v:.2f}' for v in values)})")
    return outcomes


# The retry's way from the rank's death to training again, each phase from one recorded moment to the
# next: the job's death and first steps, the task instance's tries as the REST API has them (Airflow's
# end, queued and start times), and the retry's own timeline (XCom ``timeline``).
RETRY_PHASES = (
    ("death -> try 1 ended (our verdict and teardown, Airflow's finish)", "died", "try1_end"),
    ("try 1 ended -> try 2 queued (the scheduler)", "try1_end", "try2_queued"),
    ("try 2 queued -> started (the executor's task process)", "try2_queued", "try2_start"),
    ("try 2 started -> our execute() (the task runner)", "try2_start", "try_started"),
    ("our execute() -> group launched (preflight, spawn)", "try_started", "launched"),
    ("group launched -> first step (the fresh group)", "launched", "first_step"),
)


def retry_phases(server: object, run_id: str, env: dict[str, str]) -> dict[str, float]:
    from datetime import datetime
    from urllib.parse import quote

    def when(value: object) -> float | None:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp() if value else None

    at: dict[str, float | None] = {"died": float(Path(env["KILL_MARK"]).read_text())}
    after = [e["t"] for e in first_steps(Path(env["EVENTS"])) if e["t"] > at["died"]]  # type: ignore[operator]
    at["first_step"] = after[0] if after else None
    dag_id, task_id = server.dag_id, server.task_id  # type: ignore[attr-defined]
    code, data = server.request(  # type: ignore[attr-defined]
        "GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}/tries"
    )
    tries = {int(t["try_number"]): t for t in (data or {}).get("task_instances", [])} if code == 200 else {}
    at["try1_end"] = when(tries.get(1, {}).get("end_date"))
    at["try2_queued"] = when(tries.get(2, {}).get("queued_when"))
    at["try2_start"] = when(tries.get(2, {}).get("start_date"))
    timeline = server.xcom(run_id, "timeline")  # type: ignore[attr-defined]
    marks = json.loads(timeline) if isinstance(timeline, str) else timeline or []
    for mark in ("try_started", "launched"):
        found = [float(m["at"]) for m in marks if m.get("mark") == mark and m.get("launch") in (0, -1)]
        at[mark] = found[0] if found else None
    return {
        name: round(at[b] - at[a], 3)  # type: ignore[operator]
        for name, a, b in RETRY_PHASES
        if at.get(a) is not None and at.get(b) is not None
    }


def report_rows(runs: dict[str, list[Outcome]], sa: list[Outcome], ray_missing: str) -> list[dict[str, object]]:
    def rec(outcomes: list[Outcome]) -> Samples:
        return Samples([o.recovery_s for o in outcomes if o.recovered and o.recovery_s is not None], len(outcomes))

    def launch(mode: str) -> Samples:
        got = runs.get(mode, [])
        return Samples([o.launch_to_first_s for o in got if o.launch_to_first_s is not None], len(got))

    def fresh(outcomes: list[Outcome]) -> Samples:
        values = [o.fresh_group_s for o in outcomes if o.fresh_group_s is not None]
        return Samples(values, len(values))

    ours, ours_launch = rec(runs.get("restart", [])), launch("restart")
    ours_fresh = fresh(runs.get("restart", []) + runs.get("retry", []))
    first, death = "launch -> first training step, 2x1 (ours: from the task's start)", "rank death -> training again"
    same_run = "fresh group launch -> first step, same run"
    ray = "Ray Train TorchTrainer, 2 CPU workers, from its start"
    ray_kill = "Ray Train FailureConfig(max_failures=1)"
    rows = [row(first, ours_launch, "bare torchrun --max-restarts 3 (c10d), from its start", launch("torchrun"), "s")]
    rows.append(
        failed_row(first, ours_launch, ray, ray_missing, "s")
        if ray_missing
        else row(first, ours_launch, ray, launch("ray"), "s")
    )
    rows.append(row(f"{death}, in-try restart", ours, same_run, ours_fresh, "s"))
    for mode, anchor in (
        ("torchrun", "torchrun --max-restarts 3, defaults"),
        ("torchrun-noshare", "torchrun --max-restarts 3, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"),
    ):
        rows.append(row(f"{death}, in-try restart", ours, anchor, rec(runs.get(mode, [])), "s"))
    rows.append(
        failed_row(f"{death}, in-try restart", ours, ray_kill, ray_missing, "s")
        if ray_missing
        else row(f"{death}, in-try restart", ours, ray_kill, rec(runs.get("ray", [])), "s")
    )
    rows.append(row(f"{death}, Airflow retry (dag.test)", rec(runs.get("retry", [])), same_run, ours_fresh, "s"))
    if sa:
        rows.append(
            row(f"{death}, Airflow retry (airflow standalone)", rec(sa), f"{same_run} (standalone)", fresh(sa), "s")
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="kills per launcher (interleaved)")
    parser.add_argument("--standalone-repeats", type=int, default=3, help="kills under airflow standalone (0: none)")
    parser.add_argument(
        "--hang-s", type=float, default=40.0, help="no step this long after the death: failed (Ray took 19 s loaded)"
    )
    parser.add_argument("--ray-python", help="the Ray virtualenv's python (bench/ray_venv.py)")
    parser.add_argument("--ray-missing", default="", help="why there is no Ray anchor (its rows say so)")
    parser.add_argument("--json", metavar="PATH", help="also write the report rows (bench/rows.py) to PATH")
    args = parser.parse_args()
    ray_missing = args.ray_missing or ("" if args.ray_python else "no Ray virtualenv given (--ray-python)")
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True)
    warm_up()
    launchers: dict[str, Callable[[str], Outcome]] = {
        "restart": lambda tag: operator_run(tag, "restart"),
        "retry": lambda tag: operator_run(tag, "retry"),
        "torchrun": lambda tag: torchrun_run(tag, args.hang_s, share=True),
        "torchrun-noshare": lambda tag: torchrun_run(tag, args.hang_s, share=False),
    }
    if not ray_missing:
        launchers["ray"] = lambda tag: ray_run(tag, args.hang_s, args.ray_python)
    runs: dict[str, list[Outcome]] = {mode: [] for mode in launchers}
    total, done = args.repeats * len(launchers), 0
    for i in range(args.repeats):  # interleaved: the machine's noise falls on every launcher alike
        for mode, launch in launchers.items():
            outcome = launch(f"recover-{mode}-{i}")
            runs[mode].append(outcome)
            done += 1
            progress("recovery", f"{done}/{total} {mode}", outcome)
    sa = standalone_runs(args.standalone_repeats) if args.standalone_repeats else []
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    raw = {mode: [vars(o) for o in got] for mode, got in runs.items()}
    (out / "bench_recovery.json").write_text(json.dumps({"raw": raw, "standalone": [vars(o) for o in sa]}, indent=2))
    write_json(args.json, report_rows(runs, sa, ray_missing))


if __name__ == "__main__":
    main()
