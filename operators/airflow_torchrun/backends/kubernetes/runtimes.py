"""Platform runtimes: named bundles of image, resources and placement that a DAG picks by name.

Platform engineers define runtimes once (Kubeflow Trainer's TrainingRuntime split); a DAG says
``runtime="gpu"`` and never sees images, node selectors or tolerations. Sources, in order:

1. the YAML file named by ``[torchrun] runtimes_file``;
2. only where ``[torchrun] runtimes_variable`` names one (unset by default), that Airflow Variable,
   JSON or YAML; it may add runtimes, never replace the file's (a runtime of the same name is refused);
3. when neither holds anything, the built-in examples ``cpu`` and ``gpu`` (:data:`BUILTIN_RUNTIMES`).

Both sources hold one mapping: runtime name -> definition (see ``docs/kubernetes.md``). A Variable
is editable by any Airflow user with Variable access, so its runtimes get an allow-list: the fields
of placement and size, the images the platform uses, a few harmless overrides
(:data:`VARIABLE_POD_OVERRIDES`, :data:`VARIABLE_CONTAINER_OVERRIDES`). Everything else needs the
file's :data:`POLICY_KEY` to allow it (:data:`ALLOWANCES`; ``images:`` for other images), and some
settings (:data:`NEVER_FROM_VARIABLE`) only a file runtime may have.
:func:`get_runtime` is called when a DAG is parsed: it reads a cached file and, guarded, the
Variable, so parsing works where no metadata database is reachable. Nothing here imports the
Kubernetes client.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from airflow_torchrun.errors import InvalidSpecError

log = logging.getLogger(__name__)

DEFAULT_RUNTIME = "cpu"
DEFAULT_VARIABLE = "torchrun_runtimes"
DEFAULT_IMAGE = "airflow-torchrun-trainer:0.1.0"
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_SHM_SIZE = "1Gi"
DEFAULT_UID = 1000
# How long one read of the Variable is reused: a DAG file with many training tasks parses them
# all within a second, and an edited Variable takes effect on the next parse cycle.
VARIABLE_TTL_SECONDS = 30.0
# A finished Job must outlive the operator's last look at it (every few seconds; the triggerer
# may be restarting): a Job deleted the moment it finishes leaves a task that cannot tell success
# from a vanished group.
MIN_TTL_SECONDS = 60
# The file's reserved key (a runtime name cannot start with "_") and what it may allow.
POLICY_KEY = "_variable_policy"
ALLOWANCES = {
    "privileged": (
        "privileged containers, privilege escalation, capabilities added or not all dropped, an unconfined "
        "seccomp or AppArmor profile, SELinux options, procMount, sysctls"
    ),
    "root": (
        "running as root or group 0 (run_as_user/run_as_group: 0, runAsUser/runAsGroup/fsGroup: 0, runAsNonRoot: false)"
    ),
    "host_namespaces": "hostNetwork, hostPID or hostIPC",
    "host_path": "hostPath volumes",
    "service_account_token": "the service account's API token in the pods (automount, a projected token volume)",
    "writable_root": "a writable root filesystem (read_only_root_filesystem: false)",
    "service_account": "a service account of the pods' own (service_account, serviceAccountName): its cloud identity",
    "secrets": "Secrets in the pods (env_from_secrets, image_pull_secrets, secret volumes, envFrom)",
    "overrides": "pod_overrides and container_overrides beyond the few harmless ones a Variable may always set",
    "identity_labels": (
        "labels and annotations with a prefix (iam.amazonaws.com/role, azure.workload.identity/use...), which "
        "admission webhooks read to give pods an identity"
    ),
    "environment": (
        "variables that change where the ranks' storage, tracking or code come from (AWS_*, AZURE_*, GOOGLE_*, "
        "MLFLOW_*, PYTHON*, LD_*, TRAIN_*, EVAL_*, TORCHELASTIC_*, AIRFLOW_*)"
    ),
    "open_network": "the group's pods open to connections from any pod (network_policy: false)",
}
_STEERING_ENV = (
    "AWS_",
    "AZURE_",
    "GOOGLE_",
    "MLFLOW_",
    "PYTHON",
    "LD_",
    "TRAIN_",
    "EVAL_",
    "TORCHELASTIC_",
    "AIRFLOW_",
)
# What a runtime of the Variable may put in its overrides without the "overrides" allowance.
VARIABLE_POD_OVERRIDES = frozenset({"topologySpreadConstraints", "schedulingGates", "enableServiceLinks"})
VARIABLE_CONTAINER_OVERRIDES = frozenset({"ports", "resources"})
# Pod settings that only a runtime of the file may have, whatever the policy allows: each can send
# the ranks' rendezvous elsewhere (hosts, DNS) or bypass the scheduler's placement rules.
NEVER_FROM_VARIABLE = ("nodeName", "hostAliases", "dnsConfig", "dnsPolicy")

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PULL_POLICIES = ("Always", "IfNotPresent", "Never")
_TOLERATION_KEYS = frozenset({"key", "operator", "value", "effect", "tolerationSeconds"})
_AFFINITY_KEYS = frozenset({"nodeAffinity", "podAffinity", "podAntiAffinity"})
_RESOURCE_KEYS = frozenset({"cpu", "memory", "gpu", "gpu_resource", "ephemeral_storage"})
_FIELDS = (
    "description",
    "image",
    "image_pull_policy",
    "nproc_per_node",
    "resources",
    "shm_size",
    "node_selector",
    "tolerations",
    "affinity",
    "queue",
    "priority_class",
    "service_account",
    "image_pull_secrets",
    "env",
    "env_from_secrets",
    "labels",
    "annotations",
    "working_dir",
    "run_as_user",
    "run_as_group",
    "ttl_seconds_after_finished",
    "termination_grace_period",
    "automount_service_account_token",
    "network_policy",
    "read_only_root_filesystem",
    "writable_paths",
    "pod_overrides",
    "container_overrides",
)


@dataclass(frozen=True)
class Runtime:
    """One named runtime. Build it with :func:`parse_runtime`, which validates.

    Kubernetes-shaped values (tolerations, affinity, the overrides) keep Kubernetes' own
    camelCase field names; they are copied into the rendered objects as they are.
    """

    name: str
    image: str
    description: str = ""
    image_pull_policy: str | None = None
    nproc_per_node: int = 1
    cpu: str | None = None
    memory: str | None = None
    gpu: int = 0
    gpu_resource: str = DEFAULT_GPU_RESOURCE
    ephemeral_storage: str | None = None
    shm_size: str | None = DEFAULT_SHM_SIZE
    node_selector: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None
    queue: str | None = None
    priority_class: str | None = None
    service_account: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    env_from_secrets: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    annotations: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    working_dir: str | None = None
    run_as_user: int = DEFAULT_UID
    run_as_group: int = DEFAULT_UID
    ttl_seconds_after_finished: int | None = None
    # Seconds between SIGTERM and SIGKILL for the pods (terminationGracePeriodSeconds): the time
    # a rank has to save a checkpoint when it is evicted, preempted or torn down. None: the task's
    # teardown_grace.
    termination_grace_period: int | None = None
    automount_service_account_token: bool = False
    # A NetworkPolicy that lets only the group's own pods connect to them (rendezvous, collectives).
    network_policy: bool = True
    read_only_root_filesystem: bool = True
    # Writable emptyDirs besides /tmp (and /dev/shm) for a read-only root filesystem.
    writable_paths: tuple[str, ...] = ()
    pod_overrides: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    container_overrides: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    source: str = "built-in"

    @property
    def cpus(self) -> float | None:
        """CPUs per node as a number (``"500m"`` -> 0.5), for OMP threads per rank."""
        return cpu_count(self.cpu) if self.cpu is not None else None

    def resources(self) -> dict[str, dict[str, str]]:
        """The trainer container's resources: requests equal limits (Guaranteed QoS, so a
        training pod is the last one the kubelet evicts under node pressure)."""
        amounts: dict[str, str] = {}
        if self.cpu is not None:
            amounts["cpu"] = self.cpu
        if self.memory is not None:
            amounts["memory"] = self.memory
        if self.ephemeral_storage is not None:
            amounts["ephemeral-storage"] = self.ephemeral_storage
        if self.gpu:
            amounts[self.gpu_resource] = str(self.gpu)
        if not amounts:
            return {}
        return {"requests": dict(amounts), "limits": dict(amounts)}


def cpu_count(quantity: str) -> float:
    """``"2"`` -> 2.0, ``"500m"`` -> 0.5 (only the forms a CPU amount takes)."""
    if quantity.endswith("m"):
        return float(quantity[:-1]) / 1000
    return float(quantity)


def _frozen(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({k: _frozen(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """A plain, mutable deep copy (dicts and lists) of a runtime's frozen value."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [thaw(v) for v in value]
    return copy.copy(value)


