"""Bring the cluster up (idempotent: what runs is kept, what is missing is started) and down."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from cluster import configs, images, pki
from cluster.build import BY_NAME, COMPONENTS, binary, build_all, require_free, say
from cluster.kube import api_ready, kubectl, ready_nodes
from cluster.layout import (
    BRIDGE,
    ETCD_PORT,
    GATEWAY,
    KUBERNETES_VERSION,
    MLFLOW_PORT,
    NAMESPACE,
    NODES,
    PAUSE_IMAGE,
    S3_PORT,
    TRAINER_IMAGE,
    Node,
    State,
    ephemeral_ports,
    fixed_ports_inside,
    state,
)
from cluster.proc import Processes, cgroup_pids, kill, make_cgroup, remove_cgroup, terminate, unmount_all

S3_BUCKET = "airflow-torchrun"
S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "cluster-testing",
    "AWS_SECRET_ACCESS_KEY": "cluster-testing-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_ENDPOINT_URL": f"http://{GATEWAY}:{S3_PORT}",
}
S3_SECRET = "s3-credentials"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def preflight() -> None:
    if os.geteuid() != 0:
        raise SystemExit("make cluster runs the kubelets and containerd, which need root")
    for tool in ("ip", "unshare", "mount", "umount"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed (apt-get install iproute2 util-linux mount)")
    ephemeral = ephemeral_ports()
    inside = sorted(f"{name} {port}" for name, port in fixed_ports_inside(ephemeral).items())
    if inside:
        say(
            f"warning: {', '.join(inside)} inside the ephemeral ports {ephemeral.start}-{ephemeral.stop - 1}: an "
            "outgoing connection may hold one when it is bound; set AIRFLOW_TORCHRUN_CLUSTER_API_PORT below them"
        )


def network() -> None:
    """The bridge every pod hangs off, with the gateway address and one address per node."""
    if ip("link", "show", BRIDGE, check=False).returncode != 0:
        ip("link", "add", BRIDGE, "type", "bridge")
    have = ip("-o", "addr", "show", "dev", BRIDGE).stdout
    for address in (GATEWAY, *(n.address for n in NODES)):
        if f" {address}/" not in have:
            ip("addr", "add", f"{address}/16", "dev", BRIDGE)
    ip("link", "set", BRIDGE, "up")


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def control_plane(st: State, procs: Processes) -> None:
    kube = BY_NAME["kubernetes"].bin_dir
    procs.start("etcd", configs.etcd_args(st, binary("etcd")))
    procs.wait_for("etcd", lambda: http_ok(f"http://127.0.0.1:{ETCD_PORT}/health"), 60, "healthy etcd")
    procs.start("kube-apiserver", configs.apiserver_args(st, kube / "kube-apiserver"))
    procs.wait_for("kube-apiserver", api_ready, 180, "ready API server (/readyz)")
    procs.start("kube-controller-manager", configs.controller_manager_args(st, kube / "kube-controller-manager"))
    procs.start("kube-scheduler", configs.scheduler_args(st, kube / "kube-scheduler"))
    # Neither serves a health endpoint here (no ports of theirs); a bad flag ends them at once.
    time.sleep(3)
    for name in ("kube-controller-manager", "kube-scheduler"):
        if procs.pid(name) is None:
            raise SystemExit(f"{name} exited; the end of {procs.log(name)}:\n{procs.tail(name)}")
    kubectl("apply", "-f", "-", input=configs.RBAC)
    kubectl("apply", "-f", "-", input=configs.worker_role(NAMESPACE))
    corefile = st.dir / "Corefile"
    corefile.write_text(configs.corefile().replace("{KUBECONFIG}", str(st.pki / "coredns.kubeconfig")))
    procs.start("coredns", [str(binary("coredns")), "-conf", str(corefile)])
    procs.wait_for("coredns", lambda: port_open(GATEWAY, 53), 60, "DNS on port 53")


def node_up(st: State, procs: Processes, node: Node) -> None:
    data, run = st.node_dir(node), st.node_run(node)
    for folder in (data / "cni", data / "kubelet", data / "pod-logs", data / "sysctl", run):
        folder.mkdir(parents=True, exist_ok=True)
    bins = {name: BY_NAME[name].bin_dir for name in ("runc", "cni", "containerd")}
    (data / "containerd.toml").write_text(configs.containerd_config(st, node, bins))
    (data / "cni" / "10-airflow-torchrun.conflist").write_text(configs.dumps(configs.cni_config(st, node)))
    (data / "kubelet.yaml").write_text(yaml.safe_dump(configs.kubelet_config(st, node), sort_keys=False))
    for key, value in configs.KUBELET_SYSCTLS.items():
        (data / "sysctl" / key.replace("/", ".")).write_text(value + "\n")
    kubelet_root = data / "kubelet"
    # A shared mount of its own: the volumes the kubelet mounts in its namespace reach containerd's.
    if not any(line.split()[4] == str(kubelet_root) for line in Path("/proc/self/mountinfo").read_text().splitlines()):
        subprocess.run(["mount", "--bind", str(kubelet_root), str(kubelet_root)], check=True)
        subprocess.run(["mount", "--make-rshared", str(kubelet_root)], check=True)
    # containerd's shims (and so the containers' runc) find their binaries on PATH.
    env = {**os.environ, "PATH": f"{bins['containerd']}:{bins['runc']}:{os.environ.get('PATH', '')}"}
    name = f"containerd-{node.name}"
    procs.start(name, [str(bins["containerd"] / "containerd"), "--config", str(data / "containerd.toml")], env=env)
    sock = st.containerd_socket(node)
    procs.wait_for(name, sock.exists, 60, "containerd socket")
    ctr = bins["containerd"] / "ctr"
    pause_tar = images.pause_image_tar(binary("pause"), st.dir / "pause-image.tar")
    if PAUSE_IMAGE not in images.image_ids(ctr, sock):
        images.ctr_import(ctr, sock, pause_tar)
    make_cgroup(f"{st.cgroup}/{node.name}")
    kubelet = BY_NAME["kubernetes"].bin_dir / "kubelet"
    argv = configs.kubelet_wrapper(st, node, configs.kubelet_args(st, node, kubelet))
    procs.start(f"kubelet-{node.name}", argv, env=env)


def services(st: State, procs: Processes) -> None:
    """S3 (moto's server) and MLflow on the bridge's address: the Airflow side and the pods reach
    them at the same URL."""
    bindir = Path(sys.executable).parent
    procs.start("s3", [str(bindir / "moto_server"), "-H", GATEWAY, "-p", str(S3_PORT)])
    procs.wait_for("s3", lambda: port_open(GATEWAY, S3_PORT), 60, "S3 port")
    import boto3

    s3 = boto3.client(
        "s3",
        endpoint_url=S3_CREDENTIALS["AWS_ENDPOINT_URL"],
        aws_access_key_id=S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )
    if S3_BUCKET not in [b["Name"] for b in s3.list_buckets().get("Buckets", [])]:
        s3.create_bucket(Bucket=S3_BUCKET)
    mlflow_dir = st.dir / "mlflow"
    mlflow_dir.mkdir(exist_ok=True)
    procs.start(
        "mlflow",
        [
            *(str(bindir / "mlflow"), "server", "--host", GATEWAY, "--port", str(MLFLOW_PORT), "--workers", "1"),
            *("--backend-store-uri", f"sqlite:///{mlflow_dir / 'mlflow.db'}"),
            *("--artifacts-destination", str(mlflow_dir / "artifacts")),
            *("--allowed-hosts", "*"),
        ],
        cwd=mlflow_dir,
    )
    procs.wait_for("mlflow", lambda: http_ok(f"http://{GATEWAY}:{MLFLOW_PORT}/health"), 120, "MLflow /health")


def airflow_env(st: State) -> dict[str, str]:
    """What an Airflow process needs to use this cluster as it would use a production one."""
    conn = {
        "conn_type": "kubernetes",
        "extra": {"kube_config_path": str(st.pki / "airflow.kubeconfig"), "namespace": NAMESPACE},
    }
    return {
        "KUBECONFIG": str(st.kubeconfig),
        "AIRFLOW_CONN_KUBERNETES_DEFAULT": json.dumps(conn),
        "AIRFLOW__TORCHRUN__KUBERNETES_NAMESPACE": NAMESPACE,
        "AIRFLOW__TORCHRUN__RUNTIMES_FILE": str(st.dir / "runtimes.yaml"),
        "AIRFLOW__TORCHRUN__CHECKPOINT_BASE": f"s3://{S3_BUCKET}/checkpoints",
        "AIRFLOW__TORCHRUN__MLFLOW_TRACKING_URI": f"http://{GATEWAY}:{MLFLOW_PORT}",
        "MLFLOW_TRACKING_URI": f"http://{GATEWAY}:{MLFLOW_PORT}",
        **S3_CREDENTIALS,
    }


def home_env(cluster_env: dict[str, str], root: Path, deployment: str) -> dict[str, str]:
    """The environment of an Airflow home laid out under ``root`` (``airflow/``, ``dags/``,
    ``torchrun/``) that runs on the cluster (``cluster_env``: :func:`airflow_env`) as ``deployment``."""
    return {
        **os.environ,
        **cluster_env,
        "AIRFLOW_HOME": str(root / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(root / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__TORCHRUN__STATE_DIR": str(root / "torchrun"),
        "AIRFLOW__TORCHRUN__DEPLOYMENT": deployment,
    }


def runtimes() -> dict[str, object]:
    """The platform's runtimes for this cluster: ``cpu`` (the name the shipped DAG uses) sized to
    the nodes (1.5 allocatable CPUs each), the trainer image imported into every node."""
    return {
        "cpu": {
            "description": "make cluster: 1 CPU, 2 GiB, the trainer image imported into each node",
            "image": TRAINER_IMAGE,
            "image_pull_policy": "Never",
            "resources": {"cpu": "1", "memory": "2Gi"},
            "shm_size": "256Mi",
            "env_from_secrets": [S3_SECRET],
            "termination_grace_period": 10,
        }
    }


def write_env(st: State) -> Path:
    env = airflow_env(st)
    path = st.dir / "env"
    path.write_text("".join(f"export {k}={_quote(v)}\n" for k, v in env.items()))
    (st.dir / "runtimes.yaml").write_text(yaml.safe_dump(runtimes(), sort_keys=False))
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": S3_SECRET, "namespace": NAMESPACE},
        "stringData": S3_CREDENTIALS,
    }
    kubectl("apply", "-f", "-", input=json.dumps(secret))
    return path


def _quote(value: str) -> str:
    return "'" + value.replace("'", "'\"'\"'") + "'"


# How a node's copy was imported, kept beside its image id: a node imported from a tar before the
# layers were discarded (2.1 GiB of blobs kept) is imported again.
IMPORT_METHOD = "streamed, layers discarded"


def trainer_image(st: State) -> None:
    """Build the trainer image as ``make image-test`` does (Docker, debootstrap, the CPU torch
    base) and stream it into every node's containerd unless it holds that very image already."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "images"))
    import image_test

    name = TRAINER_IMAGE.split("/", 2)[-1]
    ctr = binary("ctr")
    with image_test.docker_daemon():
        image_test.build_rootfs()
        image_test.build_base()
        image_test.build_trainer()
        image_test.docker("tag", image_test.TRAINER_IMAGE, name)
        inspect = image_test.docker("image", "inspect", "--format", "{{.Id}} {{.Size}}", image_test.TRAINER_IMAGE)
        image_id, size = inspect.split()
        fresh = [n for n in NODES if _imported(st, n) != f"{image_id} {IMPORT_METHOD}"]
        if fresh:
            # Each node ends with one unpacked copy; the one being imported holds its layers too
            # until they are unpacked.
            need = (len(fresh) + 1) * int(size) * 11 // 10
            require_free(st.dir, need, f"importing the trainer image into {len(fresh)} node(s)")
        for node in fresh:
            say(f"importing the trainer image {image_id[:19]} ({int(size) / 2**30:.1f} GiB) into {node.name}")
            images.ctr_import_stream(ctr, st.containerd_socket(node), ["docker", "save", name])
            (st.node_dir(node) / "trainer-image.id").write_text(f"{image_id} {IMPORT_METHOD}")


def _imported(st: State, node: Node) -> str:
    path = st.node_dir(node) / "trainer-image.id"
    return path.read_text().strip() if path.exists() else ""


def up(*, image: bool = True, kueue: bool = True) -> None:
    preflight()
    started = time.monotonic()
    build_all([c.name for c in COMPONENTS if kueue or c.name != "kueue"])
    st = state()
    st.dir.mkdir(parents=True, exist_ok=True)
    procs = Processes(st)
    pki.make_all(st)
    (st.dir / "resolv.conf").write_text(f"nameserver {GATEWAY}\n")
    network()
    control_plane(st, procs)
    for node in NODES:
        node_up(st, procs, node)
    deadline = time.monotonic() + 180
    while sorted(ready_nodes()) != sorted(n.name for n in NODES):
        for node in NODES:
            name = f"kubelet-{node.name}"
            if procs.pid(name) is None:
                raise SystemExit(f"{name} exited; the end of {procs.log(name)}:\n{procs.tail(name)}")
        if time.monotonic() > deadline:
            raise SystemExit(f"nodes not Ready after 180s: {ready_nodes()}; see {st.logs}")
        time.sleep(1)
    services(st, procs)
    env_file = write_env(st)
    if kueue:
        from cluster import kueue as kueue_setup

        kueue_setup.up(st, procs)
    if image:
        trainer_image(st)
    nodes = ", ".join(ready_nodes())
    say(f"cluster up in {time.monotonic() - started:.0f}s: Kubernetes {KUBERNETES_VERSION}, nodes {nodes}")
    print(f"export KUBECONFIG={st.kubeconfig}")
    print(f"# everything an Airflow process needs for this cluster: source {env_file}")


def lose_node(name: str) -> list[int]:
    """A node lost as a power cut loses it: its kubelet and every process of its pods SIGKILLed at
    once (its containerd stays, as a disk outlives a reboot). The API server hears nothing: the node
    goes NotReady once the controller manager's grace period passes. The PIDs killed."""
    node = _node(name)
    st = state()
    procs = Processes(st)
    victims = [p for p in (procs.pid(f"kubelet-{node.name}"),) if p is not None]
    victims += cgroup_pids(f"{st.cgroup}/{node.name}")
    kill(victims)
    (st.pids / f"kubelet-{node.name}.pid").unlink(missing_ok=True)
    say(f"{node.name} lost: kubelet and {len(victims) - 1} pod process(es) killed")
    return victims


def restore_node(name: str) -> None:
    """Start a lost node's kubelet again and wait until the node is Ready."""
    node = _node(name)
    st = state()
    node_up(st, Processes(st), node)
    deadline = time.monotonic() + 180
    while node.name not in ready_nodes():
        if time.monotonic() > deadline:
            raise SystemExit(f"{node.name} not Ready 180s after its kubelet started; see {st.logs}")
        time.sleep(1)
    say(f"{node.name} Ready again")


def _node(name: str) -> Node:
    for node in NODES:
        if node.name == name:
            return node
    raise SystemExit(f"no node {name!r}: the cluster's nodes are {', '.join(n.name for n in NODES)}")


def down() -> None:
    st = state()
    procs = Processes(st)
    for name in ("kueue", "coredns", "kube-scheduler", "kube-controller-manager", "mlflow", "s3"):
        procs.stop(name)
    for node in NODES:
        procs.stop(f"kubelet-{node.name}")
    # The pods' processes: under the kubelets' cgroup roots; nothing is left to restart them.
    for node in NODES:
        kill(cgroup_pids(f"{st.cgroup}/{node.name}"))
    for node in NODES:
        procs.stop(f"containerd-{node.name}")
    procs.stop("kube-apiserver")
    procs.stop("etcd")
    # Whatever is still in the cluster's cgroup (the shims, a process a component left) by PID.
    leftover = cgroup_pids(st.cgroup)
    if leftover:
        terminate(leftover, 5)
    unmounted = unmount_all([st.dir, st.run])
    if ip("link", "show", BRIDGE, check=False).returncode == 0:
        ip("link", "del", BRIDGE)
    remove_cgroup(st.cgroup)
    shutil.rmtree(st.run, ignore_errors=True)
    # The cluster's data goes; its certificates, logs and the nodes' image stores stay for next time.
    for path in (st.dir / "etcd", st.pids, st.dir / "mlflow"):
        shutil.rmtree(path, ignore_errors=True)
    for node in NODES:
        for sub in ("kubelet", "ipam", "pod-logs"):
            shutil.rmtree(st.node_dir(node) / sub, ignore_errors=True)
    say(f"cluster down ({unmounted} mounts removed, bridge {BRIDGE} deleted)")


def running() -> list[str]:
    """The components whose recorded process still runs: none where no cluster runs."""
    st = state()
    if not st.pids.is_dir():
        return []
    procs = Processes(st)
    return [name for name in procs.names() if procs.pid(name) is not None]


def status() -> int:
    st = state()
    procs = Processes(st)
    running = {name: procs.pid(name) for name in procs.names()}
    for name, pid in running.items():
        print(f"{name:<28} {'pid ' + str(pid) if pid else 'not running'}")
    if running and api_ready():
        print(kubectl("get", "nodes", "-o", "wide"))
        print(kubectl("version"))
        return 0
    return 1
