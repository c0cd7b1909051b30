"""The local backend's agent (``airflow_torchrun.backends.local.agent``): torchrun, ended without the
interpreter's teardown.

What must hold: for every way a node ends (its workers succeed, one fails, the agent is stopped by
SIGTERM, a bad argument) the agent's exit status and the end of its output are torchrun's own; two
nodes on the backend's static rendezvous (node 0's agent hosts the store the others need for their
exit barrier) both end cleanly; the atexit handlers ran and the output was flushed, and the teardown
did not run. How much time that saves is a benchmark's question (``bench/bench_group.py``), not a
test's.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from airflow_torchrun.backends.local.backend import AGENT_MODULE, LocalBackend
from airflow_torchrun.naming import GroupIdentity
from airflow_torchrun.spec import GroupSpec
from airflow_torchrun.wiring import TORCHRUN_MODULE
from tests.ports import refusing_port

WORKER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    how = os.environ["HOW"]
    print("worker up", flush=True)
    Path(os.environ["UP"]).touch()
    if how == "fail":
        raise RuntimeError("the worker failed on purpose")
    if how == "hang":
        time.sleep(60)
    if how == "slow-stop":  # a SIGTERM save: 1.5 s of work after the signal, then the worker is done
        import signal
        def save(*_):
            time.sleep(1.5)
            Path(os.environ["UP"] + ".saved").touch()
            sys.exit(0)
        signal.signal(signal.SIGTERM, save)
        Path(os.environ["UP"] + ".armed").touch()
        time.sleep(60)
    """
)


def _node(
    module: str,
    tmp_path: Path,
    how: str,
    *extra: str,
    port: int,
    nnodes: int = 1,
    node_rank: int = 0,
    program: Path | None = None,
) -> tuple[subprocess.Popen[str], Path]:
    """One node's agent as the local backend starts it (static rendezvous, tee'd logs), and its folder;
    ``program`` runs instead of ``-m module``."""
    run = tmp_path / f"{module.rsplit('.', 1)[-1]}-{how}-{node_rank}"
    run.mkdir(parents=True, exist_ok=True)
    (run / "worker.py").write_text(WORKER)
    launcher = [str(program)] if program else ["-m", module]
    argv = [sys.executable, *launcher, f"--nnodes={nnodes}", "--nproc-per-node=1", f"--node-rank={node_rank}"]
    argv += ["--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}"]
    argv += ["--max-restarts=0", "--monitor-interval=0.1", "--tee=3", f"--log-dir={run / 'logs'}", *extra]
    env = {**os.environ, "HOW": how, "UP": str(run / "up"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [*argv, str(run / "worker.py")], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return proc, run


def _end(node: tuple[subprocess.Popen[str], Path], how: str) -> tuple[int, str]:
    proc, run = node
    try:
        if how == "hang":  # the worker runs: now the agent is stopped, as a teardown stops it
            deadline = time.monotonic() + 120
            while not (run / "up").exists():
                assert time.monotonic() < deadline and proc.poll() is None, "the worker never came up"
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # a failed check: the agent does not outlive the test (its worker ends in 60 s)
            proc.kill()
            proc.communicate()
    return proc.returncode, out


def _last_line(output: str) -> str:
    """The last line that says something, its numbers (pids, times) left out."""
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith("=")]
    return re.sub(r"\d+", "N", lines[-1]) if lines else ""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "extra", "says"),
    [
        ("succeed", (), None),
        ("fail", (), "ChildFailedError"),
        ("hang", (), "SignalException"),
        ("succeed", ("--no-such-flag",), "unrecognized arguments: --no-such-flag"),
    ],
)
def test_the_agent_ends_as_torchrun_does(
    tmp_path: Path, reserve_port: Callable[[], int], how: str, extra: tuple[str, ...], says: str | None
) -> None:
    """Afterwards: the same exit status as torchrun, the same last line, and what it says."""
    ours = _end(_node(AGENT_MODULE, tmp_path, how, *extra, port=reserve_port()), how)
    theirs = _end(_node(TORCHRUN_MODULE, tmp_path, how, *extra, port=reserve_port()), how)
    assert ours[0] == theirs[0], (ours, theirs)
    assert _last_line(ours[1]) == _last_line(theirs[1]), (ours[1][-2000:], theirs[1][-2000:])
    if says is not None:
        assert says in ours[1], ours[1][-2000:]
    else:
        assert ours[0] == 0 and "worker up" in ours[1]


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(3))
def test_two_static_nodes_pass_their_exit_barrier_though_node_0_leaves_at_once(
    tmp_path: Path, reserve_port: Callable[[], int], round_: int
) -> None:
    """Node 0's agent hosts the rendezvous store; it leaves as soon as its exit barrier passed.
    Afterwards: both agents exited 0 and neither logged an error from the barrier or a traceback."""
    port = reserve_port()
    nodes = [_node(AGENT_MODULE, tmp_path, "succeed", nnodes=2, node_rank=n, port=port) for n in (0, 1)]
    ends = [_end(node, "succeed") for node in nodes]
    for code, out in ends:
        assert code == 0, out[-3000:]
        assert "worker up" in out
        assert "Error waiting on exit barrier" not in out and "Traceback" not in out, out[-3000:]


