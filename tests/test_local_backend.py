"""Local process hygiene with real torchrun agents: nothing is ever left behind.

torchrun puts each worker in a session of its own, so neither killing an agent nor killing its
process group reaches the workers (seen with torchrun 2.13). These tests kill things the hard way and check,
by scanning processes (not by sleeping), that the group is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from airflow_torchrun.backends.local.backend import LocalBackend
from airflow_torchrun.backends.local.procs import group_pids, rank_pid
from airflow_torchrun.naming import GroupIdentity
from airflow_torchrun.spec import GroupSpec
from airflow_torchrun.status import NodePhase, Outcome, group_status
from tests.conftest import unique_run

pytestmark = pytest.mark.slow


def _until(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _launch(tmp_path, tiny_script, *, watch_caller=False, **env):
    backend = LocalBackend(tmp_path / "state")
    spec = GroupSpec.create(
        script=str(tiny_script),
        num_nodes=2,
        nproc_per_node=1,
        env={"STEPS": "100000", "STEP_SECONDS": "0.1", **env},
        teardown_grace=3,
    )
    handle = backend.launch(
        backend.plan(spec, GroupIdentity("d", "t", unique_run(tmp_path.name)), {}), watch_caller=watch_caller
    )
    return backend, handle


def _terminal(backend, handle, what):
    """Wait until the group is done; its final status."""

    def done():
        status = group_status(
            backend.observe(handle), launched_at=handle.launched_at, now=time.time(), startup_timeout=60
        )
        return status if status.state.terminal else None

    return _until(done, what=what)


def _workers_running(backend, handle):
    """Both ranks printed their first line: every process of the group exists."""
    logs = [Path(p).read_text() if Path(p).exists() else "" for p in backend.log_locations(handle)]
    return all("sum=3" in text for text in logs)


def test_agent_killed_with_sigkill_leaves_no_orphaned_worker(tmp_path, tiny_script):
    backend, handle = _launch(tmp_path, tiny_script)
    try:
        _until(lambda: _workers_running(backend, handle), what="ranks to start")
        sup = json.loads((Path(handle.group_dir) / "node-1" / "supervisor.json").read_text())
        os.kill(sup["agent_pid"], signal.SIGKILL)
        status = _terminal(backend, handle, what="the group to fail")
        assert status.state is Outcome.FAILED
        # Node 0 may be seen failing first (its rank lost its peer); node 1's outcome follows.
        node1 = _until(
            lambda: (n := backend.observe(handle)[1]).finished_at and n.exit_code is not None and n,
            what="node 1's outcome",
        )
        assert node1.signal == "SIGKILL"
        # node 1's supervisor reaped the orphaned worker itself (and exited), before any teardown
        _until(lambda: group_pids(handle.group_id, node_rank=1) == [], timeout=10, what="node 1 to end by itself")
    finally:
        backend.teardown(handle)
    assert group_pids(handle.group_id) == []


def test_supervisor_killed_is_lost_and_teardown_still_finds_every_process(tmp_path, tiny_script):
    backend, handle = _launch(tmp_path, tiny_script)
    try:
        _until(lambda: _workers_running(backend, handle), what="ranks to start")
        sup = json.loads((Path(handle.group_dir) / "node-0" / "supervisor.json").read_text())
        os.kill(sup["pid"], signal.SIGKILL)
        nodes = _until(
            lambda: (o := backend.observe(handle))[0].phase is NodePhase.LOST and o, what="node 0 to be lost"
        )
        assert "died without recording an outcome" in (nodes[0].reason or "")
        assert group_pids(handle.group_id, node_rank=0), "agent and worker outlive their supervisor"
    finally:
        backend.teardown(handle)
    assert group_pids(handle.group_id) == []
    backend.teardown(handle)  # idempotent: nothing to do, no error


def test_dead_caller_stops_the_group(tmp_path, tiny_script):
    """Sync mode: when the Airflow task process dies (kill -9), its group follows."""
    launcher = tmp_path / "launcher.py"
    launcher.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
            from tests.test_local_backend import _launch
            from pathlib import Path
            backend, handle = _launch(Path({str(tmp_path)!r}), Path({str(tiny_script)!r}), watch_caller=True)
            print(handle.group_id, flush=True)
            time.sleep(600)
            """
        )
    )
    proc = subprocess.Popen([sys.executable, str(launcher)], stdout=subprocess.PIPE, text=True)
    try:
        group_id = proc.stdout.readline().strip()
        assert group_id
        backend = LocalBackend(tmp_path / "state")
        _until(lambda: len(group_pids(group_id)) >= 6, what="2 supervisors, 2 agents and 2 workers")
    finally:
        proc.kill()
        proc.wait()
    _until(lambda: group_pids(group_id) == [], timeout=30, what="the group to stop after its caller died")
    exits = [
        json.loads((backend.state_dir / "groups" / group_id / f"node-{n}" / "exit.json").read_text()) for n in range(2)
    ]
    assert all("watched process" in (e["stopped_by"] or "") for e in exits)


