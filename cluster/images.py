"""Images for the nodes' containerd: the pause image (made here from our static binary: no registry
can be reached) and the trainer image (built as ``make image-test`` builds it, then imported)."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
import tempfile
from pathlib import Path

from cluster.layout import PAUSE_IMAGE


def _blob(root: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    path = root / "blobs" / "sha256" / digest
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return f"sha256:{digest}"


def pause_image_tar(pause: Path, out: Path) -> Path:
    """An OCI image layout (as a tar) holding one layer: ``/pause``."""
    layer_buf = io.BytesIO()
    with tarfile.open(fileobj=layer_buf, mode="w", format=tarfile.PAX_FORMAT) as layer:
        info = tarfile.TarInfo("pause")
        data = pause.read_bytes()
        info.size, info.mode, info.mtime = len(data), 0o755, 0
        layer.addfile(info, io.BytesIO(data))
    layer_bytes = layer_buf.getvalue()
    work = out.with_suffix(".d")
    work.mkdir(parents=True, exist_ok=True)
    layer_digest = _blob(work, layer_bytes)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }
    config_bytes = json.dumps(config).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": _blob(work, config_bytes),
            "size": len(config_bytes),
        },
        "layers": [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": len(layer_bytes)}
        ],
    }
    manifest_bytes = json.dumps(manifest).encode()
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": _blob(work, manifest_bytes),
                "size": len(manifest_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {"io.containerd.image.name": PAUSE_IMAGE, "org.opencontainers.image.ref.name": "1"},
            }
        ],
    }
    (work / "index.json").write_text(json.dumps(index))
    (work / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    with tarfile.open(out, "w") as tar:
        for path in sorted(work.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(work)), recursive=False)
    return out


def _import_command(ctr: Path, socket: Path) -> list[str]:
    return [str(ctr), "--address", str(socket), "--namespace", "k8s.io", "images", "import", "--local"]


def ctr_import_stream(ctr: Path, socket: Path, source: list[str]) -> None:
    """Pipe an image tar written to stdout by ``source`` (``docker save``) into a node's containerd.
    Nothing is written to disk on the way, and containerd drops each layer's blob once it is unpacked:
    a node keeps only the snapshots its containers run from, one copy of the image instead of three."""
    with tempfile.TemporaryFile() as source_err:
        producer = subprocess.Popen(source, stdout=subprocess.PIPE, stderr=source_err)
        assert producer.stdout is not None
        try:
            done = subprocess.run(
                [*_import_command(ctr, socket), "--discard-unpacked-layers", "-"],
                stdin=producer.stdout,
                capture_output=True,
                text=True,
                timeout=900,
                check=False,
            )
        finally:
            producer.stdout.close()
            # ctr gone early: the producer's next write fails and it exits; kill it if it hangs.
            try:
                producer.wait(timeout=60)
            except subprocess.TimeoutExpired:
                producer.kill()
                producer.wait()
        source_err.seek(0)
        err = source_err.read().decode(errors="replace")
    # ctr first: when it fails early, the producer dies of the closed pipe and has nothing to say.
    if done.returncode != 0:
        raise SystemExit(
            f"importing the output of {' '.join(source[:2])} into {socket} failed (ctr exited {done.returncode}): "
            f"{done.stderr[-2000:]}" + (f"\n{' '.join(source[:2])} said: {err[-1000:]}" if err.strip() else "")
        )
    if producer.returncode != 0:
        raise SystemExit(f"{' '.join(source[:2])} exited {producer.returncode}: {err[-2000:]}")


def ctr_import(ctr: Path, socket: Path, tar: Path) -> None:
    done = subprocess.run(
        [*_import_command(ctr, socket), str(tar)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"importing {tar} into {socket} failed: {done.stderr[-2000:]}")


def image_ids(ctr: Path, socket: Path) -> dict[str, str]:
    """name -> digest of the images a node's containerd holds."""
    done = subprocess.run(
        [str(ctr), "--address", str(socket), "--namespace", "k8s.io", "images", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    found = {}
    for line in done.stdout.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 3:
            found[parts[0]] = parts[2]
    return found
