"""Diagnosis and the ranks' launcher for scripts users bring: own failures, command-line errors,
import-time failures, the process group check, ``${TRAIN_CHECKPOINT_DIR}``. Pure functions, and
the launcher run as a real subprocess (no torchrun needed for what it records)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from airflow_torchrun import diagnosis
from airflow_torchrun.contract import checkpoint_dir
from airflow_torchrun.integrations.detect import find_framework_checkpoint
from airflow_torchrun.storage.checkpoints import CheckpointStore
from airflow_torchrun.worker.launch import expand_args

ROOT = Path(__file__).resolve().parent.parent


def _error_file(rank: int, message: str, when: float, **extra: str) -> str:
    info = {"py_callstack": f"Traceback...\n{message}\n", "airflow_torchrun_time": repr(when), "rank": str(rank)}
    return json.dumps({"message": {"message": message, "extraInfo": {**info, **extra}}})


def test_ranks_failing_on_their_own_are_failures_not_collateral():
    reported = [diagnosis.RankFailure(node_rank=n, rank=n, exit_code=1) for n in (0, 1)]
    files = [(n, _error_file(n, "AssertionError: loss is nan", 10.0 + n)) for n in (0, 1)]
    failures = diagnosis.merge(reported, files)
    msg = diagnosis.failure_message("g", failures, node_headline="", log_tail=[], log_path="p")
    assert "rank 0 (node 0) exited with code 1" in msg
    assert "Also failed on their own: rank 1: exit code 1: AssertionError: loss is nan" in msg
    assert "as a consequence" not in msg
    # A real peer loss still is a consequence.
    files[1] = (1, _error_file(1, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1", 9.0))
    msg = diagnosis.failure_message("g", diagnosis.merge(reported, files), node_headline="", log_tail=[], log_path="p")
    assert "Then, as a consequence: rank 1" in msg and "on their own" not in msg


def test_a_command_line_error_leads_and_is_not_retried():
    usage = "error: Unrecognized arguments: --trainer.max_step=3"
    reported = [diagnosis.RankFailure(node_rank=n, rank=n, exit_code=2) for n in (0, 1)]
    files = [(n, _error_file(n, "SystemExit: 2", 5.0 + n, usage_error=usage)) for n in (0, 1)]
    failures = diagnosis.merge(reported, files)
    msg = diagnosis.failure_message("g", failures, node_headline="", log_tail=["usage: ..."], log_path="p")
    first = msg.splitlines()[0]
    assert first == f"Training group g failed: rank 0 (node 0) exited with code 2, a command-line error: {usage}."
    assert not diagnosis.retryable(failures)
    # exit code 2 without a parser's error line is an ordinary, retryable exit
    plain = diagnosis.merge(reported[:1], [(0, _error_file(0, "SystemExit: 2", 5.0))])
    assert diagnosis.retryable(plain)


def test_any_failure_while_importing_is_not_retried():
    reported = [diagnosis.RankFailure(node_rank=0, rank=0, exit_code=1)]
    msg_text = "RuntimeError: operator torchvision::nms does not exist"
    failures = diagnosis.merge(reported, [(0, _error_file(0, msg_text, 5.0, phase="import"))])
    assert not diagnosis.retryable(failures)
    msg = diagnosis.failure_message("g", failures, node_headline="", log_tail=[], log_path="p")
    assert "while the script imported its modules" in msg and "a retry would fail the same way" in msg
    same_at_run_time = diagnosis.merge(reported, [(0, _error_file(0, msg_text, 5.0))])
    assert diagnosis.retryable(same_at_run_time)


def test_clip_ends_at_a_sentence_and_tracebacks_start_on_a_frame():
    text = "First sentence here. " * 5 + "x" * 400
    clipped = diagnosis.clip(text, 120)
    assert clipped.endswith("here. [...]") or clipped.endswith("here. [...]".replace(". ", "."))
    assert "x" not in clipped and len(clipped) <= 130
    assert diagnosis.clip("short", 120) == "short"
    tb = ["Traceback (most recent call last):"]
    for i in range(12):
        tb += [f'  File "s.py", line {i}, in f{i}', f"    call_{i}(x)", "    ^^^^^^^^^"]
    tb.append("ValueError: boom")
    tail = diagnosis.traceback_tail("\n".join(tb), limit=20)
    assert tail[0].lstrip().startswith("File ") and tail[-1] == "ValueError: boom"


def test_agent_tracebacks_fold_into_one_line_across_reads():
    folder = diagnosis.AgentTracebackFolder("node.log")
    shown = [*folder.feed("W1201 some agent warning"), *folder.feed("Traceback (most recent call last):")]
    shown += folder.feed('  File "run.py", line 1, in <module>')
    shown += folder.feed("    main()")  # a second read: still held
    shown += folder.feed("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ")
    shown += folder.feed("====")
    assert shown == [
        "W1201 some agent warning",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:  "
        "(torchrun agent's traceback of 3 lines folded; in full in node.log)",
        "====",
    ]


def test_process_group_problem():
    joined = [{"joined": True, "world_size": 2, "rank_env": str(r)} for r in (0, 1)]
    assert diagnosis.process_group_problem(joined, 2) is None
    assert diagnosis.process_group_problem(None, 2) is None  # nobody can tell: nothing claimed
    alone = [{"joined": False, "rank_env": "0"}, {"joined": False, "rank_env": "1"}]
    said = diagnosis.process_group_problem(alone, 2)
    assert said and "rank(s) 0,1 never joined a process group" in said
    assert "--use_cpu" in said and "ACCELERATE_USE_CPU=1" in said and "init_process_group" in said
    ones = [{"joined": True, "world_size": 1, "rank_env": str(r)} for r in (0, 1)]
    assert "joined one of world size 1" in (diagnosis.process_group_problem(ones, 2) or "")
    assert diagnosis.process_group_problem(alone[:1], 1) is None
    unused = [{"joined": True, "world_size": 2, "collectives": 0, "rank_env": str(r)} for r in (0, 1)]
    assert "rank(s) 0,1 joined it but never communicated through it" in (
        diagnosis.process_group_problem(unused, 2) or ""
    )
    used = [{**r, "collectives": 3} for r in unused]
    assert diagnosis.process_group_problem(used, 2) is None


def test_checkpoint_dir_and_placeholders():
    assert checkpoint_dir("file:///a/b") == "/a/b"
    assert checkpoint_dir("s3://bucket/x") == "s3://bucket/x"
    env = {"TRAIN_CHECKPOINT_DIR": "/c", "TRAIN_RESUME_FROM": ""}
    assert expand_args(["--out=${TRAIN_CHECKPOINT_DIR}/hf", "${TRAIN_RESUME_FROM}", "${HOME}", "$X"], env) == [
        "--out=/c/hf",
        "",
        "${HOME}",
        "$X",
    ]


def test_framework_checkpoints_are_found_under_the_root(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}")
    assert find_framework_checkpoint(store) is None
    (tmp_path / "step-00000010").mkdir()
    (tmp_path / "step-00000010" / "x.ckpt").write_text("not a framework's")
    assert find_framework_checkpoint(store) is None
    hf = tmp_path / "hf" / "checkpoint-6"
    hf.mkdir(parents=True)
    (tmp_path / "hf" / "checkpoint-3").mkdir()  # no trainer_state.json: not a Trainer checkpoint
    (hf / "trainer_state.json").write_text("{}")
    found = find_framework_checkpoint(store)
    assert found and found.framework == "transformers" and found.step == 6 and found.uri.endswith("/hf/checkpoint-6")
    ckpt = tmp_path / "lightning" / "checkpoints" / "epoch=1-step=8.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_text("x")
    os.utime(ckpt, (hf.stat().st_mtime + 5, hf.stat().st_mtime + 5))
    found = find_framework_checkpoint(store)
    assert found and found.to_xcom() == {"uri": f"file://{ckpt}", "step": 8, "framework": "lightning"}


def _launch(tmp_path: Path, source: str, *args: str) -> tuple[subprocess.CompletedProcess[str], dict, dict]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    rank_dir = tmp_path / "rank0"
    rank_dir.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "operators"),
        "TORCHELASTIC_ERROR_FILE": str(rank_dir / "error.json"),
        "RANK": "0",
        "TRAIN_CHECKPOINT_DIR": "/ckpt/dir",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "airflow_torchrun.worker.launch", str(script), *args],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    err = rank_dir / "error.json"
    pg = rank_dir / "process_group.json"
    return (
        proc,
        json.loads(err.read_text()) if err.exists() else {},
        json.loads(pg.read_text()) if pg.exists() else {},
    )


def _stamped(record: dict, *keys: str) -> dict:
    """``record`` without ``keys``, after checking each is a recent epoch time (the timeline's marks)."""
    for key in keys:
        assert isinstance(record.get(key), float) and abs(time.time() - record[key]) < 600, (key, record)
    return {k: v for k, v in record.items() if k not in keys}


@pytest.mark.slow
def test_launcher_records_the_parsers_error_line(tmp_path):
    proc, err, pg = _launch(
        tmp_path,
        """
        import argparse, sys
        p = argparse.ArgumentParser()
        p.add_argument("--out")
        print("out:", p.parse_args().out, flush=True)
        """,
        "--out",
        "${TRAIN_CHECKPOINT_DIR}/x",
    )
    assert proc.returncode == 0 and "out: /ckpt/dir/x" in proc.stdout
    # when the script started is the timeline's ``ranks started``; it never joined a group
    assert _stamped(pg, "started_at") == {"joined": False, "rank_env": "0"}
    proc, err, _ = _launch(tmp_path, "import argparse\nargparse.ArgumentParser(prog='train.py').parse_args()\n", "--x")
    assert proc.returncode == 2 and "usage:" in proc.stderr  # stderr still reaches the log
    extra = err["message"]["extraInfo"]
    assert extra["usage_error"] == "train.py: error: unrecognized arguments: --x"
    assert "phase" not in extra


def test_usage_error_lines():
    from airflow_torchrun.worker.launch import usage_error

    assert usage_error("usage: x\ntrain.py fit: error: argument --lr: invalid float\n") == (
        "train.py fit: error: argument --lr: invalid float"
    )
    assert usage_error("usage: ...\ntip: run --help\nerror: Unrecognized arguments: --x\n") == (
        "error: Unrecognized arguments: --x"
    )
    assert usage_error("Traceback...\nValueError: no error here\n") is None


@pytest.mark.slow
def test_launcher_marks_failures_of_module_level_imports(tmp_path):
    (tmp_path / "brokenlib.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    _, err, _ = _launch(tmp_path, "import os\nimport brokenlib\n")
    assert err["message"]["message"].startswith("RuntimeError: operator torchvision::nms")
    assert err["message"]["extraInfo"]["phase"] == "import"
    _, err, _ = _launch(tmp_path, "def main():\n    raise RuntimeError('later')\nmain()\n")
    assert "phase" not in err["message"]["extraInfo"]


@pytest.mark.slow
def test_launcher_records_the_process_group_the_script_joined(tmp_path, monkeypatch, reserve_port):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(reserve_port()))
    monkeypatch.setenv("WORLD_SIZE", "1")
    proc, _, pg = _launch(
        tmp_path,
        """
        from torch.distributed import init_process_group, destroy_process_group
        import torch
        from torch.distributed import all_reduce
        init_process_group("gloo")
        all_reduce(torch.ones(1))
        destroy_process_group()
        """,
    )
    assert proc.returncode == 0, proc.stderr
    # destroy_process_group() came first: what ran on the group is noted before it goes away
    stamps = {key: pg[key] for key in ("started_at", "joined_at") if key in pg}
    assert _stamped(pg, "started_at", "joined_at") == {
        "joined": True,
        "rank": 0,
        "world_size": 1,
        "backend": "gloo",
        "collectives": 1,
        "rank_env": "0",
    }
    assert stamps["started_at"] <= stamps["joined_at"]  # the group stood after the script started
