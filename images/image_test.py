"""``make image-test``: build the trainer image from nothing and run a rendered 2-node Job's pods as containers.

No Kubernetes cluster can run where this project is developed, but a container engine can. This
script proves what the schema checks and the fake API server cannot: that the image builds, that
the pod command the Kubernetes backend renders runs in it, and that its failure model holds there.

What it does:

1. Builds, caching each stage in the Docker data root under ``.state/image-test/`` (CI builds
   from nothing): a Debian 12 root filesystem (``debootstrap``, imported), a base image with a
   virtualenv holding the CPU build of torch (``images/test-base/Dockerfile``; it stands in for the
   CUDA PyTorch base of the trainer Dockerfile), then ``images/trainer/Dockerfile`` as shipped,
   with ``--build-arg BASE_IMAGE=<that base>``, from a build context filtered by its
   ``Dockerfile.dockerignore``.
2. Checks the image: no Airflow in it, a numeric non-root user equal to the runtimes' default.
3. Renders the Indexed Job and Service of a 2-node training task with ``airflow-torchrun render``
   (a real DAG file, a real runtimes file naming this image, checkpoints on ``s3://``).
4. Runs one container per completion index *from the rendered pod template*: the init container
   (the DNS wait) to completion, then the trainer container, with the template's command, env (its
   ``fieldRef``s resolved as the kubelet would: the completion-index annotation, the pod's name and
   IP), ``envFrom`` Secrets (emulated here: moto's credentials), ``runAsUser``/``runAsGroup``/
   ``fsGroup``, ``readOnlyRootFilesystem`` (``--read-only``), dropped capabilities and no privilege
   escalation, CPU and memory limits, the emptyDir volumes (``/dev/shm`` at its ``sizeLimit``).
   Each pod has a loopback address of its own (127.0.0.10, .11); the headless Service's DNS names
   of the pods map to them (``--add-host``). Checkpoints go to moto's S3 server on loopback.
5. Scenarios: a first launch runs until a checkpoint is committed, then node 1's container is
   killed (SIGKILL): node 0 must exit non-zero promptly, as the Job's ``podFailurePolicy`` expects
   of a group with a dead rank. A second launch, with ``TRAIN_RESUME_FROM`` set the way the operator
   sets it (the latest committed checkpoint), resumes from S3 and trains to the end: every
   container exits 0 and rank 0 prints ``FINAL``.

What it does not emulate: the Job controller (pod creation, ``backoffLimit``, ``podFailurePolicy``,
``activeDeadlineSeconds``), the scheduler and node placement, Services and cluster DNS (only
``--add-host`` entries), kubelet restarts and probes, the pod network (all containers share the
host's loopback, ``--network host``), the hostname/subdomain of pods, emptyDirs shared between an
init container and the trainer (each container gets its own tmpfs), the service account token.

Docker: when no daemon answers (``DOCKER_HOST`` or the default socket), one is started with
``--bridge=none --iptables=false`` (no bridge network, nothing outside loopback), its data root
under ``.state/image-test/docker``, and stopped by its PID at the end. Needs ``docker.io`` and
``debootstrap`` (``apt-get install docker.io debootstrap``); root.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
STATE = ROOT / ".state" / "image-test"
# PyTorch's CPU wheel where a local folder holds it (../shared/wheels on our machines, as the
# Makefile does): on PyPI, torch==2.13.0 for Linux resolves to the CUDA build. PyPI's elsewhere.
TORCH_WHEELS = next((p for p in (ROOT.parent / "shared" / "wheels", Path("/work/shared/wheels")) if p.is_dir()), None)
TORCH_PIN = "torch==2.13.0+cpu" if TORCH_WHEELS is not None else "torch==2.13.0"
TORCH_FIND_LINKS = ["--find-links", str(TORCH_WHEELS)] if TORCH_WHEELS is not None else []
ROOTFS_IMAGE = "airflow-torchrun-test-rootfs:bookworm"
BASE_IMAGE = f"airflow-torchrun-test-base:torch-{TORCH_PIN.split('==')[1].replace('+', '-')}"
TRAINER_IMAGE = "airflow-torchrun-trainer:image-test"
LABEL = "airflow-torchrun-image-test"
NAMESPACE = "ml"
SECRET = "s3-credentials"
# A peer of a dead rank must notice within this (gloo sees the closed connection; torchrun's
# agent then stops its workers); the podFailurePolicy ends the Job on its non-zero exit.
PEER_EXIT_LIMIT_S = 60.0
DEBOOTSTRAP_PACKAGES = "python3,python3-venv,python3-pip,ca-certificates"
T0 = time.monotonic()


def say(message: str) -> None:
    print(f"[image-test {time.monotonic() - T0:6.1f}s] {message}", flush=True)


class Failure(Exception):
    """A check that did not hold."""


# -- docker -------------------------------------------------------------------------------------------
def docker(*args: str, check: bool = True, capture: bool = True, timeout: float = 600, **kw: Any) -> str:
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}  # the classic builder: no frontend image to pull
    done = subprocess.run(
        ["docker", *args], env=env, check=False, capture_output=capture, text=True, timeout=timeout, **kw
    )
    if check and done.returncode != 0:
        raise Failure(f"docker {' '.join(args[:3])} ... exited {done.returncode}: {(done.stderr or '')[-2000:]}")
    return done.stdout or ""


def daemon_answers() -> bool:
    try:
        return docker("version", "--format", "{{.Server.Version}}", check=False, timeout=20).strip() != ""
    except (OSError, subprocess.TimeoutExpired):
        return False


@contextlib.contextmanager
def docker_daemon() -> Iterator[None]:
    """The daemon in use; one of our own (stopped by its PID afterwards) when none answers."""
    if shutil.which("docker") is None:
        raise Failure("no docker client: apt-get install docker.io")
    if daemon_answers():
        say(f"using the running Docker daemon ({os.environ.get('DOCKER_HOST', 'default socket')})")
        yield
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise Failure("no Docker daemon answers and dockerd is not installed: apt-get install docker.io")
    run_dir = Path("/run/airflow-torchrun-image-test")
    run_dir.mkdir(parents=True, exist_ok=True)
    sock = run_dir / "docker.sock"
    (STATE / "docker").mkdir(parents=True, exist_ok=True)
    log = (STATE / "dockerd.log").open("w")
    proc = subprocess.Popen(
        [
            dockerd,
            "--bridge=none",
            "--iptables=false",
            f"--data-root={STATE / 'docker'}",
            f"--exec-root={run_dir / 'exec'}",
            f"--pidfile={run_dir / 'dockerd.pid'}",
            f"--host=unix://{sock}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    os.environ["DOCKER_HOST"] = f"unix://{sock}"
    try:
        deadline = time.monotonic() + 60
        while not daemon_answers():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise Failure(f"dockerd did not start (see {STATE / 'dockerd.log'})")
            time.sleep(0.5)
        say(f"started dockerd (pid {proc.pid}, data root {STATE / 'docker'})")
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
        say(f"stopped dockerd (pid {proc.pid})")


def image_exists(tag: str) -> bool:
    done = subprocess.run(["docker", "image", "inspect", tag], capture_output=True, timeout=30, check=False)
    return done.returncode == 0


# -- building -----------------------------------------------------------------------------------------
def build_rootfs() -> None:
    if image_exists(ROOTFS_IMAGE):
        say(f"{ROOTFS_IMAGE}: cached")
        return
    if shutil.which("debootstrap") is None:
        raise Failure("debootstrap is not installed: apt-get install debootstrap")
    rootfs = STATE / "rootfs"
    if not (rootfs / "usr" / "bin" / "python3").exists():
        shutil.rmtree(rootfs, ignore_errors=True)
        say("debootstrap: Debian 12 (minbase) with Python 3.11")
        subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={DEBOOTSTRAP_PACKAGES}", "bookworm", str(rootfs)],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=900,
        )
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    docker("import", "-", ROOTFS_IMAGE, stdin=tar.stdout)
    if tar.wait() != 0:
        raise Failure("tar of the root filesystem failed")
    say(f"{ROOTFS_IMAGE}: imported")


def ca_bundle() -> Path:
    """The CA bundle pip uses here (the TLS-intercepting proxy's CA is in it)."""
    for candidate in (os.environ.get("PIP_CERT"), "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise Failure("no CA bundle found (PIP_CERT or /etc/ssl/certs/ca-certificates.crt)")


def build_base() -> None:
    if image_exists(BASE_IMAGE):
        say(f"{BASE_IMAGE}: cached")
        return
    context = STATE / "base-context"
    shutil.rmtree(context, ignore_errors=True)
    # torch's wheels, the context Docker copies them into, and the installed layer: 3 GiB measured.
    free = shutil.disk_usage(STATE).free
    if free < 4 << 30:
        raise Failure(f"building {BASE_IMAGE} needs about 4 GiB free under {STATE}; it has {free / 2**30:.1f} GiB")
    (context / "wheels").mkdir(parents=True)
    shutil.copy(ca_bundle(), context / "ca-certificates.crt")
    say(f"downloading the CPU wheel of {TORCH_PIN} and its dependencies")
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:"),
            *("--python-version", "3.11", "--platform", "manylinux_2_28_x86_64"),
            *TORCH_FIND_LINKS,
            *("-d", str(context / "wheels"), TORCH_PIN),
        ],
        check=True,
        timeout=900,
    )
    say(f"building {BASE_IMAGE}")
    docker(
        "build",
        "--network",
        "host",
        "-f",
        str(ROOT / "images" / "test-base" / "Dockerfile"),
        "--build-arg",
        f"ROOTFS_IMAGE={ROOTFS_IMAGE}",
        "-t",
        BASE_IMAGE,
        str(context),
        timeout=1200,
    )
    shutil.rmtree(context, ignore_errors=True)


