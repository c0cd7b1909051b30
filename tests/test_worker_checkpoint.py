"""save_checkpoint / load_checkpoint inside ranks: one process, 2 real gloo ranks under torchrun,
a rank killed mid-save, and the example trainer resumed bit-exactly after a killed rank."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from airflow_torchrun.errors import StorageError
from airflow_torchrun.storage.checkpoints import COMMIT_MARKER, CheckpointRef, CheckpointStore
from airflow_torchrun.worker import load_checkpoint, resume_step, save_checkpoint, wait_for_checkpoint
from airflow_torchrun.worker.checkpoint.files import MAPPED_FILE_SYSTEMS, file_system_of
from tests.s3_fixtures import MotoS3, reachable

ROOT = Path(__file__).resolve().parent.parent
TRAINER = ROOT / "images" / "trainer" / "train.py"
CONTRACT_VARS = ("TRAIN_CHECKPOINT_URI", "TRAIN_RESUME_FROM", "TRAIN_CHECKPOINT_KEEP_LAST")


@dataclass
class Location:
    uri: str
    env: dict[str, str]  # what a rank needs to reach it

    def store(self) -> CheckpointStore:
        return CheckpointStore(self.uri, _options_from(self.env))


def _options_from(env: dict[str, str]) -> dict[str, Any]:
    return {"endpoint_url": env["AWS_ENDPOINT_URL"]} if "AWS_ENDPOINT_URL" in env else {}


@pytest.fixture(params=["file", "s3"])
def location(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Location:
    for name in CONTRACT_VARS:
        monkeypatch.delenv(name, raising=False)
    if request.param == "file":
        return Location(uri=f"file://{tmp_path}/ckpt", env={})
    moto: MotoS3 = request.getfixturevalue("moto_s3")
    for key, value in moto.env().items():
        monkeypatch.setenv(key, value)
    return Location(uri=f"s3://{moto.make_bucket()}/run", env=moto.env())


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (*CONTRACT_VARS, "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _draws() -> list[Any]:
    return [torch.rand(4).tolist(), random.random(), float(np.random.rand())]


def _seed(value: int) -> None:
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value)


# -- one process, no process group ----------------------------------------------------------------
def test_round_trip_restores_state_step_and_rng(location: Location, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAIN_CHECKPOINT_URI", location.uri)
    _seed(1)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "extra": {"epoch": 3, "tag": "x"}}

    uri = save_checkpoint(state, 7, meta={"epoch": 3})
    after_save = _draws()
    store = location.store()
    assert uri == f"{store.uri}/step-00000007"
    assert store.latest() == CheckpointRef(uri, 7)
    marker = store.read_marker(7)
    assert (marker["format"], marker["world_size"], marker["epoch"]) == ("torch", 1, 3)
    assert set(marker["files"]) == {"state.pt"}  # with every rank's RNG states inside

    assert load_checkpoint() is None  # fresh start: TRAIN_RESUME_FROM unset
    assert resume_step() == 0
    monkeypatch.setenv("TRAIN_RESUME_FROM", uri)
    _seed(999)  # what a new process would have
    loaded = load_checkpoint()
    assert loaded is not None
    restored = _draws()
    assert restored[0] == after_save[0]  # torch
    assert restored[2] == after_save[2]  # numpy
    if location.uri.startswith("file:"):
        # moto's server runs in this process and draws from `random` for its request ids, so the
        # python stream is compared here only for file://; the 2-rank test compares it on S3.
        assert restored[1] == after_save[1]
    assert resume_step() == 7
    assert loaded["extra"] == {"epoch": 3, "tag": "x"}
    for key, value in state["model"].items():
        assert torch.equal(loaded["model"][key], value)
    fresh = torch.optim.Adam(torch.nn.Linear(8, 4).parameters())
    fresh.load_state_dict(loaded["optimizer"])
    assert fresh.state_dict()["state"][0]["step"] == 1


def test_retention_from_env_never_deletes_the_resumed_checkpoint(location: Location, clean_env: Any) -> None:
    clean_env.setenv("TRAIN_CHECKPOINT_URI", location.uri)
    clean_env.setenv("TRAIN_CHECKPOINT_KEEP_LAST", "2")
    first = save_checkpoint({"x": torch.ones(2)}, 1)
    clean_env.setenv("TRAIN_RESUME_FROM", first)
    for step in (2, 3, 4, 5):
        save_checkpoint({"x": torch.ones(2) * step}, step)
    assert [r.step for r in location.store().committed()] == [1, 4, 5]


def test_saving_the_resumed_step_again_keeps_it(tmp_path: Path, clean_env: Any) -> None:
    root = f"file://{tmp_path}/ckpt"
    uri = save_checkpoint({"x": torch.zeros(3)}, 3, uri=root)
    marker = Path(tmp_path / "ckpt" / "step-00000003" / COMMIT_MARKER)
    before = marker.stat().st_mtime_ns
    clean_env.setenv("TRAIN_RESUME_FROM", uri)
    assert save_checkpoint({"x": torch.ones(3)}, 3, uri=root) == uri
    assert marker.stat().st_mtime_ns == before
    loaded = load_checkpoint()
    assert loaded is not None
    assert torch.equal(loaded["x"], torch.zeros(3))


def test_a_torn_leftover_is_written_beside_not_listed(tmp_path: Path, clean_env: Any) -> None:
    torn = tmp_path / "ckpt" / "step-00000004"
    torn.mkdir(parents=True)
    (torn / "junk-from-a-dead-try.bin").write_bytes(b"x")
    (torn / "state.pt").write_bytes(b"half")  # what a dead (or still running) writer left
    store = CheckpointStore(str(tmp_path / "ckpt"))
    assert store.latest() is None
    uri = save_checkpoint({"x": torch.ones(1)}, 4, uri=str(tmp_path / "ckpt"))
    marker = store.read_marker(4)
    # The marker names only what this writer wrote, under a name of its own: nothing it did not
    # write is listed, overwritten or deleted (another writer may still be at work there).
    assert list(marker["files"]) == [marker["state_file"]] and re.fullmatch(
        r"state-[0-9a-f]{8}\.pt", marker["state_file"]
    )
    assert (torn / "state.pt").read_bytes() == b"half"
    assert store.verify(4) == []
    loaded = load_checkpoint(uri=uri)
    assert loaded is not None and torch.equal(loaded["x"], torch.ones(1))


def test_async_save_writes_the_state_as_it_was(location: Location, clean_env: Any) -> None:
    weights = torch.zeros(1000)
    uri = save_checkpoint({"w": weights}, 1, uri=location.uri, blocking=False)
    weights += 1  # training goes on while the background thread writes
    assert wait_for_checkpoint() == uri
    assert wait_for_checkpoint() is None
    loaded = load_checkpoint(uri=uri)
    assert loaded is not None
    assert torch.equal(loaded["w"], torch.zeros(1000))
    assert location.store().latest() == CheckpointRef(uri, 1)


def test_a_save_returns_before_the_pruned_steps_files_are_removed(
    location: Location, clean_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention takes the old step out of the committed ones before the save returns; deleting its
    files (0.1 s per 168 MB here) is left to the background thread, and the next save waits for it."""
    store = location.store()
    release = threading.Event()
    removed: list[int] = []
    remove_files = CheckpointStore.remove_files

    def slow_remove(self: CheckpointStore, step: int) -> None:
        release.wait(30)
        remove_files(self, step)
        removed.append(step)

    monkeypatch.setattr(CheckpointStore, "remove_files", slow_remove)
    save_checkpoint({"w": torch.zeros(10)}, 1, uri=location.uri, keep_last=1)

    def save(step: int) -> threading.Thread:
        thread = threading.Thread(
            target=save_checkpoint, args=({"w": torch.ones(10)}, step), kwargs={"uri": location.uri, "keep_last": 1}
        )
        thread.start()
        return thread

    third: threading.Thread | None = None
    try:
        second = save(2)
        second.join(10)
        assert not second.is_alive(), "the save waited for the removal of the step it pruned"
        assert [r.step for r in store.committed()] == [2] and removed == []
        assert store.fs.exists(store.step_path(1))  # uncommitted, its files not removed yet
        third = save(3)
        third.join(1)
        assert not store.fs.exists(store.step_path(3)), "the next save claimed its step before the removal ended"
    finally:
        release.set()  # a failed check must not leave the shared background thread stuck
        if third is not None:
            third.join(30)
    assert wait_for_checkpoint() is None
    assert removed == [1, 2] and [r.step for r in store.committed()] == [3]
    assert not store.fs.exists(store.step_path(1)) and not store.fs.exists(store.step_path(2))


