"""Save on SIGTERM: the example trainer under torchrun (2 real gloo ranks), SIGTERM to the agent at
a random step (torchrun forwards it to the workers), then a resumed run.

What must hold: the ranks agree at the next step boundary and commit that step (marker
``"stopped": true``) within the grace period, the ranks exit with the "stopped to save" code, no
completed step is lost, and the resumed run ends with the uninterrupted run's weights, bit for bit.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from airflow_torchrun.contract import STOPPED_TO_SAVE_EXIT_CODE
from airflow_torchrun.diagnosis import RankFailure
from airflow_torchrun.storage.checkpoints import CheckpointStore
from tests.conftest import once_per_run

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
TRAINER = ROOT / "images" / "trainer" / "train.py"
# Long enough (about 2500 steps, 15-20 s here) to signal it well before the end even when finding
# the group's processes takes seconds on a loaded machine (with 1000 steps a CI run once finished
# training before the signal landed); no periodic checkpoint at all, so the only step a resume can
# start from is the one saved on SIGTERM.
ARGS = [str(TRAINER), "--epochs", "100", "--hidden", "256", "--checkpoint-every", "0", "--log-every", "1"]
FINAL = re.compile(r"FINAL step=(\d+) weights_sha256=([0-9a-f]{64})")
PROGRESS = re.compile(r"rank0 train INFO step (\d+)/(\d+)")
GRACE_S = 10.0  # teardown_grace's default
CONTRACT_VARS = ("TRAIN_CHECKPOINT_URI", "TRAIN_RESUME_FROM", "TRAIN_CHECKPOINT_LINEAGE")


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CONTRACT_VARS}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def _torchrun_cmd(folder: Path, args: list[str] | None = None) -> list[str]:
    """Bare torchrun; its logs in ``folder`` (without --log-dir it leaves a folder in /tmp each run)."""
    logs = f"--log-dir={folder / 'torchrun-logs'}"
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", logs, *(args or ARGS)]


def _final(out: str) -> tuple[int, str]:
    match = FINAL.search(out)
    assert match, out[-5000:]
    return int(match.group(1)), match.group(2)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str]:
    """The trainer's run of ``ARGS`` without a signal (2 ranks): its step count and final digest, what
    both tests' resumed runs must end with. Once per run (``once_per_run``: the same for every worker)."""

    def run(folder: Path) -> list[object]:
        done = subprocess.run(
            _torchrun_cmd(folder),
            env=_env({"TRAIN_CHECKPOINT_URI": f"file://{folder}/straight"}),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-5000:]
        return list(_final(done.stdout + done.stderr))

    total, digest = once_per_run(tmp_path_factory, "sigterm-trainer-straight", run)
    return int(total), str(digest)