def ignore_patterns(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def ignored(rel: str, patterns: Sequence[str]) -> bool:
    """Docker's rule for the simple patterns of Dockerfile.dockerignore: the last matching pattern
    wins; a pattern matching a parent folder matches everything below it."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    result = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        if pattern.startswith("**/"):
            hit = any(fnmatch(part, pattern[3:]) for part in parts)
        else:
            hit = any(fnmatch(prefix, pattern) for prefix in prefixes)
        if hit:
            result = not negate
    return result


def stage_context(dest: Path) -> int:
    """The trainer's build context: the repository filtered by its Dockerfile.dockerignore (the
    classic builder reads only a .dockerignore at the context's root). Tracked files only."""
    patterns = ignore_patterns(ROOT / "images" / "trainer" / "Dockerfile.dockerignore")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    shutil.rmtree(dest, ignore_errors=True)
    count = 0
    for rel in listed:
        if ignored(rel, patterns) or not (ROOT / rel).is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)
        count += 1
    return count


def build_trainer() -> None:
    context = STATE / "trainer-context"
    files = stage_context(context)
    say(f"building {TRAINER_IMAGE} from images/trainer/Dockerfile ({files} files in the context)")
    docker(
        "build",
        "--network",
        "host",
        "-f",
        str(context / "images" / "trainer" / "Dockerfile"),
        "--build-arg",
        f"BASE_IMAGE={BASE_IMAGE}",
        "-t",
        TRAINER_IMAGE,
        str(context),
        timeout=1200,
    )