# Node 1's agent as the backend runs it, with a pause between its check-in at the exit barrier and its
# wait there: the window in which node 0 passes the barrier, and (before) left and took the store along.
LATE_WAITER = textwrap.dedent(
    """
    import sys, time
    from torch.distributed.elastic.utils import store
    from airflow_torchrun.backends.local import agent
    check_in = store._barrier_nonblocking
    def late(*args, **kwargs):
        key = check_in(*args, **kwargs)
        time.sleep(1.0)
        return key
    store._barrier_nonblocking = late
    agent._exit_now(agent.main(sys.argv[1:]))
    """
)


@pytest.mark.slow
def test_node_0_waits_for_an_agent_that_is_late_to_its_exit_barrier_wait(
    tmp_path: Path, reserve_port: Callable[[], int]
) -> None:
    """Node 1 checks in at the exit barrier, then pauses a second before its wait on node 0's store.
    Afterwards: both agents exited 0, node 1 logged no barrier error, node 0 did not give up waiting for it."""
    port = reserve_port()
    late = tmp_path / "late_waiter.py"
    late.write_text(LATE_WAITER)
    node0 = _node(AGENT_MODULE, tmp_path, "succeed", nnodes=2, node_rank=0, port=port)
    node1 = _node(AGENT_MODULE, tmp_path, "succeed", nnodes=2, node_rank=1, port=port, program=late)
    (code0, out0), (code1, out1) = _end(node0, "succeed"), _end(node1, "succeed")
    assert code1 == 0 and "Error waiting on exit barrier" not in out1 and "Traceback" not in out1, out1[-3000:]
    assert code0 == 0 and "did not leave their exit barrier" not in out0, out0[-3000:]


