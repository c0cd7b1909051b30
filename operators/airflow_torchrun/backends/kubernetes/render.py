"""Pure rendering of a group plan into Kubernetes objects: one Indexed Job, one headless Service and,
unless the runtime opts out, one NetworkPolicy that admits connections to the group's pods from its
own pods only.

No I/O, no clock, no Kubernetes client: plain dicts in the API's own JSON shape, so the same
objects are created by the backend, printed by ``airflow-torchrun render`` and pinned by golden
tests.

How one pod template runs every node's command: the wiring renders ``--node-rank=<n>`` per node.
The Job uses node 0's command *without* that argument and gives torchrun the node rank through
``PET_NODE_RANK`` (torchrun reads every option from ``PET_<OPTION>`` when it is not on the command
line), taken by the downward API from the pod's completion-index annotation. The per-node values
of the environment (``AIRFLOW_TORCHRUN_NODE_RANK`` and the log-line prefix) come from the same
annotation through Kubernetes' ``$(VAR)`` expansion. :func:`check_template` proves, for every node
of the plan, that expanding the template gives exactly the command and environment the wiring
rendered for that node (the local backend runs those).

Names: the Job, the Service and the NetworkPolicy share one name, a DNS-1035 label of at most
:data:`~airflow_torchrun.naming.MAX_GROUP_ID` characters, the group id
(:class:`~airflow_torchrun.naming.GroupIdentity`): pods of an Indexed Job are called
``<name>-<index>`` in DNS, which must stay a 63-character label. The deployment (``[torchrun]
deployment``) keeps two Airflow deployments that share a namespace (and may well share dag and run ids) apart.

Shared clusters: pods run as a non-root user with a read-only root filesystem (writable
emptyDirs at ``/tmp``, ``/dev/shm`` and the runtime's ``writable_paths``), every capability
dropped, no service account token unless the runtime asks for it, no connection from pods outside
the group (where the cluster's network plugin enforces NetworkPolicies), and the Job ends itself
after ``active_deadline_seconds`` (the task's ``execution_timeout``) even when no Airflow process is left.
"""

from __future__ import annotations

import copy
import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from airflow_torchrun.backends.kubernetes.runtimes import Runtime, thaw
from airflow_torchrun.contract.launch import NODE_RANK_VAR
from airflow_torchrun.naming import GroupIdentity, label_value
from airflow_torchrun.wiring import GroupPlan

CONTAINER = "trainer"
INIT_CONTAINER = "wait-for-master"
# torchrun's per-rank output files (with --tee they are also copied, prefixed, to the pod log).
TORCHRUN_LOG_DIR = "/tmp/torchrun"
PREFIX = "airflow-torchrun/"
GROUP_LABEL = f"{PREFIX}group"
INSTANCE_LABEL = f"{PREFIX}instance"
DEPLOYMENT_LABEL = f"{PREFIX}deployment"
# Set by the Job controller on every pod of a Job (Kubernetes 1.27+); unlike our own labels, its
# value (the Job's uid) is known only to whoever created or may read the Job.
CONTROLLER_UID_LABEL = "batch.kubernetes.io/controller-uid"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
NODE_RANK_FIELD = f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"
PET_NODE_RANK = "PET_NODE_RANK"
LOG_PREFIX_VAR = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
MASTER_ADDR_VAR = "AIRFLOW_TORCHRUN_MASTER_ADDR"
DNS_TIMEOUT_VAR = "AIRFLOW_TORCHRUN_DNS_TIMEOUT"
# Annotations the backend reads back to rebuild a handle when it reattaches.
ANN_GROUP_ID = f"{PREFIX}group-id"
ANN_STARTUP_TIMEOUT = f"{PREFIX}startup-timeout"
ANN_TEARDOWN_GRACE = f"{PREFIX}teardown-grace"
ANN_MASTER_ADDR = f"{PREFIX}master-addr"
ANN_MASTER_PORT = f"{PREFIX}master-port"
ANN_WORLD_SIZE = f"{PREFIX}world-size"
ANN_RUNTIME = f"{PREFIX}runtime"
ANN_QUEUE = f"{PREFIX}queue"
ANN_TRY_NUMBER = f"{PREFIX}try-number"
ANN_RELAUNCH = f"{PREFIX}relaunch"
ANN_DEPLOYMENT = f"{PREFIX}deployment"

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_NODE_RANK_ARG = "--node-rank="

