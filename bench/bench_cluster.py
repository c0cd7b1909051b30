"""Launch and teardown on the real cluster of ``make cluster``, against the bare Job of the same task.

Both sides run the same objects: the anchor ``kubectl apply``-s the Job and Service that
``airflow-torchrun render`` prints for the operator's task (same image, runtime, script, arguments),
so the difference is what the operator adds (its preflight, its API calls, its watch).

1. launch -> first training step: ours from the try's start (the engine's timeline, ``try_started``)
   to the first ``step 1/`` line of node 0's pod (containerd's own timestamp, ``kubectl logs
   --timestamps``); the anchor from just before ``kubectl apply`` to the same line of its pod.
2. rank death -> no pod of the group running: rank 1 SIGKILLs itself at a step (the trainer's
   ``--fail-at-step --fail-mode kill``; the moment is its log line's timestamp), until every pod of
   the group is gone from the API or has ended (phase ``Failed`` or ``Succeeded``: no container
   runs). Ours: the operator sees the failure and deletes the Job; the anchor: the bare Job, which
   the Job controller fails through the same ``podFailurePolicy``, deleting its running pods (the
   failed one stays until the Job is deleted).

Needs a running cluster (``make cluster``); without one its rows say so (not run), measuring nothing.
Run: ``.venv/bin/python bench/bench_cluster.py [--repeats 3] [--json rows.json]``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402
from rows import Samples, row, write_json  # noqa: E402

from airflow_torchrun.contract import RESUME_FROM  # noqa: E402
from cluster import kube  # noqa: E402
from cluster.layout import NAMESPACE, state  # noqa: E402
from cluster.up import airflow_env, home_env  # noqa: E402

WORK = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
atexit.register(shutil.rmtree, WORK, ignore_errors=True)  # its Airflow home, state and logs
DEPLOYMENT = f"bench-{os.getpid()}"
TRAINER = "/opt/trainer/train.py"
KILL_STEP = 40
MEASURES = (
    (
        "Kubernetes: launch -> first training step, 2x1 (ours: from the try's start)",
        "kubectl apply of the same rendered Job and Service",
    ),
    (
        "Kubernetes: rank SIGKILLed -> no pod of the group running",
        "the same bare Job: its podFailurePolicy, the Job controller alone",
    ),
)
_BEGAN = time.monotonic()


def progress(what: str, value: object) -> None:
    shown = round(value, 2) if isinstance(value, float) else value
    print(f"  [bench:cluster +{time.monotonic() - _BEGAN:4.0f}s] {what}: {shown}", flush=True)


def environment() -> dict[str, str]:
    return home_env(airflow_env(state()), WORK, DEPLOYMENT)


def write_dag(dag_id: str, script_args: list[str]) -> Path:
    path = WORK / "dags" / f"{dag_id}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        textwrap.dedent(
            f"""
            import pendulum
            from airflow.sdk import DAG
            from airflow_torchrun import DistributedTrainingOperator

            with DAG({dag_id!r}, schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False):
                DistributedTrainingOperator(
                    task_id="train", backend="kubernetes", runtime="cpu", script={TRAINER!r},
                    script_args={script_args!r}, num_nodes=2, nproc_per_node=1, track=False, retries=0,
                    startup_timeout=300,
                )
            """
        )
    )
    return path


def timestamp(line: str) -> float:
    """The epoch of a ``kubectl logs --timestamps`` line (RFC 3339 with nanoseconds)."""
    stamp = line.split(" ", 1)[0]
    head, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(head + "+00:00").timestamp() + float("0." + (frac or "0"))


class LogWatch:
    """Polls the logs of every pod of one group (by a label selector) for lines containing
    ``needle``, keeping the earliest timestamp seen; the polling rate does not set the accuracy,
    containerd's timestamps do."""

    def __init__(self, selector: str, needle: str) -> None:
        self.selector, self.needle = selector, needle
        self.at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while self.at is None and not self._stop.wait(0.5):
            out = kube.kubectl(
                "logs", "-n", NAMESPACE, "-l", self.selector, "-c", "trainer", "--timestamps", "--tail=-1",
                "--prefix=false", check=False, timeout=30,
            )  # fmt: skip
            found = [timestamp(line) for line in out.splitlines() if self.needle in line]
            if found:
                self.at = min(found)

    def wait(self, deadline_s: float) -> float:
        self._thread.join(deadline_s)
        self._stop.set()
        if self.at is None:
            raise SystemExit(f"no pod of {self.selector} logged {self.needle!r} in {deadline_s:.0f}s")
        return self.at


def pods(selector: str) -> list[dict[str, Any]]:
    return list(kube.kubectl_json("get", "pods", "-n", NAMESPACE, "-l", selector)["items"])


def wait_until(done: Callable[[], bool], what: str, deadline_s: float = 300) -> float:
    deadline = time.monotonic() + deadline_s
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} after {deadline_s:.0f}s")
        time.sleep(0.2)
    return time.time()


