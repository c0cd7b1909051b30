"""Invalid specs fail when the DAG is parsed, with a message that says what to fix."""

from __future__ import annotations

import textwrap

import pytest

from airflow_torchrun.errors import InvalidSpecError
from airflow_torchrun.spec import GroupSpec


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"num_nodes": 0}, "num_nodes must be at least 1, got 0"),
        ({"nproc_per_node": -2}, "nproc_per_node must be at least 1, got -2"),
        ({"num_nodes": "two"}, "num_nodes must be a whole number"),
        ({"num_nodes": True}, "num_nodes must be a whole number"),
        ({"backend": "slurm"}, "backend 'slurm' is unknown; choose one of local, kubernetes"),
        ({"rdzv_port": 70000}, "rdzv_port must be a TCP port between 1 and 65535"),
        ({"rdzv_port": 0}, "rdzv_port must be a TCP port between 1 and 65535"),
        ({"script": None}, "give exactly one of script"),
        ({"command": ["x"]}, "give exactly one of script"),
        ({"script": "train.sh"}, "is not a .py file; to run another executable use command="),
        ({"script_args": "--lr 0.1"}, "script_args must be a list of strings"),
        ({"env": {"WORLD_SIZE": "8"}}, "env: WORLD_SIZE is set by torchrun"),
        ({"env": {"1BAD": "x"}}, "'1BAD' is not a valid environment variable name"),
        ({"startup_timeout": 0}, "startup_timeout must be a positive number of seconds"),
        ({"rdzv_timeout": -1}, "rdzv_timeout must be a positive number of seconds"),
        ({"threads_per_proc": 0}, "threads_per_proc must be at least 1"),
    ],
)
def test_invalid_values_are_named(kwargs, expected, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    args = {"script": str(script), **kwargs}
    with pytest.raises(InvalidSpecError) as info:
        GroupSpec.create(**args)
    assert expected in str(info.value)


def test_every_problem_is_reported_at_once(tmp_path):
    with pytest.raises(InvalidSpecError) as info:
        GroupSpec.create(num_nodes=0, nproc_per_node=0, script=str(tmp_path / "missing.py"), backend="x")
    assert len(info.value.problems) == 3
    # the missing script is checked only once the values are valid (no point in a fourth line)


def test_missing_script_is_named_with_its_resolved_path(tmp_path):
    """The local backend's question (a script in an image is not looked for), asked with the task's other checks."""
    from airflow_torchrun.settings import RunSettings, validate_task

    def make() -> GroupSpec:
        return GroupSpec.create(script=str(tmp_path / "missing.py"))

    with pytest.raises(InvalidSpecError, match=r"script '.*missing\.py' does not exist \(resolved to") as info:
        validate_task(make, where="task d.t", backend="local", run=RunSettings())
    # Where a relative script may live: the operator looks beside the DAG file too (resolve_script).
    assert "relative to the DAG file's folder or the worker's current directory" in str(info.value)
    assert validate_task(
        lambda: GroupSpec.create(script="/opt/trainer/missing.py", backend="kubernetes"),
        where="task d.t",
        backend="kubernetes",
        run=RunSettings(),
    )


def test_what_the_parse_time_checks_refuse_rendered_values_may_be(tmp_path, tiny_script):
    """A rendered template is text: '2' and numbers in env are taken then (the DAG's own literals are not)."""
    spec = GroupSpec.create(script=str(tiny_script), num_nodes="2", nproc_per_node="1", env={"A": 1})
    assert (spec.num_nodes, spec.env["A"]) == (2, "1")
    with pytest.raises(InvalidSpecError, match="num_nodes='2' is text"):
        GroupSpec.create(script=str(tiny_script), num_nodes="2", allow_templates=True)
    templated = GroupSpec.create(script=str(tiny_script), num_nodes="{{ params.n }}", allow_templates=True)
    assert templated.num_nodes == 1  # checked again once rendered


@pytest.mark.parametrize(
    "uri",
    ["http://mlflow:5000", "https://u@mlflow", "sqlite:////tmp/m.db", "postgresql+psycopg2://db/m", "/srv/mlruns",
     "./mlruns", "file:///srv/mlruns", "databricks", "databricks://profile", "{{ var.value.uri }}"],
)  # fmt: skip
def test_every_store_mlflow_tracks_to_passes_the_parse_time_check(uri):
    from airflow_torchrun.settings import tracking_uri_problems

    assert tracking_uri_problems(uri) == []
    assert tracking_uri_problems("s3://bucket/x") and tracking_uri_problems("")  # not a tracking store
    assert "secret" not in tracking_uri_problems("ftp://me:secret@host")[0]  # no credentials in the message


def test_templated_values_wait_for_rendering(tmp_path):
    spec = GroupSpec.create(script="{{ params.script }}", script_args=["{{ ds }}"], allow_templates=True)
    assert spec.script == "{{ params.script }}"
    with pytest.raises(InvalidSpecError, match="still hold template markup"):
        spec.check_rendered()


def test_spec_is_frozen(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    spec = GroupSpec.create(script=str(script), num_nodes=2, nproc_per_node=3, env={"A": 1})
    assert spec.world_size == 6
    assert spec.env["A"] == "1"
    with pytest.raises(AttributeError):
        spec.num_nodes = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.env["B"] = "2"  # type: ignore[index]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ("num_nodes=0", "num_nodes must be at least 1, got 0"),
        ("nproc_per_node=-1", "nproc_per_node must be at least 1"),
        ("backend='nomad'", "backend 'nomad' is unknown"),
        ("rdzv_port=99999", "rdzv_port must be a TCP port between 1 and 65535"),
        ("script='does/not/exist.py'", "script 'does/not/exist.py' does not exist"),
        # Issue 23's probe: each was accepted at parse time and failed (or misbehaved) later.
        ("resume='latest'", "'latest' is spelt 'auto'"),
        ("env={'A': 1}", "env['A'] is 1 (int): environment values are text; write '1'"),
        ("nproc_per_node='2'", "nproc_per_node='2' is text; write nproc_per_node=2"),
        ("script_args=['--epochs', None]", "script_args[1] is None (NoneType)"),
        ("backend='kubernetes', checkpoint_uri='s3://bucket/c', namespace='Bad_NS'", "e.g. 'bad-ns'"),
        ("mlflow_tracking_uri='ftp://x'", "has the scheme 'ftp', which MLflow cannot track to"),
        ("num_nodes=10**6", "the local backend starts every rank on the Airflow worker's machine (at most 256)"),
    ],
)
def test_bad_spec_is_a_dag_import_error(args, expected, airflow_db, tmp_path, tiny_script):
    """What a user sees in the UI's import errors: the DAG file fails to parse, naming the task."""
    from airflow.dag_processing.dagbag import DagBag

    script = f"script={str(tiny_script)!r}, " if "script=" not in args else ""
    dag_file = tmp_path / "bad_dag.py"
    dag_file.write_text(
        textwrap.dedent(
            f"""
            import pendulum
            from airflow.sdk import DAG
            from airflow_torchrun import DistributedTrainingOperator
            with DAG("bad_spec", schedule=None, start_date=pendulum.datetime(2026, 1, 1)):
                DistributedTrainingOperator(task_id="train", {script}{args})
            """
        )
    )
    bag = DagBag(dag_folder=str(dag_file))
    assert not bag.dags
    (error,) = bag.import_errors.values()
    assert "Invalid torchrun group spec for task bad_spec.train" in error
    assert expected in error


