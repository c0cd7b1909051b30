"""``make cluster`` on a disk too small for it (``cluster.build.require_free``), checked without a
cluster on a real file system of 16 MiB (a tmpfs, mounted with the mount(2) call itself: no process,
so ``make check`` runs it; the tests run as root).

What must hold: the check stops before the work, with a message naming what needs the space, how much,
where, and how much there is; on a file system with room it lets the work go on. CI once failed 27
minutes in with "no space left on device" from deep inside ``docker save``.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.build import require_free

LIBC = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


MNT_DETACH = 2


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0 and os.environ.get("CI", "").lower() != "true":
        pytest.skip("mounting a tmpfs needs root (make cluster does too); CI runs as root")
    target = str(tmp_path).encode()
    _check(LIBC.mount(b"tmpfs", target, b"tmpfs", 0, b"size=16m"), f"mount tmpfs on {tmp_path}")
    try:
        yield tmp_path
    finally:
        # Lazily: a failing test's open file must not turn into an unmount error that hides it.
        _check(LIBC.umount2(target, MNT_DETACH), f"umount {tmp_path}")


def test_a_disk_without_room_stops_the_work_first_and_says_how_much_is_missing(small_disk: Path) -> None:
    (small_disk / "filler").write_bytes(b"\0" * (8 << 20))
    with pytest.raises(SystemExit) as stopped:
        require_free(small_disk / "images", 1 << 30, "importing the trainer image into 2 node(s)")
    message = str(stopped.value)
    assert "importing the trainer image into 2 node(s) needs about 1.0 GiB free" in message
    assert str(small_disk / "images") in message
    assert "it has 0.0 GiB" in message


def test_a_disk_with_room_lets_the_work_go_on(small_disk: Path) -> None:
    require_free(small_disk / "images", 4 << 20, "importing the trainer image into 1 node(s)")
    assert (small_disk / "images").is_dir()
