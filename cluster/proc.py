"""The cluster's processes: each started into a cgroup of the cluster's own (in every v1 hierarchy),
its PID recorded, and stopped by PID. The cgroup also catches what they start (containerd's shims,
the pods' processes under the kubelets' cgroup roots), so ``down`` finds and stops every one of
them by PID, and nothing outside the cluster's cgroup is ever signalled."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from cluster.layout import State

CGROUP_ROOT = Path("/sys/fs/cgroup")


def hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy (v1 controllers, named ones, and the v2 one in hybrid mode)."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype = right.split()[0] if right else ""
        if fstype in ("cgroup", "cgroup2"):
            found.append(Path(left.split()[4]))
    return found


def v1_hierarchies() -> list[Path]:
    return [h for h in hierarchies() if h.name != "unified" and (h / "cgroup.procs").exists() and h != CGROUP_ROOT]


def make_cgroup(relative: str) -> None:
    """Create ``relative`` (e.g. ``airflow-torchrun-cluster-ab12/system``) in every v1 hierarchy."""
    for h in v1_hierarchies():
        path = h
        for part in relative.strip("/").split("/"):
            parent, path = path, path / part
            if not path.exists():
                path.mkdir()
            # cpuset: a new cgroup has no CPUs or memory nodes; no task can join it until set.
            if h.name == "cpuset":
                for knob in ("cpuset.cpus", "cpuset.mems"):
                    if not (path / knob).read_text().strip():
                        (path / knob).write_text((parent / knob).read_text())


def cgroup_pids(relative: str) -> list[int]:
    """Every process in ``relative`` and below it (from the pids hierarchy, else the first one)."""
    v1 = v1_hierarchies()
    h = next((x for x in v1 if x.name == "pids"), v1[0] if v1 else None)
    if h is None or not (h / relative).exists():
        return []
    pids: list[int] = []
    for procs in (h / relative).rglob("cgroup.procs"):
        pids += [int(p) for p in procs.read_text().split()]
    return pids


def remove_cgroup(relative: str) -> None:
    """rmdir the tree (deepest first) in every hierarchy, the v2 one of hybrid mode included (runc
    makes a container's cgroup there too)."""
    for h in hierarchies():
        top = h / relative
        if not top.exists():
            continue
        for path in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            try:
                path.rmdir()
            except OSError:
                pass
        try:
            top.rmdir()
        except OSError:
            pass


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class Processes:
    def __init__(self, state: State) -> None:
        self.state = state
        state.pids.mkdir(parents=True, exist_ok=True)
        state.logs.mkdir(parents=True, exist_ok=True)

    def log(self, name: str) -> Path:
        return self.state.logs / f"{name}.log"

    def pid(self, name: str) -> int | None:
        """The recorded PID of ``name`` while that very process (same start time) still runs."""
        path = self.state.pids / f"{name}.pid"
        if not path.exists():
            return None
        pid_text, _, started = path.read_text().partition(" ")
        pid = int(pid_text)
        if alive(pid) and _start_time(pid) == started.strip():
            return pid
        return None

    def names(self) -> list[str]:
        return sorted(p.stem for p in self.state.pids.glob("*.pid"))

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cgroup: str | None = None,
        cwd: Path | None = None,
    ) -> int:
        running = self.pid(name)
        if running is not None:
            return running
        group = cgroup or f"{self.state.cgroup}/system"
        make_cgroup(group)
        targets = [h / group / "cgroup.procs" for h in v1_hierarchies()]

        def join() -> None:
            me = str(os.getpid())
            for target in targets:
                target.write_text(me)

        log = self.log(name).open("ab")
        log.write(f"\n--- {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            list(argv),
            env=dict(env) if env is not None else None,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=join,  # noqa: PLW1509 - a single-threaded launcher; the child joins before exec
        )
        log.close()
        (self.state.pids / f"{name}.pid").write_text(f"{proc.pid} {_start_time(proc.pid)}\n")
        return proc.pid

    def wait_for(self, name: str, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.pid(name) is None:
                raise SystemExit(f"{name} exited before {what}; the end of {self.log(name)}:\n{self.tail(name)}")
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"{name}: no {what} after {timeout:.0f}s; the end of {self.log(name)}:\n{self.tail(name)}"
                )
            time.sleep(0.5)

    def tail(self, name: str, chars: int = 3000) -> str:
        try:
            return self.log(name).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, name: str, grace: float = 15.0) -> None:
        pid = self.pid(name)
        if pid is not None:
            terminate([pid], grace)
        (self.state.pids / f"{name}.pid").unlink(missing_ok=True)


def terminate(pids: Sequence[int], grace: float) -> None:
    """SIGTERM each PID, SIGKILL whatever still runs after ``grace`` seconds."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    kill(pids)


def kill(pids: Sequence[int]) -> None:
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)


def mounts_under(roots: Sequence[Path]) -> Iterator[Path]:
    """Mount points at or below any of ``roots``, deepest first (the order to unmount them in)."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = Path(line.split()[4].replace("\\040", " "))
        if any(point == r or r in point.parents for r in roots):
            points.append(point)
    yield from sorted(set(points), key=lambda p: len(p.parts), reverse=True)


def unmount_all(roots: Sequence[Path]) -> int:
    count = 0
    for _ in range(5):  # stacked mounts come back one layer at a time
        points = list(mounts_under(roots))
        if not points:
            break
        for point in points:
            done = subprocess.run(["umount", str(point)], capture_output=True, check=False)
            if done.returncode != 0:
                subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False)
            count += 1
    return count
