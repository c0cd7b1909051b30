"""``make ui``: the Airflow UI (``airflow standalone``) and the MLflow UI on the demo's state.

Starts both, each in a process group of its own, prints their URLs and where Airflow's generated
admin password is, and stops both on Ctrl-C. The state is the Makefile's: ``AIRFLOW_HOME``,
``AIRFLOW__TORCHRUN__STATE_DIR`` (what ``make demo`` wrote); the MLflow UI reads the state dir's
SQLite store (or ``$MLFLOW_TRACKING_URI``), and the Airflow UI's MLflow links point at it.
``--dry-run`` prints the plan and starts nothing.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PASSWORDS = "simple_auth_manager_passwords.json.generated"


@dataclass(frozen=True)
class Plan:
    airflow_url: str
    mlflow_url: str
    passwords: str  # where airflow standalone writes the admin password
    env: dict[str, str]
    airflow: list[str]
    mlflow: list[str]


def plan(airflow_port: int, mlflow_port: int) -> Plan:
    from airflow_torchrun.state import state_dir

    home = Path(os.environ.get("AIRFLOW_HOME") or Path.home() / "airflow")
    state = state_dir()
    store = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{state}/mlflow/mlflow.db"
    mlflow_url = f"http://localhost:{mlflow_port}"
    bin_dir = Path(sys.executable).parent
    env = {
        "AIRFLOW__API__PORT": str(airflow_port),
        "AIRFLOW__API__BASE_URL": f"http://localhost:{airflow_port}",
        "AIRFLOW__TORCHRUN__MLFLOW_UI_URL": mlflow_url,
        "AIRFLOW__TORCHRUN__STATE_DIR": str(state),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",  # standalone starts `airflow ...`
    }
    return Plan(
        airflow_url=f"http://localhost:{airflow_port}",
        mlflow_url=mlflow_url,
        passwords=str(home / PASSWORDS),
        env=env,
        airflow=[sys.executable, "-m", "airflow", "standalone"],
        mlflow=[
            str(bin_dir / "mlflow"),
            "ui",
            "--backend-store-uri",
            store,
            "--host",
            "127.0.0.1",
            "--port",
            str(mlflow_port),
        ],
    )


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except Exception:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--airflow-port", type=int, default=int(os.environ.get("AIRFLOW_PORT", "8080")))
    parser.add_argument("--mlflow-port", type=int, default=int(os.environ.get("MLFLOW_PORT", "5000")))
    parser.add_argument("--dry-run", action="store_true", help="print what would start, start nothing")
    args = parser.parse_args(argv)
    p = plan(args.airflow_port, args.mlflow_port)
    env = {**os.environ, **p.env}
    print(f"Airflow UI  {p.airflow_url}   (user admin; password in {p.passwords})")
    print(f"MLflow UI   {p.mlflow_url}")
    print(f"  airflow: {' '.join(p.airflow)}")
    print(f"  mlflow:  {' '.join(p.mlflow)}")
    if args.dry_run:
        return 0
    procs = [subprocess.Popen(cmd, env=env, start_new_session=True) for cmd in (p.mlflow, p.airflow)]
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not _up(f"{p.airflow_url}/api/v2/monitor/health"):
            if any(proc.poll() is not None for proc in procs):
                print("a service exited early; see its output above", file=sys.stderr)
                return 1
            time.sleep(2)
        print(f"\nReady: Airflow {p.airflow_url} (password: {p.passwords}), MLflow {p.mlflow_url}; Ctrl-C stops both")
        while all(proc.poll() is None for proc in procs):
            time.sleep(1)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    raise SystemExit(main())
