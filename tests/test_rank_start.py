"""How the local backend's agents start their ranks: forked, torch imported (the default), or exec'd
as torchrun does (``[torchrun] local_rank_start = exec``, or a task's
``env={"AIRFLOW_TORCHRUN_RANK_START": "exec"}``).

A forked rank must be what a new interpreter is to the user's script, torch's import aside: its
signal handlers, atexit functions, logging, ``sys.argv``/``sys.path``, thread count and numpy's
global seed, and at its end its exit status, traceback and error file. Each test runs both ways
and asks for the same answers.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from airflow_torchrun.backends.local.backend import LocalBackend, rank_start
from airflow_torchrun.backends.local.procs import group_pids
from airflow_torchrun.contract.launch import RANK_START_VAR
from airflow_torchrun.errors import GroupLaunchError
from airflow_torchrun.naming import GroupIdentity
from airflow_torchrun.spec import GroupSpec
from airflow_torchrun.status import Outcome, group_status
from tests.conftest import unique_run

LOOKS = textwrap.dedent(
    """
    import sys
    preloaded = "torch" in sys.modules  # before this script imports it
    import atexit, faulthandler, json, logging, os, signal
    import numpy as np
    import torch
    import torch.distributed as dist

    child = os.fork()  # a process of the script's own, which ends through the launcher as itself
    if child == 0:
        sys.exit(0)
    _, status = os.waitpid(child, 0)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = os.environ["OUT"]
    atexit.register(lambda: open(f"{out}/atexit-{rank}", "w").write("ran"))
    looks = {
        "rank": rank,
        "preloaded": preloaded,
        "argv": sys.argv,
        "path0": sys.path[0],
        "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "sighup": signal.getsignal(signal.SIGHUP) == signal.SIG_DFL,
        "root_handlers": len(logging.getLogger().handlers),
        "threads": torch.get_num_threads(),
        "omp": os.environ["OMP_NUM_THREADS"],
        "numpy": int(np.random.randint(1 << 30)),
        "main": __name__,
        "init_wrapped": hasattr(dist.init_process_group, "__wrapped__"),
        "faulthandler": faulthandler.is_enabled(),
        "child_status": status,
    }
    with open(f"{out}/looks-{rank}.json", "w") as fp:
        json.dump(looks, fp)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    """
)

ENDS = textwrap.dedent(
    """
    import os, sys
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        sys.exit(7)
    raise ValueError("rank one says boom")
    """
)


def _launch(tmp_path: Path, script: str, how: str, *, nodes: int = 1, nproc: int = 2, **env: str):
    """A group of ``nodes`` x ``nproc`` ranks of ``script``, its ranks started ``how``."""
    path = tmp_path / "script.py"
    path.write_text(script)
    backend = LocalBackend(tmp_path / "state")
    spec = GroupSpec.create(
        script=str(path),
        script_args=["--flag", "value"],
        num_nodes=nodes,
        nproc_per_node=nproc,
        env={RANK_START_VAR: how, "OUT": str(tmp_path), **env},
        teardown_grace=3,
    )
    # A group id of its own (a teardown stops every process of its group id), named for the test's
    # folder and ``how`` to be found among the state's groups.
    identity = GroupIdentity("d", "t", unique_run(f"{tmp_path.name}-{how}"))
    handle = backend.launch(backend.plan(spec, identity, {}), watch_caller=False)
    return backend, handle, path


def _run(tmp_path: Path, script: str, how: str, *, nodes: int = 1, nproc: int = 2):
    """:func:`_launch`, watched until every node's agent has ended by itself (no teardown before:
    each node's record is whole)."""
    backend, handle, path = _launch(tmp_path, script, how, nodes=nodes, nproc=nproc)
    exits = [Path(handle.group_dir) / f"node-{n}" / "exit.json" for n in range(nodes)]
    deadline = time.monotonic() + 120
    try:
        while not all(e.exists() for e in exits) and time.monotonic() < deadline:
            time.sleep(0.1)
        status = group_status(
            backend.observe(handle), launched_at=handle.launched_at, now=time.time(), startup_timeout=60
        )
    finally:
        backend.teardown(handle)
    assert group_pids(handle.group_id) == []
    return backend, handle, status, path


@pytest.mark.slow
@pytest.mark.parametrize("how", ["fork", "exec"])
def test_a_rank_sees_what_a_new_interpreter_would_torch_aside(tmp_path: Path, how: str) -> None:
    _, handle, status, script = _run(tmp_path, LOOKS, how)
    assert status.state is Outcome.SUCCEEDED, status
    looks = [json.loads((tmp_path / f"looks-{r}.json").read_text()) for r in (0, 1)]
    for seen in looks:
        assert seen["preloaded"] is (how == "fork"), seen  # the one difference, and the point of forking
        assert seen["argv"] == [str(script), "--flag", "value"]
        assert seen["path0"] == str(script.parent)
        assert seen["sigterm"] and seen["sigint"] and seen["sighup"], seen
        assert seen["root_handlers"] == 0
        assert seen["threads"] == int(seen["omp"]), seen
        assert seen["main"] == "__main__"
        assert seen["init_wrapped"], "the launcher's watch of init_process_group is missing"
        assert seen["faulthandler"] is False and seen["child_status"] == 0, seen
    assert looks[0]["numpy"] != looks[1]["numpy"], "numpy's global seed is shared between ranks"
    # the script's atexit functions ran, as at a new interpreter's exit
    assert (tmp_path / "atexit-0").read_text() == "ran" and (tmp_path / "atexit-1").read_text() == "ran"
    # the launcher's record of the process group, beside torchrun's error file
    records = sorted(Path(handle.group_dir).glob("node-0/torchrun/*/attempt_0/*/process_group.json"))
    assert [json.loads(r.read_text())["joined"] for r in records] == [True, True]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["fork", "exec"])
