"""The configuration files and command lines of the cluster's components (pure: no I/O here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from cluster.layout import (
    API_PORT,
    BRIDGE,
    CLUSTER_DOMAIN,
    ETCD_PEER_PORT,
    ETCD_PORT,
    GATEWAY,
    KUBELET_PORT,
    PAUSE_IMAGE,
    POD_SUBNET,
    SERVICE_SUBNET,
    Node,
    State,
)

# What the kubelet would otherwise write into the machine's kernel settings at start (its
# setupKernelTunables). It runs in a mount namespace of its own in which these files are bind
# mounts holding the values it wants, with protectKernelDefaults on: it reads them, finds them
# as wanted, and writes nothing; the machine's own settings are never changed.
KUBELET_SYSCTLS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}


def etcd_args(state: State, etcd: Path) -> list[str]:
    return [
        str(etcd),
        "--name=airflow-torchrun",
        f"--data-dir={state.dir / 'etcd'}",
        f"--listen-client-urls=http://127.0.0.1:{ETCD_PORT}",
        f"--advertise-client-urls=http://127.0.0.1:{ETCD_PORT}",
        f"--listen-peer-urls=http://127.0.0.1:{ETCD_PEER_PORT}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{ETCD_PEER_PORT}",
        f"--initial-cluster=airflow-torchrun=http://127.0.0.1:{ETCD_PEER_PORT}",
        "--listen-metrics-urls=",
        "--log-level=warn",
        # One member on a shared disk: a slow fsync must not read as a lost leader.
        "--heartbeat-interval=250",
        "--election-timeout=2500",
        "--quota-backend-bytes=2147483648",
    ]


def apiserver_args(state: State, binary: Path) -> list[str]:
    pki = state.pki
    return [
        str(binary),
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        # Nothing in a pod talks to the API server (no service account tokens; Kueue and CoreDNS
        # are host processes): the `kubernetes` Service gets no endpoints, and a loopback
        # advertise address, which the endpoint reconciler refuses, is fine.
        "--endpoint-reconciler-type=none",
        f"--secure-port={API_PORT}",
        f"--etcd-servers=http://127.0.0.1:{ETCD_PORT}",
        f"--service-cluster-ip-range={SERVICE_SUBNET}",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
        "--kubelet-preferred-address-types=InternalIP",
        f"--service-account-key-file={pki / 'service-account.pub'}",
        f"--service-account-signing-key-file={pki / 'service-account.key'}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction",
        "--allow-privileged=false",
        "--anonymous-auth=false",
        "--profiling=false",
        # A lost node's pods are evicted after 30 s instead of 300 (the node-loss test waits on it).
        "--default-not-ready-toleration-seconds=30",
        "--default-unreachable-toleration-seconds=30",
        "--event-ttl=2h",
    ]


def controller_manager_args(state: State, binary: Path) -> list[str]:
    pki = state.pki
    return [
        str(binary),
        "--bind-address=127.0.0.1",
        "--secure-port=0",
        f"--kubeconfig={pki / 'controller-manager.kubeconfig'}",
        f"--authentication-kubeconfig={pki / 'controller-manager.kubeconfig'}",
        f"--authorization-kubeconfig={pki / 'controller-manager.kubeconfig'}",
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={pki / 'service-account.key'}",
        f"--root-ca-file={pki / 'ca.crt'}",
        f"--cluster-signing-cert-file={pki / 'ca.crt'}",
        f"--cluster-signing-key-file={pki / 'ca.key'}",
        f"--service-cluster-ip-range={SERVICE_SUBNET}",
        # Each node's pod range is set in its CNI config; the controller does not hand out ranges.
        "--allocate-node-cidrs=false",
        "--leader-elect=false",
        # A node that stops reporting is NotReady after 20 s (default 50).
        "--node-monitor-grace-period=20s",
    ]


def scheduler_args(state: State, binary: Path) -> list[str]:
    kubeconfig = state.pki / "scheduler.kubeconfig"
    return [
        str(binary),
        "--bind-address=127.0.0.1",
        "--secure-port=0",
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--leader-elect=false",
    ]


def containerd_config(state: State, node: Node, bin_dirs: dict[str, Path]) -> str:
    run = state.node_run(node)
    data = state.node_dir(node)
    runtime = "plugins.'io.containerd.cri.v1.runtime'"
    root, run_state, ttrpc = data / "containerd", run / "containerd", run / "containerd.sock.ttrpc"
    runc, runc_root, cni_bin, cni_conf = bin_dirs["runc"] / "runc", run / "runc", bin_dirs["cni"], data / "cni"
    # No NRI (its socket is one per machine), no tracing, no snapshotters that are not used.
    return f"""version = 3