def test_group_keeps_logs_of_every_rank_and_a_status_file_per_node(tmp_path, tiny_script):
    backend = LocalBackend(tmp_path / "state")
    spec = GroupSpec.create(script=str(tiny_script), num_nodes=2, nproc_per_node=1)
    identity = GroupIdentity("d", "t", unique_run("logs"))
    handle = backend.launch(backend.plan(spec, identity, {}), watch_caller=False)
    status = _terminal(backend, handle, what="the group to finish")
    assert status.state is Outcome.SUCCEEDED
    for n in range(2):
        node_dir = Path(handle.group_dir) / f"node-{n}"
        assert json.loads((node_dir / "exit.json").read_text())["returncode"] == 0
        assert f"[node {n} rank {n}] rank {n} done" in (node_dir / "node.log").read_text()
        # torchrun's own per-rank files
        assert list((node_dir / "torchrun").glob("*/attempt_0/0/stdout.log"))
    # A relaunch of the same try keeps the earlier logs instead of overwriting them.
    handle2 = backend.launch(backend.plan(spec, identity, {}), watch_caller=False)
    backend.teardown(handle2)
    assert len(list((backend.state_dir / "groups").glob(f"{handle.group_id}*"))) == 2


SLOW_TO_STOP = textwrap.dedent(
    """
    import signal, sys, time
    def stop(*_):
        time.sleep(0.5)  # like an agent waiting for its workers to save
        sys.exit(3)
    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
    """
)


def test_a_stopped_agent_keeps_its_exit_code_in_exit_json(tmp_path):
    """The supervisor reaps orphans while it stops its node; it must not swallow the agent's own
    status (Popen then reports 0: a CI run saw a torn-down group reported as succeeded)."""
    from airflow_torchrun.contract.launch import GROUP_ID_VAR, NODE_RANK_VAR

    script = tmp_path / "agent.py"
    script.write_text(SLOW_TO_STOP)
    node_dir = tmp_path / "node-0"
    node_dir.mkdir()
    env = {**os.environ, GROUP_ID_VAR: f"reap-{os.getpid()}", NODE_RANK_VAR: "0"}
    supervisor = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "airflow_torchrun.backends.local.supervisor",
            f"--node-dir={node_dir}",
            "--grace=10",
            "--",
            sys.executable,
            str(script),
        ],
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while b"ready" not in (node_dir / "node.log").read_bytes() if (node_dir / "node.log").exists() else True:
        assert time.monotonic() < deadline, "the agent never started"
        time.sleep(0.05)
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=60) == 1  # the node did not succeed
    outcome = json.loads((node_dir / "exit.json").read_text())
    assert outcome["returncode"] == 3, outcome
    assert outcome["stopped_by"] == "SIGTERM"


def test_an_exec_d_supervisor_that_cannot_start_says_why_and_fails(tmp_path):
    """An exec'd supervisor ends without the interpreter's teardown (procs.exit_now): its status and
    its traceback must still be what a normal exit gives, and argparse's own exits keep theirs."""
    from airflow_torchrun.contract.launch import GROUP_ID_VAR

    command = [sys.executable, "-m", "airflow_torchrun.backends.local.supervisor"]
    env = {k: v for k, v in os.environ.items() if k != GROUP_ID_VAR}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*command, *args], check=False, env=env, capture_output=True, text=True, timeout=60)

    failed = run(f"--node-dir={tmp_path}", "--", "true")
    assert failed.returncode == 1, failed
    assert "Traceback" in failed.stderr and f"KeyError: '{GROUP_ID_VAR}'" in failed.stderr, failed.stderr
    assert not (tmp_path / "exit.json").exists()
    usage = run("--no-such-option")
    assert usage.returncode == 2 and "--node-dir" in usage.stderr, usage
    helped = run("--help")
    assert helped.returncode == 0 and "--node-dir" in helped.stdout, helped


