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
import textwrap
import time
from pathlib import Path

import pytest

from airflow_torchrun.backends.local.backend import LocalBackend, rank_start
from airflow_torchrun.backends.local.procs import group_pids
from airflow_torchrun.contract.launch import RANK_START_VAR
from airflow_torchrun.errors import GroupLaunchError
from airflow_torchrun.naming import GroupIdentity
from airflow_torchrun.spec import GroupSpec
from airflow_torchrun.status import Outcome, group_status

LOOKS = textwrap.dedent(
    """
    import sys
    preloaded = "torch" in sys.modules  # before this script imports it
    import atexit, json, logging, os, signal
    import numpy as np
    import torch
    import torch.distributed as dist

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


def _run(tmp_path: Path, script: str, how: str, *, nodes: int = 1, nproc: int = 2):
    """A group of ``nodes`` x ``nproc`` ranks of ``script``, its ranks started ``how``, watched until
    every node's agent has ended by itself (no teardown before: each node's record is whole)."""
    path = tmp_path / "script.py"
    path.write_text(script)
    backend = LocalBackend(tmp_path / "state")
    spec = GroupSpec.create(
        script=str(path),
        script_args=["--flag", "value"],
        num_nodes=nodes,
        nproc_per_node=nproc,
        env={RANK_START_VAR: how, "OUT": str(tmp_path)},
        teardown_grace=3,
    )
    handle = backend.launch(backend.plan(spec, GroupIdentity("d", "t", tmp_path.name), {}), watch_caller=False)
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