class _Fields:
    """A runtime definition read field by field: each reader returns the value, or a default while
    it notes the problem, so one error lists every problem of the definition."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.data = data
        self.problems: list[str] = []

    def text(self, key: str, required: bool = False) -> str | None:
        value = self.data.get(key)
        if value is None:
            if required:
                self.problems.append(f"{key} is required")
            return None
        if not isinstance(value, str) or not value.strip():
            self.problems.append(f"{key} must be a non-empty string, got {value!r}")
            return None
        return value

    def whole(self, key: str, value: object, minimum: int) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.problems.append(f"{key} must be a whole number >= {minimum}, got {value!r}")
            return None
        return value

    def quantity(self, key: str, value: object) -> str | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            self.problems.append(f"{key} must be a Kubernetes quantity such as '4', '500m' or '16Gi', got {value!r}")
            return None
        text_value = str(value)
        if not _QUANTITY.match(text_value):
            self.problems.append(f"{key} {text_value!r} is not a Kubernetes quantity (examples: '4', '500m', '16Gi')")
            return None
        return text_value

    def str_map(self, key: str, check_keys: re.Pattern[str] | None = None) -> dict[str, str]:
        value = self.data.get(key)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.problems.append(f"{key} must be a mapping of strings, got {type(value).__name__}")
            return {}
        out = {}
        for k, v in value.items():
            if not isinstance(k, str) or (check_keys is not None and not check_keys.match(k)):
                self.problems.append(f"{key}: {k!r} is not a valid name")
                continue
            if isinstance(v, Mapping | list | tuple) or v is None:
                self.problems.append(f"{key}: the value of {k} must be a string, got {v!r}")
                continue
            out[k] = str(v)
        return out

    def str_list(self, key: str) -> tuple[str, ...]:
        value = self.data.get(key)
        if value is None:
            return ()
        if (
            isinstance(value, str)
            or not isinstance(value, Sequence)
            or not all(isinstance(v, str) and v for v in value)
        ):
            self.problems.append(f"{key} must be a list of names, got {value!r}")
            return ()
        return tuple(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            self.problems.append(f"{key} must be true or false, got {value!r}")
            return default
        return value

    def obj(self, key: str) -> dict[str, Any]:
        value = self.data.get(key)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.problems.append(f"{key} must be a mapping (Kubernetes field names), got {type(value).__name__}")
            return {}
        return dict(value)


def _image(f: _Fields) -> dict[str, Any]:
    image = f.text("image", required=True)
    pull_policy = f.text("image_pull_policy")
    if pull_policy is not None and pull_policy not in _PULL_POLICIES:
        f.problems.append(f"image_pull_policy must be one of {', '.join(_PULL_POLICIES)}, got {pull_policy!r}")
    return {
        "image": image,
        "image_pull_policy": pull_policy,
        "image_pull_secrets": f.str_list("image_pull_secrets"),
    }


def _size(f: _Fields) -> dict[str, Any]:
    """What one node asks for: resources, ranks per node, shared memory."""
    resources = f.obj("resources")
    for k in sorted(set(resources) - _RESOURCE_KEYS):
        f.problems.append(f"resources: unknown key {k!r}; known keys: {', '.join(sorted(_RESOURCE_KEYS))}")
    gpu = f.whole("resources.gpu", resources.get("gpu", 0), 0) or 0
    gpu_resource = resources.get("gpu_resource", DEFAULT_GPU_RESOURCE)
    if not isinstance(gpu_resource, str) or "/" not in gpu_resource:
        f.problems.append(
            f"resources.gpu_resource must be an extended resource name like 'nvidia.com/gpu', got {gpu_resource!r}"
        )
        gpu_resource = DEFAULT_GPU_RESOURCE
    return {
        "cpu": f.quantity("resources.cpu", resources.get("cpu")),
        "memory": f.quantity("resources.memory", resources.get("memory")),
        "ephemeral_storage": f.quantity("resources.ephemeral_storage", resources.get("ephemeral_storage")),
        "gpu": gpu,
        "gpu_resource": gpu_resource,
        "nproc_per_node": f.whole("nproc_per_node", f.data.get("nproc_per_node"), 1) or max(gpu, 1),
        "shm_size": f.quantity("shm_size", f.data["shm_size"]) if "shm_size" in f.data else DEFAULT_SHM_SIZE,
    }


def _placement(f: _Fields) -> dict[str, Any]:
    """Where the pods may run and in which queue."""
    tolerations = f.data.get("tolerations") or []
    if not isinstance(tolerations, list) or not all(isinstance(t, Mapping) for t in tolerations):
        f.problems.append("tolerations must be a list of mappings (key, operator, value, effect, tolerationSeconds)")
        tolerations = []
    for t in tolerations:
        extra = sorted(set(t) - _TOLERATION_KEYS)
        if extra:
            f.problems.append(f"tolerations: unknown key(s) {', '.join(extra)} in {dict(t)!r}")
    affinity = f.obj("affinity")
    extra_aff = sorted(set(affinity) - _AFFINITY_KEYS)
    if extra_aff:
        f.problems.append(f"affinity: unknown key(s) {', '.join(extra_aff)}; use {', '.join(sorted(_AFFINITY_KEYS))}")
    return {
        "node_selector": MappingProxyType(f.str_map("node_selector")),
        "tolerations": tuple(_frozen(t) for t in tolerations),
        "affinity": _frozen(affinity) if affinity else None,
        "queue": f.text("queue"),
        "priority_class": f.text("priority_class"),
    }


def _identity_and_sandbox(f: _Fields) -> dict[str, Any]:
    """Who the trainer runs as, what it may write and what it is given (env, Secrets, a token)."""
    run_as_user = f.whole("run_as_user", f.data.get("run_as_user", DEFAULT_UID), 0)
    run_as_group = f.whole("run_as_group", f.data.get("run_as_group", DEFAULT_UID), 0)
    writable = f.str_list("writable_paths")
    for path in writable:
        if not path.startswith("/") or path.rstrip("/") in ("", "/tmp", "/dev/shm") or ".." in path.split("/"):
            f.problems.append(
                f"writable_paths: {path!r} must be an absolute path other than /, /tmp and /dev/shm (those are "
                "writable already)"
            )
    return {
        "service_account": f.text("service_account"),
        "automount_service_account_token": f.flag("automount_service_account_token", False),
        "network_policy": f.flag("network_policy", True),
        "env": MappingProxyType(f.str_map("env", _ENV_NAME)),
        "env_from_secrets": f.str_list("env_from_secrets"),
        "working_dir": f.text("working_dir"),
        "run_as_user": DEFAULT_UID if run_as_user is None else run_as_user,
        "run_as_group": DEFAULT_UID if run_as_group is None else run_as_group,
        "read_only_root_filesystem": f.flag("read_only_root_filesystem", True),
        "writable_paths": writable,
    }


def _lifetime(f: _Fields) -> dict[str, Any]:
    ttl = f.whole("ttl_seconds_after_finished", f.data.get("ttl_seconds_after_finished"), 0)
    if ttl is not None and ttl < MIN_TTL_SECONDS:
        f.problems.append(
            f"ttl_seconds_after_finished {ttl} is too short: the Job would be deleted before the operator reads "
            f"how it ended (the task would see a vanished group); give at least {MIN_TTL_SECONDS}, or leave it out "
            "(the operator deletes its Jobs itself)"
        )
        ttl = None
    return {
        "ttl_seconds_after_finished": ttl,
        "termination_grace_period": f.whole("termination_grace_period", f.data.get("termination_grace_period"), 1),
    }


def _overrides(f: _Fields) -> dict[str, Any]:
    """Raw pod and container fields, except those the group's wiring depends on."""
    pod_overrides = f.obj("pod_overrides")
    container_overrides = f.obj("container_overrides")
    for bad in ("containers", "initContainers", "restartPolicy", "subdomain"):
        if bad in pod_overrides:
            f.problems.append(
                f"pod_overrides may not set {bad}: the group's wiring depends on it "
                "(use container_overrides to change the trainer container)"
            )
    for bad in ("name", "image", "command", "args", "env"):
        if bad in container_overrides:
            f.problems.append(
                f"container_overrides may not set {bad}; set image and env in the runtime, the command in the DAG"
            )
    return {
        "labels": MappingProxyType(f.str_map("labels")),
        "annotations": MappingProxyType(f.str_map("annotations")),
        "pod_overrides": _frozen(pod_overrides),
        "container_overrides": _frozen(container_overrides),
    }


