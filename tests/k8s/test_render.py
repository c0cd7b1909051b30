"""Rendering: golden manifests, the official OpenAPI schema, names, and the shared command.

``UPDATE_GOLDEN=1 pytest tests/k8s/test_render.py`` rewrites the files under ``golden/`` after an
intended change; review the diff like code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from airflow_torchrun.backends.kubernetes import render as k8s_render
from airflow_torchrun.backends.kubernetes.backend import KubernetesBackend
from airflow_torchrun.backends.kubernetes.render import (
    PET_NODE_RANK,
    WAIT_FOR_MASTER,
    expand_for_node,
    render_group,
    to_yaml,
)
from airflow_torchrun.backends.kubernetes.runtimes import BUILTIN_RUNTIMES, parse_runtime
from airflow_torchrun.backends.local.backend import AGENT_MODULE, LocalBackend
from airflow_torchrun.naming import MAX_GROUP_ID, GroupIdentity, label_value
from airflow_torchrun.spec import GroupSpec
from airflow_torchrun.wiring import TORCHRUN_MODULE

GOLDEN = Path(__file__).parent / "golden"
# The oldest version this backend supports (podFailurePolicy rules without onPodConditions), the
# release where podFailurePolicy and DisruptionTarget went GA, and two recent ones.
K8S_VERSIONS = ("1.29.0", "1.31.0", "1.34.0", "1.37.0")
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

FULL_RUNTIME = parse_runtime(
    "a100",
    {
        "description": "8 x A100 per node",
        "image": "registry.example.com/ml/trainer:0.1.0@sha256:" + "0" * 64,
        "image_pull_policy": "IfNotPresent",
        "nproc_per_node": 8,
        "resources": {"cpu": "94", "memory": "900Gi", "gpu": 8, "ephemeral_storage": "200Gi"},
        "shm_size": "64Gi",
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "airflow-torchrun"}},
                        },
                    }
                ]
            }
        },
        "queue": "research",
        "priority_class": "training-high",
        "service_account": "trainer",
        "image_pull_secrets": ["registry-creds"],
        "env": {"NCCL_IB_DISABLE": "0", "NCCL_DEBUG": "WARN"},
        "env_from_secrets": ["s3-credentials", "mlflow-credentials"],
        "labels": {"team": "research"},
        "annotations": {"cost-center": "ml-42"},
        "working_dir": "/opt/trainer",
        "run_as_user": 2000,
        "run_as_group": 2000,
        "ttl_seconds_after_finished": 3600,
        "termination_grace_period": 120,
        "automount_service_account_token": True,
        "writable_paths": ["/home/trainer/.cache"],
        "pod_overrides": {"hostIPC": False, "dnsConfig": {"options": [{"name": "ndots", "value": "2"}]}},
        "container_overrides": {"securityContext": {"readOnlyRootFilesystem": False}},
    },
    "test",
)
LONG = "x" * 200

SCENARIOS: dict[str, tuple[GroupSpec, GroupIdentity, str, dict[str, str]]] = {
    "cpu_single_node": (
        GroupSpec.create(
            num_nodes=1,
            nproc_per_node=1,
            script="/opt/trainer/train.py",
            script_args=["--epochs", "3"],
            backend="kubernetes",
            runtime="cpu",
        ),
        GroupIdentity("pipeline", "train", "manual__2026-11-30T10:00:00+00:00", try_number=1),
        "default",
        {"TRAIN_CHECKPOINT_URI": "file:///data/ckpt/pipeline/train"},
    ),
    "gpu_four_nodes_queued": (
        GroupSpec.create(
            num_nodes=4,
            nproc_per_node=8,
            command=["python", "-u", "/opt/trainer/train.py"],
            script_args=["--lr", "3e-4"],
            env={"WANDB_MODE": "offline", "SHELLISH": "cost $(echo 1) and ${HOME} stay literal"},
            backend="kubernetes",
            runtime="a100",
            rdzv_port=23456,
            startup_timeout=1800,
            teardown_grace=45,
        ),
        GroupIdentity(f"Nightly_{LONG}", f"Train.Model_{LONG}", f"scheduled__{LONG}+00:00", try_number=3, map_index=7),
        "research-jobs",
        {"TRAIN_CHECKPOINT_URI": "s3://ckpt/nightly/train", "TRAIN_RESUME_FROM": "s3://ckpt/nightly/train/step-900"},
    ),
}


def trainer_template(group: k8s_render.RenderedGroup) -> k8s_render.ContainerTemplate:
    """The command and env of the rendered trainer container, as the kubelet would read them."""
    (trainer,) = group.job["spec"]["template"]["spec"]["containers"]
    return k8s_render.ContainerTemplate(command=tuple(trainer["command"]), env=tuple(trainer["env"]))


# Backend options per scenario: the Airflow deployment's name, the task's execution_timeout.
BACKEND_OPTIONS: dict[str, dict[str, object]] = {
    "gpu_four_nodes_queued": {"deployment": "prod-eu", "active_deadline_seconds": 7200},
}


def rendered(name: str) -> k8s_render.RenderedGroup:
    spec, identity, namespace, extra_env = SCENARIOS[name]
    backend = KubernetesBackend(
        namespace=namespace,
        runtimes={**BUILTIN_RUNTIMES, "a100": FULL_RUNTIME},
        **BACKEND_OPTIONS.get(name, {}),  # type: ignore[arg-type]
    )
    return backend.render(backend.plan(spec, identity, extra_env))


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_manifests_match_golden(name: str) -> None:
    text = to_yaml(rendered(name).objects)
    path = GOLDEN / f"{name}.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} is missing; run with UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), (
        f"rendering changed; if intended, regenerate with UPDATE_GOLDEN=1 and review {path}"
    )
    assert list(yaml.safe_load_all(text)) == rendered(name).objects  # the YAML is the objects, nothing lost


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_object_validates_against_the_official_schema(name: str, version: str) -> None:
    group = rendered(name)
    for obj in group.objects:
        kubernetes_validate.validate(obj, version, strict=True)
    # As created: the Service with its ownerReference.
    job = {**group.job, "metadata": {**group.job["metadata"], "uid": "5f0c0c8e-0000-4000-8000-000000000000"}}
    owned = {
        **group.service,
        "metadata": {**group.service["metadata"], "ownerReferences": [k8s_render.owner_reference(job)]},
    }
    kubernetes_validate.validate(owned, version, strict=True)
    assert group.network_policy is not None
    kubernetes_validate.validate(k8s_render.policy_for_job(group.network_policy, job), version, strict=True)


def test_schema_validation_catches_a_broken_object() -> None:
    """The check above can fail: a misspelt field is rejected in strict mode."""
    job = rendered("cpu_single_node").job
    broken = {**job, "spec": {**job["spec"], "completionsMode": "Indexed"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.34.0", strict=True)


def test_group_shape() -> None:
    group = rendered("gpu_four_nodes_queued")
    job, svc = group.job, group.service
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == (
        "Indexed",
        4,
        4,
        0,
    )
    assert spec["suspend"] is True and job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "research"
    assert [r["action"] for r in spec["podFailurePolicy"]["rules"]] == ["FailJob", "FailJob"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {k8s_render.GROUP_LABEL: group.name}
    # Ingress to the group's pods from the group's pods only; its egress (storage, tracking) is free.
    policy = group.network_policy
    assert policy is not None and policy["metadata"]["name"] == group.name and group.objects[-1] is policy
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": policy["spec"]["podSelector"]}]}]
    assert job["spec"]["template"]["metadata"]["labels"][k8s_render.GROUP_LABEL] == group.name
    assert pod["subdomain"] == group.name and pod["restartPolicy"] == "Never"
    trainer = pod["containers"][0]
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["volumes"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 2000
    assert trainer["envFrom"] == [
        {"secretRef": {"name": "s3-credentials"}},
        {"secretRef": {"name": "mlflow-credentials"}},
    ]
    assert pod["dnsConfig"] == {"options": [{"name": "ndots", "value": "2"}]}  # pod_overrides merged
    assert trainer["securityContext"]["capabilities"] == {"drop": ["ALL"]}  # container_overrides merged, not replaced
    # Raw ids survive in annotations even where labels had to be shortened.
    assert job["metadata"]["annotations"]["airflow-torchrun/dag-id"] == f"Nightly_{LONG}"
    assert len(job["metadata"]["labels"]["airflow-torchrun/dag-id"]) <= 63


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_each_pod_runs_exactly_the_wiring_command_of_its_node(name: str) -> None:
    spec, identity, namespace, extra_env = SCENARIOS[name]
    backend = KubernetesBackend(namespace=namespace, runtimes={**BUILTIN_RUNTIMES, "a100": FULL_RUNTIME})
    plan = backend.plan(spec, identity, extra_env)
    template = trainer_template(backend.render(plan))
    for node in plan.nodes:
        command, env = expand_for_node(template, node.node_rank)
        assert command == [a for a in node.argv if not a.startswith("--node-rank=")]
        assert env == {**node.env, PET_NODE_RANK: str(node.node_rank)}
        assert env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == f"[node {node.node_rank} rank ${{rank}}] "


def test_the_command_is_the_local_backends_apart_from_where(tmp_path: Path) -> None:
    spec = GroupSpec.create(
        num_nodes=2, nproc_per_node=2, script="/opt/trainer/train.py", backend="kubernetes", runtime="cpu"
    )
    identity = SCENARIOS["cpu_single_node"][1]
    k8s = KubernetesBackend(namespace="ml", runtimes=BUILTIN_RUNTIMES).plan(spec, identity, {})
    local = LocalBackend(state_dir=tmp_path).plan(spec, identity, {})
    where = re.compile(r"^--(master-addr|master-port|log-dir)=")
    for k, lo in zip(k8s.nodes, local.nodes, strict=True):
        assert [a for a in k.argv[3:] if not where.match(a)] == [a for a in lo.argv[3:] if not where.match(a)]
        assert k.argv[0] == "python" and lo.argv[0] == sys.executable
        # The agent: torchrun itself in a pod; on the local backend torchrun's main without the teardown.
        assert k.argv[1:3] == ("-m", TORCHRUN_MODULE) and lo.argv[1:3] == ("-m", AGENT_MODULE)


def test_torchrun_reads_the_node_rank_from_the_completion_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's own parser, given the pod's command and PET_NODE_RANK, gets node rank 3."""
    group = rendered("gpu_four_nodes_queued")
    command, env = expand_for_node(trainer_template(group), 3)
    monkeypatch.setenv(PET_NODE_RANK, env[PET_NODE_RANK])
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(command[3:])  # after "python -m torch.distributed.run"
    assert (args.node_rank, args.nnodes, args.nproc_per_node) == (3, "4", "8")
    assert args.master_addr == f"{group.name}-0.{group.name}.research-jobs.svc"
    assert args.master_port == 23456


