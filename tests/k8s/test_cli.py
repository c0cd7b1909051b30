"""``airflow-torchrun render``: the objects a task would create, from its DAG file alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from airflow_torchrun import cli
from airflow_torchrun.backends.kubernetes.backend import KubernetesBackend
from airflow_torchrun.backends.kubernetes.runtimes import BUILTIN_RUNTIMES
from airflow_torchrun.naming import GroupIdentity
from airflow_torchrun.spec import GroupSpec

DAG = textwrap.dedent(
    """
    import pendulum
    from airflow.sdk import DAG
    from airflow_torchrun import DistributedTrainingOperator

    with DAG("nightly", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
             params={"epochs": 3}):
        DistributedTrainingOperator(
            task_id="train",
            backend="kubernetes",
            runtime="gpu",
            script="/opt/trainer/train.py",
            script_args=["--epochs", "{{ params.epochs }}"],
            num_nodes=2,
            nproc_per_node=1,
            env={"RUN": "{{ run_id }}"},
            checkpoint_uri="s3://ckpt/nightly",
            track=False,
        )
        DistributedTrainingOperator(task_id="local_train", command=["true"], backend="local")
    """
)


@pytest.fixture
def dag_file(tmp_path: Path) -> Path:
    path = tmp_path / "nightly.py"
    path.write_text(DAG)
    return path


def expected_objects(namespace: str, run_id: str, try_number: int) -> list[dict[str, object]]:
    spec = GroupSpec.create(
        num_nodes=2,
        nproc_per_node=1,
        script="/opt/trainer/train.py",
        script_args=["--epochs", "3"],
        env={"RUN": run_id},
        backend="kubernetes",
        runtime="gpu",
    )
    backend = KubernetesBackend(namespace=namespace, runtimes=BUILTIN_RUNTIMES)
    identity = GroupIdentity("nightly", "train", run_id, try_number=try_number)
    # What the operator adds to the rank contract, as its I/O-free preview shows it.
    contract = {
        "TRAIN_CHECKPOINT_URI": "s3://ckpt/nightly",
        "TRAIN_CHECKPOINT_DIR": "s3://ckpt/nightly",
        "TRAIN_RESUME_FROM": "<latest committed checkpoint, or empty on a fresh start>",
        "TRAIN_CHECKPOINT_KEEP_LAST": "3",
    }
    return backend.render(backend.plan(spec, identity, contract)).objects


def test_render_prints_exactly_what_the_backend_would_create(
    dag_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = "manual__2026-11-30T10:00:00+00:00"
    args = ["render", "--dag-file", str(dag_file), "--task-id", "train", "--run-id", run_id, "--try-number", "2"]
    assert cli.main([*args, "--namespace", "ml"]) == 0
    out = capsys.readouterr().out
    objects = list(yaml.safe_load_all(out))
    assert objects == expected_objects("ml", run_id, 2)
    assert [o["kind"] for o in objects] == ["Job", "Service", "NetworkPolicy"]
    for obj in objects:
        kubernetes_validate.validate(obj, "1.34.0", strict=True)


@pytest.mark.slow
def test_console_script_keeps_stdout_for_yaml(dag_file: Path) -> None:
    script = Path(sys.executable).with_name("airflow-torchrun")
    done = subprocess.run(
        [str(script), "render", "--dag-file", str(dag_file), "--task-id", "train"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("# airflow-torchrun render: nightly.train, run manual__render, try 1")
    assert "# Not shown" not in done.stdout  # the operator previews its contract variables
    assert list(yaml.safe_load_all(done.stdout)) == expected_objects("default", "manual__render", 1)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--task-id", "nope"], "DAG nightly has no task 'nope'; its tasks: local_train, train"),
        (["--task-id", "local_train"], "uses backend='local'; render prints the objects of backend='kubernetes'"),
        (["--task-id", "train", "--dag-id", "other"], "has no DAG 'other'; it defines nightly"),
    ],
)
def test_render_errors_say_what_to_change(
    dag_file: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert cli.main(["render", "--dag-file", str(dag_file), *extra]) == 1
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""


def test_render_with_a_runtimes_file(dag_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runtimes = tmp_path / "runtimes.yaml"
    runtimes.write_text("gpu:\n  image: registry.example.com/trainer:9\n  resources: {gpu: 2}\n")
    assert (
        cli.main(["render", "--dag-file", str(dag_file), "--task-id", "train", "--runtimes-file", str(runtimes)]) == 0
    )
    job = next(yaml.safe_load_all(capsys.readouterr().out))
    trainer = job["spec"]["template"]["spec"]["containers"][0]
    assert trainer["image"] == "registry.example.com/trainer:9"
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "2"

    runtimes.write_text("cpu:\n  image: t:1\n")
    assert (
        cli.main(["render", "--dag-file", str(dag_file), "--task-id", "train", "--runtimes-file", str(runtimes)]) == 1
    )
    assert "runtime 'gpu' is unknown; known runtimes: cpu" in capsys.readouterr().err


def test_contract_variables_come_from_a_side_effect_free_preview(tmp_path: Path, capsys) -> None:
    path = tmp_path / "preview.py"
    path.write_text(
        DAG.replace(
            "from airflow_torchrun import DistributedTrainingOperator",
            "from airflow_torchrun import DistributedTrainingOperator as _Base\n\n"
            "class DistributedTrainingOperator(_Base):\n"
            "    def contract_env_preview(self, context):\n"
            "        return {'TRAIN_CHECKPOINT_URI': f\"s3://ckpt/{context['run_id']}\"}\n",
        )
    )
    assert cli.main(["render", "--dag-file", str(path), "--task-id", "train", "--run-id", "r1"]) == 0
    out = capsys.readouterr().out
    assert "Not shown" not in out
    env = next(yaml.safe_load_all(out))["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "TRAIN_CHECKPOINT_URI", "value": "s3://ckpt/r1"} in env


UPSTREAM = textwrap.dedent(
    """
    import pendulum
    from airflow.sdk import DAG, task
    from airflow_torchrun import DistributedTrainingOperator

    with DAG("chained", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
             params={"epochs": 3, "lr": 0.1}):
        @task
        def manifest():
            return "s3://data/manifest.json"

        m = manifest()
        DistributedTrainingOperator(
            task_id="train",
            backend="kubernetes",
            runtime="cpu",
            script="/opt/trainer/train.py",
            script_args=["--epochs", "{{ params.epochs }}", "--lr", "{{ params.lr }}", "--data", m],
            env={"NOTE": "{{ dag_run.conf.get('note', 'none') }}"},
            checkpoint_uri="s3://ckpt/chained",
            shard_manifest=m,
            track=False,
        )
    """
)


def _trainer(out: str) -> dict[str, object]:
    job = next(yaml.safe_load_all(out))
    return dict(job["spec"]["template"]["spec"]["containers"][0])


def test_render_shows_upstream_outputs_as_placeholders_and_takes_the_runs_conf(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An upstream task's output (``XComArg``) exists only at run time: shown as a placeholder that
    names it (it failed with KeyError 'ti' before); ``--conf`` is merged over the params as a
    triggered run's conf is, and ``dag_run.conf`` reads it."""
    path = tmp_path / "chained.py"
    path.write_text(UPSTREAM)
    args = ["render", "--dag-file", str(path), "--task-id", "train"]
    assert cli.main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    trainer = _trainer(out)
    placeholder = "<XCom 'return_value' of task manifest, resolved at run time>"
    assert trainer["command"][-6:] == ["--epochs", "3", "--lr", "0.1", "--data", placeholder], trainer["command"]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert (env["TRAIN_SHARD_MANIFEST"], env["NOTE"]) == (placeholder, "none"), env
    for obj in yaml.safe_load_all(out):
        kubernetes_validate.validate(obj, "1.34.0", strict=True)

    assert cli.main([*args, "--conf", '{"epochs": 7, "note": "from the form"}']) == 0
    trainer = _trainer(capsys.readouterr().out)
    assert trainer["command"][-6:-2] == ["--epochs", "7", "--lr", "0.1"], trainer["command"]
    assert {"name": "NOTE", "value": "from the form"} in trainer["env"]


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ('{"backend": "slurm"}', "are invalid: Invalid input for param backend: 'slurm'"),
        ('{"num_nodes": 0}', "are invalid: Invalid input for param num_nodes"),
    ],
)
def test_render_refuses_a_conf_the_trigger_form_would(conf: str, message: str, capsys) -> None:
    pipeline = Path(__file__).resolve().parents[2] / "dags" / "torchrun_pipeline.py"
    assert cli.main(["render", "--dag-file", str(pipeline), "--task-id", "train", "--conf", conf]) == 1
    err = capsys.readouterr().err
    assert message in err and "Failed validating" not in err, err