def _mapped_from(address: int) -> str | None:
    """The file whose mapping holds ``address`` in this process, from /proc/self/maps."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in span.split("-"))
        if low <= address < high:
            return rest[4].strip() if len(rest) > 4 else None
    return None


def test_a_local_checkpoint_is_mapped_not_copied(tmp_path: Path, clean_env: Any) -> None:
    """The loaded tensors are the file's pages (one copy of the state in memory, not two), and a
    change to them stays in this process."""
    if file_system_of(str(tmp_path)) not in MAPPED_FILE_SYSTEMS:
        pytest.skip(f"{tmp_path} is on {file_system_of(str(tmp_path))}, which a load does not map")
    uri = save_checkpoint({"w": torch.arange(1 << 20, dtype=torch.float32)}, 1, uri=f"file://{tmp_path}/ckpt")
    state = load_checkpoint(uri=uri)
    assert state is not None
    assert _mapped_from(state["w"].data_ptr()) == str(tmp_path / "ckpt" / "step-00000001" / "state.pt")
    state["w"] += 1  # copy on write: the file keeps what was saved
    again = load_checkpoint(uri=uri)
    assert again is not None and torch.equal(again["w"], torch.arange(1 << 20, dtype=torch.float32))


def test_a_checkpoint_on_a_shared_file_system_is_read_not_mapped(
    tmp_path: Path, clean_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On NFS another client's delete would fault a mapping mid-training: such a file is read."""
    from airflow_torchrun.worker.checkpoint import files

    assert file_system_of("/proc/self") == "proc" and file_system_of("/dev/shm") in ("tmpfs", None)
    uri = save_checkpoint({"w": torch.arange(1 << 20, dtype=torch.float32)}, 1, uri=f"file://{tmp_path}/ckpt")
    monkeypatch.setattr(files, "file_system_of", lambda path: "nfs4")
    state = load_checkpoint(uri=uri)
    assert state is not None and torch.equal(state["w"], torch.arange(1 << 20, dtype=torch.float32))
    assert _mapped_from(state["w"].data_ptr()) != str(tmp_path / "ckpt" / "step-00000001" / "state.pt")


