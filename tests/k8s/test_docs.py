"""The examples in docs/kubernetes.md are valid: runtimes parse, Kubernetes objects pass the schema."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from airflow_torchrun.backends.kubernetes.runtimes import parse_runtimes

DOC = Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md"


def yaml_blocks() -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.DOTALL)


def test_the_runtimes_example_is_valid() -> None:
    (block,) = [b for b in yaml_blocks() if b.startswith("# runtimes.yaml")]
    runtimes = parse_runtimes(yaml.safe_load(block), "docs/kubernetes.md")
    assert sorted(runtimes) == ["a100-x8", "cpu-small"]
    assert runtimes["a100-x8"].queue == "research" and runtimes["a100-x8"].gpu == 8


def test_the_variable_policy_example_is_valid() -> None:
    from airflow_torchrun.backends.kubernetes.runtimes import parse_policy

    (block,) = [b for b in yaml_blocks() if "_variable_policy:" in b]
    policy = parse_policy(yaml.safe_load(block), "docs/kubernetes.md")
    assert policy.allow == {"host_namespaces", "secrets"} and policy.images == ("registry.example.com/ml/",)


@pytest.mark.parametrize("version", ["1.29.0", "1.34.0"])
def test_the_rbac_example_is_valid(version: str) -> None:
    objects = [o for b in yaml_blocks() for o in yaml.safe_load_all(b) if isinstance(o, dict) and "apiVersion" in o]
    assert [o["kind"] for o in objects] == ["Role", "RoleBinding"]
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)
    # Every API the backend calls is granted.
    granted = {
        (g, r, v)
        for rule in objects[0]["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    for need in [
        ("batch", "jobs", "create"),
        ("batch", "jobs", "list"),
        ("batch", "jobs", "delete"),
        ("", "services", "create"),
        ("networking.k8s.io", "networkpolicies", "create"),
        ("", "pods", "watch"),
        ("", "pods/log", "get"),
        ("", "events", "list"),
        ("kueue.x-k8s.io", "workloads", "list"),
    ]:
        assert need in granted, need


def test_the_role_grants_every_call_the_backend_makes(fake_api, kubeconfig) -> None:
    """Run a queued group through its life against the fake and check each recorded call."""
    from airflow_torchrun.backends.kubernetes.backend import KubernetesBackend
    from airflow_torchrun.backends.kubernetes.runtimes import parse_runtime

    from .conftest import IDENTITY, NAMESPACE, make_spec

    queued = parse_runtime("q", {"image": "t:1", "queue": "team-a"})
    plain = parse_runtime("p", {"image": "t:1"})
    backend = KubernetesBackend(namespace=NAMESPACE, config_file=str(kubeconfig), runtimes={"q": queued, "p": plain})
    spec = make_spec(runtime="q")
    handle = backend.launch(backend.plan(spec, IDENTITY, {}))
    backend.observe(handle)  # suspended: reads Kueue workloads
    backend.teardown(handle)
    spec = make_spec(runtime="p")
    handle = backend.launch(backend.plan(spec, IDENTITY, {}))
    backend.observe(handle)  # no pods yet: reads events
    name = handle.job_name
    fake_api.create_pods(NAMESPACE, name)
    fake_api.set_running(NAMESPACE, name)
    backend.observe(handle)  # watches
    backend.read_new_log_lines(handle)
    fake_api.set_terminated(NAMESPACE, name, 1, exit_code=1, reason="Error")
    backend.observe(handle)
    backend.teardown(handle)  # keeps the failed pod's log tail first
    backend.find_existing(IDENTITY, spec)

    role = next(
        o for b in yaml_blocks() for o in yaml.safe_load_all(b) if isinstance(o, dict) and o.get("kind") == "Role"
    )
    granted = {
        (g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
    }
    used = set()
    for call in fake_api.calls:
        parts = call.path.strip("/").split("/")
        group = "" if parts[0] == "api" else parts[1]
        rest = parts[2:] if parts[0] == "api" else parts[3:]
        resource = rest[2] + (f"/{rest[4]}" if len(rest) > 4 else "")
        named = len(rest) > 3
        verb = {"POST": "create", "DELETE": "delete"}.get(call.method) or (
            "get" if named else "watch" if call.is_watch else "list"
        )
        used.add((group, resource, verb))
    assert {("", "pods/log", "get"), ("", "pods", "watch"), ("kueue.x-k8s.io", "workloads", "list")} <= used
    assert used <= granted, used - granted
