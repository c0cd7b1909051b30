"""Fixtures of the Kubernetes backend's tests: a fake API server over HTTP and the provider's hooks
pointed at it (a kubeconfig file for the sync hook, an Airflow connection for the async one)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from airflow_torchrun.backends.base import GroupHandle
from airflow_torchrun.backends.kubernetes.backend import KubernetesBackend
from airflow_torchrun.backends.kubernetes.runtimes import BUILTIN_RUNTIMES
from airflow_torchrun.naming import GroupIdentity
from airflow_torchrun.spec import GroupSpec
from airflow_torchrun.status import GroupStatus, group_status
from tests import s3_fixtures

from .fake_api import FakeKubeAPI

NAMESPACE = "ml"


@pytest.fixture
def fake_api() -> Iterator[FakeKubeAPI]:
    api = FakeKubeAPI().start()
    yield api
    api.stop()


@pytest.fixture
def kubeconfig(fake_api: FakeKubeAPI, tmp_path: Path) -> Path:
    path = tmp_path / "kubeconfig.yaml"
    path.write_text(yaml.safe_dump(fake_api.kubeconfig(NAMESPACE)))
    return path


@pytest.fixture
def pod_storage(s3_env: s3_fixtures.MotoS3, monkeypatch: pytest.MonkeyPatch) -> str:
    """Checkpoints where pods and the worker both reach them: ``[torchrun] checkpoint_base`` on
    moto's S3 (the local default is refused for the Kubernetes backend when the DAG is parsed)."""
    base = f"s3://{s3_env.make_bucket()}/checkpoints"
    monkeypatch.setenv("AIRFLOW__TORCHRUN__CHECKPOINT_BASE", base)
    return base


@pytest.fixture
def k8s_connection(kubeconfig: Path, monkeypatch: pytest.MonkeyPatch, pod_storage: str) -> str:
    """The Airflow connection ``kubernetes_default``, defined in the environment (no database),
    and shared checkpoint storage (:func:`pod_storage`)."""
    conn = {"conn_type": "kubernetes", "extra": {"kube_config_path": str(kubeconfig)}}
    monkeypatch.setenv("AIRFLOW_CONN_KUBERNETES_DEFAULT", json.dumps(conn))
    return "kubernetes_default"


@pytest.fixture
def backend(kubeconfig: Path) -> KubernetesBackend:
    """The sync path: ``KubernetesHook(config_file=...)``."""
    return KubernetesBackend(
        namespace=NAMESPACE, config_file=str(kubeconfig), watch_seconds=1.0, runtimes=BUILTIN_RUNTIMES
    )


def make_spec(**overrides: object) -> GroupSpec:
    values: dict[str, object] = {
        "num_nodes": 2,
        "nproc_per_node": 1,
        "script": "/opt/trainer/train.py",
        "backend": "kubernetes",
        "runtime": "cpu",
        "startup_timeout": 60.0,
    }
    values.update(overrides)
    return GroupSpec.create(**values)  # type: ignore[arg-type]


IDENTITY = GroupIdentity(dag_id="pipeline", task_id="train", run_id="manual__2026-11-30T10:00:00+00:00", try_number=1)


def settle(
    backend: KubernetesBackend,
    handle: GroupHandle,
    until: Callable[[GroupStatus], bool],
    *,
    deadline: float = 20.0,
) -> GroupStatus:
    """The operator's wait loop in small: observe, reduce, until ``until`` holds (or fail)."""
    end = time.monotonic() + deadline
    while True:
        status = group_status(
            backend.observe(handle),
            launched_at=handle.launched_at,
            now=time.time(),
            startup_timeout=handle.startup_timeout,
        )
        if until(status):
            return status
        if time.monotonic() > end:
            raise AssertionError(f"group never reached the expected state; last: {status}")