def test_parsing_a_dag_imports_no_torch_kubernetes_s3fs_or_mlflow(airflow_db):
    """STYLE 12: the DAG processor parses DAGs all day; the heavy libraries load only where used."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = (
        "import sys, runpy\n"
        f"runpy.run_path({str(ROOT / 'dags' / 'torchrun_pipeline.py')!r})\n"
        "heavy = [m for m in ('torch', 'kubernetes', 'kubernetes_asyncio', 's3fs', 'mlflow') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "HEAVY []" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


def test_a_relative_script_is_found_beside_the_dag_file(tmp_path, monkeypatch):
    """README "Your own script": a relative ``script=`` is looked up in the current directory, then
    next to the DAG file; the task keeps the absolute path it found."""
    import runpy

    dags, elsewhere = tmp_path / "dags", tmp_path / "worker-cwd"
    dags.mkdir()
    elsewhere.mkdir()
    (dags / "train.py").write_text("print('hi')\n")
    (dags / "my_training.py").write_text(
        textwrap.dedent(
            """
            import pendulum
            from airflow.sdk import DAG
            from airflow_torchrun import DistributedTrainingOperator

            with DAG("my_training", schedule=None, start_date=pendulum.datetime(2026, 1, 1)):
                task = DistributedTrainingOperator(task_id="train", script="train.py", num_nodes=2, backend="local")
            """
        )
    )
    monkeypatch.chdir(elsewhere)
    task = runpy.run_path(str(dags / "my_training.py"))["task"]
    assert task.script == str(dags / "train.py")
    assert task.group_spec().script == str(dags / "train.py")
    # In the current directory, the same name wins (looked up first).
    (elsewhere / "train.py").write_text("print('here')\n")
    assert runpy.run_path(str(dags / "my_training.py"))["task"].script == str(elsewhere / "train.py")