def test_a_killed_rank_fails_its_node_before_its_agent_has_stopped(tmp_path, tiny_script):
    """torchrun's agent takes a second or more to stop a node whose rank died. The node counts as
    failed from the agent's first report (so the rest of the group is stopped that much sooner),
    and the teardown lets that agent finish, so the report still names the rank and its signal."""
    backend, handle = _launch(tmp_path, tiny_script)
    node1 = Path(handle.group_dir) / "node-1"
    try:
        _until(lambda: _workers_running(backend, handle), what="ranks to start")
        sup = json.loads((node1 / "supervisor.json").read_text())
        (rank,) = [p for p in group_pids(handle.group_id, node_rank=1) if p not in (sup["pid"], sup["agent_pid"])]
        rank_0 = rank_pid(handle.group_id, 0)
        assert rank_0 is not None
        # The agent is held still so that "before it has stopped" does not depend on how fast a
        # loaded machine runs it: only the supervisor can see the rank die meanwhile. Rank 0 is held
        # too: in its all_reduce it would fail within milliseconds of its peer, and node 0 with it.
        held = (sup["agent_pid"], rank_0)
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
        try:
            os.kill(rank, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while (nodes := backend.observe(handle))[1].phase is NodePhase.RUNNING and time.monotonic() < deadline:
                time.sleep(0.02)
            agent_done = (node1 / "exit.json").exists()
        finally:
            for pid in held:
                os.kill(pid, signal.SIGCONT)
        assert nodes[1].phase is NodePhase.FAILED, nodes
        assert not agent_done, "node 1 was seen failed only once its agent had exited"
        assert nodes[1].reason == "local rank 0 was killed by SIGKILL; its torchrun agent is stopping the node"
        assert nodes[0].phase is NodePhase.RUNNING
    finally:
        backend.teardown(handle)
    assert group_pids(handle.group_id) == []
    exits = [json.loads((Path(handle.group_dir) / f"node-{n}" / "exit.json").read_text()) for n in (0, 1)]
    assert exits[0]["stopped_by"] == "SIGTERM" and exits[1]["stopped_by"] is None
    status = group_status(backend.observe(handle), launched_at=handle.launched_at, now=time.time(), startup_timeout=60)
    report = backend.explain(handle, status)
    assert report.signal == "SIGKILL" and report.headline.startswith("rank 1 "), report.message


DEAF_TO_SIGTERM = textwrap.dedent(
    """
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a rank stuck in a save that outlasts the grace
    print("deaf", flush=True)
    while True:
        time.sleep(0.05)
    """
)


def test_a_teardown_past_its_grace_still_leaves_each_nodes_record(tmp_path):
    """A rank ignores SIGTERM, so its agent outlives the teardown's grace and everything left is
    SIGKILLed. The supervisors go last: each still records how its node ended (exit.json), so the
    node reads as stopped, not as lost. Before, the supervisor was SIGKILLed with its agent and the
    record was lost (one CI run saw it with a grace of 3 s on a loaded machine)."""
    script = tmp_path / "deaf.py"
    script.write_text(DEAF_TO_SIGTERM)
    backend = LocalBackend(tmp_path / "state")
    spec = GroupSpec.create(script=str(script), num_nodes=2, nproc_per_node=1, teardown_grace=1)
    handle = backend.launch(backend.plan(spec, GroupIdentity("d", "deaf", unique_run(tmp_path.name)), {}))
    logs = [Path(p) for p in backend.log_locations(handle)]
    _until(lambda: all(p.exists() and "deaf" in p.read_text() for p in logs), what="both ranks up")
    backend.teardown(handle)
    assert group_pids(handle.group_id) == []
    for node in range(2):
        exit_json = Path(handle.group_dir) / f"node-{node}" / "exit.json"
        assert exit_json.exists(), f"node {node} left no record of how it ended"
        assert json.loads(exit_json.read_text())["stopped_by"] == "SIGTERM"
    assert [n.phase for n in backend.observe(handle)] == [NodePhase.FAILED, NodePhase.FAILED]


PRINTS_THE_AGENTS_PHRASE = textwrap.dedent(
    """
    import sys, time
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    # What torchrun's agent logs when a worker dies, printed by a healthy rank (a log line it
    # relays, a test it runs, a user's message): to stdout and to stderr, whole lines.
    phrase = "failed (exitcode: -9) local_rank: 0 (pid: 4242) of binary: /usr/bin/python3"
    for step in range(30):
        print(f"step {step}: relaying: {phrase}", flush=True)
        print(phrase, file=sys.stderr, flush=True)
        dist.all_reduce(torch.ones(1))
        time.sleep(0.05)
    dist.destroy_process_group()
    print("done", flush=True)
    """
)


def _run_to_its_end(tmp_path, script):
    """A two-node group of ``script``, watched to its end and torn down."""
    backend = LocalBackend(tmp_path / "state")
    spec = GroupSpec.create(script=str(script), num_nodes=2, nproc_per_node=1, teardown_grace=3)
    handle = backend.launch(
        backend.plan(spec, GroupIdentity("d", "t", unique_run(tmp_path.name)), {}), watch_caller=False
    )
    try:
        return backend, handle, _terminal(backend, handle, what="the group to end")
    finally:
        backend.teardown(handle)


def test_a_rank_printing_the_agents_failure_phrase_does_not_fail_a_healthy_group(tmp_path):
    """Finding 8 of the trust review: the node's supervisor marked its node failed when the phrase
    torchrun's agent logs for a dead worker appeared anywhere in the node's log, and rank output
    shares that log, so a rank that printed it tore down a healthy group. A node fails only by its
    ranks' exit statuses and error files, and its agent's."""
    script = tmp_path / "prints_phrase.py"
    script.write_text(PRINTS_THE_AGENTS_PHRASE)
    backend, handle, status = _run_to_its_end(tmp_path, script)
    logs = "".join(Path(p).read_text() for p in backend.log_locations(handle))
    assert logs.count("failed (exitcode: -9)") >= 60 and logs.count("done") == 2, logs[-2000:]
    assert status.state is Outcome.SUCCEEDED, status
    assert [n.exit_code for n in status.nodes] == [0, 0]
    assert not list(Path(handle.group_dir).glob("node-*/rank-failed.json"))
    assert group_pids(handle.group_id) == []


WRITES_LINES_IN_PARTS = textwrap.dedent(
    """
    import os, sys, time

    # A line whose end is written later than its start, as Python unbuffered writes a print's text
    # and its newline apart; and a last line with no end at all.
    for _ in range(3):
        print("METRICS loss=5.671374320983887", end="", flush=True)
        time.sleep(0.3)  # past the tee's look at the file (every 0.1 s)
        print(" epoch=3", flush=True)
    os.write(2, b"to stderr, a line in two ")
    time.sleep(0.3)
    os.write(2, b"parts\\n")
    print("the last words, no newline", end="", flush=True)
    """
)


def test_each_ranks_line_reaches_the_node_log_whole(tmp_path):
    """CI failure of stop 35: torchrun's tee wrote the part of a line it had read, with its prefix,
    and the rest later, so another rank's line landed inside it (``loss=5.67[node 0 rank 1] ...``)
    and a test's parse of the log failed. Each line is now written whole, a line the file ended
    inside with a newline added."""
    script = tmp_path / "parts.py"
    script.write_text(WRITES_LINES_IN_PARTS)
    backend = LocalBackend(tmp_path / "state")
    spec = GroupSpec.create(script=str(script), num_nodes=1, nproc_per_node=2, teardown_grace=3)
    handle = backend.launch(
        backend.plan(spec, GroupIdentity("d", "t", unique_run(tmp_path.name)), {}), watch_caller=False
    )
    try:
        status = _terminal(backend, handle, what="the group to end")
    finally:
        backend.teardown(handle)
    assert status.state is Outcome.SUCCEEDED, status
    log = (Path(handle.group_dir) / "node-0" / "node.log").read_text()
    for rank in (0, 1):
        prefix = f"[node 0 rank {rank}]"
        assert log.count(f"{prefix} METRICS loss=5.671374320983887 epoch=3\n") == 3, log
        assert f"{prefix} to stderr, a line in two parts\n" in log, log
        assert f"{prefix} the last words, no newline\n" in log, log
    ranks_lines = [line for line in log.splitlines() if "METRICS" in line or "parts" in line or "last words" in line]
    assert all(line.startswith("[node 0 rank ") and line.count("[node") == 1 for line in ranks_lines), log


def test_a_rank_saying_address_already_in_use_is_no_port_race(tmp_path):
    """The port race is read from the agent's words (torchrun has no other report of it), and a
    rank's words share node 0's log and, through its error file, the agent's: a rank of node 0 whose
    own server found its port taken was taken for a lost rendezvous race and relaunched up to three
    times. It is its own failure: no relaunch, and the node fails with the rank's exit code."""
    script = tmp_path / "port_taken.py"
    script.write_text(
        "import os, sys\n"
        "if os.environ['RANK'] == '0':\n"
        "    print('my metrics server: [Errno 98] Address already in use (EADDRINUSE)', flush=True)\n"
        "    raise OSError(98, 'Address already in use: my metrics server on :9100 (EADDRINUSE)')\n"
    )
    backend, handle, status = _run_to_its_end(tmp_path, script)
    node0 = Path(handle.group_dir) / "node-0"
    said = (node0 / "node.log").read_text() + (
        (node0 / "agent-error.json").read_text() if (node0 / "agent-error.json").exists() else ""
    )
    assert "Address already in use" in said, said[-2000:]
    assert status.state is Outcome.FAILED, status
    assert "local rank 0 exited with code 1" in (status.nodes[0].reason or ""), status
    workers = json.loads((node0 / "workers.json").read_text())["workers"]
    assert [(w["rank"], w["exit_code"]) for w in workers] == [(0, 1)], workers
    assert backend.relaunch_reason(handle, status) is None


def test_a_lost_rendezvous_port_is_a_port_race_before_any_rank_ran(tmp_path):
    """What the agent says when another process took node 0's rendezvous port before it bound it
    (no rank has started yet): a relaunch, on a new port. Files as the supervisor and torchrun leave
    them."""
    from airflow_torchrun.backends.base import RelaunchKind
    from airflow_torchrun.backends.handles import LocalHandle

    group_dir = tmp_path / "g"
    node0 = group_dir / "node-0"
    node0.mkdir(parents=True)
    (node0 / "node.log").write_text(
        "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
        "address. port: 41234, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use\n"
    )
    handle = LocalHandle(
        group_id="g",
        num_nodes=2,
        world_size=2,
        launched_at=0.0,
        startup_timeout=60.0,
        teardown_grace=3.0,
        group_dir=str(group_dir),
        master_port=41234,
    )
    backend = LocalBackend(tmp_path / "state")
    status = group_status([], launched_at=0.0, now=1.0, startup_timeout=60.0)
    relaunch = backend.relaunch_reason(handle, status)
    assert relaunch is not None and relaunch.kind is RelaunchKind.PORT_RACE
    assert "rendezvous port 41234 was taken by another process" in relaunch.why
    # A rank started (torchrun made its attempt folder), or one ended (the supervisor listed it):
    # the words may be its own.
    (node0 / "torchrun" / "g_x1" / "attempt_0").mkdir(parents=True)
    assert backend.relaunch_reason(handle, status) is None
    (node0 / "torchrun" / "g_x1" / "attempt_0").rmdir()
    assert backend.relaunch_reason(handle, status) is not None
    (node0 / "workers.json").write_text(json.dumps({"workers": [{"pid": 7, "rank": 0, "exit_code": 1}]}))
    assert backend.relaunch_reason(handle, status) is None


REAPING_PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    # Like torchrun's agent: three workers, reaped by polling every 0.1 s.
    codes = {"ok": "import time; time.sleep(1.0)", "three": "import time, sys; time.sleep(1.3); sys.exit(3)",
             "killed": "import time; time.sleep(60)"}
    procs = {name: subprocess.Popen([sys.executable, "-c", code], env={"RANK": str(i), "LOCAL_RANK": str(i)})
             for i, (name, code) in enumerate(codes.items())}
    print(" ".join(f"{name}={p.pid}" for name, p in procs.items()), flush=True)
    while any(p.poll() is None for p in procs.values()):
        time.sleep(0.1)
    """
)


@contextlib.contextmanager
def _workers_with_one_killed(sig: int = signal.SIGKILL):
    """The stand-in agent's three workers, watched (``_WorkerWatch``), the "killed" one killed by
    ``sig``; yields the watch and the workers' pids by name. The stand-in is killed on the way out."""
    from airflow_torchrun.backends.local.supervisor import _WorkerWatch

    parent = subprocess.Popen([sys.executable, "-c", REAPING_PARENT], stdout=subprocess.PIPE, text=True)
    try:
        pids = {name: int(pid) for name, pid in (item.split("=") for item in parent.stdout.readline().split())}
        watch = _WorkerWatch(parent.pid)
        # Each worker's rank is read from its environment once it has exec'd (before, it has its
        # parent's): a worker killed earlier has no rank to report.
        _until(
            lambda: (
                watch.discover()
                or (len(watch.workers) == 3 and all(w.rank is not None for w in watch.workers.values()))
            ),
            what="the three workers, their ranks known",
        )
        os.kill(pids["killed"], sig)
        yield watch, pids
    finally:
        parent.kill()
        parent.wait()


def test_the_supervisor_reads_each_workers_exit_status_from_the_kernel(tmp_path):
    """Each worker's outcome comes from its pidfd and its zombie's wait status, before the parent
    (torchrun's agent, here a stand-in that reaps every 0.1 s) collects it: an exit code, a signal."""
    import select

    with _workers_with_one_killed() as (watch, pids):
        deadline = time.monotonic() + 30
        while len(watch.outcomes) < 3 and time.monotonic() < deadline:
            readable, _, _ = select.select(watch.fds(), [], [], 0.05)
            watch.ended(readable)
    by_pid = {o["pid"]: o for o in watch.outcomes}
    assert by_pid[pids["ok"]]["exit_code"] == 0
    assert by_pid[pids["three"]]["exit_code"] == 3 and by_pid[pids["three"]]["local_rank"] == 1
    killed = by_pid[pids["killed"]]
    assert (killed["exit_code"], killed["signal"], killed["rank"]) == (-9, "SIGKILL", 2)
    assert watch.workers == {}  # every pidfd closed


@pytest.mark.skipif(
    not hasattr(os, "pidfd_open") or tuple(map(int, os.uname().release.split(".")[:2])) < (6, 15),
    reason="the kernel keeps a reaped process's exit status for its pidfd from Linux 6.15",
)
def test_the_supervisor_reads_the_status_of_a_worker_the_agent_already_reaped(tmp_path):
    """On a loaded machine the supervisor often looks only after the agent's next monitor tick reaped
    the dead worker: its status still comes from the kernel (the pidfd keeps it), so a killed rank
    still fails its node at once instead of at the agent's exit. Before, the outcome was ``None``."""
    with _workers_with_one_killed() as (watch, pids):
        _until(lambda: not Path(f"/proc/{pids['killed']}").exists(), what="the agent reaping the killed worker")
        ended = {o["pid"]: o for o in watch.ended(watch.fds())}
    killed = ended[pids["killed"]]
    assert (killed["exit_code"], killed["signal"], killed["rank"]) == (-9, "SIGKILL", 2)


def test_a_worker_killed_by_a_signal_python_has_no_name_for_is_reported_by_number():
    """A real-time signal (SIGRTMIN+3) kills by default and ``signal.Signals`` has no member for it:
    the supervisor reports "signal 37" instead of dying of a ValueError (its node then taken for lost)."""
    import select

    sig = signal.SIGRTMIN + 3
    with _workers_with_one_killed(sig) as (watch, pids):
        deadline = time.monotonic() + 30
        while pids["killed"] in watch.workers and time.monotonic() < deadline:
            readable, _, _ = select.select(watch.fds(), [], [], 0.05)
            watch.ended(readable)
    killed = {o["pid"]: o for o in watch.outcomes}[pids["killed"]]
    assert (killed["exit_code"], killed["signal"]) == (-sig, f"signal {sig}")


def _group_of_sleepers(tmp_path, seconds):
    """A group directory whose node 0 is a supervisor (here a sleeping process) still running and
    whose node 1 has its outcome on disk: what the watch pauses on between two looks."""
    from airflow_torchrun.backends.handles import LocalHandle

    group_dir = tmp_path / "groups" / "g"
    for n in (0, 1):
        (group_dir / f"node-{n}").mkdir(parents=True)
    sleeper = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])
    (group_dir / "node-0" / "supervisor.json").write_text(json.dumps({"pid": sleeper.pid}))
    (group_dir / "node-1" / "supervisor.json").write_text(json.dumps({"pid": os.getpid()}))
    (group_dir / "node-1" / "exit.json").write_text(json.dumps({"returncode": 0}))
    handle = LocalHandle(
        group_id="g",
        num_nodes=2,
        world_size=2,
        launched_at=time.time(),
        startup_timeout=60,
        teardown_grace=3,
        group_dir=str(group_dir),
        master_port=29500,
    )
    return LocalBackend(tmp_path), handle, sleeper