def parse_runtime(name: object, data: object, source: str = "") -> Runtime:
    """Validate one runtime definition; raises :class:`InvalidSpecError` listing every problem."""
    problems: list[str] = []
    where = f"runtime {name!r}{f' in {source}' if source else ''}"
    if not isinstance(name, str) or not _NAME.match(name) or len(name) > 63:
        problems.append(
            f"runtime name {name!r} must be lower-case letters, digits, '-', '_' or '.', at most 63 characters"
        )
    if not isinstance(data, Mapping):
        raise InvalidSpecError([*problems, f"the definition must be a mapping, got {type(data).__name__}"], where)
    unknown = sorted(set(map(str, data)) - set(_FIELDS))
    if unknown:
        problems.append(f"unknown field(s) {', '.join(unknown)}; known fields: {', '.join(_FIELDS)}")
    f = _Fields(data)
    fields = {
        **_image(f),
        **_size(f),
        **_placement(f),
        **_identity_and_sandbox(f),
        **_lifetime(f),
        **_overrides(f),
        "description": f.text("description") or "",
    }
    problems += f.problems
    if problems:
        raise InvalidSpecError(problems, where)
    return Runtime(name=str(name), source=source or "built-in", **fields)


def parse_runtimes(data: object, source: str, *, policy_allowed: bool = False) -> dict[str, Runtime]:
    """A whole runtimes document (name -> definition); every runtime's problems at once.

    :data:`POLICY_KEY` is skipped where ``policy_allowed`` (the runtimes file), refused elsewhere.
    """
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise InvalidSpecError(
            [f"expected a mapping of runtime name -> definition, got {type(data).__name__}"], f"runtimes in {source}"
        )
    out: dict[str, Runtime] = {}
    problems: list[str] = []
    for name, definition in data.items():
        if name == POLICY_KEY:
            if not policy_allowed:
                problems.append(
                    f"{POLICY_KEY} may be set only in the platform's runtimes file ([torchrun] runtimes_file)"
                )
            continue
        try:
            out[str(name)] = parse_runtime(name, definition, source)
        except InvalidSpecError as exc:
            problems += [f"runtime {name!r}: {p}" for p in exc.problems]
    if problems:
        raise InvalidSpecError(problems, f"runtimes in {source}")
    return out


