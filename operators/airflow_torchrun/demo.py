"""``make demo``: the whole pipeline on the embedded default, with a failure on purpose.

Runs ``airflow dags test torchrun_pipeline`` (real Airflow on SQLite, the local backend, file://
checkpoints, MLflow on SQLite) with ``fail_at_step`` set, so the first training try loses rank 1
part-way and the retry resumes from the latest checkpoint. Unattended: ``require_approval`` is off,
so the promotion to champion asks no one (``airflow dags test`` has no one to ask; trigger the DAG
from ``make ui`` to approve on the Required Actions page). Then prints a summary read back from
Airflow's metadata DB and MLflow, and the commands to open both UIs on these results.

Environment (the Makefile sets these): ``AIRFLOW_HOME``, ``AIRFLOW__CORE__DAGS_FOLDER``,
``AIRFLOW__TORCHRUN__STATE_DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from airflow_torchrun.backends import DEFAULT_BACKEND, backend_class, backend_names

DAG_ID = "torchrun_pipeline"
# What is worth seeing live from Airflow's (very detailed) output; everything goes to the log file.
LIVE = re.compile(
    r"\[DAG TEST\] (starting|end) task|Launched group|Checkpoints:|Group \S+ (nodes|succeeded|failed)|"
    r"Training group .* failed|\[node \d+ rank 0\] .*(step \d+/|FINAL|EVAL|Resumed)|Registered|champion|"
    r"Created dag run|Marking run|require_approval|new champion|Approved by|Rejected by"
)


def _airflow(*args: str, log: Path | None = None, echo: bool = False) -> int:
    cmd = [sys.executable, "-m", "airflow", *args]
    if log is None:
        return subprocess.run(cmd, capture_output=True, check=False).returncode
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if echo and LIVE.search(line):
                print("  " + _tidy(line), flush=True)
        return proc.wait()


def _tidy(line: str) -> str:
    """Drop structlog's timestamp/level/logger decoration for the console."""
    line = line.rstrip()
    line = re.sub(r"^\S+Z \[\w+\s*\] ", "", line)
    line = re.sub(r"\s+\[[\w.]+\]( loc=\S+)?(\s+\w+=.*)?$", "", line)
    return line[:200]


def _summary() -> dict[str, Any]:
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        run = session.scalars(select(DagRun).where(DagRun.dag_id == DAG_ID).order_by(DagRun.id.desc())).first()
        if run is None:
            raise SystemExit("the demo DAG run was not found in Airflow's DB")
        tis = {
            ti.task_id: ti
            for ti in session.scalars(
                select(TaskInstance).where(TaskInstance.dag_id == DAG_ID, TaskInstance.run_id == run.run_id)
            )
        }

        def xcom(task_id: str, key: str = "return_value") -> Any:
            row = session.scalars(
                XComModel.get_many(run_id=run.run_id, key=key, task_ids=task_id, dag_ids=DAG_ID)
            ).first()
            return None if row is None else XComModel.deserialize_value(row)

        return {
            "run_id": run.run_id,
            "state": str(getattr(run.state, "value", run.state)),
            "tasks": {k: (str(getattr(v.state, "value", v.state)), v.try_number) for k, v in sorted(tis.items())},
            "shards": xcom("shard", "summary"),
            "manifest": xcom("shard"),
            "train": xcom("train"),
            "resumed_from": xcom("train", "resumed_from"),
            "evaluate": xcom("evaluate"),
            "register": xcom("register"),
            "promote": xcom("promote"),
            "decision": xcom("approve", "decision"),
        }