def check_image(expected_uid: int) -> list[str]:
    user = docker("image", "inspect", TRAINER_IMAGE, "--format", "{{.Config.User}}").strip()
    if not re.fullmatch(r"\d+:\d+", user) or int(user.split(":")[0]) == 0:
        raise Failure(f"the image's USER is {user!r}: it must be a numeric non-root uid:gid")
    if int(user.split(":")[0]) != expected_uid:
        raise Failure(f"the image's USER {user} is not the runtimes' default runAsUser {expected_uid}")
    uid = docker("run", "--rm", "--network", "none", TRAINER_IMAGE, "id", "-u").strip()
    if uid != str(expected_uid):
        raise Failure(f"a container of the image runs as uid {uid}, not {expected_uid}")
    probe = "import importlib.util as u; print(u.find_spec('airflow') is None, bool(u.find_spec('airflow_torchrun')))"
    found = docker("run", "--rm", "--network", "none", TRAINER_IMAGE, "python", "-c", probe).strip()
    if found != "True True":
        raise Failure(f"Airflow must not be in the image, airflow-torchrun must (find_spec says {found!r})")
    return [f"image runs as {user} (non-root)", "image holds airflow_torchrun and no Airflow"]


# -- rendering ----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


DAG = """\
import pendulum
from airflow.sdk import DAG
from airflow_torchrun import DistributedTrainingOperator

with DAG("image_test", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False):
    DistributedTrainingOperator(
        task_id="train",
        backend="kubernetes",
        runtime="image-test",
        script="/opt/trainer/train.py",
        script_args=["--epochs", "30", "--checkpoint-every", "50", "--log-every", "100"],
        num_nodes=2,
        nproc_per_node=1,
        rdzv_port={port},
        startup_timeout=120,
        checkpoint_uri={checkpoint_uri!r},
        track=False,
    )
"""