# The two examples in effect when nothing is configured. They name the image that
# images/trainer/README.md builds; a platform replaces them with its own runtimes file.
BUILTIN_DEFINITIONS: dict[str, dict[str, Any]] = {
    "cpu": {
        "description": "CPU-only nodes: 2 CPUs and 4 GiB per node (an example; define your own runtimes)",
        "image": DEFAULT_IMAGE,
        "nproc_per_node": 1,
        "resources": {"cpu": "2", "memory": "4Gi"},
        "shm_size": "1Gi",
    },
    "gpu": {
        "description": "One NVIDIA GPU per node, 8 CPUs, 32 GiB (an example; define your own runtimes)",
        "image": DEFAULT_IMAGE,
        "nproc_per_node": 1,
        "resources": {"cpu": "8", "memory": "32Gi", "gpu": 1},
        "shm_size": "8Gi",
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "env": {"NCCL_DEBUG": "WARN"},
    },
}
BUILTIN_RUNTIMES: Mapping[str, Runtime] = MappingProxyType(parse_runtimes(BUILTIN_DEFINITIONS, "built-in"))


@dataclass(frozen=True)
class VariablePolicy:
    """What the runtimes file lets runtimes of the Variable do (:data:`POLICY_KEY`)."""

    allow: frozenset[str] = frozenset()
    # Image prefixes a Variable runtime may name; None: exactly the images of the file's runtimes.
    images: tuple[str, ...] | None = None