def test_a_ranks_end_is_a_processes_end(tmp_path: Path, how: str) -> None:
    """``sys.exit(7)`` is exit code 7, an uncaught exception exit code 1 with its traceback in the
    rank's output and the launcher's error file; the supervisor names each rank. Two nodes of one
    rank each: each agent sees only its own rank end."""
    backend, handle, status, script = _run(tmp_path, ENDS, how, nodes=2, nproc=1)
    assert status.state is Outcome.FAILED, status
    group = Path(handle.group_dir)
    for node, code in ((0, 7), (1, 1)):
        (worker,) = json.loads((group / f"node-{node}" / "workers.json").read_text())["workers"]
        assert (worker["rank"], worker["local_rank"], worker["exit_code"]) == (node, 0, code), worker
    log = Path(backend.log_locations(handle)[1]).read_text()
    assert "ValueError: rank one says boom" in log and 'raise ValueError("rank one says boom")' in log, log
    (error_0,) = group.glob("node-0/torchrun/*/attempt_0/0/error.json")
    (error_1,) = group.glob("node-1/torchrun/*/attempt_0/0/error.json")
    assert json.loads(error_0.read_text())["message"]["message"] == "SystemExit: 7"
    assert json.loads(error_1.read_text())["message"]["message"] == "ValueError: rank one says boom"
    assert str(script) in json.loads(error_1.read_text())["message"]["extraInfo"]["py_callstack"]


ENDS_LIKE_PYTHON = textwrap.dedent(
    """
    import ctypes, os, signal, sys, threading, time
    import torch.distributed as dist

    out = os.environ["OUT"]
    rank = int(os.environ["RANK"])
    def late():  # a background save still being written when the script fails
        time.sleep(0.5)
        open(f"{out}/thread-{rank}", "w").write("done")
    threading.Thread(target=late).start()
    ctypes.CDLL(None).printf(b"C-LEVEL-OUTPUT rank=%d\\n", rank)  # C's stdio: buffered in a file
    if os.environ.get("WAIT_FOR_A_SIGNAL"):
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda n, _: (open(f"{out}/got-{signal.Signals(n).name}-{rank}", "w"), sys.exit(75)))
        open(f"{out}/waiting-{rank}", "w").close()
        while True:
            time.sleep(0.05)
    sys.exit(3)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["fork", "exec"])
def test_a_failing_rank_joins_its_threads_and_flushes_c_output_first(tmp_path: Path, how: str) -> None:
    backend, handle, _, _ = _run(tmp_path, ENDS_LIKE_PYTHON, how, nodes=1, nproc=1)
    (worker,) = json.loads((Path(handle.group_dir) / "node-0" / "workers.json").read_text())["workers"]
    assert worker["exit_code"] == 3, worker
    assert (tmp_path / "thread-0").read_text() == "done"
    assert "C-LEVEL-OUTPUT rank=0" in Path(backend.log_locations(handle)[0]).read_text()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["fork", "exec"])
def test_a_rank_whose_agent_is_killed_gets_sigterm_from_the_supervisor(tmp_path: Path, how: str) -> None:
    """No signal on its agent's death (torch's fork wrapper asks for SIGINT): the node's supervisor
    stops the orphan with SIGTERM, so a save on stop still runs, as for an exec'd rank."""
    backend, handle, _ = _launch(tmp_path, ENDS_LIKE_PYTHON, how, nproc=1, WAIT_FOR_A_SIGNAL="1")
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "waiting-0").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        agent = json.loads((Path(handle.group_dir) / "node-0" / "supervisor.json").read_text())["agent_pid"]
        os.kill(agent, signal.SIGKILL)
        exit_file = Path(handle.group_dir) / "node-0" / "exit.json"
        while not exit_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        backend.teardown(handle)
    assert group_pids(handle.group_id) == []
    assert (tmp_path / "got-SIGTERM-0").exists() and not (tmp_path / "got-SIGINT-0").exists()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["fork", "exec"])
