"""Issue 23, trust boundaries round two: one test per finding, each with the review's probe as its
scenario. Data that others can write (a checkpoint store, XCom, a connection, a Variable, a rank's
own output) must never decide what the operator, the API server or the ranks do.

The tests that need a DAG run, the training view's API or a Kubernetes fake live beside their
subjects; these run in one process with real parts (a real checkpoint store on disk, real
markers, the real helpers).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from airflow_torchrun.worker import save_checkpoint
from tests import s3_fixtures

moto_s3 = s3_fixtures.moto_s3

CONTRACT_VARS = ("TRAIN_CHECKPOINT_URI", "TRAIN_RESUME_FROM", "TRAIN_CHECKPOINT_KEEP_LAST", "TRAIN_CHECKPOINT_LINEAGE")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (*CONTRACT_VARS, "WORLD_SIZE", "RANK", "TRAIN_CHECKPOINT_TRUST_SHARDED"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# -- finding 1: the HF resume helper wrote anywhere ---------------------------------------------
@pytest.mark.parametrize("escape", ["../../escaped.txt", "ABSOLUTE"])
def test_hf_resume_helper_writes_nothing_outside_output_dir(tmp_path: Path, clean_env: Any, escape: str) -> None:
    """A checkpoint in TorchrunCallback's format whose file names lead out of ``output_dir`` (``..``,
    an absolute path): whoever can write the store chose them. Nothing may be written, anywhere."""
    pytest.importorskip("transformers")
    from airflow_torchrun.integrations.transformers import _FORMAT, resume_checkpoint

    outside = tmp_path / "escaped.txt"
    name = str(outside) if escape == "ABSOLUTE" else escape
    root = tmp_path / "store"
    step = save_checkpoint({"format": _FORMAT, "files": {"config.json": b"{}", name: b"pwned"}}, 4, uri=str(root))
    clean_env.setenv("TRAIN_RESUME_FROM", step)
    output_dir = tmp_path / "runs" / "out"
    with pytest.raises(ValueError, match="outside"):
        resume_checkpoint(output_dir)
    assert not outside.exists()
    # None of the checkpoint's files was written, not even the harmless one.
    assert not (output_dir / "checkpoint-4" / "config.json").exists()


def test_hf_resume_helper_refuses_a_symlink_out_of_output_dir(tmp_path: Path, clean_env: Any) -> None:
    pytest.importorskip("transformers")
    from airflow_torchrun.integrations.transformers import _FORMAT, resume_checkpoint

    output_dir = tmp_path / "out"
    (output_dir / "checkpoint-4").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (output_dir / "checkpoint-4" / "link").symlink_to(elsewhere)
    step = save_checkpoint({"format": _FORMAT, "files": {"link/x.bin": b"pwned"}}, 4, uri=str(tmp_path / "store"))
    clean_env.setenv("TRAIN_RESUME_FROM", step)
    with pytest.raises(ValueError, match="symbolic link"):
        resume_checkpoint(output_dir)
    assert os.listdir(elsewhere) == []


def test_hf_resume_helper_still_writes_the_trainers_own_files(tmp_path: Path, clean_env: Any) -> None:
    pytest.importorskip("transformers")
    from airflow_torchrun.integrations.transformers import _FORMAT, resume_checkpoint

    files = {"trainer_state.json": b"{}", "sub/dir/rng_state_0.pth": b"rng"}
    step = save_checkpoint({"format": _FORMAT, "files": files}, 4, uri=str(tmp_path / "store"))
    clean_env.setenv("TRAIN_RESUME_FROM", step)
    target = Path(str(resume_checkpoint(tmp_path / "out")))
    assert target == tmp_path / "out" / "checkpoint-4"
    assert (target / "sub" / "dir" / "rng_state_0.pth").read_bytes() == b"rng"


# -- finding 5: INI injection into the ranks' AWS profile ------------------------------------------
INJECTED_ARN = "arn:aws:iam::123456789012:role/trainer\ncredential_process = /bin/sh -c 'touch /tmp/pwned'"


def test_a_newline_in_role_arn_never_reaches_the_ranks_aws_profile(tmp_path: Path, monkeypatch: Any) -> None:
    """The probe: a connection whose ``role_arn`` holds a newline and a ``credential_process`` line.
    Written as it was, botocore in every rank would run that command. It is refused, nothing written."""
    import json

    from airflow_torchrun.errors import StorageError
    from airflow_torchrun.storage.aws import rank_role_for

    connection = {
        "conn_type": "aws",
        "login": "AKIAEXAMPLEKEY",
        "password": "example-secret",
        "extra": {"role_arn": INJECTED_ARN, "region_name": "eu-west-1"},
    }
    monkeypatch.setenv("AIRFLOW_CONN_EVIL_ROLE", json.dumps(connection))
    with pytest.raises(StorageError, match="role_arn") as raised:
        role, _why = rank_role_for("evil_role")
        # What the ranks would have read (before the fix): botocore's own parse of the profile.
        assert role is not None
        profile = tmp_path / "profile.ini"
        env = role.write(profile)
        import botocore.session

        monkeypatch.setenv("AWS_CONFIG_FILE", env["AWS_CONFIG_FILE"])
        parsed = botocore.session.Session().full_config["profiles"][env["AWS_PROFILE"]]
        raise AssertionError(f"the ranks' profile was written: {parsed}")
    assert raised.value.transient is False


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("region_name", "eu-west-1\n[profile airflow-torchrun]\ncredential_process = id"),
        ("external_id", "x]\n[default"),
        ("role_session_name", "s\rcredential_process = id"),
    ],
)
def test_every_value_of_the_ranks_aws_profile_is_one_line(monkeypatch: Any, field: str, value: str) -> None:
    import json

    from airflow_torchrun.errors import StorageError
    from airflow_torchrun.storage.aws import rank_role_for

    extra: dict[str, Any] = {"role_arn": "arn:aws:iam::123456789012:role/trainer"}
    if field == "region_name":
        extra["region_name"] = value
    else:
        key = {"external_id": "ExternalId", "role_session_name": "RoleSessionName"}[field]
        extra["assume_role_kwargs"] = {key: value}
    connection = {"conn_type": "aws", "login": "AKIAEXAMPLEKEY", "password": "example-secret", "extra": extra}
    monkeypatch.setenv("AIRFLOW_CONN_EVIL_VALUE", json.dumps(connection))
    with pytest.raises(StorageError, match="line break"):
        rank_role_for("evil_value")


# -- finding 3: sharded-checkpoint trust was decided by the marker's own lineage -------------------
def test_a_foreign_store_whose_marker_claims_our_lineage_is_not_trusted(tmp_path: Path, clean_env: Any) -> None:
    """The probe: whoever writes a store outside the task's root writes its marker too, and wrote
    the rank's own lineage into it; the sharded step's metadata (unpickled on load) was then trusted."""
    import json

    import torch

    from airflow_torchrun.errors import StorageError
    from airflow_torchrun.worker import load_checkpoint

    ours = {"dag_id": "dag_a", "run_id": "manual__1", "task_id": "train", "map_index": -1, "try_number": 1}
    clean_env.setenv("TRAIN_CHECKPOINT_LINEAGE", json.dumps(ours))  # the forger copies what the rank will see
    foreign = save_checkpoint({"w": torch.arange(4.0)}, 3, uri=f"file://{tmp_path}/elsewhere", sharded=True)
    clean_env.setenv("TRAIN_CHECKPOINT_URI", f"file://{tmp_path}/ours")
    into = {"w": torch.zeros(4)}
    with pytest.raises(StorageError, match="outside this task's checkpoint root"):
        load_checkpoint(uri=foreign, into=into)
    assert torch.equal(into["w"], torch.zeros(4))  # nothing was read into it
    # A sharded step inside the task's own root loads, whatever its marker says.
    clean_env.setenv("TRAIN_CHECKPOINT_LINEAGE", json.dumps({**ours, "dag_id": "someone_else"}))
    own = save_checkpoint({"w": torch.arange(4.0)}, 4, sharded=True)
    clean_env.setenv("TRAIN_CHECKPOINT_LINEAGE", json.dumps(ours))
    assert torch.equal(load_checkpoint(uri=own, into=into)["w"], torch.arange(4.0))  # type: ignore[index]


# -- low: a corrupt marker blocked resume from older good steps -----------------------------------
def test_a_corrupt_marker_is_skipped_for_the_older_good_step(
    tmp_path: Path, clean_env: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The probe: a committed step's marker, valid JSON, says ``"files": {"state.pt": "big"}``; every
    resume raised a bare ``ValueError`` instead of using the step before it."""
    import json

    import torch

    from airflow_torchrun.storage.checkpoints import COMMIT_MARKER, CheckpointStore
    from airflow_torchrun.storage.lineage import resolve_resume
    from airflow_torchrun.worker import load_checkpoint, resume_step

    root = f"file://{tmp_path}/ckpt"
    clean_env.setenv("TRAIN_CHECKPOINT_URI", root)
    save_checkpoint({"w": torch.ones(2)}, 1)
    second = save_checkpoint({"w": torch.ones(2) * 2}, 2)
    store = CheckpointStore(root)
    marker_path = Path(store.step_path(2)) / COMMIT_MARKER
    marker = json.loads(marker_path.read_text())
    marker["files"] = {name: "big" for name in marker["files"]}
    marker_path.write_text(json.dumps(marker))
    with caplog.at_level("WARNING"):
        latest = store.latest()
    assert latest is not None and latest.step == 1
    assert "Skipping checkpoint" in caplog.text and "step-00000002" in caplog.text
    ref = resolve_resume(root, "auto")
    assert ref is not None and ref.step == 1
    # A rank told to resume from the corrupt step (the operator looked before it was corrupted).
    clean_env.setenv("TRAIN_RESUME_FROM", second)
    state = load_checkpoint()
    assert state is not None and float(state["w"][0]) == 1.0 and resume_step() == 1