def parse_policy(data: object, source: str) -> VariablePolicy:
    """The runtimes file's :data:`POLICY_KEY` (nothing allowed when it has none)."""
    if not isinstance(data, Mapping) or data.get(POLICY_KEY) is None:
        return VariablePolicy()
    policy = data[POLICY_KEY]
    where = f"{POLICY_KEY} in {source}"
    if not isinstance(policy, Mapping) or set(policy) - {"allow", "images"}:
        raise InvalidSpecError(
            [f"expected a mapping with the keys allow: [{', '.join(ALLOWANCES)}] and images: [<prefix>, ...]"], where
        )
    allow = policy.get("allow") or []
    if isinstance(allow, str) or not isinstance(allow, Sequence):
        raise InvalidSpecError([f"allow must be a list of {', '.join(ALLOWANCES)}; got {allow!r}"], where)
    unknown = [a for a in allow if a not in ALLOWANCES]
    if unknown:
        raise InvalidSpecError([f"unknown allowance(s) {unknown!r}; known: {', '.join(ALLOWANCES)}"], where)
    images = policy.get("images")
    if images is not None and (
        isinstance(images, str) or not isinstance(images, Sequence) or not all(isinstance(i, str) and i for i in images)
    ):
        raise InvalidSpecError(
            [f"images must be a list of image prefixes such as 'registry.example.com/ml/'; got {images!r}"], where
        )
    return VariablePolicy(frozenset(allow), None if images is None else tuple(images))