@pytest.mark.slow
def test_the_agent_runs_atexit_and_flushes_but_skips_the_teardown(tmp_path: Path) -> None:
    """The exit itself: an atexit handler ran, buffered output came out, an object left for the
    interpreter's teardown was never finalised (the teardown is what it skips), the status is kept."""
    ran, finalised = tmp_path / "atexit-ran", tmp_path / "finalised"
    program = textwrap.dedent(
        f"""
        import atexit, sys
        from airflow_torchrun.backends.local import agent

        class Left:
            def __del__(self, open=open):  # bound now: the teardown clears builtins late
                open({str(finalised)!r}, "w").close()

        left = Left()
        atexit.register(lambda: open({str(ran)!r}, "w").close())
        sys.stdout.write("buffered, not flushed")
        agent._exit_now(3)
        """
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered, not flushed"
    assert ran.exists()
    assert not finalised.exists()
    # Without it (the check itself can fail): a normal exit finalises the object.
    normal = program.replace("agent._exit_now(3)", "sys.exit(3)")
    subprocess.run([sys.executable, "-c", normal], capture_output=True, timeout=60, check=False)
    assert finalised.exists()


def test_the_local_backend_runs_its_agent(tmp_path: Path) -> None:
    """Every node of a local plan runs the agent module; the pure plan keeps torchrun's."""
    spec = GroupSpec(script="train.py", num_nodes=2, nproc_per_node=1)
    plan = LocalBackend(state_dir=tmp_path).plan(spec, GroupIdentity("d", "t", "r"), {})
    assert [node.argv[1:3] for node in plan.nodes] == [("-m", AGENT_MODULE)] * 2


@pytest.mark.slow
def test_a_second_sigterm_does_not_cut_the_agents_shutdown_short(
    tmp_path: Path, reserve_port: Callable[[], int]
) -> None:
    """A teardown signals the agent twice (stop_group reaches every process of the node, and the node's
    supervisor, signalled too, stops its node again). torchrun raises in its signal handler, so the
    second SIGTERM broke off its wait for the worker. Afterwards: the agent left only once its worker
    had finished its save, and said so once (no exception raised while handling the first)."""
    proc, run = _node(AGENT_MODULE, tmp_path, "slow-stop", port=reserve_port())
    try:
        deadline = time.monotonic() + 120
        while not Path(f"{run / 'up'}.armed").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the worker never came up"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        saved_at_exit = Path(f"{run / 'up'}.saved").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert saved_at_exit, out[-3000:]
    assert "During handling of the above exception" not in out, out[-3000:]
    assert "SignalException" in out and proc.returncode == 1, out[-3000:]


@pytest.mark.slow
def test_a_failed_ranks_traceback_is_logged_without_importing_dynamo() -> None:
    """torchrun logs a forked rank's failure with its exception, and torch's log formatter imports
    ``torch._dynamo`` (sympy, inductor: 1.5 s) to format one: every agent of a failed group spent
    that before its exit, and "rank death -> every process gone" went from 0.3 s to 1.9 s
    (bench/bench_group.py). The agent formats the traceback itself; the log reads the same."""
    code = textwrap.dedent(
        """
        import logging, sys
        from torch.distributed import run  # torch's log handlers, as the agent has them
        from airflow_torchrun.backends.local import agent
        agent._tracebacks_without_dynamo()
        try:
            raise RuntimeError("process 0 terminated with exit code 1")
        except RuntimeError:
            logging.getLogger("torch.distributed.elastic.multiprocessing.api").exception("failed (exitcode: %s)", 1)
        print("dynamo imported:", "torch._dynamo" in sys.modules)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "dynamo imported: False" in done.stdout
    lines = done.stderr.splitlines()
    assert any(re.search(r"^E\d{4} .*\] failed \(exitcode: 1\)$", line) for line in lines)
    assert any(line.endswith("] Traceback (most recent call last):") for line in lines), done.stderr
    assert any(line.endswith("] RuntimeError: process 0 terminated with exit code 1") for line in lines), done.stderr


def test_a_static_client_connects_only_once_node_0s_store_listens(
    monkeypatch: pytest.MonkeyPatch, reserve_port: Callable[[], int]
) -> None:
    """torchrun's client would connect at once and, refused, back off for 0.4 to 0.6 s after the store
    is up; the agent's client first waits for node 0's port to listen, so torch finds it up."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous as static

    from airflow_torchrun.backends.local import agent

    monkeypatch.setattr(static.StaticTCPRendezvous, "next_rendezvous", static.StaticTCPRendezvous.next_rendezvous)
    agent._connect_once_node_0_listens()
    port, listening_at_connect = reserve_port(), []

    def recording_store(host: str, port_: int, *args: object, **kwargs: object) -> dist.TCPStore:
        with socket.socket() as probe:
            listening_at_connect.append(probe.connect_ex((host, port_)) == 0)
        return dist.TCPStore(host, port_, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(static, "TCPStore", recording_store)
    joined: list[object] = []
    node_1 = static.StaticTCPRendezvous("127.0.0.1", port, rank=1, world_size=2, run_id="g", timeout=60)
    client = threading.Thread(target=lambda: joined.append(node_1.next_rendezvous()))
    client.start()
    time.sleep(0.3)  # node 0's agent still importing torch
    assert listening_at_connect == [], "node 1 asked torch to connect before node 0's port listened"
    server = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    client.join(timeout=30)
    assert joined and listening_at_connect == [True]
    server.set("k", "v")
    assert node_1._store is not None and node_1._store.get("k") == b"v"


def test_a_static_client_whose_node_0_never_listens_fails_at_the_rendezvous_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wait for node 0's port is the rendezvous's timeout, not one more before torchrun's own, and
    its error is torch's for a store it cannot reach, naming that timeout."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous as static

    from airflow_torchrun.backends.local import agent

    monkeypatch.setattr(static.StaticTCPRendezvous, "next_rendezvous", static.StaticTCPRendezvous.next_rendezvous)
    agent._connect_once_node_0_listens()
    with refusing_port() as port:
        node_1 = static.StaticTCPRendezvous("127.0.0.1", port, rank=1, world_size=2, run_id="g", timeout=3)
        began = time.monotonic()
        with pytest.raises(dist.DistNetworkError, match=r"within the rendezvous timeout of 3 s \(rdzv_timeout\)"):
            node_1.next_rendezvous()
    assert time.monotonic() - began < 3 + 1.5  # torchrun's own connect after it would take 3 s more
    assert node_1._store is None