def wait_stopped(selector: str) -> float:
    """When no pod of ``selector`` runs any more: each one gone or ended."""
    ended = ("Failed", "Succeeded")
    return wait_until(
        lambda: all(p["status"].get("phase") in ended for p in pods(selector)), f"pods of {selector} still running"
    )


def wait_gone(selector: str) -> float:
    return wait_until(lambda: not pods(selector), f"pods of {selector} still there")


def trainer_args(kill: bool) -> list[str]:
    """Every step logged (the first one is the mark); with ``kill``, rank 1 SIGKILLs itself."""
    args = ["--epochs", "30", "--checkpoint-every", "0", "--log-every", "1"]
    if kill:
        args += ["--fail-at-step", str(KILL_STEP), "--fail-rank", "1", "--fail-mode", "kill"]
    return args


def try_started(dag_id: str) -> float:
    with sqlite3.connect(WORK / "airflow" / "airflow.db") as db:
        (value,) = db.execute(
            "select value from xcom where dag_id=? and task_id='train' and key='timeline' order by dag_run_id desc",
            (dag_id,),
        ).fetchone()
    marks = json.loads(value)
    return float(next(m["at"] for m in marks if m["mark"] == "try_started"))


def group_selector(dag_id: str) -> str:
    return f"airflow-torchrun/deployment={DEPLOYMENT},airflow-torchrun/dag-id={dag_id}"


def ours(dag_id: str, kill: bool, env: dict[str, str]) -> float:
    """launch -> first step, or rank death -> no pod running, through the operator."""
    write_dag(dag_id, trainer_args(kill))
    selector = group_selector(dag_id)
    watch = LogWatch(selector, "Simulated failure" if kill else "step 1/")
    task = subprocess.Popen(
        [sys.executable, "-m", "airflow", "dags", "test", dag_id],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        seen = watch.wait(600)
        if kill:
            return wait_stopped(selector) - seen
        task.wait(900)
        return seen - try_started(dag_id)
    finally:
        if task.poll() is None:
            task.kill()
        task.wait()


def fresh_start(rendered: str) -> str:
    """The rendered objects with what the operator resolves at launch set as a first launch has it:
    ``render`` shows the resume point as a placeholder, which a rank would take for a checkpoint."""
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    for doc in docs:
        if doc["kind"] != "Job":
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            for var in container.get("env", []):
                if var["name"] == RESUME_FROM:
                    var["value"] = ""
    return yaml.safe_dump_all(docs)


def bare(dag_id: str, kill: bool, env: dict[str, str]) -> float:
    """The same with the rendered Job and Service applied by kubectl, nothing of ours watching."""
    dag_file = write_dag(dag_id, trainer_args(kill))
    rendered = subprocess.run(
        [
            str(Path(sys.executable).parent / "airflow-torchrun"),
            "render",
            "--dag-file",
            str(dag_file),
            "--task-id",
            "train",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    selector = group_selector(dag_id)
    watch = LogWatch(selector, "Simulated failure" if kill else "step 1/")
    applied = time.time()
    kube.kubectl("apply", "-f", "-", input=fresh_start(rendered))
    try:
        seen = watch.wait(600)
        return (wait_stopped(selector) - seen) if kill else (seen - applied)
    finally:
        kube.kubectl("delete", "jobs,services,networkpolicies", "-n", NAMESPACE, "-l", selector, "--wait=true")
        wait_gone(selector)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    try:
        up = kube.api_ready() and len(kube.ready_nodes()) == 2
    except SystemExit:  # kubectl not built: no cluster was ever made here
        up = False
    if not up:
        note = "not run: no cluster running (make cluster, then make bench)"
        print(f"bench_cluster: {note}", flush=True)
        write_json(args.json, [row(m, Samples(), a, None, "s", note=note) for m, a in MEASURES])
        return 0
    env = environment()
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, capture_output=True)
    first = {"ours": Samples(), "bare": Samples()}
    gone = {"ours": Samples(), "bare": Samples()}
    for i in range(args.repeats):
        # Interleaved, alternating which side goes first.
        sides = [("ours", ours), ("bare", bare)]
        for name, measure in sides if i % 2 == 0 else sides[::-1]:
            for kill, samples in ((False, first), (True, gone)):
                # Names of this run only: the trainer's --fail-at-step marker sits under the
                # checkpoint URI, which the DAG and run ids (render's is fixed) derive.
                dag_id = f"bench_{os.getpid()}_{name}_{'kill' if kill else 'ok'}_{i}"
                value = measure(dag_id, kill, env)
                samples[name].values.append(value)
                progress(f"{name} {'rank death -> no pod running' if kill else 'launch -> first step'} #{i}", value)
    (first_measure, first_anchor), (gone_measure, gone_anchor) = MEASURES
    rows = [
        row(first_measure, first["ours"], first_anchor, first["bare"], "s"),
        row(gone_measure, gone["ours"], gone_anchor, gone["bare"], "s"),
    ]
    write_json(args.json, rows)
    for r in rows:
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
