"""The local cluster's fixed ports (``cluster/layout.py``), checked without a cluster.

What must hold: every port the control plane and its services bind on this machine lies outside the
kernel's range for outgoing connections' local ports, so no client socket of an earlier test can
hold one when ``make cluster`` binds it (CI once failed so: etcd's "bind: address already in use").
"""

from __future__ import annotations

from cluster.layout import FIXED_PORTS, ephemeral_ports, fixed_ports_inside


def test_the_clusters_fixed_ports_lie_outside_the_ephemeral_range() -> None:
    ephemeral = ephemeral_ports()
    inside = fixed_ports_inside(ephemeral)
    assert not inside, f"{inside} inside {ephemeral.start}-{ephemeral.stop - 1}"


def test_the_fixed_ports_are_distinct_and_valid() -> None:
    ports = list(FIXED_PORTS.values())
    assert len(set(ports)) == len(ports)
    assert all(1024 <= port <= 65535 for port in ports), ports
