"""Checkpoints you can trust: lineage, integrity (sizes and checksums), injective paths, the trust
boundary. Real files and real s3 (moto's server); the operator through ``dag.test()``; the example
trainer under torchrun for bit-identical resumes past a damaged step."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from airflow_torchrun.errors import StorageError
from airflow_torchrun.naming import lineage_path, segment, task_segment
from airflow_torchrun.storage.checkpoints import CheckpointRef, CheckpointStore
from airflow_torchrun.storage.lineage import LINEAGE_FILE, Lineage, claim_lineage, final_checkpoint, read_lineage
from airflow_torchrun.worker import load_checkpoint, resume_step, save_checkpoint
from tests import s3_fixtures
from tests.conftest import once_per_run
from tests.s3_fixtures import MotoS3

ROOT = Path(__file__).resolve().parent.parent
TRAINER = ROOT / "images" / "trainer" / "train.py"
CONTRACT_VARS = (
    "TRAIN_CHECKPOINT_URI",
    "TRAIN_RESUME_FROM",
    "TRAIN_CHECKPOINT_KEEP_LAST",
    "TRAIN_CHECKPOINT_LINEAGE",
    "TRAIN_CHECKPOINT_TRUST_SHARDED",
    "EVAL_CHECKPOINT_URI",
)
MINE = Lineage("dag_a", "manual__1", "train")
THEIRS = Lineage("dag_b", "manual__2", "train")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (*CONTRACT_VARS, "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture(params=["file", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path, clean_env: pytest.MonkeyPatch) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/ckpt"
    moto: MotoS3 = request.getfixturevalue("moto_s3")
    for key, value in moto.env().items():
        clean_env.setenv(key, value)
    return f"s3://{moto.make_bucket()}/ckpt"


def _as_lineage(env: pytest.MonkeyPatch, lineage: Lineage, try_number: int = 1) -> None:
    env.setenv("TRAIN_CHECKPOINT_LINEAGE", json.dumps({**lineage.to_dict(), "try_number": try_number}))


def _state_path(store: CheckpointStore, step: int) -> str:
    return f"{store.step_path(step)}/{store.read_marker(step)['state_file']}"


# -- injective paths -------------------------------------------------------------------------------
def test_colliding_run_ids_and_task_names_map_to_distinct_directories() -> None:
    runs = ["a:b", "a+b", "a~b", "a_b", "a/b", "a b", "..", ".", "manual__2026-01-01T00:00:00+00:00"]
    segments = [segment(r) for r in runs]
    assert len(set(segments)) == len(runs), segments
    assert segment("a_b") == "a_b"  # a safe segment is kept as it is
    assert all("/" not in s and s not in (".", "..") for s in segments)
    assert re.fullmatch(r"a_b~[0-9a-f]{8}", segment("a:b"))
    # Map index 1 of task "train" is not the task named "train-1" (nor "train~map1" sanitised).
    tasks = {task_segment("train", 1), task_segment("train-1"), task_segment("train~map1"), task_segment("train")}
    assert len(tasks) == 4
    paths = {lineage_path("d", r, "t") for r in runs} | {
        lineage_path("d", "r", "train", 1),
        lineage_path("d", "r", "train-1"),
    }
    assert len(paths) == len(runs) + 2


def test_default_checkpoint_uri_is_injective(tmp_path: Path) -> None:
    from airflow.sdk import DAG

    from airflow_torchrun import DistributedTrainingOperator

    with DAG("paths", schedule=None):
        train = DistributedTrainingOperator(task_id="train", script=str(TRAINER))
        train_1 = DistributedTrainingOperator(task_id="train-1", script=str(TRAINER))
    uris = {
        train.default_checkpoint_uri({"run_id": run_id, "map_index": -1})  # type: ignore[arg-type]
        for run_id in ("a:b", "a+b", "a~b")
    }
    assert len(uris) == 3
    mapped = train.default_checkpoint_uri({"run_id": "r", "map_index": 1})  # type: ignore[arg-type]
    plain = train_1.default_checkpoint_uri({"run_id": "r", "map_index": -1})  # type: ignore[arg-type]
    assert mapped != plain and mapped.endswith("/paths/r/train~map1") and plain.endswith("/paths/r/train-1")


# -- lineage ---------------------------------------------------------------------------------------
def test_a_root_belongs_to_its_first_lineage(root: str, clean_env: pytest.MonkeyPatch) -> None:
    store = CheckpointStore(root)
    s3_fixtures.reachable(store)
    claim_lineage(store, MINE)
    claim_lineage(store, MINE)  # every try of the same task instance: fine
    assert read_lineage(store) == MINE
    _as_lineage(clean_env, MINE)
    for step in (20, 30):
        save_checkpoint({"w": torch.full((3,), float(step))}, step, uri=root, keep_last=2)
    before = [r.step for r in store.committed()]
    with pytest.raises(StorageError, match="belongs to another task instance") as refused:
        claim_lineage(store, THEIRS)
    assert refused.value.transient is False
    assert "nothing was deleted" in str(refused.value) and "resume_from_outside=True" in str(refused.value)
    assert [r.step for r in store.committed()] == before == [20, 30]
    assert all(store.verify(s) == [] for s in before)


def test_a_root_without_lineage_file_is_claimed_by_what_its_markers_say(root: str, clean_env: Any) -> None:
    _as_lineage(clean_env, THEIRS)
    save_checkpoint({"w": torch.ones(2)}, 5, uri=root)
    store = CheckpointStore(root)
    assert read_lineage(store) is None  # written by ranks, not claimed through the operator
    with pytest.raises(StorageError, match="dag 'dag_b'"):
        claim_lineage(store, MINE)
    claim_lineage(store, THEIRS)
    assert read_lineage(store) == THEIRS


def test_marker_records_files_sizes_checksums_lineage_and_writer(root: str, clean_env: Any) -> None:
    _as_lineage(clean_env, MINE, try_number=3)
    clean_env.setenv("TORCHELASTIC_RUN_ID", "group-xyz")
    save_checkpoint({"w": torch.arange(10.0)}, 7, uri=root)
    marker = CheckpointStore(root).read_marker(7)
    name = marker["state_file"]
    assert set(marker["files"]) == set(marker["checksums"]) == {name}
    assert re.fullmatch(r"crc32:[0-9a-f]{8}", marker["checksums"][name])
    assert marker["files"][name] == marker["total_bytes"] > 0
    assert (marker["format"], marker["world_size"], marker["version"]) == ("torch", 1, 2)
    assert Lineage.from_dict(marker["lineage"]) == MINE
    assert marker["writer"]["try_number"] == 3 and marker["writer"]["group_id"] == "group-xyz"


def test_final_checkpoint_is_the_lineages_most_recent_commit(tmp_path: Path, clean_env: Any) -> None:
    root = f"file://{tmp_path}/ckpt"
    store = CheckpointStore(root)
    _as_lineage(clean_env, MINE, try_number=1)
    for step in (20, 30):
        save_checkpoint({"w": torch.ones(1)}, step, uri=root, keep_last=2)
    # A retry with resume="never": a fresh start of the same lineage writes low steps after high ones.
    _as_lineage(clean_env, MINE, try_number=2)
    for step in (5, 10, 15):
        save_checkpoint({"w": torch.zeros(1)}, step, uri=root, keep_last=2)
        assert store.is_committed(step), f"step {step} was pruned right after its commit"
    assert [r.step for r in store.committed()] == [10, 15]
    assert final_checkpoint(store, MINE) == CheckpointRef(store.step_uri(15), 15)
    assert final_checkpoint(store, THEIRS) is None


# -- integrity -------------------------------------------------------------------------------------
def _damage(store: CheckpointStore, step: int, how: str) -> None:
    path = _state_path(store, step)
    data = store.fs.cat_file(path)
    if how == "truncated":
        store.fs.pipe_file(path, data[: len(data) // 2])
    elif how == "flipped":
        middle = len(data) // 2
        store.fs.pipe_file(path, data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1 :])
    else:
        store.fs.rm_file(path)
    store.fs.invalidate_cache()


@pytest.mark.parametrize("how", ["truncated", "flipped", "missing"])
def test_a_damaged_step_is_skipped_for_the_previous_one(
    root: str, clean_env: pytest.MonkeyPatch, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    for step in (10, 20):
        save_checkpoint({"w": torch.full((1000,), float(step))}, step, uri=root)
    store = CheckpointStore(root)
    _damage(store, 20, how)
    problems = store.verify(20)
    assert problems and store.verify(10) == []
    # The operator's look (sizes: a listing) already skips a truncated or missing file...
    expected_latest = 20 if how == "flipped" else 10
    with caplog.at_level("WARNING"):
        assert store.latest() == CheckpointRef(store.step_uri(expected_latest), expected_latest)
    # ...and the ranks, which checksum what they load, never load the damaged step.
    clean_env.setenv("TRAIN_CHECKPOINT_URI", root)
    clean_env.setenv("TRAIN_RESUME_FROM", store.step_uri(20))
    with caplog.at_level("WARNING"):
        state = load_checkpoint()
    assert state is not None and torch.equal(state["w"], torch.full((1000,), 10.0))
    assert resume_step() == 10
    assert f"Checkpoint {store.step_uri(20)} is damaged" in caplog.text
    assert f"loading the previous committed step {store.step_uri(10)} instead" in caplog.text
    # An explicit uri (what evaluation asks for) is refused rather than swapped for another step.
    with pytest.raises(StorageError, match="is damaged"):
        load_checkpoint(uri=store.step_uri(20))


def test_a_damaged_only_step_means_a_fresh_start(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    root = f"file://{tmp_path}/ckpt"
    save_checkpoint({"w": torch.ones(4)}, 10, uri=root)
    store = CheckpointStore(root)
    _damage(store, 10, "flipped")
    clean_env.setenv("TRAIN_RESUME_FROM", store.step_uri(10))
    assert load_checkpoint() is None
    assert resume_step() == 0


TWO_WRITERS = textwrap.dedent(
    """
    import sys, torch
    from airflow_torchrun.worker import save_checkpoint
    root, seed = sys.argv[1], int(sys.argv[2])
    for step in range(1, 9):
        # Different content per writer: a writer clobbering the other's files would show.
        save_checkpoint({"w": torch.full((20000,), float(seed * 100 + step))}, step, uri=root, keep_last=0)
    """
)


@pytest.mark.slow
def test_two_writers_on_one_root_never_lose_a_committed_step(root: str, tmp_path: Path) -> None:
    script = tmp_path / "writer.py"
    script.write_text(TWO_WRITERS)
    env = {k: v for k, v in os.environ.items() if k not in CONTRACT_VARS}
    procs = [
        subprocess.Popen([sys.executable, str(script), root, str(seed)], env=env, stderr=subprocess.PIPE, text=True)
        for seed in (1, 2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
    store = CheckpointStore(root)
    assert [r.step for r in store.committed()] == list(range(1, 9))
    for step in range(1, 9):
        # Whichever writer's marker came last, it names files that are there and intact.
        assert store.verify(step) == [], step
        state = load_checkpoint(uri=store.step_uri(step))
        assert state is not None and float(state["w"][0]) in (100.0 + step, 200.0 + step)


def test_two_writers_entering_one_step_at_the_same_moment_never_clobber_each_other(root: str) -> None:
    """The race of the test above made certain: two writers start every step's save together (a
    barrier), so both ask whether the step exists before either has written it. Only one may take
    the plain names; the other writes beside it, and the marker that wins names intact files."""
    import threading

    together = threading.Barrier(2)
    failures: list[BaseException] = []

    def writer(seed: int) -> None:
        try:
            for step in range(1, 6):
                together.wait(timeout=60)
                save_checkpoint({"w": torch.full((20000,), float(seed * 100 + step))}, step, uri=root, keep_last=0)
        except BaseException as exc:  # reported below, with the thread's own traceback
            failures.append(exc)
            together.abort()

    threads = [threading.Thread(target=writer, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not failures, failures
    store = CheckpointStore(root)
    for step in range(1, 6):
        assert store.verify(step) == [], step
        marker = store.read_marker(step)
        state = load_checkpoint(uri=store.step_uri(step))
        assert state is not None and float(state["w"][0]) in (100.0 + step, 200.0 + step)
        # Exactly one of the two took the plain name; the other's file has a name of its own.
        names = [n for n in store.list_files(step) if n.startswith("state")]
        assert len(names) == 2 and "state.pt" in names, names
        assert marker["state_file"] in names


def test_a_step_is_claimed_once(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    stores = [CheckpointStore(root), CheckpointStore(root)]
    assert [s.claim(7) for s in stores] == [True, False]
    if root.startswith("s3://"):
        # The race itself: the second writer's existence check came before the first one's claim,
        # so only the conditional put (If-None-Match) can refuse it.
        with monkeypatch.context() as patched:
            patched.setattr(type(stores[1].fs), "exists", lambda self, path, **kw: False)
            assert stores[1].claim(7) is False
    assert stores[0].claim(7) is False  # not even by the one that claimed it: a second save writes beside
    save_checkpoint({"w": torch.zeros(2)}, 8, uri=root)
    assert stores[1].claim(8) is False  # a step written by save_checkpoint is claimed too


# -- trust boundary --------------------------------------------------------------------------------
def test_a_foreign_sharded_checkpoint_needs_opt_in(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    theirs = f"file://{tmp_path}/theirs"
    _as_lineage(clean_env, THEIRS)
    uri = save_checkpoint({"w": torch.arange(4.0)}, 3, uri=theirs, sharded=True)
    assert CheckpointStore(theirs).read_marker(3)["format"] == "dcp"
    into = {"w": torch.zeros(4)}
    # The task whose root it lies in loads it; another only with the opt-in.
    clean_env.setenv("TRAIN_CHECKPOINT_URI", theirs)
    assert torch.equal(load_checkpoint(uri=uri, into=into)["w"], torch.arange(4.0))  # type: ignore[index]
    _as_lineage(clean_env, MINE)
    clean_env.setenv("TRAIN_CHECKPOINT_URI", f"file://{tmp_path}/mine")
    into = {"w": torch.zeros(4)}
    with pytest.raises(StorageError, match="sharded checkpoint outside this task's checkpoint root"):
        load_checkpoint(uri=uri, into=into)
    assert torch.equal(into["w"], torch.zeros(4))  # nothing was read into it
    assert torch.equal(load_checkpoint(uri=uri, into=into, trust_sharded=True)["w"], torch.arange(4.0))  # type: ignore[index]
    clean_env.setenv("TRAIN_CHECKPOINT_TRUST_SHARDED", "1")  # what trust_foreign_sharded=True sets
    into = {"w": torch.zeros(4)}
    assert torch.equal(load_checkpoint(uri=uri, into=into)["w"], torch.arange(4.0))  # type: ignore[index]


def test_a_damaged_sharded_step_is_not_loaded(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    root = f"file://{tmp_path}/ckpt"
    clean_env.setenv("TRAIN_CHECKPOINT_URI", root)
    uri = save_checkpoint({"w": torch.arange(1000.0)}, 3, uri=root, sharded=True)
    store = CheckpointStore(root)
    marker = store.read_marker(3)
    shard = next(rel for rel in marker["files"] if rel.endswith(".distcp"))
    path = f"{store.step_path(3)}/{shard}"
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    with pytest.raises(StorageError, match=f"{re.escape(shard)} does not match its checksum"):
        load_checkpoint(uri=uri, into={"w": torch.zeros(1000)})


# -- the example trainer: a damaged step is skipped, the result is still bit-identical -------------
FINAL = re.compile(r"FINAL step=(\d+) weights_sha256=([0-9a-f]{64})")
TRAINER_ARGS = [str(TRAINER), "--epochs", "2", "--checkpoint-every", "10", "--log-every", "40"]


def _torchrun(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k not in CONTRACT_VARS}
    full_env.update(env)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    # Its logs in a folder removed after (without --log-dir torchrun leaves one in /tmp each run).
    with tempfile.TemporaryDirectory(prefix="torchrun-logs-") as logs:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        return subprocess.run(
            [*launcher, f"--log-dir={logs}", *args],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )


def _final(proc: subprocess.CompletedProcess[str]) -> tuple[int, str]:
    match = FINAL.search(proc.stdout)
    assert match, proc.stdout[-3000:] + proc.stderr[-5000:]
    return int(match.group(1)), match.group(2)


@pytest.fixture(scope="session")
def crashed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple[int, str]]:
    """An uninterrupted run's result, and a root where a run was killed at step 25 (steps 10, 20).
    Made once per run (xdist's workers share it: the tests copy the root before damaging it)."""

    def make(base: Path) -> list[Any]:
        straight = _torchrun(TRAINER_ARGS, {"TRAIN_CHECKPOINT_URI": f"file://{base}/straight"})
        assert straight.returncode == 0, straight.stderr[-5000:]
        failing = [*TRAINER_ARGS, "--fail-at-step", "25", "--fail-rank", "1", "--fail-mode", "kill"]
        crashed = _torchrun(failing, {"TRAIN_CHECKPOINT_URI": f"file://{base}/crashed"})
        assert crashed.returncode != 0
        assert [r.step for r in CheckpointStore(f"file://{base}/crashed").committed()] == [10, 20]
        return [str(base / "crashed"), list(_final(straight))]

    root, (step, digest) = once_per_run(tmp_path_factory, "lineage-crashed-run", make)
    return Path(root), (int(step), str(digest))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated", "flipped", "missing"])
def test_trainer_resumes_past_a_damaged_step_bit_identically(
    crashed_run: tuple[Path, tuple[int, str]], tmp_path: Path, how: str
) -> None:
    crashed, expected = crashed_run
    copy = tmp_path / "ckpt"
    shutil.copytree(crashed, copy)
    root = f"file://{copy}"
    store = CheckpointStore(root)
    _damage(store, 20, how)
    # What a retry does: TRAIN_RESUME_FROM names the newest step (a flipped byte passes the
    # operator's size check); the ranks find it damaged and load step 10 instead.
    env = {"TRAIN_CHECKPOINT_URI": root, "TRAIN_RESUME_FROM": store.step_uri(20)}
    resumed = _torchrun([*TRAINER_ARGS, "--fail-at-step", "25", "--fail-rank", "1", "--fail-mode", "kill"], env)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-5000:]
    assert f"Checkpoint {store.step_uri(20)} is damaged" in out
    assert "at step 10" in out
    assert _final(resumed) == expected
    assert all(store.verify(r.step) == [] for r in store.committed())  # what is left is sound