# Runs before torchrun in every pod: node 0's DNS record (published by the headless Service as
# soon as its pod has an IP) must resolve before torchrun dials it, or the agent fails at once.
WAIT_FOR_MASTER = textwrap.dedent(
    f"""\
    import os, socket, sys, time
    host = os.environ["{MASTER_ADDR_VAR}"]
    limit = float(os.environ["{DNS_TIMEOUT_VAR}"])
    deadline = time.monotonic() + limit
    while True:
        try:
            socket.getaddrinfo(host, None)
            print("node 0 resolves:", host, flush=True)
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                sys.exit(f"node 0 ({{host}}) did not resolve within {{limit:g}}s: {{exc}}")
            time.sleep(1)
    """
)


def master_addr(name: str, namespace: str) -> str:
    """Node 0's stable DNS name: pod hostname ``<job>-0`` under the headless Service."""
    return f"{name}-0.{name}.{namespace}.svc"


def identity_labels(identity: GroupIdentity) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "airflow-torchrun",
        "app.kubernetes.io/component": "trainer",
        "app.kubernetes.io/managed-by": "airflow-torchrun",
        GROUP_LABEL: identity.group_id,
        INSTANCE_LABEL: identity.instance_key,
        DEPLOYMENT_LABEL: label_value(identity.deployment),
        f"{PREFIX}dag-id": label_value(identity.dag_id),
        f"{PREFIX}task-id": label_value(identity.task_id),
        f"{PREFIX}run-id": label_value(identity.run_id),
        f"{PREFIX}try-number": str(identity.try_number),
    }
    if identity.map_index >= 0:
        out[f"{PREFIX}map-index"] = str(identity.map_index)
    return out


def identity_annotations(identity: GroupIdentity) -> dict[str, str]:
    """The raw ids (label values may have been shortened or cleaned)."""
    return {
        ANN_DEPLOYMENT: identity.deployment,
        f"{PREFIX}dag-id": identity.dag_id,
        f"{PREFIX}task-id": identity.task_id,
        f"{PREFIX}run-id": identity.run_id,
        ANN_TRY_NUMBER: str(identity.try_number),
        f"{PREFIX}map-index": str(identity.map_index),
        ANN_RELAUNCH: str(identity.relaunch),
    }


def escape(value: str) -> str:
    """Protect a literal string from Kubernetes' ``$(VAR)`` expansion in command and env."""
    return value.replace("$", "$$")


def kube_expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' expansion of ``$(VAR)`` references (``$$`` is a literal ``$``; unknown
    references stay as written), as the kubelet applies it to env values and commands."""
    out: list[str] = []
    i = 0
    while i < len(value):
        ch = value[i]
        if ch == "$" and i + 1 < len(value):
            nxt = value[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = value.find(")", i + 2)
                if end != -1:
                    var = value[i + 2 : end]
                    out.append(env[var] if var in env else value[i : end + 1])
                    i = end + 1
                    continue
        out.append(ch)
        i += 1
    return "".join(out)


def _without_node_rank(argv: Sequence[str]) -> list[str]:
    found = [a for a in argv if a.startswith(_NODE_RANK_ARG)]
    if len(found) != 1:
        raise RuntimeError(f"expected exactly one {_NODE_RANK_ARG}N in the wiring's command, got {found!r}")
    return [a for a in argv if not a.startswith(_NODE_RANK_ARG)]


def _template_env(value: str, key: str) -> str:
    templated = escape(value)
    if key == LOG_PREFIX_VAR:
        templated = templated.replace("[node 0 ", f"[node $({NODE_RANK_VAR}) ", 1)
    return templated


@dataclass(frozen=True)
class ContainerTemplate:
    """The trainer container's command and env, shared by every pod of the Job."""

    command: tuple[str, ...]
    env: tuple[dict[str, Any], ...]


def container_template(plan: GroupPlan) -> ContainerTemplate:
    node0 = plan.nodes[0]
    env: list[dict[str, Any]] = [
        {"name": NODE_RANK_VAR, "valueFrom": {"fieldRef": {"fieldPath": NODE_RANK_FIELD}}},
        {"name": PET_NODE_RANK, "valueFrom": {"fieldRef": {"fieldPath": NODE_RANK_FIELD}}},
    ]
    for key, value in node0.env.items():
        if key in (NODE_RANK_VAR, PET_NODE_RANK):
            continue
        env.append({"name": key, "value": _template_env(value, key)})
    template = ContainerTemplate(command=tuple(escape(a) for a in _without_node_rank(node0.argv)), env=tuple(env))
    check_template(plan, template)
    return template


