"""The local backend's zygote (``airflow_torchrun.backends.local.zygote``): a launch forks each node's
supervisor from a process that imported torch once, and the supervisor forks its agent; a zygote
gone, refused or not there yet changes nothing but the speed."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import struct
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from airflow_torchrun.backends.local import zygote
from airflow_torchrun.backends.local.backend import LocalBackend
from airflow_torchrun.backends.local.procs import group_pids, pid_alive, ranks_of
from airflow_torchrun.contract.launch import AGENT_START_VAR, GROUP_ID_VAR, NODE_RANK_VAR
from airflow_torchrun.naming import GroupIdentity
from airflow_torchrun.spec import GroupSpec
from airflow_torchrun.status import Outcome, group_status
from tests.conftest import unique_run
from tests.test_local_backend import _until

SLEEPY = textwrap.dedent(
    """
    import os, time
    import torch.distributed as dist

    dist.init_process_group("gloo")
    time.sleep(float(os.environ.get("SLEEP_S", "0")))
    dist.barrier()
    dist.destroy_process_group()
    print("done", flush=True)
    """
)


@pytest.fixture
def zygotes(tmp_path, monkeypatch):
    """A zygote directory of this test's own; its zygotes stopped at the end."""
    directory = tmp_path / "zygotes"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv(zygote.DIR_VAR, str(directory))
    yield directory
    for pid in zygote.stop_all(directory):
        _until(lambda pid=pid: not pid_alive(pid), timeout=10, what=f"zygote {pid} to leave")


def _zygote_pid(directory: Path) -> int:
    """The pid of the (one) zygote serving in ``directory``, once it listens."""

    def serving():
        for pid_file in directory.glob("*.sock.pid"):
            pid = int(pid_file.read_text())
            if pid_alive(pid) and Path(str(pid_file)[: -len(".pid")]).exists():
                return pid
        return None

    return _until(serving, what="a zygote to listen")


def _launch(tmp_path, name, *, sleep_s=0.0, **env):
    script = tmp_path / "sleepy.py"
    script.write_text(SLEEPY)
    backend = LocalBackend(tmp_path / "state")
    spec = GroupSpec.create(
        script=str(script), num_nodes=2, nproc_per_node=1, teardown_grace=3, env={"SLEEP_S": str(sleep_s), **env}
    )
    return backend, backend.launch(
        backend.plan(spec, GroupIdentity("d", "t", unique_run(name)), {}), watch_caller=False
    )