def render(work: Path, checkpoint_uri: str) -> dict[str, Any]:
    """The Job that ``airflow-torchrun render`` prints for a 2-node task on this image."""
    (work / "dag.py").write_text(DAG.format(port=free_port(), checkpoint_uri=checkpoint_uri))
    runtimes = {
        "image-test": {
            "image": TRAINER_IMAGE,
            "image_pull_policy": "Never",
            "resources": {"cpu": "1", "memory": "2Gi"},
            "shm_size": "256Mi",
            "env_from_secrets": [SECRET],
        }
    }
    (work / "runtimes.yaml").write_text(yaml.safe_dump(runtimes))
    env = {
        **os.environ,
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        # The task is checked against its runtime when the DAG is parsed: the platform's file.
        "AIRFLOW__TORCHRUN__RUNTIMES_FILE": str(work / "runtimes.yaml"),
        "AIRFLOW__TORCHRUN__RUNTIMES_VARIABLE": "",
    }
    done = subprocess.run(
        [
            *(sys.executable, "-m", "airflow_torchrun.cli", "render", "--dag-file", str(work / "dag.py")),
            *("--task-id", "train", "--namespace", NAMESPACE, "--runtimes-file", str(work / "runtimes.yaml")),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise Failure(f"airflow-torchrun render failed: {done.stderr[-3000:]}")
    (work / "rendered.yaml").write_text(done.stdout)
    objects = [o for o in yaml.safe_load_all(done.stdout) if o]
    (job,) = [o for o in objects if o["kind"] == "Job"]
    say(f"rendered Job {NAMESPACE}/{job['metadata']['name']} ({work / 'rendered.yaml'})")
    return dict(job)


# -- the kubelet's part -------------------------------------------------------------------------------
def kube_expand(value: str, env: Mapping[str, str]) -> str:
    from airflow_torchrun.backends.kubernetes.render import kube_expand as expand

    return expand(value, env)


def quantity_bytes(text: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


@dataclass
class Pod:
    """One pod of the Indexed Job, as the Job controller would make it (name, labels, annotations)."""

    job: dict[str, Any]
    index: int
    run: str
    ip: str = field(init=False)

    def __post_init__(self) -> None:
        self.ip = f"127.0.0.{10 + self.index}"

    @property
    def job_name(self) -> str:
        return str(self.job["metadata"]["name"])

    @property
    def name(self) -> str:
        return f"{self.job_name}-{self.index}-{self.run}"

    @property
    def spec(self) -> dict[str, Any]:
        return dict(self.job["spec"]["template"]["spec"])

    def field(self, path: str) -> str:
        """A ``fieldRef`` as the kubelet resolves it for this pod."""
        meta = self.job["spec"]["template"]["metadata"]
        index = {"batch.kubernetes.io/job-completion-index": str(self.index)}
        annotations = {**meta.get("annotations", {}), **index}
        labels = {**meta.get("labels", {}), **index, "batch.kubernetes.io/job-name": self.job_name}
        simple = {
            "metadata.name": self.name,
            "metadata.namespace": NAMESPACE,
            "status.podIP": self.ip,
            "spec.nodeName": "image-test-node",
        }
        if path in simple:
            return simple[path]
        found = re.fullmatch(r"metadata\.(annotations|labels)\['([^']+)'\]", path)
        if found:
            source = annotations if found.group(1) == "annotations" else labels
            return str(source.get(found.group(2), ""))
        raise Failure(f"fieldRef {path!r} is not emulated here")

    def hosts(self, count: int) -> list[str]:
        """The headless Service's DNS records of every pod (hostname <job>-<i> under subdomain)."""
        sub = self.spec.get("subdomain", self.job_name)
        out = []
        for i in range(count):
            for suffix in ("svc", "svc.cluster.local"):
                out += ["--add-host", f"{self.job_name}-{i}.{sub}.{NAMESPACE}.{suffix}:127.0.0.{10 + i}"]
        return out


def container_args(
    pod: Pod, container: dict[str, Any], secrets: Mapping[str, Mapping[str, str]], overrides: Mapping[str, str]
) -> list[str]:
    """``docker run`` arguments (image and command included) for one container of ``pod``."""
    spec = pod.spec
    security = spec.get("securityContext") or {}
    csec = container.get("securityContext") or {}
    args = ["--network", "host", "--label", LABEL, *pod.hosts(int(pod.job["spec"]["completions"]))]
    user, group = csec.get("runAsUser", security.get("runAsUser")), csec.get("runAsGroup", security.get("runAsGroup"))
    if user is not None:
        args += ["--user", f"{user}:{group if group is not None else user}"]
    if security.get("fsGroup") is not None:
        args += ["--group-add", str(security["fsGroup"])]
    if (security.get("runAsNonRoot") or csec.get("runAsNonRoot")) and user in (None, 0):
        raise Failure("runAsNonRoot with no non-root runAsUser: the kubelet would refuse to start it")
    if csec.get("privileged"):
        raise Failure("privileged containers are not emulated")
    if csec.get("readOnlyRootFilesystem"):
        args.append("--read-only")
    if "ALL" in ((csec.get("capabilities") or {}).get("drop") or []):
        args += ["--cap-drop", "ALL"]
    if csec.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    limits = (container.get("resources") or {}).get("limits") or {}
    if "cpu" in limits:
        cpu = str(limits["cpu"])
        args += ["--cpus", str(float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu))]
    if "memory" in limits:
        args += ["--memory", str(quantity_bytes(str(limits["memory"])))]
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    for mount in container.get("volumeMounts") or []:
        volume = volumes[mount["name"]]
        if "emptyDir" not in volume:
            raise Failure(f"volume {mount['name']!r} is not an emptyDir: not emulated here")
        size = (volume["emptyDir"] or {}).get("sizeLimit")
        if mount["mountPath"] == "/dev/shm":
            args += ["--shm-size", str(quantity_bytes(size) if size else 64 * 2**20)]
        else:
            args += ["--tmpfs", f"{mount['mountPath']}:rw,exec,mode=1777"]
    if container.get("workingDir"):
        args += ["--workdir", container["workingDir"]]
    # The environment: envFrom Secrets first, then env in order ($(VAR) sees what came before).
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        name = (source.get("secretRef") or {}).get("name")
        if not isinstance(name, str) or name not in secrets:
            raise Failure(f"Secret {name!r} does not exist (the kubelet: CreateContainerConfigError)")
        env.update(secrets[name])
    for item in container.get("env") or []:
        if "valueFrom" in item:
            env[item["name"]] = pod.field(item["valueFrom"]["fieldRef"]["fieldPath"])
        else:
            env[item["name"]] = kube_expand(item.get("value", ""), env)
    env.update({k: v for k, v in overrides.items() if k in env})
    for key, value in env.items():
        args += ["-e", f"{key}={value}"]
    command = [kube_expand(a, env) for a in [*container.get("command", []), *container.get("args", [])]]
    if not command:
        raise Failure(f"container {container['name']} has no command: the image's entrypoint is not emulated")
    return [*args, "--entrypoint", command[0], container["image"], *command[1:]]


@dataclass
class Launch:
    """One launch of the Job: every pod's init container run, then every trainer started."""

    job: dict[str, Any]
    run: str
    pods: list[Pod] = field(default_factory=list)

    def container(self, pod: Pod) -> str:
        return f"{LABEL}-{self.run}-{pod.index}"

    def start(self, secrets: Mapping[str, Mapping[str, str]], overrides: Mapping[str, str]) -> None:
        spec = self.job["spec"]["template"]["spec"]
        self.pods = [Pod(self.job, i, self.run) for i in range(int(self.job["spec"]["completions"]))]
        for pod in self.pods:
            for init in spec.get("initContainers") or []:
                out = docker("run", "--rm", *container_args(pod, init, secrets, overrides), timeout=300)
                say(f"pod {pod.index}: init container {init['name']} done: {out.strip().splitlines()[-1:]}")
        for pod in self.pods:
            (trainer,) = [c for c in spec["containers"] if c["name"] == "trainer"]
            args = container_args(pod, trainer, secrets, overrides)
            docker("run", "-d", "--name", self.container(pod), *args, timeout=120)
        say(f"launch {self.run}: {len(self.pods)} trainer containers started")

    def running(self, pod: Pod) -> bool:
        state = docker("inspect", "-f", "{{.State.Running}}", self.container(pod), check=False, timeout=30)
        return state.strip() == "true"

    def wait(self, pod: Pod, timeout: float) -> int:
        try:
            return int(docker("wait", self.container(pod), timeout=timeout).strip())
        except subprocess.TimeoutExpired as exc:
            raise Failure(f"pod {pod.index} still runs after {timeout:g}s:\n{self.log(pod)[-3000:]}") from exc

    def log(self, pod: Pod) -> str:
        done = subprocess.run(
            ["docker", "logs", self.container(pod)], capture_output=True, text=True, timeout=60, check=False
        )
        return done.stdout + done.stderr

    def save_logs(self, work: Path) -> None:
        for pod in self.pods:
            (work / f"{self.run}-node-{pod.index}.log").write_text(self.log(pod))


def remove_our_containers() -> None:
    ids = docker("ps", "-aq", "--filter", f"label={LABEL}", check=False, timeout=60).split()
    if ids:
        docker("rm", "-f", *ids, check=False, timeout=120)


# -- the scenarios ------------------------------------------------------------------------------------
@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def sigterm_scenario(
    job: dict[str, Any], secrets: Mapping[str, Mapping[str, str]], store: Any, uri: str, work: Path, results: list[str]
) -> None:
    """Optional (``--sigterm``; not run by CI): every pod gets SIGTERM, then SIGKILL after the
    rendered ``terminationGracePeriodSeconds``, as when the Job is deleted or its pods evicted.
    The trainer calls ``save_if_stopping``: the ranks should save the step in flight (marker
    ``"stopped": true``) within the grace period. Reports what happened; fails only when no stop
    checkpoint was committed."""
    from airflow_torchrun.storage.lineage import resolve_resume

    grace = int(job["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30))
    ref = resolve_resume(uri, "auto", {})
    launch = Launch(job, "s")
    launch.start(secrets, {"TRAIN_RESUME_FROM": ref.uri if ref else ""})
    deadline = time.monotonic() + 300
    while (store.latest().step if store.latest() else -1) <= (ref.step if ref else -1):
        if time.monotonic() > deadline or not all(launch.running(p) for p in launch.pods):
            launch.save_logs(work)
            raise Failure(f"launch s committed nothing new; logs in {work}")
        time.sleep(0.5)
    say(f"launch s committed step {store.latest().step}; SIGTERM to every pod, SIGKILL after {grace}s")
    stopped_at = time.monotonic()
    stops = [
        subprocess.Popen(["docker", "stop", "--time", str(grace), launch.container(pod)], stdout=subprocess.DEVNULL)
        for pod in launch.pods
    ]
    for stop in stops:
        stop.wait(timeout=grace + 60)
    took = time.monotonic() - stopped_at
    codes = [launch.wait(pod, timeout=60) for pod in launch.pods]
    launch.save_logs(work)
    latest = store.latest()
    marker = store.read_marker(latest.step) if latest else {}
    stopped = bool((marker.get("meta") or {}).get("stopped") or marker.get("stopped"))
    results.append(
        f"SIGTERM with a {grace}s grace period: pods exited {codes} after {took:.1f}s; latest checkpoint "
        f"step {latest.step if latest else None} {'is' if stopped else 'is not'} a stop checkpoint"
    )
    say(results[-1])
    if not stopped:
        raise Failure(f"no stop checkpoint was committed on SIGTERM; logs in {work}")


def scenarios(work: Path, results: list[str], *, sigterm: bool = False) -> None:
    import boto3

    from airflow_torchrun.storage.checkpoints import CheckpointStore
    from airflow_torchrun.storage.lineage import resolve_resume

    with s3_server() as endpoint:
        creds = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,
        }
        os.environ.update(creds)  # this process reads the checkpoints as the operator would
        bucket = f"image-test-{os.getpid()}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        uri = f"s3://{bucket}/image-test/train"
        job = render(work, uri)
        pod_spec = job["spec"]["template"]["spec"]
        (trainer,) = pod_spec["containers"]
        if not trainer["securityContext"].get("readOnlyRootFilesystem"):
            raise Failure("the rendered trainer container does not have a read-only root filesystem")
        secrets = {SECRET: creds}
        store = CheckpointStore(uri)

        # Launch 1: train until a checkpoint is committed, then kill node 1's container.
        first = Launch(job, "a")
        first.start(secrets, {"TRAIN_RESUME_FROM": ""})
        deadline = time.monotonic() + 300
        while store.latest() is None:
            if time.monotonic() > deadline or not all(first.running(p) for p in first.pods):
                first.save_logs(work)
                raise Failure(f"no checkpoint was committed by launch a; logs in {work}")
            time.sleep(0.5)
        committed = store.latest()
        say(f"launch a committed step {committed.step if committed else '?'}; killing node 1 (SIGKILL)")
        killed_at = time.monotonic()
        docker("kill", "--signal", "KILL", first.container(first.pods[1]), timeout=60)
        code = first.wait(first.pods[0], timeout=PEER_EXIT_LIMIT_S * 3)
        peer_exit = time.monotonic() - killed_at
        first.save_logs(work)
        if code == 0:
            raise Failure(f"node 0 exited 0 after its peer was killed:\n{first.log(first.pods[0])[-3000:]}")
        if peer_exit > PEER_EXIT_LIMIT_S:
            raise Failure(f"node 0 took {peer_exit:.1f}s to exit after node 1 died (limit {PEER_EXIT_LIMIT_S:g}s)")
        results.append(f"node 1 killed mid-run: node 0 exited {code} after {peer_exit:.1f}s")
        say(results[-1])

        if sigterm:
            sigterm_scenario(job, secrets, store, uri, work, results)

        # Launch 2: what a retry does: resume from the latest committed checkpoint, train to the end.
        ref = resolve_resume(uri, "auto", {})
        if ref is None:
            raise Failure("the operator's resolve_resume found no committed checkpoint to resume from")
        second = Launch(job, "b")
        started = time.monotonic()
        second.start(secrets, {"TRAIN_RESUME_FROM": ref.uri})
        codes = [second.wait(p, timeout=600) for p in second.pods]
        second.save_logs(work)
        log0 = second.log(second.pods[0])
        if codes != [0, 0]:
            raise Failure(f"launch b exit codes {codes}:\n{log0[-3000:]}")
        if f"Resumed from {ref.uri} at step {ref.step}" not in log0:
            raise Failure(f"launch b did not resume from {ref.uri}:\n{log0[-3000:]}")
        final = re.search(r"FINAL step=(\d+) .*test_accuracy=([0-9.]+)", log0)
        if final is None:
            raise Failure(f"rank 0 printed no FINAL line:\n{log0[-3000:]}")
        results.append(f"launch b resumed from S3 at step {ref.step}")
        results.append(
            f"training succeeded: both pods exited 0, FINAL step={final.group(1)} test_accuracy={final.group(2)} "
            f"({time.monotonic() - started:.1f}s)"
        )
        for line in results[-2:]:
            say(line)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the containers and the work folder")
    parser.add_argument(
        "--sigterm",
        action="store_true",
        help="also stop a launch with SIGTERM and the rendered grace period (save_if_stopping); not run by CI",
    )
    args = parser.parse_args(argv)
    from airflow_torchrun.backends.kubernetes.runtimes import DEFAULT_UID

    STATE.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=STATE))
    results: list[str] = []
    failed = 0
    try:
        with docker_daemon():
            remove_our_containers()
            try:
                build_rootfs()
                build_base()
                build_trainer()
                results.append(f"images built ({time.monotonic() - T0:.0f}s so far)")
                results += check_image(DEFAULT_UID)
                for line in results[-2:]:
                    say(line)
                scenarios(work, results, sigterm=args.sigterm)
            finally:
                if not args.keep:
                    remove_our_containers()
    except Failure as exc:
        failed = 1
        print(f"image-test FAILED: {exc}", file=sys.stderr, flush=True)
        print(f"logs and the rendered manifests: {work}", file=sys.stderr, flush=True)
    else:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    say(textwrap.shorten("; ".join(results), 2000))
    print(f"image-test: {len(results)} passed, {failed} failed", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