# -- low: the LINEAGE claim was read-then-write, and prune was not lineage-scoped ---------------------
@pytest.mark.parametrize("scheme", ["file", "s3"])
def test_two_tasks_claiming_one_root_at_once_never_both_win(tmp_path: Path, scheme: str, request: Any) -> None:
    """The probe: two task instances start on one fresh root at the same moment; both read "no
    LINEAGE", both wrote theirs, both launched, each later resuming or pruning the other's steps."""
    import threading

    from airflow_torchrun.errors import StorageError
    from airflow_torchrun.storage.checkpoints import CheckpointStore
    from airflow_torchrun.storage.lineage import Lineage, claim_lineage, read_lineage

    if scheme == "s3":
        moto = request.getfixturevalue("moto_s3")
        bucket, options = moto.make_bucket(), moto.storage_options()
    for round_ in range(8):
        uri = f"s3://{bucket}/r{round_}" if scheme == "s3" else f"file://{tmp_path}/r{round_}"
        claimants = [Lineage("dag", f"run_{who}", "train") for who in ("a", "b")]
        stores = [CheckpointStore(uri, options if scheme == "s3" else None) for _ in claimants]
        for store in stores:
            s3_fixtures.reachable(store)
        ready = threading.Barrier(2)
        won: list[Lineage] = []
        refused: list[str] = []

        def claim(
            store: CheckpointStore,
            lineage: Lineage,
            ready: threading.Barrier = ready,
            won: list[Lineage] = won,
            refused: list[str] = refused,
        ) -> None:
            ready.wait()
            try:
                claim_lineage(store, lineage)
                won.append(lineage)
            except StorageError as exc:
                refused.append(str(exc))

        threads = [threading.Thread(target=claim, args=pair) for pair in zip(stores, claimants, strict=True)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len(won) == 1 and len(refused) == 1, (round_, won, refused)
        assert read_lineage(stores[0]) == won[0] and "belongs to another task instance" in refused[0]


def test_retention_never_prunes_another_lineages_steps(tmp_path: Path, clean_env: Any) -> None:
    """The probe: a root claimed by task A holds steps that task B committed there anyway (B ignored
    the claim, or wrote before it); A's retention deleted them with its own."""
    import json

    import torch

    from airflow_torchrun.storage.checkpoints import CheckpointStore

    root = f"file://{tmp_path}/ckpt"
    theirs = {"dag_id": "dag_b", "run_id": "manual__2", "task_id": "train", "map_index": -1, "try_number": 1}
    mine = {**theirs, "dag_id": "dag_a"}
    clean_env.setenv("TRAIN_CHECKPOINT_LINEAGE", json.dumps(theirs))
    for step in (1, 2):
        save_checkpoint({"w": torch.ones(1)}, step, uri=root, keep_last=5)
    clean_env.setenv("TRAIN_CHECKPOINT_LINEAGE", json.dumps(mine))
    for step in (10, 20, 30):
        save_checkpoint({"w": torch.zeros(1)}, step, uri=root, keep_last=1)
    assert [r.step for r in CheckpointStore(root).committed()] == [1, 2, 30]


# -- also: two deployments sharing a store have equal run ids ----------------------------------------
def test_a_root_claimed_by_another_deployment_is_refused_deleting_nothing(tmp_path: Path, clean_env: Any) -> None:
    """The probe: staging and production on one bucket (or two AIRFLOW_HOMEs on one machine) run
    the same DAG for the same logical date: equal run ids, so equal lineages, and the second
    resumed from the first one's checkpoints as its own."""
    import json

    import torch

    from airflow_torchrun.errors import StorageError
    from airflow_torchrun.storage.checkpoints import CheckpointStore
    from airflow_torchrun.storage.lineage import Lineage, claim_lineage, final_checkpoint

    root = f"file://{tmp_path}/ckpt"
    store = CheckpointStore(root)
    staging = Lineage("pipeline", "scheduled__2026-01-01T00:00:00+00:00", "train", deployment="af-staging")
    production = Lineage(staging.dag_id, staging.run_id, staging.task_id, deployment="af-production")
    claim_lineage(store, staging)
    clean_env.setenv("TRAIN_CHECKPOINT_LINEAGE", json.dumps({**staging.to_dict(), "try_number": 1}))
    save_checkpoint({"w": torch.ones(1)}, 30, uri=root)
    with pytest.raises(StorageError, match="another Airflow deployment") as refused:
        claim_lineage(store, production)
    assert refused.value.transient is False
    assert "checkpoint_base" in str(refused.value) and "resume_from_outside=True" in str(refused.value)
    assert [r.step for r in store.committed()] == [30]
    # Nor is staging's step production's final checkpoint.
    assert final_checkpoint(store, production) is None and final_checkpoint(store, staging) is not None
    # A root claimed before lineages named their deployment is adopted by its own ids.
    old = CheckpointStore(f"file://{tmp_path}/old")
    claim_lineage(old, Lineage(staging.dag_id, staging.run_id, staging.task_id))
    claim_lineage(old, staging)


# -- turn-2 leftover: gather_object unpickled peer data in the ranks -------------------------------
PEER_SCRIPT = """
import os, sys, torch.distributed as dist
from airflow_torchrun.worker.checkpoint.comm import checkpoint_comm

class Payload:
    def __reduce__(self):  # runs in whichever process unpickles it
        return (open, (sys.argv[1], "w"))

dist.init_process_group("gloo")
comm = checkpoint_comm()
if dist.get_rank() == 1:
    # What the checkpoint helpers' exchange looks like on the wire, carrying a pickle instead.
    try:
        dist.all_gather_object([None, None], Payload(), group=comm.group)
    except Exception as exc:
        print(f"rank 1: {type(exc).__name__} {exc}", flush=True)  # one write: the ranks share stdout
else:
    try:
        print(f"rank 0 got {comm.all_gather({'problems': []})}", flush=True)
    except RuntimeError as exc:
        print(f"rank 0 refused: {exc}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_the_ranks_never_unpickle_what_a_peer_sends(tmp_path: Path) -> None:
    """The probe: one rank hands the checkpoint exchange a pickle whose ``__reduce__`` creates a file;
    the other rank's ``all_gather_object`` ran it. Now the exchange is JSON in byte tensors."""
    import subprocess
    import sys

    script, created = tmp_path / "peer.py", tmp_path / "created-by-a-peer"
    script.write_text(PEER_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in CONTRACT_VARS}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            f"--log-dir={tmp_path / 'torchrun-logs'}",  # without it torchrun leaves a folder in /tmp
            str(script),
            str(created),
        ],
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert not created.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    assert "rank 0 refused: a peer rank sent" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