def expand_for_node(template: ContainerTemplate, node_rank: int) -> tuple[list[str], dict[str, str]]:
    """What the kubelet makes of the template in the pod of completion index ``node_rank``:
    the command and the environment the container starts with."""
    resolved: dict[str, str] = {}
    for item in template.env:
        if "valueFrom" in item:
            resolved[item["name"]] = str(node_rank)  # both fieldRefs read the completion index
        else:
            resolved[item["name"]] = kube_expand(item["value"], resolved)
    command = [kube_expand(a, resolved) for a in template.command]
    return command, resolved


def check_template(plan: GroupPlan, template: ContainerTemplate) -> None:
    """Every node of the plan must get exactly its wiring's command (node rank through
    ``PET_NODE_RANK``) and environment from the shared template."""
    for node in plan.nodes:
        command, env = expand_for_node(template, node.node_rank)
        wanted_env = {**node.env, PET_NODE_RANK: str(node.node_rank)}
        if command != _without_node_rank(node.argv) or env != wanted_env:
            raise RuntimeError(
                f"the Kubernetes pod template cannot express node {node.node_rank}'s command or environment "
                "as rendered by the wiring; the wiring changed in a way k8s_render does not know"
            )


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Mappings merge key by key; anything else (lists included) replaces."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = thaw(value)
    return out


@dataclass(frozen=True)
class RenderedGroup:
    """The objects of one group; ``objects`` is the creation order (Job first: the Service and the
    NetworkPolicy get an ownerReference to the Job's uid once the Job exists). ``network_policy``:
    ``None`` where the runtime opts out (``network_policy: false``)."""

    name: str
    namespace: str
    job: dict[str, Any]
    service: dict[str, Any]
    network_policy: dict[str, Any] | None = None

    @property
    def objects(self) -> list[dict[str, Any]]:
        return [self.job, self.service, *([self.network_policy] if self.network_policy is not None else [])]


def termination_grace(runtime: Runtime, teardown_grace: float) -> int:
    """The pods' ``terminationGracePeriodSeconds``: the runtime's ``termination_grace_period``,
    else the task's ``teardown_grace`` (whole seconds, at least 1)."""
    if runtime.termination_grace_period is not None:
        return runtime.termination_grace_period
    return max(1, int(teardown_grace))