root = "{root}"
state = "{run_state}"
disabled_plugins = [
  "io.containerd.nri.v1.nri",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.blockfile",
  "io.containerd.snapshotter.v1.erofs",
]

[grpc]
  address = "{state.containerd_socket(node)}"

[ttrpc]
  address = "{ttrpc}"

[metrics]
  address = ""

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"

[{runtime}]
  netns_mounts_under_state_dir = true
  # The machine's root lacks CAP_SYS_RESOURCE: an oom_score_adj below containerd's own (the
  # kubelet asks -998 for sandboxes) cannot be written; keep it at or above containerd's.
  restrict_oom_score_adj = true
  enable_selinux = false
  [{runtime}.containerd]
    default_runtime_name = "runc"
    [{runtime}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{runtime}.containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        Root = "{runc_root}"
        SystemdCgroup = false
  [{runtime}.cni]
    bin_dirs = ["{cni_bin}"]
    conf_dir = "{cni_conf}"
    max_conf_num = 1

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""


def cni_config(state: State, node: Node) -> dict[str, Any]:
    """One bridge for both nodes, the pods of both in one /16 (no routing between nodes needed, so
    the machine's ip_forward stays as it is); each node hands out addresses from its own /24. No
    gateway on the pods' side, no masquerading: a pod reaches the other pods and the bridge's own
    addresses (DNS, S3, MLflow) and nothing else."""
    start, end = node.pod_range
    return {
        "cniVersion": "1.0.0",
        "name": "airflow-torchrun",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": False,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(state.node_dir(node) / "ipam"),
                    "ranges": [[{"subnet": POD_SUBNET, "rangeStart": start, "rangeEnd": end}]],
                },
            }
        ],
    }


def kubelet_config(state: State, node: Node) -> dict[str, Any]:
    pki = state.pki
    data = state.node_dir(node)
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # cgroup v1 here: allowed again explicitly (Kubernetes 1.35+ refuses it by default).
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        # Each kubelet keeps its pods under a cgroup root of its own, so the two never manage (or
        # clean up) each other's pod cgroups.
        "cgroupRoot": f"/{state.cgroup}/{node.name}",
        "cgroupsPerQOS": True,
        "enforceNodeAllocatable": ["pods"],
        # Both nodes see the same 2 CPUs; reserving 500m leaves 1.5 allocatable, so two pods of
        # 1 CPU go to two nodes.
        "systemReserved": {"cpu": "500m", "memory": "1Gi"},
        "containerRuntimeEndpoint": f"unix://{state.containerd_socket(node)}",
        "address": node.address,
        "port": KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzBindAddress": node.address,
        "healthzPort": 10248,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "tlsCertFile": str(pki / f"kubelet-serving-{node.name}.crt"),
        "tlsPrivateKeyFile": str(pki / f"kubelet-serving-{node.name}.key"),
        "clusterDNS": [GATEWAY],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(state.dir / "resolv.conf"),
        "podLogsDir": str(data / "pod-logs"),
        "protectKernelDefaults": True,
        "failSwapOn": False,
        "staticPodPath": "",
        "serializeImagePulls": False,
        # The disk is shared with everything else on the machine: evict only when it is really full.
        "evictionHard": {"memory.available": "200Mi", "nodefs.available": "2%", "imagefs.available": "2%"},
        "imageGCHighThresholdPercent": 99,
        "imageGCLowThresholdPercent": 98,
        "nodeStatusUpdateFrequency": "5s",
        "shutdownGracePeriod": "0s",
    }


