"""Ports on 127.0.0.1 for tests that run beside others (pytest-xdist's workers, their servers).

A port that was merely found free (bound to port 0, then let go) can be taken by a server of a test running
beside this one before this test's server binds it, or while that server is stopped for a fault.
Hence two holds, each a socket bound to the port and never listening (connections to it are refused):

- :func:`refusing_port`, without ``SO_REUSEADDR``: no process may listen on the port meanwhile;
- :class:`ReservedPort`, with ``SO_REUSEADDR``: this test's own server may (it sets the option too:
  uvicorn's event loop, werkzeug, torch's ``TCPStore``), and no later bind to port 0 is handed the
  port while the hold lasts (a process that found the number free before the hold may still bind it).

Linux's rules for ``SO_REUSEADDR``; the BSDs' differ.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def refusing_port() -> Iterator[int]:
    """A port that refuses every connection while the block runs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


class ReservedPort:
    """A port kept for a server of this test's own until :meth:`close` (or this process's exit)."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = int(self._sock.getsockname()[1])

    def close(self) -> None:
        self._sock.close()


@contextmanager
def reserved_ports(count: int) -> Iterator[list[int]]:
    """``count`` ports kept for this test's own servers while the block runs."""
    held = [ReservedPort() for _ in range(count)]
    try:
        yield [r.port for r in held]
    finally:
        for r in held:
            r.close()
