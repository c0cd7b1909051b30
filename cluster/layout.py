"""Where everything of the cluster lives: versions, paths, addresses and ports, in one place.

Addresses: pods get 198.18.0.0/16 and Services 198.19.0.0/16, the benchmarking range (RFC 2544):
never routed on the internet and, unlike 10/8, 172.16/12 and 192.168/16, not used by the networks
a developer's machine or CI is likely to sit in, so nothing of the cluster collides with them or
reaches them. Every component listens on loopback or on the cluster's own bridge.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GO_MODULES = ROOT / "cluster" / "go"

# The releases, each pinned in its module under cluster/go/ (go.mod and go.sum).
KUBERNETES_VERSION = "v1.37.2"
VERSIONS = {
    "kubernetes": KUBERNETES_VERSION,
    "etcd": "v3.7.3",
    "containerd": "v2.4.2",
    "runc": "v1.5.3",
    "cni": "v1.10.0",
    "coredns": "v1.15.0",
    "kueue": "v0.17.0",
    "pause": "airflow-torchrun",
}

BRIDGE = "atrk8s0"  # at most 15 characters (IFNAMSIZ)
POD_SUBNET = "198.18.0.0/16"
SERVICE_SUBNET = "198.19.0.0/16"
# The bridge's own address: the pods' DNS server, S3 and MLflow are all reached here.
GATEWAY = "198.18.0.1"
CLUSTER_DOMAIN = "cluster.local"
NODE_COUNT = 2
# The control plane's ports on 127.0.0.1: a block below Linux's ephemeral range (32768-60999 by
# default), where no outgoing connection can hold one when the cluster binds it. At 36443 an earlier
# test's client socket held etcd's port once (CI, "bind: address already in use").
API_PORT = int(os.environ.get("AIRFLOW_TORCHRUN_CLUSTER_API_PORT", "26443"))
ETCD_PORT = API_PORT + 1
ETCD_PEER_PORT = API_PORT + 2
KUEUE_WEBHOOK_PORT = API_PORT + 3
KUEUE_METRICS_PORT = API_PORT + 4
KUEUE_HEALTH_PORT = API_PORT + 5
S3_PORT = API_PORT + 6
MLFLOW_PORT = API_PORT + 7
KUBELET_PORT = 10250  # one per node address
FIXED_PORTS = {
    "kube-apiserver": API_PORT,
    "etcd": ETCD_PORT,
    "etcd peer": ETCD_PEER_PORT,
    "kueue webhook": KUEUE_WEBHOOK_PORT,
    "kueue metrics": KUEUE_METRICS_PORT,
    "kueue health": KUEUE_HEALTH_PORT,
    "s3": S3_PORT,
    "mlflow": MLFLOW_PORT,
}


def ephemeral_ports() -> range:
    """The kernel's range for the local ports of outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)  # Linux's default


def fixed_ports_inside(ports: range) -> dict[str, int]:
    """The fixed ports (by what binds them) that lie in ``ports``."""
    return {name: port for name, port in FIXED_PORTS.items() if port in ports}


NAMESPACE = "default"
TRAINER_IMAGE = "docker.io/library/airflow-torchrun-trainer:cluster"
PAUSE_IMAGE = "localhost/airflow-torchrun/pause:1"


def cache_dir() -> Path:
    """Binaries and Go's caches: per user, outside the clone, so a fresh clone and CI reuse them."""
    base = os.environ.get("AIRFLOW_TORCHRUN_CLUSTER_CACHE")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "airflow-torchrun" / "cluster"


@dataclass(frozen=True)
class Node:
    index: int

    @property
    def name(self) -> str:
        return f"atr-node-{self.index}"

    @property
    def address(self) -> str:
        """The node's InternalIP (on the bridge): where its kubelet serves the API server."""
        return f"198.18.255.{10 + self.index}"

    @property
    def pod_cidr(self) -> str:
        return f"198.18.{self.index}.0/24"

    @property
    def pod_range(self) -> tuple[str, str]:
        # .1 of node 0's /24 is the bridge's own address.
        return (f"198.18.{self.index}.2", f"198.18.{self.index}.254")


NODES = tuple(Node(i) for i in range(NODE_COUNT))


@dataclass(frozen=True)
class State:
    """The cluster's folders: data under ``.state/cluster``; sockets and runtime state under a short
    folder in /run (a unix socket path has at most 107 bytes, a clone's path may be long)."""

    dir: Path

    @property
    def key(self) -> str:
        return hashlib.sha256(str(self.dir).encode()).hexdigest()[:8]

    @property
    def run(self) -> Path:
        return Path("/run") / f"atr-cluster-{self.key}"

    @property
    def cgroup(self) -> str:
        """The cgroup (in every v1 hierarchy) that holds every process of the cluster."""
        return f"airflow-torchrun-cluster-{self.key}"

    @property
    def pki(self) -> Path:
        return self.dir / "pki"

    @property
    def logs(self) -> Path:
        return self.dir / "logs"

    @property
    def pids(self) -> Path:
        return self.dir / "pids"

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    def node_dir(self, node: Node) -> Path:
        return self.dir / node.name

    def node_run(self, node: Node) -> Path:
        return self.run / node.name

    def containerd_socket(self, node: Node) -> Path:
        return self.node_run(node) / "containerd.sock"


def state() -> State:
    return State(Path(os.environ.get("AIRFLOW_TORCHRUN_CLUSTER_STATE", ROOT / ".state" / "cluster")).resolve())