def _security_context(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def loosenings(runtime: Runtime) -> list[tuple[str, str]]:
    """What in ``runtime`` loosens the pods' security: (allowance, the setting), in a stable order.

    Read from the runtime's own fields and from its overrides, which the render merges into the
    pod: lists in the overrides replace the rendered ones, so a ``volumes`` override is read whole
    and a ``capabilities.drop`` without ``ALL`` gives the dropped capabilities back.
    """
    out: list[tuple[str, str]] = []
    pod = runtime.pod_overrides
    container = runtime.container_overrides
    pod_sc = _security_context(pod.get("securityContext"))
    c_sc = _security_context(container.get("securityContext"))
    if runtime.run_as_user == 0:
        out.append(("root", "run_as_user: 0"))
    if runtime.run_as_group == 0:
        out.append(("root", "run_as_group: 0"))
    for where, sc in (("pod_overrides", pod_sc), ("container_overrides", c_sc)):
        for key in ("runAsUser", "runAsGroup", "fsGroup"):
            if sc.get(key) == 0:
                out.append(("root", f"{where}.securityContext.{key}: 0"))
        if 0 in (sc.get("supplementalGroups") or ()):
            out.append(("root", f"{where}.securityContext.supplementalGroups: 0"))
        if sc.get("runAsNonRoot") is False:
            out.append(("root", f"{where}.securityContext.runAsNonRoot: false"))
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(("privileged", f"{where}.securityContext.seccompProfile: Unconfined"))
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            out.append(("privileged", f"{where}.securityContext.appArmorProfile: Unconfined"))
        if sc.get("seLinuxOptions"):
            out.append(("privileged", f"{where}.securityContext.seLinuxOptions"))
    if pod_sc.get("sysctls"):
        out.append(("privileged", "pod_overrides.securityContext.sysctls"))
    if c_sc.get("privileged") is True:
        out.append(("privileged", "container_overrides.securityContext.privileged: true"))
    if c_sc.get("allowPrivilegeEscalation") is True:
        out.append(("privileged", "container_overrides.securityContext.allowPrivilegeEscalation: true"))
    if c_sc.get("procMount") not in (None, "Default"):
        out.append(("privileged", f"container_overrides.securityContext.procMount: {c_sc.get('procMount')}"))
    capabilities = _security_context(c_sc.get("capabilities"))
    if capabilities.get("add"):
        out.append(("privileged", "container_overrides.securityContext.capabilities.add"))
    if "drop" in capabilities and "ALL" not in (capabilities.get("drop") or ()):
        out.append(("privileged", f"container_overrides.securityContext.capabilities.drop: {capabilities['drop']!r}"))
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key) is True:
            out.append(("host_namespaces", f"pod_overrides.{key}: true"))
    volumes = [v for v in pod.get("volumes") or () if isinstance(v, Mapping)]
    for volume in volumes:
        if "hostPath" in volume:
            out.append(("host_path", f"pod_overrides.volumes: hostPath volume {volume.get('name')!r}"))
    if runtime.automount_service_account_token:
        out.append(("service_account_token", "automount_service_account_token: true"))
    if pod.get("automountServiceAccountToken") is True:
        out.append(("service_account_token", "pod_overrides.automountServiceAccountToken: true"))
    for volume in volumes:
        sources = (volume.get("projected") or {}).get("sources") or ()
        if any(isinstance(src, Mapping) and "serviceAccountToken" in src for src in sources):
            out.append(("service_account_token", f"pod_overrides.volumes: token volume {volume.get('name')!r}"))
        if "secret" in volume or any(isinstance(src, Mapping) and "secret" in src for src in sources):
            out.append(("secrets", f"pod_overrides.volumes: secret volume {volume.get('name')!r}"))
    if not runtime.read_only_root_filesystem:
        out.append(("writable_root", "read_only_root_filesystem: false"))
    if not runtime.network_policy:
        out.append(("open_network", "network_policy: false"))
    if c_sc.get("readOnlyRootFilesystem") is False:
        out.append(("writable_root", "container_overrides.securityContext.readOnlyRootFilesystem: false"))
    if runtime.service_account:
        out.append(("service_account", f"service_account: {runtime.service_account}"))
    for key in ("serviceAccountName", "serviceAccount"):
        if pod.get(key):
            out.append(("service_account", f"pod_overrides.{key}: {pod.get(key)}"))
    if runtime.env_from_secrets:
        out.append(("secrets", f"env_from_secrets: {', '.join(runtime.env_from_secrets)}"))
    if runtime.image_pull_secrets:
        out.append(("secrets", f"image_pull_secrets: {', '.join(runtime.image_pull_secrets)}"))
    if container.get("envFrom"):
        out.append(("secrets", "container_overrides.envFrom"))
    if pod.get("imagePullSecrets"):
        out.append(("secrets", "pod_overrides.imagePullSecrets"))
    prefixed = sorted(k for k in (*runtime.labels, *runtime.annotations) if "/" in k)
    if prefixed:
        out.append(("identity_labels", f"labels/annotations {', '.join(prefixed)}"))
    steering = sorted(k for k in runtime.env if k.upper().startswith(_STEERING_ENV))
    if steering:
        out.append(("environment", f"env {', '.join(steering)}"))
    extra_pod = sorted(set(map(str, pod)) - VARIABLE_POD_OVERRIDES)
    extra_container = sorted(set(map(str, container)) - VARIABLE_CONTAINER_OVERRIDES)
    if extra_pod:
        out.append(("overrides", f"pod_overrides: {', '.join(extra_pod)}"))
    if extra_container:
        out.append(("overrides", f"container_overrides: {', '.join(extra_container)}"))
    return out