def test_the_watchs_pause_ends_when_a_running_nodes_supervisor_exits(tmp_path):
    """The last look of a finished group comes when its supervisors exit, not up to poll_interval
    later (issue 26: exited -> verdict). A node already done (node 1 here, whose recorded pid is
    this test's, which never exits) is not waited on."""
    backend, handle, sleeper = _group_of_sleepers(tmp_path, 1.0)
    try:
        backend.observe(handle)  # the look before the pause
        started = time.monotonic()
        backend.pause(handle, 120.0)
        assert time.monotonic() - started < 60, "the pause slept its whole time instead of waking on the exit"
    finally:
        sleeper.kill()
        sleeper.wait()
    # Nothing left running: a pause is a plain sleep of its length (and gives its pidfds back).
    (Path(handle.group_dir) / "node-0" / "exit.json").write_text(json.dumps({"returncode": 0}))
    backend.observe(handle)
    fds_before = len(os.listdir("/proc/self/fd"))
    started = time.monotonic()
    backend.pause(handle, 0.3)
    assert time.monotonic() - started >= 0.29
    assert len(os.listdir("/proc/self/fd")) == fds_before


def test_a_pause_after_the_groups_end_ends_at_once(tmp_path):
    """The group ended between the look and the pause (its supervisors recorded their outcomes and
    exited): there is no pidfd left to wake on, and the pause must not sleep its whole length."""
    import asyncio

    backend, handle, sleeper = _group_of_sleepers(tmp_path, 120.0)
    try:
        assert [n.exit_code for n in backend.observe(handle)] == [None, 0]  # node 0 still runs
    finally:
        sleeper.kill()
        sleeper.wait()
    (Path(handle.group_dir) / "node-0" / "exit.json").write_text(json.dumps({"returncode": 0}))
    started = time.monotonic()
    backend.pause(handle, 30.0)
    asyncio.run(backend.pause_async(handle, 30.0))
    assert time.monotonic() - started < 20, "a pause slept through an outcome recorded since the last look"