def kubelet_args(state: State, node: Node, kubelet: Path) -> list[str]:
    data = state.node_dir(node)
    return [
        str(kubelet),
        f"--config={data / 'kubelet.yaml'}",
        f"--kubeconfig={state.pki / f'kubelet-{node.name}.kubeconfig'}",
        f"--root-dir={data / 'kubelet'}",
        f"--cert-dir={data / 'kubelet' / 'pki'}",
        f"--hostname-override={node.name}",
        f"--node-ip={node.address}",
        f"--node-labels=airflow-torchrun/node-index={node.index}",
        "--v=1",
    ]


def kubelet_wrapper(state: State, node: Node, argv: list[str]) -> list[str]:
    """The kubelet's command inside a mount namespace of its own (``unshare --propagation
    unchanged``: its root folder is a shared mount, so the volumes it mounts there reach containerd),
    with the kernel settings it checks bind-mounted to the values it wants (``KUBELET_SYSCTLS``)."""
    fake = state.node_dir(node) / "sysctl"
    binds = " && ".join(
        f"mount --bind {fake / key.replace('/', '.')} /proc/sys/{key}" for key in sorted(KUBELET_SYSCTLS)
    )
    script = f'mount --make-rprivate /proc && {binds} && exec "$@"'
    return ["unshare", "--mount", "--propagation", "unchanged", "--", "sh", "-c", script, "kubelet", *argv]


def corefile() -> str:
    """Cluster DNS on the bridge's address: pod and Service records of cluster.local from the API,
    NXDOMAIN for every other name (nothing is forwarded off the machine)."""
    return f"""{CLUSTER_DOMAIN}:53 {{
    bind {GATEWAY}
    errors
    kubernetes {CLUSTER_DOMAIN} {{
        kubeconfig {{KUBECONFIG}}
        pods insecure
        ttl 0
    }}
}}
.:53 {{
    bind {GATEWAY}
    template ANY ANY {{
        rcode NXDOMAIN
    }}
}}
"""


RBAC = """
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "airflow-torchrun:coredns"}
rules:
  - apiGroups: [""]
    resources: [services, pods, namespaces]
    verbs: [list, watch]
  - apiGroups: [discovery.k8s.io]
    resources: [endpointslices]
    verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "airflow-torchrun:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "airflow-torchrun:coredns"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:airflow-torchrun:coredns"}]
---
# The API server's own client to the kubelets (logs, exec) is in system:masters; nothing to bind.
"""


def worker_role(namespace: str) -> str:
    """The Role docs/kubernetes.md documents for the Airflow worker, bound to the identity of the
    cluster's Airflow connection: the operator gets exactly those rights, as in production."""
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "airflow-torchrun", "namespace": namespace},
        "rules": [
            {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["create", "get", "list", "watch", "delete"]},
            {"apiGroups": [""], "resources": ["services"], "verbs": ["create", "get", "delete"]},
            {
                "apiGroups": ["networking.k8s.io"],
                "resources": ["networkpolicies"],
                "verbs": ["create", "get", "delete"],
            },
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["events"], "verbs": ["list"]},
            {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": ["list"]},
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "airflow-torchrun", "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "airflow-torchrun"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "airflow-torchrun-worker"}],
    }
    return yaml.safe_dump_all([role, binding], sort_keys=False)


def dumps(obj: dict[str, Any]) -> str:
    return json.dumps(obj, indent=2) + "\n"
