"""Issue 23, trust boundaries round two: the findings whose subject is the Kubernetes backend or its
runtimes, each with the review's probe as its scenario (see ``tests/test_trust_boundaries.py``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from airflow_torchrun.backends.kubernetes import runtimes
from airflow_torchrun.backends.kubernetes.runtimes import DEFAULT_IMAGE, load_runtimes
from airflow_torchrun.errors import InvalidSpecError

PLATFORM_IMAGE = "registry.example.com/ml/trainer:1.0"


@pytest.fixture
def runtimes_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[dict[str, Any]], Path]]:
    for var in (
        "AIRFLOW__TORCHRUN__RUNTIMES_FILE",
        "AIRFLOW_VAR_TORCHRUN_RUNTIMES",
        "AIRFLOW__TORCHRUN__RUNTIMES_VARIABLE",
    ):
        monkeypatch.delenv(var, raising=False)

    def write(data: dict[str, Any]) -> Path:
        path = tmp_path / "runtimes.yaml"
        path.write_text(yaml.safe_dump(data))
        runtimes.clear_cache()
        return path

    yield write
    runtimes.clear_cache()


def _variable(monkeypatch: pytest.MonkeyPatch, runtime: dict[str, Any], name: str = "team") -> None:
    monkeypatch.setenv("AIRFLOW_VAR_TORCHRUN_RUNTIMES", json.dumps({name: {"image": PLATFORM_IMAGE, **runtime}}))
    runtimes.clear_cache()


# -- finding 6: the runtimes Variable's policy was a deny-list with holes ----------------------------
HOLES: dict[str, dict[str, Any]] = {
    "secret volume": {"pod_overrides": {"volumes": [{"name": "s", "secret": {"secretName": "prod-db"}}]}},
    "envFrom": {"container_overrides": {"envFrom": [{"secretRef": {"name": "prod-db"}}]}},
    "env_from_secrets": {"env_from_secrets": ["prod-db"]},
    "any service account": {"service_account": "cluster-admin-sa"},
    "serviceAccountName override": {"pod_overrides": {"serviceAccountName": "cluster-admin-sa"}},
    "capabilities.drop: []": {"container_overrides": {"securityContext": {"capabilities": {"drop": []}}}},
    "procMount": {"container_overrides": {"securityContext": {"procMount": "Unmasked"}}},
    "group 0": {"run_as_group": 0},
    "fsGroup 0": {"pod_overrides": {"securityContext": {"fsGroup": 0}}},
    "sysctls": {"pod_overrides": {"securityContext": {"sysctls": [{"name": "kernel.shm_rmid_forced", "value": "0"}]}}},
    "nodeName": {"pod_overrides": {"nodeName": "control-plane-0"}},
    "hostAliases": {"pod_overrides": {"hostAliases": [{"ip": "203.0.113.7", "hostnames": ["master"]}]}},
    "foreign image": {"image": "docker.io/attacker/miner:latest"},
    "identity annotation": {"annotations": {"iam.amazonaws.com/role": "arn:aws:iam::123456789012:role/admin"}},
    "storage endpoint in env": {"env": {"AWS_ENDPOINT_URL": "https://attacker.example.com"}},
    "any other override": {"container_overrides": {"lifecycle": {"postStart": {"exec": {"command": ["sh"]}}}}},
    # Added with the NetworkPolicy (issue 23's turn-2 leftover): opening the pods is the platform's call.
    "no network policy": {"network_policy": False},
}


@pytest.mark.parametrize("hole", sorted(HOLES))
def test_the_runtimes_variable_gets_an_allow_list_not_a_deny_list(
    hole: str, runtimes_file: Callable[[dict[str, Any]], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of the probe's runtimes passed the Variable's deny-list at e4ca0ea; none may now."""
    monkeypatch.setenv("AIRFLOW__TORCHRUN__RUNTIMES_VARIABLE", "torchrun_runtimes")
    path = runtimes_file({"cpu": {"image": PLATFORM_IMAGE}})
    _variable(monkeypatch, HOLES[hole])
    with pytest.raises(InvalidSpecError) as refused:
        load_runtimes(file=str(path))
    assert "runtime 'team'" in str(refused.value) and "runtimes_file" in str(refused.value), str(refused.value)
    # The same runtime in the platform's file is the platform's own choice.
    assert (
        "team"
        in load_runtimes(
            file=str(runtimes_file({"team": {"image": PLATFORM_IMAGE, **HOLES[hole]}})), variable=""
        ).runtimes
    )


