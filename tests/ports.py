"""Ports on 127.0.0.1 for tests that run beside others (pytest-xdist's workers, their servers)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

from airflow_torchrun.backends.local.backend import free_port

__all__ = ["free_port", "refusing_port"]


@contextmanager
def refusing_port() -> Iterator[int]:
    """A port that refuses every connection while the block runs: bound, never listening, and
    without SO_REUSEADDR, so no other process can listen on it meanwhile (a port that was merely
    free can be taken by a server of a test running beside this one)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])