# -- low: progress records could be forged across ranks; nested brackets raised RecursionError -------
def test_a_rank_cannot_report_progress_for_another_rank() -> None:
    """The probe: rank 0 prints a record naming rank 3 (a straggler alarm for a healthy rank, or
    3,000,000 ranks' worth of board entries); every line a rank prints carries its own prefix."""
    from airflow_torchrun.contract.progress import ProgressRecord, parse_records

    forged = ProgressRecord(rank=3, step=999, time=1.0, step_time=50.0).to_line()
    honest = ProgressRecord(rank=0, step=10, time=1.0, step_time=0.1).to_line()
    huge = ProgressRecord(rank=2_999_999, step=1, time=1.0).to_line()
    lines = [f"[node 0 rank 0] {forged}", f"[node 0 rank 0] {honest}", f"[node 0 rank 0] {huge}"]
    assert [(r.rank, r.step) for r in parse_records(lines)] == [(0, 10)]


def test_deeply_nested_progress_records_are_skipped_per_line() -> None:
    """The probe: ``@torchrun-progress [[[[...`` 100,000 deep raised RecursionError out of the
    training view's request (and the watch's look); now that one line is skipped."""
    from airflow_torchrun.contract.progress import MARKER, ProgressRecord, parse_records

    good = "[node 0 rank 1] " + ProgressRecord(rank=1, step=5, time=1.0).to_line()
    assert [r.step for r in parse_records([f"[node 0 rank 0] {MARKER}{'[' * 100_000}", good])] == [5]