def test_ranks_that_fail_at_once_are_each_recorded_once(tmp_path: Path, how: str) -> None:
    """A forked rank can be gone within milliseconds, before the supervisor's next look: it is then
    a zombie of its agent, whose exit status is still there to read (it was skipped, and the node's
    failure named no rank)."""
    _, handle, status, _ = _run(tmp_path, "import sys\nsys.exit(5)\n", how, nodes=1, nproc=2)
    assert status.state is Outcome.FAILED, status
    workers = json.loads((Path(handle.group_dir) / "node-0" / "workers.json").read_text())["workers"]
    assert sorted(w["rank"] for w in workers) == [0, 1], workers  # each named, each once
    # the one seen first with its own code; the other may have been stopped by then (SIGTERM)
    assert {w["exit_code"] for w in workers} <= {5, -15} and 5 in {w["exit_code"] for w in workers}, workers
    first = json.loads((Path(handle.group_dir) / "node-0" / "rank-failed.json").read_text())
    assert first["rank"] in (0, 1) and first["exit_code"] == 5, first


def test_an_agent_with_the_cuda_driver_loaded_does_not_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's LaunchConfig asks torch.cuda.is_available(): asked NVML's way, which leaves CUDA
    uninitialised; should the driver be loaded all the same, the ranks are exec'd (a forked one
    could not use CUDA)."""
    from torch.distributed import run

    from airflow_torchrun.backends.local import agent
    from airflow_torchrun.contract.launch import WORKER_ENTRY
    from airflow_torchrun.worker import launch

    asked: list[str | None] = []

    def torchruns(args: object) -> tuple[object, str, list[str]]:
        asked.append(os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"))
        return types.SimpleNamespace(start_method="spawn"), sys.executable, ["-u", "-m", WORKER_ENTRY, "s.py", "--x"]

    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    monkeypatch.delenv(RANK_START_VAR, raising=False)
    monkeypatch.delenv("AIRFLOW_TORCHRUN_RANKS_FILE", raising=False)
    monkeypatch.setattr(run, "config_from_args", torchruns)
    agent._fork_our_ranks()
    config, entry, args = run.config_from_args(None)
    assert (config.start_method, entry, args) == ("fork", launch.forked, ["s.py", "--x"])
    assert asked == ["1"] and "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ
    lib = "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libcuda.so.1\n"
    runtime = "7f00-7f01 r-xp 00000000 08:01 1 /venv/nvidia/cuda_runtime/lib/libcudart.so.12\n"
    assert not agent.cuda_untouched(lib) and agent.cuda_untouched(runtime) and agent.cuda_untouched("")
    monkeypatch.setattr(agent, "cuda_untouched", lambda: False)
    config, entry, args = run.config_from_args(None)
    assert (config.start_method, entry) == ("spawn", sys.executable), "forked after CUDA was initialised"


def test_a_rank_that_ended_before_its_agent_named_it_is_named_later(tmp_path: Path) -> None:
    from airflow_torchrun.backends.local.supervisor import _WorkerWatch

    ranks = tmp_path / "ranks.json"
    watch = _WorkerWatch(agent_pid=0, ranks_file=str(ranks))
    watch.outcomes.append({"pid": 4242, "rank": None, "local_rank": None, "exit_code": 2, "signal": None})
    assert watch.backfill() is False  # not recorded yet
    ranks.write_text(json.dumps({"4242": [3, 1]}))
    assert watch.backfill() is True
    assert (watch.outcomes[0]["rank"], watch.outcomes[0]["local_rank"]) == (3, 1)
    assert watch.backfill() is False


def test_the_rank_start_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__TORCHRUN__LOCAL_RANK_START", "Exec")
    assert rank_start() == "exec"
    monkeypatch.setenv("AIRFLOW__TORCHRUN__LOCAL_RANK_START", "spawn")
    with pytest.raises(GroupLaunchError, match=r"local_rank_start = 'spawn': give one of fork, exec"):
        rank_start()
    monkeypatch.delenv("AIRFLOW__TORCHRUN__LOCAL_RANK_START")
    assert rank_start() == "fork"
    spec = GroupSpec.create(script=__file__, env={RANK_START_VAR: "vfork"})
    assert LocalBackend.spec_problems(spec) == [f"env {RANK_START_VAR}='vfork': give one of fork, exec"]
    assert LocalBackend.spec_problems(GroupSpec.create(script=__file__, env={RANK_START_VAR: "exec"})) == []


def test_the_plan_tells_each_agent_how_to_start_its_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = LocalBackend(tmp_path)
    identity = GroupIdentity("d", "t", "r")
    spec = GroupSpec.create(script=__file__, num_nodes=2)
    assert {n.env[RANK_START_VAR] for n in backend.plan(spec, identity, {}).nodes} == {"fork"}
    monkeypatch.setenv("AIRFLOW__TORCHRUN__LOCAL_RANK_START", "exec")
    assert {n.env[RANK_START_VAR] for n in backend.plan(spec, identity, {}).nodes} == {"exec"}
    monkeypatch.delenv("AIRFLOW__TORCHRUN__LOCAL_RANK_START")
    task_says = GroupSpec.create(script=__file__, num_nodes=2, env={RANK_START_VAR: "exec"})
    assert {n.env[RANK_START_VAR] for n in backend.plan(task_says, identity, {}).nodes} == {"exec"}
    assert os.environ.get(RANK_START_VAR) is None
