"""The local backend's agent (``airflow_torchrun.backends.local.agent``): torchrun, ended without the
interpreter's teardown.

What must hold: for every way a node ends (its workers succeed, one fails, the agent is stopped by
SIGTERM, a bad argument) the agent's exit status and the end of its output are torchrun's own; the
atexit handlers ran and the output was flushed, and the teardown did not run. How much time that
saves is a benchmark's question (``bench/bench_group.py``), not a test's.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from airflow_torchrun.backends.local.backend import AGENT_MODULE, LocalBackend
from airflow_torchrun.naming import GroupIdentity
from airflow_torchrun.spec import GroupSpec
from airflow_torchrun.wiring import TORCHRUN_MODULE

pytestmark = pytest.mark.slow

WORKER = textwrap.dedent(
    """
    import os, sys, time
    how = os.environ["HOW"]
    print("worker up", flush=True)
    if how == "fail":
        raise RuntimeError("the worker failed on purpose")
    if how == "hang":
        time.sleep(120)
    """
)


def _node(module: str, tmp_path: Path, how: str, *extra: str) -> subprocess.Popen[str]:
    argv = [
        sys.executable,
        "-m",
        module,
        "--nnodes=1",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
        "--max-restarts=0",
        "--monitor-interval=0.1",
        *extra,
    ]
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "HOW": how, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([*argv, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _end(proc: subprocess.Popen[str], how: str) -> tuple[int, str]:
    if how == "hang":
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        for line in proc.stdout:  # the worker runs: now the agent is stopped as a teardown would
            if "worker up" in line or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


def _last_line(output: str) -> str:
    """The last line that says something, its numbers (pids, times) left out."""
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith("=")]
    return re.sub(r"\d+", "N", lines[-1]) if lines else ""


@pytest.mark.parametrize(
    ("how", "extra", "says"),
    [
        ("succeed", (), None),
        ("fail", (), "ChildFailedError"),
        ("hang", (), "SignalException"),
        ("succeed", ("--no-such-flag",), "unrecognized arguments: --no-such-flag"),
    ],
)
def test_the_agent_ends_as_torchrun_does(tmp_path: Path, how: str, extra: tuple[str, ...], says: str | None) -> None:
    """Afterwards: the same exit status as torchrun, the same last line, and what it says."""
    ours = _end(_node(AGENT_MODULE, tmp_path, how, *extra), how)
    theirs = _end(_node(TORCHRUN_MODULE, tmp_path, how, *extra), how)
    assert ours[0] == theirs[0], (ours, theirs)
    assert _last_line(ours[1]) == _last_line(theirs[1]), (ours[1][-2000:], theirs[1][-2000:])
    if says is not None:
        assert says in ours[1], ours[1][-2000:]
    else:
        assert ours[0] == 0 and "worker up" in ours[1]


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