def render_group(
    plan: GroupPlan,
    runtime: Runtime,
    *,
    namespace: str,
    active_deadline_seconds: int | None = None,
) -> RenderedGroup:
    """The Indexed Job and headless Service that run ``plan`` with ``runtime`` in ``namespace``.

    ``active_deadline_seconds``: the Job's own deadline (the task's ``execution_timeout``).
    """
    identity = plan.identity
    spec = plan.spec
    name = identity.group_id
    expected_master = master_addr(name, namespace)
    if plan.master_addr != expected_master:
        raise ValueError(
            f"plan's master address {plan.master_addr!r} is not node 0's DNS name {expected_master!r}; "
            "plan the group with KubernetesBackend.plan for the same namespace"
        )
    template = container_template(plan)
    grace = termination_grace(runtime, spec.teardown_grace)
    common_labels = {**runtime.labels, **identity_labels(identity)}
    job_annotations = {
        **runtime.annotations,
        **identity_annotations(identity),
        ANN_GROUP_ID: plan.group_id,
        ANN_STARTUP_TIMEOUT: f"{spec.startup_timeout:g}",
        ANN_TEARDOWN_GRACE: str(grace),
        ANN_MASTER_ADDR: plan.master_addr,
        ANN_MASTER_PORT: str(plan.master_port),
        ANN_WORLD_SIZE: str(spec.world_size),
        ANN_RUNTIME: runtime.name,
    }
    job_labels = dict(common_labels)
    if runtime.queue:
        job_labels[KUEUE_QUEUE_LABEL] = runtime.queue
        job_annotations[ANN_QUEUE] = runtime.queue

    non_root = runtime.run_as_user != 0
    container_security = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": runtime.read_only_root_filesystem,
        "capabilities": {"drop": ["ALL"]},
    }
    # Writable places on a read-only root: /tmp (torchrun's logs and error files, tempfile) and
    # whatever the runtime names.
    volume_mounts = [{"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    for i, path in enumerate(runtime.writable_paths):
        volume_mounts.append({"name": f"writable-{i}", "mountPath": path})
        volumes.append({"name": f"writable-{i}", "emptyDir": {}})
    if runtime.shm_size:
        # NCCL and DataLoader workers share memory through /dev/shm; the runtime default of
        # container engines (64 MiB) breaks both.
        volume_mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": runtime.shm_size}})

    trainer: dict[str, Any] = {
        "name": CONTAINER,
        "image": runtime.image,
        "command": list(template.command),
        "env": [dict(e) for e in template.env],
        "ports": [{"name": "rendezvous", "containerPort": plan.master_port, "protocol": "TCP"}],
        "volumeMounts": volume_mounts,
        # A failed container's termination message is the tail of its log: the failure (and
        # torchrun's error summary) stays readable from the pod's status after its log is gone.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security,
    }
    if runtime.image_pull_policy:
        trainer["imagePullPolicy"] = runtime.image_pull_policy
    if runtime.working_dir:
        trainer["workingDir"] = runtime.working_dir
    if runtime.env_from_secrets:
        trainer["envFrom"] = [{"secretRef": {"name": s}} for s in runtime.env_from_secrets]
    resources = runtime.resources()
    if resources:
        trainer["resources"] = resources
    if runtime.container_overrides:
        trainer = _deep_merge(trainer, runtime.container_overrides)

    wait: dict[str, Any] = {
        "name": INIT_CONTAINER,
        "image": runtime.image,
        "command": ["python", "-c", escape(WAIT_FOR_MASTER)],
        "env": [
            {"name": MASTER_ADDR_VAR, "value": escape(plan.master_addr)},
            {"name": DNS_TIMEOUT_VAR, "value": f"{spec.startup_timeout:g}"},
        ],
        # Requests equal to limits keep the pod's QoS class Guaranteed when the trainer's are.
        "resources": {
            "requests": {"cpu": "100m", "memory": "128Mi"},
            "limits": {"cpu": "100m", "memory": "128Mi"},
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": copy.deepcopy(container_security),
    }
    if runtime.image_pull_policy:
        wait["imagePullPolicy"] = runtime.image_pull_policy

    pod_security: dict[str, Any] = {
        "runAsNonRoot": non_root,
        "runAsUser": runtime.run_as_user,
        "runAsGroup": runtime.run_as_group,
        "fsGroup": runtime.run_as_group,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "subdomain": name,
        "enableServiceLinks": False,
        # The API token stays out of the pods unless the runtime needs it (it is an identity in
        # the cluster for whatever code runs there).
        "automountServiceAccountToken": runtime.automount_service_account_token,
        # SIGTERM, then SIGKILL after this: the time a rank has to save (worker.save_if_stopping).
        "terminationGracePeriodSeconds": grace,
        "securityContext": pod_security,
        "initContainers": [wait],
        "containers": [trainer],
        "volumes": volumes,
    }
    if runtime.service_account:
        pod_spec["serviceAccountName"] = runtime.service_account
    if runtime.priority_class:
        pod_spec["priorityClassName"] = runtime.priority_class
    if runtime.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in runtime.image_pull_secrets]
    if runtime.node_selector:
        pod_spec["nodeSelector"] = dict(runtime.node_selector)
    if runtime.tolerations:
        pod_spec["tolerations"] = [thaw(t) for t in runtime.tolerations]
    if runtime.affinity:
        pod_spec["affinity"] = thaw(runtime.affinity)
    if runtime.pod_overrides:
        pod_spec = _deep_merge(pod_spec, runtime.pod_overrides)

    job_spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": spec.num_nodes,
        "parallelism": spec.num_nodes,
        # One failed rank fails the group: no pod is retried in place. Airflow retries the task
        # (resuming from the latest checkpoint); the operator relaunches after a preemption.
        "backoffLimit": 0,
        "podFailurePolicy": {
            "rules": [
                # A preempted or evicted rank ends the Job at once (its peers would otherwise
                # wait out the rendezvous timeout); the operator relaunches the whole group.
                {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                # Any rank (or the DNS wait) exiting non-zero ends the Job.
                {"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [0]}},
            ]
        },
        "template": {
            "metadata": {
                "labels": dict(common_labels),
                "annotations": {"kubectl.kubernetes.io/default-container": CONTAINER},
            },
            "spec": pod_spec,
        },
    }
    if active_deadline_seconds is not None:
        # A backstop: the Job ends itself (pods get SIGTERM) even when no Airflow process is left
        # to stop it. Counted from the Job's start (for a queued Job: from its admission).
        job_spec["activeDeadlineSeconds"] = max(1, int(active_deadline_seconds))
    if runtime.queue:
        # Kueue admits a suspended Job as a whole (gang admission) and unsuspends it.
        job_spec["suspend"] = True
    if runtime.ttl_seconds_after_finished is not None:
        job_spec["ttlSecondsAfterFinished"] = runtime.ttl_seconds_after_finished

    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": job_labels, "annotations": job_annotations},
        "spec": job_spec,
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": dict(common_labels),
            "annotations": identity_annotations(identity),
        },
        "spec": {
            "clusterIP": "None",
            # At launch, once the Job's uid is known, the selector becomes the Job's controller-uid
            # (service_for_job): a label that other pods cannot guess.
            "selector": {GROUP_LABEL: name},
            # Ranks resolve each other while still starting (not Ready): torchrun needs node 0's
            # name before any pod could pass a readiness probe.
            "publishNotReadyAddresses": True,
            "ports": [
                {"name": "rendezvous", "port": plan.master_port, "targetPort": plan.master_port, "protocol": "TCP"}
            ],
        },
    }
    policy = None
    if runtime.network_policy:
        # Only the group's own pods may connect to its pods (the rendezvous, the collectives); what
        # the ranks reach themselves (storage, tracking) is not restricted. Selectors as the Service's.
        policy = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": dict(common_labels),
                "annotations": identity_annotations(identity),
            },
            "spec": {
                "podSelector": {"matchLabels": {GROUP_LABEL: name}},
                "policyTypes": ["Ingress"],
                "ingress": [{"from": [{"podSelector": {"matchLabels": {GROUP_LABEL: name}}}]}],
            },
        }
    return RenderedGroup(name=name, namespace=namespace, job=job, service=service, network_policy=policy)