def test_names_are_dns_labels_deterministic_and_collision_safe() -> None:
    ids = [
        GroupIdentity("pipeline", "train", "manual__2026-11-30T10:00:00+00:00"),
        GroupIdentity("9_digits_first", "t", "r"),
        GroupIdentity("ÜNÏCÖDE dag", "tâsk", "r", try_number=12, map_index=4),
        GroupIdentity("---", "___", "r"),
        GroupIdentity(LONG, LONG, LONG, try_number=99),
        GroupIdentity(LONG, LONG + "a", LONG, try_number=99),
        GroupIdentity(LONG, LONG, LONG + "b", try_number=99),
        GroupIdentity(LONG, LONG, LONG, try_number=99, map_index=1),
    ]
    names = [i.group_id for i in ids]
    for name in names:
        assert DNS_1035.match(name) and len(name) <= MAX_GROUP_ID, name
        assert len(f"{name}-99999") <= 63  # the pod hostname of index 99999
    assert len(set(names)) == len(names)  # long ids differing only past the cut stay apart
    assert names == [i.group_id for i in ids]  # deterministic
    assert ids[0].group_id != GroupIdentity("pipeline", "train", ids[0].run_id, try_number=2).group_id


@pytest.mark.parametrize(
    "raw", ["manual__2026-11-30T10:00:00+00:00", "ok-value", "-leading", "a" * 64, "ünï", "", "x/y z", "__init__"]
)
def test_label_values_are_valid_and_distinct_when_changed(raw: str) -> None:
    value = label_value(raw)
    assert LABEL_VALUE.match(value) and len(value) <= 63
    if LABEL_VALUE.match(raw) and len(raw) <= 63:
        assert value == raw
    else:
        assert value != label_value(raw + "!")  # the hash keeps cleaned values apart