# -- low: the stale-group scan stopped at relaunch 7 -----------------------------------------------
@pytest.mark.slow  # starts processes
def test_a_group_left_running_by_an_earlier_try_is_stopped_at_any_relaunch(tmp_path: Path) -> None:
    """The probe: an earlier try relaunched its group 9 times (port races, restarts) and left the
    tenth running; the next try looked at relaunches 0-7 only and let it run on beside its own."""
    import subprocess
    import sys
    from dataclasses import replace

    from airflow_torchrun.backends.local.backend import LocalBackend
    from airflow_torchrun.contract.launch import GROUP_ID_VAR
    from airflow_torchrun.naming import GroupIdentity

    second_try = GroupIdentity("dag", "train", "manual__1", try_number=2)
    leftover = replace(second_try, try_number=1, relaunch=9).group_id
    unrelated = replace(second_try, task_id="other", try_number=1).group_id
    procs = {
        group: subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)"], env={**os.environ, GROUP_ID_VAR: group}
        )
        for group in (leftover, unrelated)
    }
    try:
        stopped = LocalBackend(state_dir=tmp_path).stop_earlier_tries(second_try)
        assert stopped == [leftover]
        assert procs[leftover].wait(timeout=30) is not None
        assert procs[unrelated].poll() is None  # another task's group is none of this try's business
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


# -- also: the local default state directory belongs to one AIRFLOW_HOME ------------------------------
@pytest.mark.slow  # starts processes
def test_the_default_state_dir_belongs_to_one_airflow_home(tmp_path: Path) -> None:
    """The probe: two AIRFLOW_HOMEs of one OS user, nothing configured, shared ``~/.airflow-torchrun``
    (group directories, default checkpoints, the default MLflow store)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW__TORCHRUN__", "AIRFLOW_TORCHRUN_"))}
    code = "from airflow_torchrun.state import state_dir; print(state_dir())"
    seen = {}
    for home in ("staging", "production"):
        done = subprocess.run(
            [sys.executable, "-c", code],
            env={**env, "AIRFLOW_HOME": str(tmp_path / home)},
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        seen[home] = Path(done.stdout.strip().splitlines()[-1])
    assert seen["staging"] != seen["production"], seen
    assert all(path.is_relative_to(tmp_path / home) for home, path in seen.items()), seen