def _print_summary(s: dict[str, Any], log: Path) -> None:
    home = os.environ.get("AIRFLOW_HOME", "")
    state = os.environ.get("AIRFLOW__TORCHRUN__STATE_DIR", "")
    print("\n=== airflow-torchrun demo: summary ===")
    print(f"DAG run        {DAG_ID} / {s['run_id']}: {s['state']}")
    for task, (state_, tries) in s["tasks"].items():
        print(f"  {task:<15}{state_:<10} tries: {tries}")
    shards = s["shards"] or {}
    if shards:
        print(
            f"Shards         {shards.get('num_shards', '?')} shards, rows {shards.get('rows_per_shard', '?')}, "
            f"eval rows {shards.get('eval_rows', '?')}; manifest {s['manifest']}"
        )
    train = s["train"] or {}
    resumed = s["resumed_from"]
    if resumed:
        print(f"Training       resumed from step {resumed['step']} ({resumed['uri']}) after the planned failure")
    if train:
        print(f"               world size {train['world_size']}, final checkpoint {train['final_checkpoint']}")
        if train.get("log_dir"):
            print(f"               group logs {train['log_dir']}")
        print(f"               MLflow run {train['mlflow_run_id']}")
    if s["evaluate"]:
        shown = (f"{k}={int(v)}" if float(v).is_integer() else f"{k}={v:.4f}" for k, v in sorted(s["evaluate"].items()))
        print("Evaluation     " + ", ".join(shown))
    reg = s["register"]
    if reg:
        print(f"Registered     {reg['name']} version {reg['version']}, aliases {', '.join(reg['aliases'])}")
        proposal = reg.get("proposal") or {}
        decision = s.get("decision") or {}
        promoted = s.get("promote")
        asked = "asked" if decision.get("asked") else "not asked (require_approval off)"
        if promoted:
            aliases = ", ".join(promoted["aliases"])
            print(f"Promoted       version {promoted['version']}, aliases {aliases}; approval {asked}")
        else:
            print(f"Promoted       nothing: {proposal.get('why', 'see the log')}")
    else:
        print("Registered     nothing (the quality gate did not pass, see the log)")
    print(f"Full log       {log}")
    print("\nOpen the UIs on these results:")
    print(
        f"  Airflow: AIRFLOW_HOME={home} AIRFLOW__CORE__DAGS_FOLDER={os.environ.get('AIRFLOW__CORE__DAGS_FOLDER', '')} "
        f"AIRFLOW__TORCHRUN__STATE_DIR={state} .venv/bin/airflow standalone   # then http://localhost:8080"
    )
    tracking = os.environ.get("AIRFLOW__TORCHRUN__MLFLOW_TRACKING_URI", "")
    if tracking.startswith(("http://", "https://")):
        print(f"  MLflow:  {tracking}   # the tracking server the task and its pods logged into")
    else:
        print(
            f"  MLflow:  .venv/bin/mlflow ui --backend-store-uri sqlite:///{state}/mlflow/mlflow.db --port 5000"
            "   # then http://localhost:5000"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fail-at-step", type=int, default=30, help="rank 1 fails once at this step (0: never)")
    parser.add_argument("--conf", default="{}", help="more DAG run conf (JSON), e.g. '{\"epochs\": 8}'")
    parser.add_argument(
        "--backend",
        choices=backend_names(),
        default=DEFAULT_BACKEND,
        help="kubernetes: the training and evaluation groups run on the cluster of the Airflow connection "
        "(make demo BACKEND=kubernetes: the one of make cluster); shards and checkpoints then go to "
        "[torchrun] checkpoint_base, which must be object storage every pod reaches",
    )
    args = parser.parse_args(argv)

    state = Path(os.environ.setdefault("AIRFLOW__TORCHRUN__STATE_DIR", str(Path(".state/torchrun").resolve())))
    os.environ.setdefault("AIRFLOW_HOME", str(Path(".state/airflow").resolve()))
    os.environ.setdefault("AIRFLOW__CORE__DAGS_FOLDER", str(Path("dags").resolve()))
    os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
    log_dir = state / "demo"
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"pipeline-{time.strftime('%Y%m%dT%H%M%S')}.log"

    print(f"Preparing Airflow's metadata DB in {os.environ['AIRFLOW_HOME']} ...", flush=True)
    if _airflow("db", "migrate") != 0:
        print("airflow db migrate failed; run it by hand to see why", file=sys.stderr)
        return 1
    conf = {"require_approval": False, **json.loads(args.conf), "fail_at_step": args.fail_at_step}
    if not backend_class(args.backend).shares_worker_files:
        base = os.environ.get("AIRFLOW__TORCHRUN__CHECKPOINT_BASE", "")
        if not base.startswith("s3://"):
            print(
                f"--backend {args.backend}: set AIRFLOW__TORCHRUN__CHECKPOINT_BASE to an s3:// URI the pods reach "
                "(make cluster writes one into .state/cluster/env)",
                file=sys.stderr,
            )
            return 2
        conf.setdefault("backend", args.backend)
        conf.setdefault("shards_uri", base.rstrip("/").rsplit("/", 1)[0] + "/shards")
    print(f"Running {DAG_ID} with conf {json.dumps(conf)} (rank 1 fails once at step {args.fail_at_step}):", flush=True)
    code = _airflow("dags", "test", DAG_ID, "-c", json.dumps(conf), log=log, echo=True)
    summary = _summary()
    _print_summary(summary, log)
    if code != 0 or summary["state"] != "success":
        print(f"\nThe pipeline did not succeed (exit {code}); see {log}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