def test_a_file_system_that_cannot_map_gets_the_file_read(
    tmp_path: Path, clean_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = save_checkpoint({"w": torch.ones(8)}, 1, uri=f"file://{tmp_path}/ckpt")
    real_load = torch.load

    def no_mmap(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("mmap"):
            raise RuntimeError("unable to mmap 1234 bytes from file </proc/self/fd/5>: Operation not supported (95)")
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", no_mmap)
    state = load_checkpoint(uri=uri)
    assert state is not None and torch.equal(state["w"], torch.ones(8))


def test_bad_usage_gets_clear_errors(tmp_path: Path, clean_env: Any) -> None:
    with pytest.raises(StorageError, match="TRAIN_CHECKPOINT_URI is not set"):
        save_checkpoint({"x": 1}, 1)
    root = f"file://{tmp_path}/ckpt"
    clean_env.setenv("TRAIN_CHECKPOINT_KEEP_LAST", "many")
    with pytest.raises(StorageError, match="TRAIN_CHECKPOINT_KEEP_LAST='many' is not a whole number"):
        save_checkpoint({"x": 1}, 1, uri=root)
    clean_env.delenv("TRAIN_CHECKPOINT_KEEP_LAST")
    (tmp_path / "ckpt" / "step-00000002").mkdir(parents=True)
    (tmp_path / "ckpt" / "step-00000002" / "state.pt").write_bytes(b"half")
    with pytest.raises(StorageError, match="not committed"):
        load_checkpoint(uri=f"{root}/step-00000002")
    with pytest.raises(StorageError, match="not a checkpoint step directory"):
        load_checkpoint(uri=root)
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="init_process_group"):
        save_checkpoint({"x": 1}, 1, uri=root)


def test_weights_only_by_default(tmp_path: Path, clean_env: Any) -> None:
    uri = save_checkpoint({"when": np.datetime64("2026-01-01")}, 1, uri=str(tmp_path))
    with pytest.raises(Exception, match="weights_only"):
        load_checkpoint(uri=uri)
    loaded = load_checkpoint(uri=uri, weights_only=False)
    assert loaded is not None
    assert loaded["when"] == np.datetime64("2026-01-01")


# -- two real gloo ranks under torchrun ------------------------------------------------------------
RANKS_SCRIPT = textwrap.dedent(
    """
    import json, os, random, signal, sys, time
    import numpy as np, torch, torch.distributed as dist
    from airflow_torchrun.worker import load_checkpoint, save_checkpoint, wait_for_checkpoint
    from airflow_torchrun.storage.checkpoints import CheckpointStore
    from airflow_torchrun.worker.checkpoint.comm import Comm

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    scenario, out = sys.argv[1], sys.argv[2]
    root = os.environ["TRAIN_CHECKPOINT_URI"]

    def draws():
        return [torch.rand(4).tolist(), random.random(), float(np.random.rand())]

    def seed(value):
        torch.manual_seed(value); random.seed(value); np.random.seed(value)

    seed(100 + rank)  # a different RNG stream on each rank
    result = {"rank": rank}
    if scenario == "roundtrip":
        mine = {"w": torch.full((4,), float(rank)), "n": 5}  # rank 0's copy is the one saved
        u5 = save_checkpoint(mine, 5)
        result["after5"] = draws()
        u6 = save_checkpoint({"w": torch.full((4,), 6.0)}, 6, blocking=False)
        result["async_uri"] = wait_for_checkpoint()
        u7 = save_checkpoint({"w": torch.arange(4.0), "b": torch.ones(2, 3), "n": 7}, 7, sharded=True)
        result["after7"] = draws()
        seed(999)  # scramble, as a new process would be
        loaded = load_checkpoint(uri=u5)
        result["loaded5"] = {"w": loaded["w"].tolist(), "n": loaded["n"]}
        result["restored5"] = draws()
        into = {"w": torch.zeros(4), "b": torch.zeros(2, 3), "n": 0}
        load_checkpoint(uri=u7, into=into)
        result["loaded7"] = {"w": into["w"].tolist(), "b": into["b"].tolist(), "n": into["n"]}
        result["restored7"] = draws()
        result["uris"] = [u5, u6, u7]
    elif scenario == "killed":
        save_checkpoint({"w": torch.ones(8)}, 1)
        if rank == 1:
            state_file = CheckpointStore(root).step_path(2) + "/state.pt"

            def die_inside_save(self):
                # Die in the middle of save_checkpoint(step 2), once rank 0 has written its files.
                deadline = time.monotonic() + 30
                fs = CheckpointStore(root).fs
                while time.monotonic() < deadline and not fs.exists(state_file):
                    time.sleep(0.02)
                    fs.invalidate_cache()
                print("rank 1: killing myself inside save_checkpoint", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

            Comm.barrier = die_inside_save
        save_checkpoint({"w": torch.ones(8) * 2}, 2)
        result["survived"] = True
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as fp:
        json.dump(result, fp)
    dist.destroy_process_group()
    """
)


def _torchrun(
    args: list[str], env: dict[str, str], *, nproc: int = 2, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k not in CONTRACT_VARS}
    full_env.update(env)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    # Its logs in a folder removed after (without --log-dir torchrun leaves one in /tmp each run).
    with tempfile.TemporaryDirectory(prefix="torchrun-logs-") as logs:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        return subprocess.run(
            [*launcher, f"--log-dir={logs}", *args],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


@pytest.mark.slow
def test_the_process_end_waits_for_the_removal_of_pruned_files(tmp_path: Path) -> None:
    """A script that saves and ends without wait_for_checkpoint(): the interpreter's end joins the
    background removal, so only the ``keep_last`` newest steps are left on disk."""
    script = tmp_path / "saves.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import time, torch
            from airflow_torchrun.storage.checkpoints import CheckpointStore
            from airflow_torchrun.worker import save_checkpoint
            remove_files = CheckpointStore.remove_files
            def slow(self, step):
                time.sleep(1.0)
                remove_files(self, step)
            CheckpointStore.remove_files = slow
            for step in (1, 2, 3):
                save_checkpoint({{"w": torch.ones(4)}}, step, uri={str(tmp_path / "ckpt")!r}, keep_last=1)
            print("saved", flush=True)
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k not in CONTRACT_VARS}
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0 and "saved" in proc.stdout, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-")) == ["step-00000003"]


@pytest.mark.slow
def test_an_async_save_pending_at_the_end_still_prunes_every_old_step(tmp_path: Path) -> None:
    """blocking=False, then the script ends without wait_for_checkpoint(): the interpreter's end runs
    the save and its retention to the end (the background thread takes no new work by then, so the
    removals run on it directly), leaving only the newest step."""
    script = tmp_path / "saves.py"
    root = str(tmp_path / "ckpt")
    script.write_text(
        textwrap.dedent(
            f"""
            import torch
            from airflow_torchrun.worker import save_checkpoint, wait_for_checkpoint
            for step in (1, 2, 3):
                save_checkpoint({{"w": torch.ones(4)}}, step, uri={root!r}, keep_last=5)
            wait_for_checkpoint()
            save_checkpoint({{"w": torch.ones(1 << 22)}}, 4, uri={root!r}, keep_last=1, blocking=False)
            print("returned", flush=True)
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k not in CONTRACT_VARS}
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0 and "returned" in proc.stdout, proc.stderr[-3000:]
    assert "Could not" not in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in Path(root).iterdir() if p.name.startswith("step-")) == ["step-00000004"]
    assert [r.step for r in CheckpointStore(root).committed()] == [4]


@pytest.mark.slow
def test_a_forked_child_saves_with_a_background_thread_of_its_own(tmp_path: Path, clean_env: Any) -> None:
    """A process that saved (its background thread made) forks: the child's saves and their pruning
    must not wait on the parent's thread, which the child does not have."""
    root = str(tmp_path / "ckpt")
    save_checkpoint({"w": torch.ones(4)}, 1, uri=root, keep_last=1)
    save_checkpoint({"w": torch.ones(4)}, 2, uri=root, keep_last=1)  # a removal handed to the thread
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through its exit status
        code = 1
        try:
            for step in (3, 4):
                save_checkpoint({"w": torch.ones(4)}, step, uri=root, keep_last=1)
            wait_for_checkpoint()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(child, 9)
        os.waitpid(child, 0)
        pytest.fail("the forked child's save hung on its parent's background thread")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    wait_for_checkpoint()
    assert [r.step for r in CheckpointStore(root).committed()] == [4]


@pytest.mark.slow
def test_two_gloo_ranks_round_trip(location: Location, tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    env = {**location.env, "TRAIN_CHECKPOINT_URI": location.uri}
    proc = _torchrun([str(script), "roundtrip", str(out)], env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]

    store = location.store()
    assert [r.step for r in store.committed()] == [5, 6, 7]
    assert ranks[0]["uris"] == [store.step_uri(s) for s in (5, 6, 7)]
    assert ranks[0]["async_uri"] == store.step_uri(6)
    torch_marker, dcp_marker = store.read_marker(5), store.read_marker(7)
    assert (torch_marker["format"], torch_marker["world_size"]) == ("torch", 2)
    assert (dcp_marker["format"], dcp_marker["world_size"]) == ("dcp", 2)
    assert any(name.startswith("dcp/") and name.endswith(".distcp") for name in dcp_marker["files"])
    assert "dcp/.metadata" in dcp_marker["files"]
    assert "rng.pt" in dcp_marker["files"]
    assert set(torch_marker["files"]) == {"state.pt"}
    for result in ranks:
        # Rank 0's state is the one saved, and every rank reads it back.
        assert result["loaded5"] == {"w": [0.0] * 4, "n": 5}
        assert result["loaded7"] == {"w": [0.0, 1.0, 2.0, 3.0], "b": [[1.0] * 3] * 2, "n": 7}
        # Each rank gets its own RNG states back: the next draws are those after the save.
        assert result["restored5"] == result["after5"]
        assert result["restored7"] == result["after7"]
    assert ranks[0]["after5"] != ranks[1]["after5"]


@pytest.mark.slow
def test_rank_killed_during_save_leaves_the_step_uncommitted(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    root = f"file://{tmp_path}/ckpt"
    proc = _torchrun([str(script), "killed", str(out)], {"TRAIN_CHECKPOINT_URI": root})
    assert proc.returncode != 0
    assert "killing myself inside save_checkpoint" in proc.stdout + proc.stderr
    assert not list(out.iterdir())  # neither rank got past save_checkpoint(step 2)
    store = CheckpointStore(root)
    assert store.latest() == CheckpointRef(store.step_uri(1), 1)
    torn = tmp_path / "ckpt" / "step-00000002"
    assert (torn / "state.pt").is_file()  # rank 0 had written the state...
    assert not (torn / COMMIT_MARKER).exists()  # ...but never committed it


# -- the example trainer --------------------------------------------------------------------------
FINAL = re.compile(r"FINAL step=(\d+) weights_sha256=([0-9a-f]{64})")


def _final(proc: subprocess.CompletedProcess[str]) -> tuple[int, str]:
    match = FINAL.search(proc.stdout)
    assert match, proc.stdout[-3000:] + proc.stderr[-5000:]
    return int(match.group(1)), match.group(2)


@pytest.mark.slow
def test_trainer_resumed_after_a_killed_rank_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    args = [str(TRAINER), "--epochs", "4", "--checkpoint-every", "20", "--log-every", "40"]
    straight = _torchrun(args, {"TRAIN_CHECKPOINT_URI": f"file://{tmp_path}/straight"})
    assert straight.returncode == 0, straight.stderr[-5000:]
    total, digest = _final(straight)
    assert total == 88  # 1437 training samples / (32 x 2 ranks) = 22 steps per epoch

    root = f"file://{tmp_path}/interrupted"
    failing = [*args, "--fail-at-step", "50", "--fail-rank", "1", "--fail-mode", "kill"]
    crashed = _torchrun(failing, {"TRAIN_CHECKPOINT_URI": root})
    assert crashed.returncode != 0
    assert "FINAL" not in crashed.stdout
    latest = CheckpointStore(root).latest()
    assert latest is not None
    assert latest.step == 40

    # What the operator does on retry: same arguments, resume from the latest committed checkpoint.
    resumed = _torchrun(failing, {"TRAIN_CHECKPOINT_URI": root, "TRAIN_RESUME_FROM": latest.uri})
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert f"at step {latest.step}" in resumed.stdout + resumed.stderr
    assert _final(resumed) == (total, digest)
    assert CheckpointStore(root).latest() == CheckpointRef(f"{root}/step-00000088", 88)


@pytest.mark.slow
def test_import_boundaries() -> None:
    """Storage imports neither Airflow nor torch nor s3fs; the worker helpers never import Airflow."""
    code = textwrap.dedent(
        """
        import sys
        import airflow_torchrun.storage.checkpoints, airflow_torchrun.storage.lineage, airflow_torchrun.storage.aws
        heavy = {"airflow", "torch", "s3fs"} & set(sys.modules)
        assert not heavy, heavy
        from airflow_torchrun.worker import save_checkpoint, load_checkpoint, ProgressLogger
        import airflow_torchrun.worker.launch
        assert "torch" in sys.modules and "airflow" not in sys.modules
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_connection_options_reach_the_ranks_through_env(moto_s3: MotoS3, clean_env: Any) -> None:
    """What the operator does with aws_conn_id: connection -> storage_options -> rank env -> s3."""
    from airflow_torchrun.storage.aws import storage_env, storage_options_from_aws_connection

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"):
        clean_env.delenv(name, raising=False)
    bucket = moto_s3.make_bucket()
    options = storage_options_from_aws_connection(
        "testing", "testing", {"region_name": "us-east-1", "service_config": {"s3": {"endpoint_url": moto_s3.endpoint}}}
    )
    options["config_kwargs"] = {"connect_timeout": 3}
    root = f"s3://{bucket}/from-connection"
    reachable(CheckpointStore(root, options))
    for key, value in storage_env(options).items():
        clean_env.setenv(key, value)
    clean_env.setenv("TRAIN_CHECKPOINT_URI", root)
    uri = save_checkpoint({"x": torch.arange(3)}, 12)
    assert CheckpointStore(root, options).latest() == CheckpointRef(uri, 12)
