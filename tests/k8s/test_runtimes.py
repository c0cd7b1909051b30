"""Platform runtimes: built-in examples, a YAML file, an Airflow Variable, and clear errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_torchrun.backends.kubernetes import runtimes
from airflow_torchrun.backends.kubernetes.runtimes import BUILTIN_RUNTIMES, get_runtime, load_runtimes, parse_runtime
from airflow_torchrun.errors import InvalidSpecError

FILE_RUNTIMES = """\
# a platform team's runtimes
small:
  image: registry.example.com/trainer:1.0
  resources: {cpu: "500m", memory: 2Gi}
h100:
  image: registry.example.com/trainer:1.0
  nproc_per_node: 8
  resources: {cpu: "96", memory: 1Ti, gpu: 8}
  shm_size: 128Gi
  queue: research
  node_selector: {cloud.example.com/accelerator: h100}
  tolerations:
    - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
"""


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in (
        "AIRFLOW__TORCHRUN__RUNTIMES_FILE",
        "AIRFLOW__TORCHRUN__RUNTIMES_VARIABLE",
        "AIRFLOW_VAR_TORCHRUN_RUNTIMES",
        "AIRFLOW__TORCHRUN__DEFAULT_RUNTIME",
    ):
        monkeypatch.delenv(var, raising=False)
    runtimes.clear_cache()
    yield
    runtimes.clear_cache()


def test_builtin_examples_are_in_effect_when_nothing_is_configured() -> None:
    catalog = load_runtimes()
    assert sorted(catalog.runtimes) == ["cpu", "gpu"]
    assert catalog.sources == ("built-in examples",)
    assert get_runtime(None).name == "cpu"  # the default runtime
    gpu = get_runtime("gpu")
    assert gpu.gpu == 1 and gpu.resources()["limits"]["nvidia.com/gpu"] == "1"
    assert gpu.tolerations[0]["key"] == "nvidia.com/gpu"


def test_runtimes_file_from_airflow_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "runtimes.yaml"
    path.write_text(FILE_RUNTIMES)
    monkeypatch.setenv("AIRFLOW__TORCHRUN__RUNTIMES_FILE", str(path))
    monkeypatch.setenv("AIRFLOW__TORCHRUN__DEFAULT_RUNTIME", "small")
    catalog = load_runtimes()
    assert sorted(catalog.runtimes) == ["h100", "small"]  # the built-ins are examples only
    h100 = get_runtime("h100")
    assert (h100.nproc_per_node, h100.gpu, h100.queue, h100.shm_size) == (8, 8, "research", "128Gi")
    assert h100.node_selector == {"cloud.example.com/accelerator": "h100"}
    assert get_runtime(None).name == "small"
    assert get_runtime("small").cpus == 0.5
    with pytest.raises(InvalidSpecError, match=r"runtime 'gpu' is unknown; known runtimes: h100, small \(from file "):
        get_runtime("gpu", where="task pipeline.train")


def test_the_file_is_reread_only_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "runtimes.yaml"
    path.write_text(FILE_RUNTIMES)
    first = load_runtimes(file=str(path), variable="").runtimes
    assert load_runtimes(file=str(path), variable="").runtimes["small"] is first["small"]  # not parsed again
    path.write_text(FILE_RUNTIMES + "tiny:\n  image: t:1\n")
    assert "tiny" in load_runtimes(file=str(path), variable="").runtimes


def test_a_configured_variable_json_or_yaml_adds_runtimes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "runtimes.yaml"
    path.write_text(FILE_RUNTIMES)
    variable = {"small-v2": {"image": "registry.example.com/trainer:1.0", "resources": {"cpu": "1"}}}
    # An environment-defined Airflow Variable, read through Airflow's secrets chain, once configured.
    monkeypatch.setenv("AIRFLOW__TORCHRUN__RUNTIMES_VARIABLE", "torchrun_runtimes")
    monkeypatch.setenv("AIRFLOW_VAR_TORCHRUN_RUNTIMES", json.dumps(variable))
    catalog = load_runtimes(file=str(path))
    assert sorted(catalog.runtimes) == ["h100", "small", "small-v2"]
    assert catalog.runtimes["small-v2"].cpu == "1"
    assert catalog.sources == (f"file {path}", "Variable torchrun_runtimes")

    runtimes.clear_cache()
    monkeypatch.setenv("AIRFLOW_VAR_TORCHRUN_RUNTIMES", f"only-yaml:\n  image: {runtimes.DEFAULT_IMAGE}\n")
    assert sorted(load_runtimes().runtimes) == ["only-yaml"]


def test_an_unreadable_variable_never_breaks_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk import Variable

    def no_database(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no metadata database here")

    monkeypatch.setattr(Variable, "get", no_database)
    assert sorted(load_runtimes().runtimes) == ["cpu", "gpu"]


def test_every_problem_of_a_bad_file_is_reported_at_once(tmp_path: Path) -> None:
    path = tmp_path / "runtimes.yaml"
    path.write_text(
        "bad:\n"
        "  resources: {cpu: lots, gpu: -1, tpu: 4}\n"
        "  shm_size: 1 GB\n"
        "  image_pull_policy: Sometimes\n"
        "  tolerations: [{key: a, effects: NoSchedule}]\n"
        "  nproc_per_node: 0\n"
        "  imagee: typo\n"
        "  pod_overrides: {containers: []}\n"
        "  container_overrides: {command: [sh]}\n"
        "Bad_Name:\n"
        "  image: t:1\n"
    )
    with pytest.raises(InvalidSpecError) as info:
        load_runtimes(file=str(path), variable="")
    text = str(info.value)
    for fragment in (
        "image is required",
        "resources.cpu 'lots' is not a Kubernetes quantity",
        "resources.gpu must be a whole number >= 0",
        "resources: unknown key 'tpu'",
        "shm_size '1 GB' is not a Kubernetes quantity",
        "image_pull_policy must be one of Always, IfNotPresent, Never",
        "tolerations: unknown key(s) effects",
        "nproc_per_node must be a whole number >= 1",
        "unknown field(s) imagee",
        "pod_overrides may not set containers",
        "container_overrides may not set command",
        "runtime name 'Bad_Name' must be lower-case",
    ):
        assert fragment in text, fragment


def test_missing_or_broken_file_says_what_to_fix(tmp_path: Path) -> None:
    with pytest.raises(
        InvalidSpecError, match=r"runtimes file .*nope.yaml cannot be read .*fix \[torchrun\] runtimes_file"
    ):
        load_runtimes(file=str(tmp_path / "nope.yaml"), variable="")
    broken = tmp_path / "broken.yaml"
    broken.write_text("cpu: [unclosed\n")
    with pytest.raises(InvalidSpecError, match="not valid YAML/JSON"):
        load_runtimes(file=str(broken), variable="")
    listy = tmp_path / "list.yaml"
    listy.write_text("- image: t:1\n")
    with pytest.raises(InvalidSpecError, match="expected a mapping of runtime name -> definition"):
        load_runtimes(file=str(listy), variable="")


def test_defaults_of_one_runtime() -> None:
    rt = parse_runtime("x", {"image": "t:1", "resources": {"gpu": 4}})
    assert rt.nproc_per_node == 4  # one rank per GPU unless said otherwise
    assert rt.shm_size == "1Gi" and rt.run_as_user == 1000
    assert parse_runtime("y", {"image": "t:1", "shm_size": None}).shm_size is None
    assert parse_runtime("z", {"image": "t:1"}).resources() == {}
    assert BUILTIN_RUNTIMES["cpu"].cpus == 2.0


def test_an_empty_runtimes_variable_option_turns_the_variable_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_VAR_TORCHRUN_RUNTIMES", f"from-variable:\n  image: {runtimes.DEFAULT_IMAGE}\n")
    monkeypatch.setenv("AIRFLOW__TORCHRUN__RUNTIMES_VARIABLE", "torchrun_runtimes")
    assert sorted(load_runtimes().runtimes) == ["from-variable"]
    runtimes.clear_cache()
    monkeypatch.setenv("AIRFLOW__TORCHRUN__RUNTIMES_VARIABLE", "")
    assert sorted(load_runtimes().runtimes) == ["cpu", "gpu"]