def _end(backend, handle):
    def done():
        status = group_status(
            backend.observe(handle), launched_at=handle.launched_at, now=time.time(), startup_timeout=60
        )
        return status if status.state in (Outcome.SUCCEEDED, Outcome.FAILED) else None

    try:
        return _until(done, what="the group to end")
    finally:
        backend.teardown(handle)


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fp:
        return int(fp.read().rsplit(")", 1)[1].split()[1])


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if _ppid(int(entry.name)) == pid:
                    found.add(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as fp:
        items = [i.decode() for i in fp.read().split(b"\0") if i]
    return dict(i.partition("=")[::2] for i in items)


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as fp:
        return " ".join(a.decode() for a in fp.read().split(b"\0") if a)


def _supervisor(handle, node: int) -> dict:
    path = Path(handle.group_dir) / f"node-{node}" / "supervisor.json"
    return _until(lambda: path.exists() and json.loads(path.read_text()), what=f"node {node}'s supervisor")


@pytest.mark.slow
def test_a_launch_forks_each_nodes_supervisor_and_agent_from_the_zygote(tmp_path, zygotes):
    """The first launch finds no zygote: its nodes start as new interpreters and it starts one. The
    next is forked from it, and each forked process carries its own group markers and command line
    where the backend and ``ps`` read them (so teardown still finds every process)."""
    backend, first = _launch(tmp_path, "first")
    assert _supervisor(first, 0)["pid"] and _ppid(_supervisor(first, 0)["pid"]) in (os.getpid(), 1)
    assert _end(backend, first).state is Outcome.SUCCEEDED
    zygote_pid = _zygote_pid(zygotes)
    # Its spares, forked ahead of the requests: a launch waits for no fork of a process holding torch.
    spares = _until(lambda: len(_children(zygote_pid)) == zygote.SPARES and _children(zygote_pid), what="spares")
    for spare in spares:  # a spare the zygote's death left behind would keep the next zygote from starting
        held = [os.readlink(fd) for fd in Path(f"/proc/{spare}/fd").iterdir() if fd.is_symlink()]
        assert not any(h.endswith(".sock.lock") for h in held), held

    backend, second = _launch(tmp_path, "second", sleep_s=3)
    try:
        for node in (0, 1):
            sup = _supervisor(second, node)
            assert _ppid(sup["pid"]) == zygote_pid, "the supervisor was not forked by the zygote"
            assert sup["pid"] in spares, "the supervisor was not one of the spares forked before the launch"
            assert _ppid(sup["agent_pid"]) == sup["pid"]
            assert "-m airflow_torchrun.backends.local.supervisor --node-dir=" in _cmdline(sup["pid"])
            assert "-m airflow_torchrun.backends.local.agent --nnodes=2" in _cmdline(sup["agent_pid"])
            for pid in (sup["pid"], sup["agent_pid"]):  # forked, not exec'd: it shows the zygote's room
                with open(f"/proc/{pid}/cmdline", "rb") as fp:
                    assert len(fp.read()) >= zygote._ARGV_ROOM, f"process {pid} was exec'd"
            for pid in (sup["pid"], sup["agent_pid"]):  # what ps and the backend read: the node's own
                env = _environ(pid)
                assert env[GROUP_ID_VAR] == second.group_id and env[NODE_RANK_VAR] == str(node), env
                assert env["SLEEP_S"] == "3" and zygote.DIR_VAR in env, env
                assert not any(k.startswith("AIRFLOW_TORCHRUN_ZYGOTE_ROOM") for k in env), env
        running = _until(lambda: len(group_pids(second.group_id)) >= 6 and group_pids(second.group_id), what="ranks")
        assert sorted(r[0] for p in running if (r := ranks_of(p)) is not None) == [0, 1]
        assert zygote_pid not in running
        supervisors = {_supervisor(second, node)["pid"] for node in (0, 1)}
        _until(lambda: len(_children(zygote_pid) - supervisors) == zygote.SPARES, what="the spares taken replaced")
    finally:
        status = _end(backend, second)
    assert status.state is Outcome.SUCCEEDED, status
    assert [n.exit_code for n in status.nodes] == [0, 0]
    assert "[node 1 rank 1] done" in (Path(second.group_dir) / "node-1" / "node.log").read_text()
    assert group_pids(second.group_id) == []
    assert pid_alive(zygote_pid), "the zygote serves the next launch"


@pytest.mark.slow
def test_a_zygote_killed_mid_run_changes_nothing_but_the_speed(tmp_path, zygotes):
    """kill -9 of the zygote while a group it forked trains: the group ends as it would have, and
    the next launch starts as new interpreters (and a new zygote). Nothing of either is left."""
    backend, first = _launch(tmp_path, "warm")
    _end(backend, first)
    old = _zygote_pid(zygotes)
    backend, forked = _launch(tmp_path, "forked", sleep_s=2)
    assert _ppid(_supervisor(forked, 0)["pid"]) == old
    serving = {_supervisor(forked, node)["pid"] for node in (0, 1)}
    # The zygote forks new spares once its waiting ones took the launch's requests: on a loaded
    # machine they are not there yet when the supervisors are (CI saw none at this point).
    spares = _until(lambda: _children(old) - serving, timeout=30, what="the zygote's new spares")
    os.kill(old, signal.SIGKILL)
    status = _end(backend, forked)
    assert status.state is Outcome.SUCCEEDED and [n.exit_code for n in status.nodes] == [0, 0], status
    _until(lambda: not pid_alive(old), what="the killed zygote to be gone")
    _until(lambda: not any(pid_alive(p) for p in spares), timeout=10, what="its waiting spares to die with it")

    backend, after = _launch(tmp_path, "after")
    assert _ppid(_supervisor(after, 0)["pid"]) != old
    assert _end(backend, after).state is Outcome.SUCCEEDED
    assert _zygote_pid(zygotes) != old, "a new zygote was started for the launches after"
    assert group_pids(forked.group_id) == [] and group_pids(after.group_id) == []


@pytest.mark.slow
def test_a_caller_gone_before_its_go_starts_nothing(tmp_path, zygotes):
    """The forked supervisor waits for its caller's go: a caller that died in between (or gave up)
    leaves no half-started node."""
    backend, first = _launch(tmp_path, "warm")
    _end(backend, first)
    _zygote_pid(zygotes)
    (sock_path,) = zygotes.glob("*.sock")
    node_dir = tmp_path / "node"
    node_dir.mkdir()
    env = {**os.environ, GROUP_ID_VAR: "never-started", NODE_RANK_VAR: "0"}
    request = json.dumps({"argv": [f"--node-dir={node_dir}", "--", "true"], "env": env, "cwd": str(tmp_path)}).encode()
    with socket.socket(socket.AF_UNIX) as sock, open(os.devnull, "rb") as null, open(node_dir / "err", "wb") as err:
        with zygote._addressable(sock_path) as address:
            sock.connect(address)
        socket.send_fds(sock, [struct.pack("!Q", len(request))], [null.fileno(), err.fileno(), err.fileno()])
        sock.sendall(request)
        pid = json.loads(zygote._line(sock))["pid"]
        assert pid_alive(pid)
    _until(lambda: not pid_alive(pid), timeout=10, what="the forked supervisor to leave without its go")
    assert not (node_dir / "supervisor.json").exists()
    assert group_pids("never-started") == []


@pytest.mark.slow
def test_the_zygote_leaves_after_its_idle_time(zygotes, monkeypatch):
    monkeypatch.setenv(zygote.IDLE_VAR, "5")
    path = zygotes / f"{zygote.fingerprint(os.environ)}.sock"
    zygote.start(path, dict(os.environ))
    pid = _zygote_pid(zygotes)
    spares = _until(lambda: len(_children(pid)) == zygote.SPARES and _children(pid), what="spares")
    _until(lambda: not pid_alive(pid), timeout=60, what="the idle zygote to leave")
    assert not path.exists() and not Path(f"{path}.pid").exists()
    _until(lambda: not any(pid_alive(p) for p in spares), timeout=10, what="its spares to leave with it")


@pytest.mark.slow
def test_stop_all_signals_a_zygote_and_never_whoever_took_a_dead_ones_pid(zygotes):
    """A zygote killed with SIGKILL leaves its pid file; its pid may by then be any process's
    (pids wrap: 32768 on these machines). Only a process that is that file's zygote is stopped."""
    path = zygotes / f"{zygote.fingerprint(os.environ)}.sock"
    zygote.start(path, dict(os.environ))
    pid = _zygote_pid(zygotes)
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        (zygotes / "dead.sock.pid").write_text(str(bystander.pid))  # the dead zygote's pid, reused
        assert zygote.stop_all(zygotes) == [pid]
        _until(lambda: not pid_alive(pid), timeout=10, what="the zygote to leave")
        assert bystander.poll() is None, "stop_all signalled a process that is not a zygote"
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.slow
def test_agent_start_exec_does_without_the_zygote(tmp_path, zygotes):
    backend, first = _launch(tmp_path, "warm")
    _end(backend, first)
    zygote_pid = _zygote_pid(zygotes)
    backend, execd = _launch(tmp_path, "execd", **{AGENT_START_VAR: "exec"})
    sup = _supervisor(execd, 0)
    assert _ppid(sup["pid"]) != zygote_pid
    assert _end(backend, execd).state is Outcome.SUCCEEDED


@pytest.mark.slow  # a fresh interpreter: its imports are the point
def test_an_execd_supervisor_imports_only_what_it_needs_before_its_agent_starts():
    """An exec'd supervisor's imports come before its agent starts: none of the zygote's (its
    fork of the agent is for a supervisor forked from one), no dataclasses, torch or Airflow."""
    import subprocess
    import sys

    heavy = ("airflow_torchrun.backends.local.zygote", "dataclasses", "inspect", "tempfile", "torch", "airflow")
    code = f"import sys, airflow_torchrun.backends.local.supervisor\nprint(sorted(set({heavy!r}) & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_a_zygote_directory_others_can_enter_is_not_used(tmp_path, monkeypatch, caplog):
    """Its socket would let another user run commands as this one: no zygote, and the node starts
    as a new interpreter."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    monkeypatch.setenv(zygote.DIR_VAR, str(shared))
    with caplog.at_level(logging.WARNING, logger=zygote.__name__):
        assert zygote.spawn(["--node-dir=x"], dict(os.environ), str(tmp_path), tmp_path / "err") is None
    assert "only it can enter (it is mode 755" in caplog.text
    assert list(shared.iterdir()) == [], "nothing was started there"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs another uid to try")
@pytest.mark.slow
def test_another_user_cannot_reach_the_zygote(tmp_path, zygotes):
    backend, first = _launch(tmp_path, "warm")
    _end(backend, first)
    _zygote_pid(zygotes)
    (sock_path,) = zygotes.glob("*.sock")
    child = os.fork()
    if child == 0:  # as nobody
        code = 0
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX) as sock, zygote._addressable(sock_path) as address:
                sock.connect(address)
        except PermissionError:
            code = 3
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 3


def test_the_fingerprint_names_what_a_zygotes_start_reads():
    """Variables read while Python, torch and OpenMP load make another zygote; the per-task ones do
    not (each forked process gets its own environment)."""
    base = {"PATH": "/usr/bin", "HOME": "/root"}
    same = zygote.fingerprint(base)
    for per_task in (
        {"OMP_NUM_THREADS": "3"},
        {"AWS_SECRET_ACCESS_KEY": "x"},
        {GROUP_ID_VAR: "g", NODE_RANK_VAR: "1"},
        {"TORCHELASTIC_ERROR_FILE": "/tmp/e"},
        {"TORCHINDUCTOR_CACHE_DIR": "/tmp/i", "PYTORCH_NVML_BASED_CUDA_CHECK": "1", "CUDA_VISIBLE_DEVICES": "0"},
        {"PATH": "/elsewhere"},
    ):
        assert zygote.fingerprint({**base, **per_task}) == same, per_task
    for at_start in ({"TORCH_LOGS": "+dynamo"}, {"PYTHONPATH": "/x"}, {"LD_PRELOAD": "/x.so"}, {"OMP_PROC_BIND": "1"}):
        assert zygote.fingerprint({**base, **at_start}) != same, at_start