# -- the operator ----------------------------------------------------------------------------------
SAVER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from airflow_torchrun.worker import load_checkpoint, resume_step, save_checkpoint
    lineage = json.loads(os.environ["TRAIN_CHECKPOINT_LINEAGE"])
    fail_try = int(sys.argv[2])
    # argv[1]: the last step of the first try; argv[3], if given: of the later tries.
    last = int(sys.argv[1] if lineage["try_number"] == 1 or len(sys.argv) < 4 else sys.argv[3])
    state = load_checkpoint()
    w = state["w"] if state is not None else torch.zeros(3)
    for step in range(resume_step() + 5, last + 1, 5):
        w = w + 1
        save_checkpoint({"w": w}, step)
    print("SAVED up to", last, "on try", lineage["try_number"], flush=True)
    sys.exit(3 if lineage["try_number"] == fail_try else 0)
    """
)


@pytest.fixture
def saver(tmp_path: Path) -> Path:
    path = tmp_path / "saver.py"
    path.write_text(SAVER)
    return path


@pytest.mark.slow
def test_defect_1_a_fresh_task_on_a_used_root_is_refused_and_deletes_nothing(
    run_dag: Any, saver: Path, tmp_path: Path
) -> None:
    root = f"file://{tmp_path}/shared"
    first = run_dag(
        f"""
        DistributedTrainingOperator(task_id="train", script={str(saver)!r}, script_args=["40", "0"],
                                    checkpoint_uri={root!r}, keep_last=2, track=False)
        """
    )
    assert first.state == "success", first.log[-4000:]
    store = CheckpointStore(root)
    assert [r.step for r in store.committed()] == [35, 40]
    assert first.xcom("train")["final_checkpoint"] == store.step_uri(40)
    second = run_dag(
        f"""
        DistributedTrainingOperator(task_id="train", script={str(saver)!r}, script_args=["15", "0"],
                                    checkpoint_uri={root!r}, keep_last=2, resume="never", retries=2,
                                    track=False)
        """
    )
    # Refused before launch, without retry, and the first task's checkpoints are intact.
    assert second.state == "failed"
    assert "belongs to another task instance" in second.log and "nothing was deleted" in second.log
    assert second.try_number("train") == 1 and "Launched group" not in second.log
    assert [r.step for r in store.committed()] == [35, 40]
    assert all(store.verify(s) == [] for s in (35, 40))
    assert json.loads(Path(store.location.path, LINEAGE_FILE).read_text())["dag_id"] == first.dag_id


@pytest.mark.slow
def test_a_retry_with_resume_never_keeps_its_own_steps_and_reports_them(run_dag: Any, saver: Path) -> None:
    # Try 1 saves 5..40 and fails; try 2 starts fresh (resume="never") and saves 5..15.
    result = run_dag(
        f"""
        DistributedTrainingOperator(task_id="train", script={str(saver)!r}, script_args=["40", "1", "15"],
                                    keep_last=2, resume="never", retries=1, retry_delay=timedelta(0),
                                    track=False)
        """,
        imports="from datetime import timedelta",
    )
    assert result.state == "success", result.log[-4000:]
    xcom = result.xcom("train")
    store = CheckpointStore(xcom["checkpoint_uri"])
    assert xcom["final_checkpoint"] == store.step_uri(15)
    assert [r.step for r in store.committed()] == [10, 15]
    assert store.read_marker(15)["writer"]["try_number"] == 2


@pytest.mark.slow
def test_resume_outside_the_root_needs_the_operator_argument(run_dag: Any, saver: Path, tmp_path: Path) -> None:
    other = f"file://{tmp_path}/other"
    os.environ.pop("TRAIN_CHECKPOINT_LINEAGE", None)
    save_checkpoint({"w": torch.full((3,), 7.0)}, 10, uri=other)
    task = """
        DistributedTrainingOperator(task_id="train", script={saver!r}, script_args=["20", "0"], track=False,
                                    resume={resume!r}, {extra} retries=2)
        """
    refused = run_dag(task.format(saver=str(saver), resume=f"{other}/step-00000010", extra=""))
    assert refused.state == "failed" and "resume_from_outside=True" in refused.log
    assert refused.try_number("train") == 1 and "Launched group" not in refused.log
    allowed = run_dag(task.format(saver=str(saver), resume=f"{other}/step-00000010", extra="resume_from_outside=True,"))
    assert allowed.state == "success", allowed.log[-4000:]
    assert allowed.xcom("train", key="resumed_from") == {"uri": f"{other}/step-00000010", "step": 10}
    final = allowed.xcom("train")["final_checkpoint"]
    assert final.endswith("/step-00000020") and not final.startswith(other)


# -- AWS connections through the Amazon provider ---------------------------------------------------
ROLE_ARN = "arn:aws:iam::123456789012:role/checkpoints"


def _role_connection(moto: MotoS3) -> str:
    """An AWS connection that assumes a role through STS (moto's server answers STS too)."""
    return json.dumps(
        {
            "conn_type": "aws",
            "login": s3_fixtures.ACCESS_KEY,
            "password": s3_fixtures.SECRET_KEY,
            "extra": {
                "role_arn": ROLE_ARN,
                # The shortest session STS grants: the ranks' refresh shows within the test.
                "assume_role_kwargs": {"DurationSeconds": 900},
                "region_name": s3_fixtures.REGION,
                "endpoint_url": moto.endpoint,
                "service_config": {"sts": {"endpoint_url": moto.endpoint}},
            },
        }
    )


def test_an_aws_connection_with_role_arn_is_resolved_by_the_provider(
    moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_torchrun.storage.aws import storage_options_from_aws_conn_id

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AIRFLOW_CONN_CKPT_ROLE", _role_connection(moto_s3))
    options = storage_options_from_aws_conn_id("ckpt_role")
    # The assumed role's temporary credentials, not the connection's own keys.
    assert options["key"].startswith("ASIA") and options["key"] != s3_fixtures.ACCESS_KEY
    assert options["token"] and options["secret"]
    assert options["endpoint_url"] == moto_s3.endpoint
    assert options["client_kwargs"] == {"region_name": s3_fixtures.REGION}
    bucket = moto_s3.make_bucket()
    s3_fixtures.reachable(CheckpointStore(f"s3://{bucket}/x", options))
    with pytest.raises(StorageError, match="no such Airflow connection") as missing:
        storage_options_from_aws_conn_id("no_such_connection_anywhere")
    assert missing.value.transient is False


KEY_PRINTER = textwrap.dedent(
    """
    import os, stat, boto3, torch
    from airflow_torchrun.worker import save_checkpoint
    print("RANK ENV KEY", repr(os.environ.get("AWS_ACCESS_KEY_ID")), flush=True)
    mode = stat.S_IMODE(os.stat(os.environ["AWS_CONFIG_FILE"]).st_mode)
    credentials = boto3.Session().get_credentials()
    first = credentials.get_frozen_credentials().access_key
    print("RANK CREDS", credentials.method, first[:4], oct(mode), flush=True)
    # A 900 s session is inside botocore's refresh window at once: it assumes the role again itself.
    second = credentials.get_frozen_credentials().access_key
    print("RANK REFRESHED", second != first, second[:4], flush=True)
    save_checkpoint({"w": torch.ones(3)}, 1)
    """
)


@pytest.mark.slow
def test_an_aws_connection_with_role_arn_works_end_to_end(
    run_dag: Any, moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    bucket = moto_s3.make_bucket()
    monkeypatch.setenv("AIRFLOW_CONN_CKPT_ROLE", _role_connection(moto_s3))
    script = tmp_path / "key_printer.py"
    script.write_text(KEY_PRINTER)
    result = run_dag(
        f"""
        DistributedTrainingOperator(task_id="train", script={str(script)!r}, track=False,
                                    checkpoint_uri="s3://{bucket}/ckpt", aws_conn_id="ckpt_role")
        """
    )
    assert result.state == "success", result.log[-4000:]
    # The ranks assume the role themselves (a private profile, no keys in their environment), and
    # their session refreshes when it nears its expiry.
    assert "RANK ENV KEY ''" in result.log
    assert "RANK CREDS assume-role ASIA 0o600" in result.log
    assert "RANK REFRESHED True ASIA" in result.log
    assert "the ranks assume arn:aws:iam::" in result.log
    assert s3_fixtures.SECRET_KEY not in result.log
    # The profile lived with the group only (0600 above), and went with its teardown.
    state = Path(os.environ["AIRFLOW__TORCHRUN__STATE_DIR"])
    assert not list((state / "credentials").glob("*.ini")) and not list(state.glob("groups/*/aws-profile.ini"))
    xcom = result.xcom("train")
    assert xcom["final_checkpoint"] == f"s3://{bucket}/ckpt/step-00000001"
    assert s3_fixtures.SECRET_KEY not in json.dumps(xcom)
    keys = [o["Key"] for o in moto_s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert "ckpt/step-00000001/COMMITTED" in keys and "ckpt/LINEAGE" in keys


def test_a_role_the_ranks_cannot_assume_themselves_says_why() -> None:
    """Only a plain assume_role with the connection's own source keys becomes a rank profile."""
    from types import SimpleNamespace

    from airflow_torchrun.storage.aws import rank_role

    def wrapper(**fields: Any) -> SimpleNamespace:
        base = {
            "conn_id": "c",
            "role_arn": ROLE_ARN,
            "assume_role_method": None,
            "assume_role_kwargs": {},
            "aws_access_key_id": "AKIDEXAMPLE",
            "aws_secret_access_key": "s3cr3t",
            "aws_session_token": None,
            "region_name": "eu-west-1",
        }
        return SimpleNamespace(**{**base, **fields}, get_service_endpoint_url=lambda *_a, **_k: None)

    role, why = rank_role(wrapper(assume_role_kwargs={"ExternalId": "x1", "DurationSeconds": 3600}))
    assert role is not None and why is None
    assert role.sts_endpoint == "https://sts.eu-west-1.amazonaws.com"
    text = role.config_text()
    assert "external_id = x1" in text and "duration_seconds = 3600" in text and "s3cr3t" in text
    assert rank_role(wrapper(role_arn=None)) == (None, None)
    for fields, reason in (
        ({"assume_role_method": "assume_role_with_web_identity"}, "assume_role_method"),
        ({"aws_access_key_id": None}, "worker's own chain"),
        ({"assume_role_kwargs": {"Policy": "{}"}}, "Policy"),
    ):
        role, why = rank_role(wrapper(**fields))
        assert role is None and why and reason in why, (fields, why)