def test_the_triggers_pause_ends_when_a_running_nodes_supervisor_exits(tmp_path):
    import asyncio

    backend, handle, sleeper = _group_of_sleepers(tmp_path, 1.0)
    backend.observe(handle)
    fds_before = len(os.listdir("/proc/self/fd"))
    try:
        started = time.monotonic()
        asyncio.run(backend.pause_async(handle, 120.0))
        assert time.monotonic() - started < 60, "the pause slept its whole time instead of waking on the exit"
        sleeper.wait(5)
        (Path(handle.group_dir) / "node-0" / "exit.json").write_text(json.dumps({"returncode": 0}))
        backend.observe(handle)
        started = time.monotonic()
        asyncio.run(backend.pause_async(handle, 0.3))
        assert time.monotonic() - started >= 0.29
    finally:
        sleeper.kill()
        sleeper.wait()
    assert len(os.listdir("/proc/self/fd")) <= fds_before


def test_a_teardowns_wait_ends_when_a_process_exits(tmp_path):
    """stop_group waits for a signalled process by its pidfd: it sees it gone when it exits, not at
    its next look (it looked every 50 ms: a teardown of a finished group took that long now and then)."""
    from airflow_torchrun.backends.local.procs import until_one_exits

    leaving = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    staying = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        started = time.monotonic()
        until_one_exits([leaving.pid, staying.pid], 60.0)
        assert time.monotonic() - started < 30, "the wait slept its whole time instead of waking on the exit"
        assert leaving.poll() is not None or leaving.wait(5) == 0
        started = time.monotonic()
        until_one_exits([leaving.pid], 60.0)  # one already gone: at once (reaped, or a zombie: exited)
        assert time.monotonic() - started < 30
        started = time.monotonic()
        until_one_exits([staying.pid], 0.2)
        assert time.monotonic() - started >= 0.19  # none exits: the whole time
    finally:
        staying.kill()
        staying.wait()
