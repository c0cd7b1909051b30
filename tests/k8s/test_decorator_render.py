"""``airflow-torchrun render`` of a ``@task.torchrun`` task: the Job carries the function, and validates."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from airflow_torchrun import cli
from airflow_torchrun.backends.kubernetes.render import ContainerTemplate, expand_for_node
from airflow_torchrun.contract.function import CALL_ENV, SOURCE_ENV

from .test_render import K8S_VERSIONS

DAG = textwrap.dedent(
    """
    import pendulum
    from airflow.sdk import DAG, task

    with DAG("nightly", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
             params={"epochs": 3}):

        @task
        def pick_lr():
            return 0.05

        @task.torchrun(backend="kubernetes", num_nodes=2, nproc_per_node=1, checkpoint_uri="s3://ckpt/nightly",
                       track=False)
        def train(lr, epochs=1):
            import torch
            import torch.distributed as dist

            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(10, 1))
            cost = "$(HOME) stays literal"
            return {"rank": dist.get_rank(), "lr": lr, "epochs": int(epochs), "cost": cost}

        train(pick_lr(), epochs="{{ params.epochs }}")
    """
)


@pytest.fixture
def rendered(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, list[dict]]:
    path = tmp_path / "nightly.py"
    path.write_text(DAG)
    assert cli.main(["render", "--dag-file", str(path), "--task-id", "train", "--run-id", "r1"]) == 0
    out = capsys.readouterr().out
    return out, list(yaml.safe_load_all(out))


def test_render_of_a_decorated_task_validates_against_the_kubernetes_schemas(rendered):
    _, objects = rendered
    assert [o["kind"] for o in objects] == ["Job", "Service", "NetworkPolicy"]
    for version in K8S_VERSIONS:
        for obj in objects:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_pod_template_carries_the_functions_source_and_arguments(rendered):
    out, objects = rendered
    container = objects[0]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][-4:] == ["--no-python", "python", "-m", "airflow_torchrun.worker.function"]
    # What the container starts with, after the kubelet's $(VAR) expansion (`$$` stays a literal `$`).
    _, env = expand_for_node(ContainerTemplate(command=tuple(container["command"]), env=tuple(container["env"])), 1)
    source = env[SOURCE_ENV]
    assert source.startswith("def train(lr, epochs=1):\n    import torch\n")
    assert 'cost = "$(HOME) stays literal"' in source
    call = json.loads(env[CALL_ENV])
    assert call["name"] == "train"
    # The upstream output does not exist at render time; the template is rendered.
    assert call["kwargs"] == {"lr": "<XCom 'return_value' of task pick_lr, resolved at run time>", "epochs": "3"}
    assert call["result_uri"] == "s3://ckpt/nightly/results/train-try1.json"
    assert env["TRAIN_CHECKPOINT_URI"] == "s3://ckpt/nightly"
    # Readable in review: the source is a literal block of the YAML.
    assert f"- name: {SOURCE_ENV}\n" in out and "      value: |\n" in out and "def train(lr, epochs=1):" in out
