"""The nodes of ``make cluster`` hold the trainer image once each.

What must hold: each node's containerd runs its containers from the unpacked snapshots and keeps no
second copy of the image's layers in its content store (``ctr images import
--discard-unpacked-layers``, fed by ``docker save`` through a pipe): 2 GiB per node saved, which CI's
disk once ran out of.
"""

from __future__ import annotations

from pathlib import Path

from cluster import images
from cluster.build import binary
from cluster.layout import NODES, TRAINER_IMAGE, state


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


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
