"""The nodes of ``make cluster`` hold the trainer image once each.

What must hold: each node's containerd runs its containers from the unpacked snapshots and keeps no
second copy of the image's layers in its content store (``ctr images import
--discard-unpacked-layers``, fed by ``docker save`` through a pipe): 2 GiB per node saved, which CI's
disk once ran out of.
"""

from __future__ import annotations

import stat
from pathlib import Path

from cluster import images
from cluster.build import binary
from cluster.layout import NODES, TRAINER_IMAGE, state


def _size(folder: Path) -> int:
    """Bytes of the regular files under ``folder`` (links not followed; a file a running container
    removes meanwhile is skipped)."""
    total = 0
    for path in folder.rglob("*"):
        try:
            info = path.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(info.st_mode):
            total += info.st_size
    return total


def test_each_node_holds_the_trainer_image_unpacked_and_no_copy_of_its_layers(
    cluster_env: dict[str, str],
) -> None:
    st = state()
    for node in NODES:
        held = images.image_ids(binary("ctr"), st.containerd_socket(node))
        assert TRAINER_IMAGE in held, f"{node.name} does not hold {TRAINER_IMAGE}: {sorted(held)}"
        root = st.node_dir(node) / "containerd"
        content = _size(root / "io.containerd.content.v1.content")
        unpacked = _size(root / "io.containerd.snapshotter.v1.overlayfs" / "snapshots")
        assert unpacked > 1 << 30, f"{node.name}: the trainer image unpacked is only {unpacked} bytes"
        assert content < 64 << 20, f"{node.name}: {content >> 20} MiB of blobs kept beside the snapshots"