def test_what_a_variable_runtime_may_still_set(
    runtimes_file: Callable[[dict[str, Any]], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW__TORCHRUN__RUNTIMES_VARIABLE", "torchrun_runtimes")
    path = runtimes_file({"cpu": {"image": PLATFORM_IMAGE}})
    _variable(
        monkeypatch,
        {
            "resources": {"cpu": "4", "memory": "8Gi", "gpu": 1},
            "node_selector": {"pool": "gpu"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            "queue": "team",
            "env": {"NCCL_DEBUG": "INFO"},
            "pod_overrides": {"topologySpreadConstraints": []},
            "container_overrides": {"ports": [{"containerPort": 8080}]},
        },
    )
    assert load_runtimes(file=str(path)).runtimes["team"].gpu == 1


def test_the_file_can_allow_secrets_service_accounts_overrides_and_registries(
    runtimes_file: Callable[[dict[str, Any]], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW__TORCHRUN__RUNTIMES_VARIABLE", "torchrun_runtimes")
    policy = {"allow": ["secrets", "service_account", "overrides"], "images": ["registry.example.com/team/"]}
    path = runtimes_file({"cpu": {"image": PLATFORM_IMAGE}, "_variable_policy": policy})
    _variable(
        monkeypatch,
        {
            "image": "registry.example.com/team/trainer:7",
            "env_from_secrets": ["team-s3"],
            "service_account": "team-trainer",
            "container_overrides": {"lifecycle": {"preStop": {"exec": {"command": ["sleep", "1"]}}}},
        },
    )
    assert load_runtimes(file=str(path)).runtimes["team"].service_account == "team-trainer"
    # What redirects the rendezvous stays the file's alone, whatever the policy allows.
    _variable(monkeypatch, {"image": "registry.example.com/team/t:7", "pod_overrides": {"hostAliases": []}})
    with pytest.raises(InvalidSpecError, match="only a runtime of"):
        load_runtimes(file=str(path))


def test_the_runtimes_variable_never_shadows_a_file_runtime(
    runtimes_file: Callable[[dict[str, Any]], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe: a Variable runtime named like the file's ``cpu`` replaced it (another image, other
    resources) for every DAG that asked for ``cpu``."""
    monkeypatch.setenv("AIRFLOW__TORCHRUN__RUNTIMES_VARIABLE", "torchrun_runtimes")
    path = runtimes_file({"cpu": {"image": PLATFORM_IMAGE, "resources": {"cpu": "2"}}})
    _variable(monkeypatch, {"resources": {"cpu": "64"}}, name="cpu")
    with pytest.raises(InvalidSpecError, match="the Variable may not replace"):
        load_runtimes(file=str(path))


def test_the_runtimes_variable_is_read_only_when_configured(
    runtimes_file: Callable[[dict[str, Any]], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe: with nothing configured, a Variable called ``torchrun_runtimes`` (which any user
    with Variable access may create) was read by every Kubernetes task."""
    _variable(monkeypatch, {"image": DEFAULT_IMAGE}, name="from-variable")
    assert sorted(load_runtimes().runtimes) == ["cpu", "gpu"]
    monkeypatch.setenv("AIRFLOW__TORCHRUN__RUNTIMES_VARIABLE", "torchrun_runtimes")
    runtimes.clear_cache()
    assert sorted(load_runtimes().runtimes) == ["from-variable"]