def test_sigterm_saves_the_next_step_and_the_resume_is_bit_identical(tmp_path: Path, straight: tuple[int, str]) -> None:
    total, digest = straight
    root = f"file://{tmp_path}/stopped"
    target = random.Random().randint(50, total - 200)
    proc = subprocess.Popen(
        _torchrun_cmd(tmp_path),
        env=_env({"TRAIN_CHECKPOINT_URI": root}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    seen: list[str] = []
    last_done = 0
    signalled_at = 0.0
    try:
        for line in proc.stdout:
            seen.append(line)
            match = PROGRESS.search(line)
            if match and int(match.group(1)) >= target:
                last_done = int(match.group(1))
                signalled_at = time.time()
                proc.send_signal(signal.SIGTERM)  # the agent; torchrun forwards it to its workers
                break
        assert signalled_at, "".join(seen)[-5000:]
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(seen) + rest
    assert proc.returncode != 0, out[-3000:]
    assert "FINAL" not in out

    store = CheckpointStore(root)
    committed = store.committed()
    assert len(committed) == 1, out[-5000:]
    saved = committed[0].step
    marker = store.read_marker(saved)
    assert marker["stopped"] is True and store.verify(saved) == []
    # The next step boundary after the signal: no completed step is lost (the one in flight at most;
    # the ranks may be a few steps past what their output showed when the signal was sent).
    assert last_done <= saved, (last_done, saved)
    assert marker["committed_at"] - signalled_at < GRACE_S, marker["committed_at"] - signalled_at
    assert "Stopped to save: checkpoint" in out
    # (torchrun's agent, itself signalled, prints no summary of its workers' exit codes.)
    assert f"exiting with code {STOPPED_TO_SAVE_EXIT_CODE}" in out
    # The operator's diagnosis counts it as collateral and retryable, with its own wording.
    failure = RankFailure(node_rank=0, rank=0, exit_code=STOPPED_TO_SAVE_EXIT_CODE)
    assert failure.collateral and failure.retryable and "stopped to save a checkpoint" in failure.headline()

    resumed = subprocess.run(
        _torchrun_cmd(tmp_path / "resumed"),
        env=_env({"TRAIN_CHECKPOINT_URI": root, "TRAIN_RESUME_FROM": committed[0].uri}),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert f"at step {saved}" in resumed.stdout + resumed.stderr
    assert _final(resumed.stdout + resumed.stderr) == (total, digest)


def _digest(log: str) -> str:
    found = FINAL.findall(log)
    assert found, "the trainer printed no FINAL line"
    return str(found[-1][1])


def _train_task(**kwargs: object) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return f"""
    DistributedTrainingOperator(
        task_id="train", script={str(TRAINER)!r}, num_nodes=2, nproc_per_node=1, track=False,
        script_args={ARGS[1:]!r}, retry_delay=timedelta(0), {args}
    )
    """


def test_a_group_torn_down_mid_run_saves_and_the_retry_resumes_bit_identical(
    run_dag: object, straight: tuple[int, str]
) -> None:
    """The operator's own teardown (stop_group: SIGTERM to every process, SIGKILL after the grace)
    at a random step: the ranks save the next step boundary, the retry resumes from it, and ends
    with the weights of the run without a signal."""
    from airflow_torchrun.backends.local.procs import group_pids, stop_group

    _total, digest = straight

    state_dir = Path(os.environ["AIRFLOW__TORCHRUN__STATE_DIR"])
    earlier = set((state_dir / "groups").glob("*"))
    target = random.Random().randint(50, 600)
    stopped: dict[str, object] = {}

    def watch() -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not stopped:
            for node_log in (state_dir / "groups").glob("*/node-0/node.log"):
                if node_log.parent.parent in earlier:
                    continue
                steps = [int(m) for m in re.findall(r"step (\d+)/\d+", node_log.read_text(errors="replace"))]
                if steps and max(steps) >= target:
                    group_id = node_log.parent.parent.name
                    pids = group_pids(group_id)
                    if not pids:
                        continue  # not found this time: look again
                    stopped.update(group=group_id, last_done=max(steps), at=time.time(), pids=pids)
                    stopped["killed"] = stop_group(group_id, grace=GRACE_S)
                    return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    result = run_dag(_train_task(retries=1), imports="from datetime import timedelta")  # type: ignore[operator]
    thread.join(timeout=5)
    assert stopped, "the group was never stopped"
    assert result.state == "success", result.log[-6000:]
    interesting = r"[Rr]elaunch|resuming|Stopped to save|torn down|fresh start|failed|nodes:|Launched"
    story = "\n".join(line[:300] for line in result.log.splitlines() if re.search(interesting, line))
    assert result.try_number("train") == 2, (stopped, story[-3000:])
    assert "Stopped to save: checkpoint" in result.log
    match = re.search(r"resuming from \S+/step-0*(\d+) \(step (\d+)\)", result.log)
    assert match, result.log[-6000:]
    saved = int(match.group(2))
    # No completed step is lost (the ranks may be a few steps past what their log showed).
    assert saved >= int(str(stopped["last_done"])), (stopped, saved)
    assert _digest(result.node_logs("train")) == digest


def test_killing_the_task_saves_a_checkpoint_first(run_dag: object) -> None:
    """``on_kill`` (the task cleared or marked failed in the UI) is a SIGTERM teardown: ranks that
    call ``save_if_stopping`` commit the step in progress before they go, so the next try of the
    task resumes from there; nothing is left running."""
    from airflow_torchrun.backends.local.procs import group_pids

    state_dir = Path(os.environ["AIRFLOW__TORCHRUN__STATE_DIR"])
    earlier = set((state_dir / "groups").glob("*"))
    seen: dict[str, object] = {}
    done = threading.Event()

    def kill_when_training() -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not done.is_set():
            for node_log in (state_dir / "groups").glob("*/node-0/node.log"):
                if node_log.parent.parent in earlier:
                    continue
                steps = [int(m) for m in re.findall(r"step (\d+)/\d+", node_log.read_text(errors="replace"))]
                if steps and max(steps) >= 50:
                    handler = signal.getsignal(signal.SIGTERM)
                    seen.update(group=node_log.parent.parent.name, last_done=max(steps), handler=handler)
                    # What Airflow's task runner receives when the task is killed from the UI; sent
                    # only to its handler (a signal this process does not handle would end the
                    # pytest worker, and xdist then waits for ever on the worker that replaces it).
                    if callable(handler):
                        os.kill(os.getpid(), signal.SIGTERM)
                    return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_when_training, daemon=True)
    killer.start()
    try:
        result = run_dag(_train_task(retries=0), imports="from datetime import timedelta")  # type: ignore[operator]
    finally:
        done.set()  # never a signal into a later test of this worker
        killer.join(5)
    assert seen, "training never reached step 50"
    assert callable(seen["handler"]), f"no SIGTERM handler in the task's process: {seen['handler']!r}"
    assert result.state == "failed"  # type: ignore[attr-defined]
    log = result.log  # type: ignore[attr-defined]
    assert "on_kill: tearing down group" in log
    node_log = (state_dir / "groups" / str(seen["group"]) / "node-0" / "node.log").read_text()
    match = re.search(r"Stopped to save: checkpoint (\S+) \(step (\d+)\) committed", node_log)
    assert match, node_log[-4000:]
    uri, step = match.group(1), int(match.group(2))
    store = CheckpointStore(uri.rpartition("/")[0])
    assert store.read_marker(step)["stopped"] is True and store.verify(step) == []
    assert step >= int(str(seen["last_done"]))
    assert group_pids(str(seen["group"])) == []


def test_async_saves_and_the_stop_flag_do_not_deadlock(tmp_path: Path) -> None:
    """save_if_stopping's all-reduce (main thread, every step) and an async save's collectives (its
    thread) once shared one gloo group and paired different operations across ranks: the trainer
    with --async-checkpoint hung at its first save. 110 steps, saves at 50 and 100."""
    args = [str(TRAINER), "--epochs", "5", "--checkpoint-every", "50", "--async-checkpoint", "--log-every", "1000"]
    proc = subprocess.run(
        _torchrun_cmd(tmp_path, args),
        env=_env({"TRAIN_CHECKPOINT_URI": f"file://{tmp_path}/async"}),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    total, _ = _final(proc.stdout + proc.stderr)
    store = CheckpointStore(f"file://{tmp_path}/async")
    assert store.read_marker(50) and store.read_marker(100) and store.read_marker(total)


# Ranks with steps of a fraction of a millisecond: rank 1 alone is signalled at STOP_AT; both count
# the all-reduces of the stop flag's own group.
FAST_STEPS = """
import os, signal, sys, torch, torch.distributed as dist
from airflow_torchrun.worker import save_if_stopping
from airflow_torchrun.worker.checkpoint.comm import stop_group

dist.init_process_group("gloo")
rank = dist.get_rank()
reduce, flags = dist.all_reduce, []
def counted(tensor, *args, group=None, **kwargs):
    if group is not None and group is stop_group():
        flags.append(1)
    return reduce(tensor, *args, group=group, **kwargs)
dist.all_reduce = counted
weights = torch.zeros(4)
for step in range(1, int(sys.argv[1]) + 1):
    weights += 1
    if rank == 1 and step == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGTERM)
    print(f"rank {rank} step {step} flags {len(flags)}", flush=True)
    save_if_stopping(lambda: {"weights": weights.clone()}, step)
print(f"rank {rank} finished", flush=True)
"""


def test_the_stop_flag_is_agreed_on_without_a_collective_every_step(tmp_path: Path) -> None:
    """Fast steps are not each held up by the stop flag's all-reduce (it cost the example trainer a
    quarter of its training time), and a SIGTERM to one rank still makes every rank save the same
    step, later than the signal, and exit with the "stopped to save" code."""
    script = tmp_path / "fast_steps.py"
    script.write_text(FAST_STEPS)
    steps, stop_at = 4000, 3000
    proc = subprocess.run(
        _torchrun_cmd(tmp_path, [str(script), str(steps), str(stop_at)]),
        env=_env({"TRAIN_CHECKPOINT_URI": f"file://{tmp_path}/ckpt"}),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "finished" not in out, out[-3000:]
    assert f"exiting with code {STOPPED_TO_SAVE_EXIT_CODE}" in out, out[-3000:]
    committed = CheckpointStore(f"file://{tmp_path}/ckpt").committed()
    assert len(committed) == 1, out[-3000:]
    saved = committed[0].step
    assert stop_at <= saved < stop_at + 200, saved
    # Both ranks stepped to the saved step and no further.
    for rank in (0, 1):
        last = max(int(m) for m in re.findall(rf"rank {rank} step (\d+) ", out))
        assert last == saved, (rank, last, saved)
    # Each step once agreed on: 3000 all-reduces. At most one per 8 steps once the pace is known.
    flags = max(int(m) for m in re.findall(r"rank 0 step \d+ flags (\d+)", out))
    assert flags <= saved // 8, (flags, saved)
