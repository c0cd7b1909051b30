"""``make ui``: the Airflow UI (``airflow standalone``) and the MLflow UI on the demo's state.

Starts both, each in a process group of its own, prints their URLs and where Airflow's generated
admin password is, and stops both (their whole process groups) however the launcher is stopped:
Ctrl-C (SIGINT), SIGTERM, or a closed terminal (SIGHUP). The services run in sessions of their own,
so a closed terminal reaches only the launcher; it must pass the news on. The state is the Makefile's: ``AIRFLOW_HOME``,
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

from airflow_torchrun import contract

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
    store = os.environ.get(contract.MLFLOW_TRACKING_URI) or f"sqlite:///{state}/mlflow/mlflow.db"
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
            # Its default is 4 uvicorn workers: on a 2-core machine the UI then took minutes to answer.
            "--workers",
            "1",
        ],
    )


class Stopped(Exception):
    """The launcher was told to stop (SIGTERM, SIGHUP): stop what it started, then exit."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, _frame: object) -> None:
    raise Stopped(signum)


def stop_all(procs: Sequence[subprocess.Popen[bytes]], grace: float = 30.0) -> None:
    """SIGTERM each service's process group, then SIGKILL what is left of it after ``grace`` seconds.

    By process group, not by pid: ``airflow standalone`` runs api-server, scheduler, dag-processor
    and triggerer as its children in its group, and a SIGTERM to the leader alone left them serving.
    """
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C or signal must not cut the teardown short
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:  # the group may outlive its leader (a child that ignored SIGTERM)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            print(f"pid {proc.pid} did not exit after SIGKILL", file=sys.stderr)


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
    # Before the first service starts: a signal that arrives in between still stops what started.
    signal.signal(signal.SIGTERM, _raise_stopped)
    signal.signal(signal.SIGHUP, _raise_stopped)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for cmd in (p.mlflow, p.airflow):
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
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
    except Stopped as stop:
        print(f"\n{stop}: stopping Airflow and MLflow", file=sys.stderr)
        return 128 + stop.signum
    finally:
        stop_all(procs)


if __name__ == "__main__":
    raise SystemExit(main())