def test_escape_and_expand_follow_kubernetes_rules() -> None:
    env = {"A": "1"}
    assert k8s_render.kube_expand("$(A)-$$(A)-$(B)-$x-$", env) == "1-$(A)-$(B)-$x-$"
    for text in ("$(A)", "$$", "${rank}", "cost $5", "$"):
        assert k8s_render.kube_expand(k8s_render.escape(text), env) == text


def test_render_refuses_a_plan_for_another_namespace() -> None:
    spec, identity, _, _ = SCENARIOS["cpu_single_node"]
    plan = KubernetesBackend(namespace="a", runtimes=BUILTIN_RUNTIMES).plan(spec, identity, {})
    with pytest.raises(ValueError, match="not node 0's DNS name"):
        render_group(plan, BUILTIN_RUNTIMES["cpu"], namespace="b")


@pytest.mark.slow
def test_the_dns_wait_succeeds_when_the_name_resolves_and_gives_up_at_its_deadline() -> None:
    ok = subprocess.run(
        [sys.executable, "-c", WAIT_FOR_MASTER],
        env={**os.environ, "AIRFLOW_TORCHRUN_MASTER_ADDR": "localhost", "AIRFLOW_TORCHRUN_DNS_TIMEOUT": "5"},
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0 and "node 0 resolves: localhost" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-c", WAIT_FOR_MASTER],
        env={**os.environ, "AIRFLOW_TORCHRUN_MASTER_ADDR": "no-such-node.invalid", "AIRFLOW_TORCHRUN_DNS_TIMEOUT": "1"},
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "did not resolve within 1s" in bad.stderr


TINY = """
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"RANK={os.environ['RANK']} GROUP_RANK={os.environ['GROUP_RANK']} sum={int(t.item())}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_the_pod_command_runs_a_real_group_with_the_rank_from_the_completion_index(tmp_path: Path) -> None:
    """Two agents started exactly as two pods would start them (expanded command and env), on
    loopback instead of node 0's DNS name: ranks, node ranks and log prefixes come out right."""
    import socket

    script = tmp_path / "tiny.py"
    script.write_text(TINY)
    spec = GroupSpec.create(num_nodes=2, nproc_per_node=1, script=str(script), backend="kubernetes", runtime="cpu")
    backend = KubernetesBackend(namespace="ml", runtimes=BUILTIN_RUNTIMES)
    group = backend.render(backend.plan(spec, SCENARIOS["cpu_single_node"][1], {}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for node in (0, 1):
        command, env = expand_for_node(trainer_template(group), node)
        local = {
            "python": sys.executable,
            f"--master-addr={group.name}-0.{group.name}.ml.svc": "--master-addr=127.0.0.1",
            "--master-port=29500": f"--master-port={port}",
            f"--log-dir={k8s_render.TORCHRUN_LOG_DIR}": f"--log-dir={tmp_path / f'node-{node}'}",
        }
        assert all(k in command for k in local)  # only these four differ from what the pod runs
        command = [local.get(a, a) for a in command]
        procs.append(
            subprocess.Popen(
                command,
                env={**os.environ, **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=180)
        outputs.append(out)
        assert proc.returncode == 0, out
    assert "[node 0 rank 0] RANK=0 GROUP_RANK=0 sum=3" in outputs[0]
    assert "[node 1 rank 1] RANK=1 GROUP_RANK=1 sum=3" in outputs[1]