def variable_problems(
    runtimes: Mapping[str, Runtime], policy: VariablePolicy, platform: Mapping[str, Runtime], source: str
) -> list[str]:
    """Why runtimes of ``source`` (the Variable) may not be used; empty when nothing is wrong.

    ``platform``: the runtimes of the file (their names are the platform's; their images, unless
    the policy lists ``images``, the only ones a Variable runtime may name), or the built-ins where
    there is no file (their images count, their names are free to take).
    """
    problems = []
    images = policy.images if policy.images is not None else tuple(sorted({r.image for r in platform.values()}))
    exact = policy.images is None
    reserved = set() if platform is BUILTIN_RUNTIMES else set(platform)
    for name, runtime in runtimes.items():
        if name in reserved:
            problems.append(
                f"runtime {name!r} is defined in the platform's runtimes file, which the Variable may not replace: "
                "give the Variable's runtime another name"
            )
        if not any(runtime.image == i if exact else runtime.image.startswith(i) for i in images):
            known = ", ".join(images) or "(none: the runtimes file has no runtimes)"
            problems.append(
                f"runtime {name!r} names the image {runtime.image!r}, which the platform does not use; a runtime of "
                f"the Variable may name {'one of the images' if exact else 'images under'} {known}. Define it in "
                f"[torchrun] runtimes_file, or list its registry under {POLICY_KEY}.images there"
            )
        for key in NEVER_FROM_VARIABLE:
            if key in runtime.pod_overrides:
                problems.append(
                    f"runtime {name!r} sets pod_overrides.{key}, which only a runtime of [torchrun] runtimes_file may "
                    "set (it can redirect the ranks' rendezvous or bypass the scheduler)"
                )
        problems += [
            f"runtime {name!r} sets {setting} ({ALLOWANCES[allowance]}), which the platform's runtimes file does not "
            f"allow for runtimes of the Variable: define this runtime in [torchrun] runtimes_file, or list "
            f"{allowance!r} under {POLICY_KEY}.allow there"
            for allowance, setting in loosenings(runtime)
            if allowance not in policy.allow
        ]
    return problems


_file_cache: dict[str, tuple[tuple[int, int], dict[str, Runtime], VariablePolicy]] = {}
_variable_cache: dict[str, tuple[float, str | None]] = {}


def clear_cache() -> None:
    """Forget cached file and Variable contents (tests; a long-lived process after an edit)."""
    _file_cache.clear()
    _variable_cache.clear()


def _config(key: str, default: str | None = None, *, keep_empty: bool = False) -> str | None:
    """``[torchrun] key``; an empty value means the default unless ``keep_empty``."""
    try:
        from airflow.sdk import conf
    except ImportError:  # the core without Airflow: environment only
        value = os.environ.get(f"AIRFLOW__TORCHRUN__{key.upper()}")
    else:
        value = conf.get("torchrun", key, fallback=None)
    if value is None or (value == "" and not keep_empty):
        return default
    return value


