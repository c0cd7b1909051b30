"""Where a command's CPU goes, by kind of process: ``python bench/cpu_profile.py -- make test``.

Runs the command and, every ``--every`` seconds until it ends, reads ``/proc/<pid>/stat`` of every
process on the machine: each process's CPU time (user + system, its threads included) as last seen,
with its command line as first seen. Then prints the CPU seconds per kind of process (the agents
of the local nodes, the standalone's services, the pytest workers...), largest first. A process
that lives less than one interval may be missed; what the machine ran beside the command is
counted too (run it on an otherwise idle machine).

How ``make test``'s time was found to be half the nodes' agents (most of it their ``import torch``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict

HZ = os.sysconf("SC_CLK_TCK")

# First match wins: the agents' ranks are forked from them and keep their command line.
KINDS = (
    ("chromium", r"chrom"),
    ("airflow scheduler", r"airflow scheduler"),
    ("airflow api-server", r"airflow api[-_]server|uvicorn"),
    ("airflow dag-processor", r"dag[-_]processor"),
    ("airflow triggerer", r"airflow triggerer"),
    ("airflow standalone (launcher)", r"airflow standalone"),
    ("airflow task processes", r"airflow worker|airflow\.sdk|task_runner|airflow tasks run"),
    ("airflow dags test", r"dags test"),
    ("airflow db migrate", r"db migrate"),
    ("other airflow commands", r"-m airflow |bin/airflow "),
    ("local nodes' agents and their forked ranks", r"backends\.local\.agent|torch\.distributed\.run|torchrun"),
    ("local nodes' supervisors", r"backends\.local\.supervisor"),
    ("local nodes' zygotes", r"backends\.local\.zygote"),
    ("mlflow server", r"mlflow|gunicorn|waitress|huey"),
    ("moto", r"moto"),
    ("pytest and its xdist workers", r"pytest|python -u -c"),
    ("ruff, mypy, make", r"ruff|mypy|make"),
)


def kind_of(command: str) -> str:
    for name, pattern in KINDS:
        if re.search(pattern, command):
            return name
    return "other: " + (" ".join(command.split()[:2])[:60] or "(no command line)")


def sample(seen: dict[str, tuple[str, float]], me: int) -> None:
    """One look at every process: its CPU seconds so far, keyed by pid and start time."""
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fp:
                stat = fp.read()
            fields = stat[stat.rindex(b")") + 2 :].split()
            cpu = (int(fields[11]) + int(fields[12])) / HZ
            key = f"{name}:{fields[19].decode()}"
            if key in seen:
                seen[key] = (seen[key][0], cpu)
                continue
            with open(f"/proc/{name}/cmdline", "rb") as fp:
                command = fp.read().replace(b"\0", b" ").decode(errors="replace").strip()
            seen[key] = (command, cpu)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile


def table(seen: dict[str, tuple[str, float]]) -> str:
    cpu: defaultdict[str, float] = defaultdict(float)
    count: Counter[str] = Counter()
    for command, seconds in seen.values():
        kind = kind_of(command)
        cpu[kind] += seconds
        count[kind] += 1
    total = sum(cpu.values()) or 1.0
    lines = [f"{total:.0f} CPU seconds in {len(seen)} processes", "", "| kind | CPU s | share | processes |"]
    lines.append("| --- | --- | --- | --- |")
    ranked = sorted(cpu.items(), key=lambda kv: -kv[1])
    lines += [f"| {k} | {s:.1f} | {100 * s / total:.1f}% | {count[k]} |" for k, s in ranked]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=0.5, help="seconds between two looks (default 0.5)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    seen: dict[str, tuple[str, float]] = {}
    started = time.monotonic()
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        sample(seen, os.getpid())
        time.sleep(args.every)
    sample(seen, os.getpid())
    print(f"\n{' '.join(command)}: exit {proc.returncode} after {time.monotonic() - started:.0f} s")
    print(table(seen), flush=True)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
