"""Build the cluster's binaries with Go from the module proxy, once per version, into the user cache.

Each component is a small module of ours under ``cluster/go/<name>`` whose go.mod pins the release
(and, for Kubernetes, every staging module); its binaries go to
``<cache>/bin/<name>-<version>-<digest of go.mod and go.sum>/``, written to a temporary folder and
renamed when complete, so an interrupted build never passes for a cached one. Go's module cache
lives in ``<cache>/go/mod`` (a rebuild after a version bump downloads only what changed); its build
cache, 7 GiB once Kubernetes is compiled and of no use once the binaries exist, is removed after a
build.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.layout import GO_MODULES, VERSIONS, cache_dir

# -trimpath and -s -w: smaller binaries and a shorter link, which is most of a warm rebuild.
LDFLAGS = "-s -w"


@dataclass(frozen=True)
class Component:
    name: str
    packages: tuple[str, ...]
    cgo: bool = False
    tags: str = ""
    # go build names a binary after its package's last path element (the one before a /vN suffix).
    rename: tuple[tuple[str, str], ...] = ()
    # -X settings of the link (what a release build stamps in: the version the binaries report).
    stamps: tuple[tuple[str, str], ...] = ()

    @property
    def ldflags(self) -> str:
        return " ".join([LDFLAGS, *(f"-X {var}={value}" for var, value in self.stamps)])

    @property
    def module(self) -> Path:
        return GO_MODULES / self.name

    @property
    def version(self) -> str:
        return VERSIONS[self.name]

    def digest(self) -> str:
        h = hashlib.sha256()
        for name in ("go.mod", "go.sum", "main.go"):
            path = self.module / name
            if path.exists():
                h.update(path.read_bytes())
        h.update(f"{self.ldflags} {self.tags} {self.cgo}".encode())
        return h.hexdigest()[:10]

    @property
    def bin_dir(self) -> Path:
        return cache_dir() / "bin" / f"{self.name}-{self.version}-{self.digest()}"


K8S = "k8s.io/kubernetes/cmd/"


def kubernetes_stamps(version: str) -> tuple[tuple[str, str], ...]:
    """What Kubernetes' own build (hack/lib/version.sh) writes into component-base and client-go,
    so that the nodes and ``kubectl version`` report the pinned release, not v0.0.0-master."""
    major, minor = version.lstrip("v").split(".")[:2]
    values = {"gitVersion": version, "gitMajor": major, "gitMinor": minor, "gitTreeState": "clean"}
    return tuple(
        (f"{package}.{var}", value)
        for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
        for var, value in values.items()
    )


COMPONENTS = (
    Component("pause", (".",)),
    Component("etcd", ("go.etcd.io/etcd/server/v3",), rename=(("server", "etcd"),)),
    # runc needs cgo (its nsenter is C) and libseccomp for the RuntimeDefault seccomp profile.
    Component("runc", ("github.com/opencontainers/runc",), cgo=True, tags="seccomp"),
    Component(
        "containerd",
        (
            "github.com/containerd/containerd/v2/cmd/containerd",
            "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
            "github.com/containerd/containerd/v2/cmd/ctr",
        ),
    ),
    Component(
        "cni",
        (
            "github.com/containernetworking/plugins/plugins/main/bridge",
            "github.com/containernetworking/plugins/plugins/ipam/host-local",
            "github.com/containernetworking/plugins/plugins/main/loopback",
        ),
    ),
    # Only the plugins the Corefile uses (cluster/go/coredns/main.go).
    Component("coredns", (".",)),
    Component(
        "kubernetes",
        tuple(K8S + c for c in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl")),
        stamps=kubernetes_stamps(VERSIONS["kubernetes"]),
    ),
    Component("kueue", ("sigs.k8s.io/kueue/cmd/kueue",)),
)
BY_NAME = {c.name: c for c in COMPONENTS}


def go_env() -> dict[str, str]:
    go = cache_dir() / "go"
    return {
        **os.environ,
        "GOMODCACHE": str(go / "mod"),
        "GOCACHE": str(go / "build"),
        "GOFLAGS": "-mod=readonly -buildvcs=false",
        "GOTOOLCHAIN": os.environ.get("GOTOOLCHAIN", "auto"),
    }


def say(message: str) -> None:
    print(f"[cluster] {message}", flush=True)


def build(component: Component) -> Path:
    """The component's bin folder, built now unless the cache has it."""
    final = component.bin_dir
    if (final / ".complete").exists():
        return final
    if shutil.which("go") is None:
        raise SystemExit("Go is not installed (the cluster is built from source): install Go 1.26 or newer")
    tmp = final.with_name(final.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    env = {**go_env(), "CGO_ENABLED": "1" if component.cgo else "0"}
    cmd = ["go", "build", "-v", "-trimpath", f"-ldflags={component.ldflags}", "-o", str(tmp) + "/"]
    if component.tags:
        cmd.append(f"-tags={component.tags}")
    cmd += component.packages
    log = cache_dir() / "logs" / f"build-{component.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    say(f"building {component.name} {component.version} (log: {log})")
    started = time.monotonic()
    compiled = 0
    done = threading.Event()

    def progress() -> None:
        while not done.wait(15):
            say(f"  {component.name}: {compiled} packages compiled, {time.monotonic() - started:.0f}s")

    ticker = threading.Thread(target=progress, daemon=True)
    ticker.start()
    with log.open("w") as out:
        # go build -v names each package as it compiles it: the count is the progress shown.
        proc = subprocess.Popen(
            cmd, cwd=component.module, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if not line.startswith(("go: ", "#")) and " " not in line.strip():
                compiled += 1
        code = proc.wait()
    done.set()
    if code != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"building {component.name} failed (exit {code}); the end of {log}:\n{tail}")
    for built, wanted in component.rename:
        (tmp / built).rename(tmp / wanted)
    (tmp / ".complete").write_text(f"{time.monotonic() - started:.1f}\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    # The binaries of this component's earlier pins (another version or go.mod) are of no more use.
    for stale in final.parent.glob(f"{component.name}-*"):
        if stale != final and not stale.name.endswith(".partial"):
            shutil.rmtree(stale, ignore_errors=True)
    say(f"built {component.name} in {time.monotonic() - started:.0f}s ({compiled} packages)")
    return final


# What a cold build of every component takes on disk, measured: Go's module cache 2.1 GiB and its build
# cache 6.8 GiB at the peak, the binaries 0.7 GiB.
COLD_BUILD_BYTES = 10 << 30


def require_free(path: Path, need: int, what: str) -> None:
    """Stop before ``what`` when the file system holding ``path`` has less than ``need`` bytes free:
    a disk that fills midway leaves a half-written cache or image and an error from deep inside Go,
    Docker or containerd."""
    path.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path).free
    if free < need:
        raise SystemExit(
            f"{what} needs about {need / 2**30:.1f} GiB free on the file system of {path}; "
            f"it has {free / 2**30:.1f} GiB. Free some space there and run it again."
        )


def build_all(names: list[str] | None = None) -> dict[str, Path]:
    wanted = [BY_NAME[n] for n in names] if names else list(COMPONENTS)
    started = time.monotonic()
    cold = [c.name for c in wanted if not (c.bin_dir / ".complete").exists()]
    if cold:
        require_free(cache_dir(), COLD_BUILD_BYTES, f"building {', '.join(cold)} from source")
    dirs = {c.name: build(c) for c in wanted}
    say(f"binaries ready in {time.monotonic() - started:.0f}s: {cache_dir() / 'bin'}")
    build_cache = cache_dir() / "go" / "build"
    if build_cache.exists():
        size = sum(f.stat().st_size for f in build_cache.rglob("*") if f.is_file())
        shutil.rmtree(build_cache, ignore_errors=True)
        say(f"removed Go's build cache ({size / 2**30:.1f} GiB): the binaries are built")
    return dirs


def missing() -> list[str]:
    """The components whose binaries are not in the cache (a cold ``make cluster`` builds them)."""
    return [c.name for c in COMPONENTS if not (c.bin_dir / ".complete").exists()]


def binary(name: str) -> Path:
    """The path of one built binary (``kubectl``, ``containerd``, ``bridge``...)."""
    for component in COMPONENTS:
        path = component.bin_dir / name
        if path.exists() and (component.bin_dir / ".complete").exists():
            return path
    raise SystemExit(f"{name} is not built: run `make cluster` (or python -m cluster build)")


if __name__ == "__main__":
    build_all(sys.argv[1:] or None)