def owner_reference(job: Mapping[str, Any]) -> dict[str, Any]:
    """Makes the Job the owner (of the Service, the NetworkPolicy): deleting the Job garbage-collects them."""
    meta = job["metadata"]
    return {"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"], "uid": meta["uid"], "controller": True}


def service_for_job(service: Mapping[str, Any], job: Mapping[str, Any]) -> dict[str, Any]:
    """The Service as created once ``job`` exists: owned by it, and selecting only its pods (by the
    controller-uid label the Job controller sets), so no other pod can take node 0's DNS name."""
    uid = job["metadata"]["uid"]
    meta = {**service["metadata"], "ownerReferences": [owner_reference(job)]}
    spec = {**service["spec"], "selector": {CONTROLLER_UID_LABEL: uid}}
    return {**service, "metadata": meta, "spec": spec}


def policy_for_job(policy: Mapping[str, Any], job: Mapping[str, Any]) -> dict[str, Any]:
    """The NetworkPolicy as created once ``job`` exists: owned by it, for and from only its pods (the
    controller-uid label, as the Service's selector)."""
    only_ours = {"matchLabels": {CONTROLLER_UID_LABEL: job["metadata"]["uid"]}}
    meta = {**policy["metadata"], "ownerReferences": [owner_reference(job)]}
    spec = {**policy["spec"], "podSelector": only_ours, "ingress": [{"from": [{"podSelector": only_ours}]}]}
    return {**policy, "metadata": meta, "spec": spec}


def to_yaml(objects: Sequence[Mapping[str, Any]]) -> str:
    """Multi-document YAML, keys in rendering order (what ``kubectl apply -f -`` reads)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
        # Multi-line strings (the DNS-wait script) as literal blocks, readable in review.
        if "\n" in data:
            return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|")
        return dumper.represent_str(data)

    Dumper.add_representer(str, text)
    return yaml.dump_all(
        [thaw(o) for o in objects], Dumper=Dumper, sort_keys=False, default_flow_style=False, width=120
    )