def _yaml_load(text: str, source: str) -> object:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidSpecError([f"not valid YAML/JSON: {exc}"], f"runtimes in {source}") from exc


def _load_file(path: str) -> tuple[dict[str, Runtime], VariablePolicy]:
    """The runtimes of one YAML file and its policy for the Variable, cached until the file changes."""
    p = Path(path).expanduser()
    try:
        st = p.stat()
    except OSError as exc:
        raise InvalidSpecError(
            [f"the runtimes file {path} cannot be read ({exc.strerror}); fix [torchrun] runtimes_file"],
            "runtimes",
        ) from exc
    key = (st.st_mtime_ns, st.st_size)
    cached = _file_cache.get(str(p))
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    data = _yaml_load(p.read_text(), f"file {p}")
    runtimes = parse_runtimes(data, f"file {p}", policy_allowed=True)
    policy = parse_policy(data, f"file {p}")
    _file_cache[str(p)] = (key, runtimes, policy)
    return runtimes, policy


def read_variable(name: str) -> str | None:
    """The Variable's text, or None when unset *or unreadable*.

    Guarded on purpose: DAG parsing, the ``render`` command and tests may run where no metadata
    database or API server is reachable; runtimes then come from the file or the built-ins.
    Environment-defined Variables (``AIRFLOW_VAR_<NAME>``) are read through Airflow like any other.
    """
    now = time.monotonic()
    cached = _variable_cache.get(name)
    if cached is not None and now - cached[0] < VARIABLE_TTL_SECONDS:
        return cached[1]
    value: str | None
    try:
        from airflow.sdk import Variable

        raw = Variable.get(name, default=None)
        value = None if raw is None else str(raw)
    except Exception as exc:  # any backend failure means "not available here", never a parse error
        log.debug("Variable %s not readable here (%s); using the runtimes file or built-ins", name, exc)
        value = None
    _variable_cache[name] = (now, value)
    return value


@dataclass(frozen=True)
class RuntimeCatalog:
    runtimes: Mapping[str, Runtime]
    sources: tuple[str, ...]

    def describe_sources(self) -> str:
        return ", ".join(self.sources)


def load_runtimes(*, file: str | None = None, variable: str | None = None) -> RuntimeCatalog:
    """Every runtime in effect, from ``file`` / ``variable`` or the Airflow config when not given.

    The Variable is read only where one is named (``variable``, else ``[torchrun] runtimes_variable``,
    unset by default); pass ``variable=""`` to skip it whatever the config says.
    """
    path = file if file is not None else _config("runtimes_file")
    var_name = variable if variable is not None else _config("runtimes_variable", None, keep_empty=True)
    merged: dict[str, Runtime] = {}
    sources: list[str] = []
    policy = VariablePolicy()
    platform: Mapping[str, Runtime] = BUILTIN_RUNTIMES
    if path:
        platform, policy = _load_file(path)
        merged.update(platform)
        sources.append(f"file {path}")
    if var_name:
        text = read_variable(var_name)
        if text is not None and text.strip():
            source = f"Variable {var_name}"
            from_variable = parse_runtimes(_yaml_load(text, source), source)
            problems = variable_problems(from_variable, policy, platform, source)
            if problems:
                raise InvalidSpecError(problems, f"runtimes in {source}")
            merged.update(from_variable)
            sources.append(source)
    if not sources:
        return RuntimeCatalog(BUILTIN_RUNTIMES, ("built-in examples",))
    return RuntimeCatalog(MappingProxyType(merged), tuple(sources))


def default_runtime_name() -> str:
    return _config("default_runtime", DEFAULT_RUNTIME) or DEFAULT_RUNTIME


def get_runtime(name: str | None = None, *, where: str = "", catalog: RuntimeCatalog | None = None) -> Runtime:
    """The runtime called ``name`` (``[torchrun] default_runtime``, else ``cpu``, when None).

    Raises :class:`InvalidSpecError` naming the known runtimes when there is no such runtime.
    """
    catalog = catalog or load_runtimes()
    chosen = name or default_runtime_name()
    runtime = catalog.runtimes.get(chosen)
    if runtime is None:
        known = ", ".join(sorted(catalog.runtimes)) or "(none)"
        raise InvalidSpecError(
            [
                f"runtime {chosen!r} is unknown; known runtimes: {known} (from {catalog.describe_sources()}). "
                "Pick one of them, or ask your platform team to define it in [torchrun] runtimes_file "
                f"or the Airflow Variable {DEFAULT_VARIABLE}"
            ],
            where,
        )
    return runtime