def test_render_refuses_conf_that_is_not_a_json_object(dag_file: Path, capsys) -> None:
    for conf, message in (("[1]", "a JSON object is needed"), ("{epochs: 3}", "not JSON")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["render", "--dag-file", str(dag_file), "--task-id", "train", "--conf", conf])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_render_shows_the_shipped_pipelines_jobs(monkeypatch, capsys) -> None:
    """README: ``make demo BACKEND=kubernetes`` runs the pipeline's training and evaluation as Jobs;
    ``render`` shows each from the DAG file, with the run's conf, before anything runs. What upstream
    tasks push (``shard.output``, ``ti.xcom_pull(...)``) is shown as a placeholder that names it."""
    monkeypatch.setenv("AIRFLOW__TORCHRUN__CHECKPOINT_BASE", "s3://ckpt/base")
    monkeypatch.setenv("AIRFLOW__TORCHRUN__MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    pipeline = Path(__file__).resolve().parents[2] / "dags" / "torchrun_pipeline.py"
    conf = '{"backend": "kubernetes", "num_nodes": 2, "shards_uri": "s3://data/shards"}'
    manifest = "<XCom 'return_value' of task shard, resolved at run time>"
    final = "<XCom 'return_value' of task train['final_checkpoint'], resolved at run time>"
    for task_id, nodes in (("train", 2), ("evaluate", 1)):
        assert cli.main(["render", "--dag-file", str(pipeline), "--task-id", task_id, "--conf", conf]) == 0
        out = capsys.readouterr().out
        objects = list(yaml.safe_load_all(out))
        assert [o["kind"] for o in objects] == ["Job", "Service", "NetworkPolicy"], task_id
        assert objects[0]["spec"]["completions"] == nodes, task_id
        for obj in objects:
            kubernetes_validate.validate(obj, "1.34.0", strict=True)
        env = {e["name"]: e.get("value") for e in _trainer(out)["env"]}
        assert env["TRAIN_SHARD_MANIFEST"] == manifest, env
        if task_id == "evaluate":
            assert env["EVAL_CHECKPOINT_URI"] == final, env
            assert env["EVAL_METRICS_URI"] == f"<the folder of {final}>/eval/evaluate-try1.json", env
            # The same variables as a launch sets (the preview lacked these before).
            run = "<XCom 'return_value' of task train['mlflow_run_id'], resolved at run time>"
            assert (env["MLFLOW_RUN_ID"], env["MLFLOW_TRACKING_URI"]) == (run, "http://mlflow.example:5000"), env
    # Without --conf the pipeline's training runs locally: nothing to render, and render says so.
    assert cli.main(["render", "--dag-file", str(pipeline), "--task-id", "train"]) == 1
    assert "uses backend='local'" in capsys.readouterr().err


def test_a_param_without_default_is_asked_for(tmp_path: Path, capsys) -> None:
    """As the Trigger form does: a param with no default needs a value (``--conf``)."""
    path = tmp_path / "needs.py"
    path.write_text(
        DAG.replace('params={"epochs": 3}', 'params={"epochs": Param(type="integer", minimum=1)}').replace(
            "from airflow.sdk import DAG", "from airflow.sdk import DAG, Param"
        )
    )
    args = ["render", "--dag-file", str(path), "--task-id", "train"]
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert "are invalid: Invalid input for param epochs" in err and "--conf" in err, err
    assert cli.main([*args, "--conf", '{"epochs": 4}']) == 0
    assert _trainer(capsys.readouterr().out)["command"][-2:] == ["--epochs", "4"]


LOOPS = textwrap.dedent(
    """
    import pendulum
    from airflow.sdk import DAG, task
    from airflow_torchrun import DistributedTrainingOperator

    with DAG("loops", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False, params={"y": 2}):
        @task
        def files():
            return ["s3://d/a", "s3://d/b"]

        f = files()
        t = DistributedTrainingOperator(
            task_id="train", backend="kubernetes", runtime="cpu", script="/opt/trainer/train.py",
            script_args=[
                "--files", "{{ ti.xcom_pull(task_ids='files') | join(',') }}",
                "--each", "{% for x in task_instance.xcom_pull('files') %}{{ x }}{% endfor %}",
                "--get", "{{ ti.xcom_pull(task_ids='files', key='meta').get('k') }}",
                "--json", "{{ ti.xcom_pull(task_ids='files') | tojson }}",
                "--x", "{{ params.x }}", "--y", "{{ params.y }}",
            ],
            params={"x": 1},
            checkpoint_uri="s3://ckpt-bucket/p", track=False,
        )
        f >> t
    """
)


@pytest.mark.timeout(120)
def test_render_templates_that_loop_over_or_read_into_an_upstream_output(tmp_path: Path, capsys) -> None:
    """``join``, ``for``, ``.get()`` and ``tojson`` over ``ti.xcom_pull(...)`` (``join`` iterated the
    placeholder forever, ``.get`` was "not safely callable"); ``task_instance`` is ``ti``; the
    task's own ``params`` are seen; and the preview creates nothing (no deployment Variable)."""
    path = tmp_path / "loops.py"
    path.write_text(LOOPS)
    assert cli.main(["render", "--dag-file", str(path), "--task-id", "train"]) == 0
    captured = capsys.readouterr()
    args = _trainer(captured.out)["command"]
    values = dict(zip(args[-12::2], args[-11::2], strict=True))
    element = "<an element of XCom 'return_value' of task files, resolved at run time>"
    assert values["--files"] == values["--each"] == element, values
    assert values["--get"] == "<XCom 'meta' of task files.get('k'), resolved at run time>", values
    assert "resolved at run time" in json.loads(values["--json"]), values
    assert (values["--x"], values["--y"]) == ("1", "2"), values
    assert "Variable" not in captured.err, captured.err


def test_render_says_a_mapped_task_cannot_be_rendered(tmp_path: Path, capsys) -> None:
    path = tmp_path / "mapped.py"
    path.write_text(
        textwrap.dedent(
            """
            import pendulum
            from airflow.sdk import DAG
            from airflow_torchrun import DistributedTrainingOperator

            with DAG("mapped", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False):
                DistributedTrainingOperator.partial(
                    task_id="sweep", backend="kubernetes", runtime="cpu", script="/opt/trainer/train.py",
                    checkpoint_uri="s3://ckpt/sweep", track=False,
                ).expand(script_args=[["--lr", "0.1"], ["--lr", "0.2"]])
            """
        )
    )
    assert cli.main(["render", "--dag-file", str(path), "--task-id", "sweep"]) == 1
    assert "task mapped.sweep is mapped (.expand())" in capsys.readouterr().err
