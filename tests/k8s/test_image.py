"""The trainer image's Dockerfile, checked without building it (no container engine here)."""

from __future__ import annotations

import glob
import re
from fnmatch import fnmatch
from pathlib import Path

from airflow_torchrun.runtimes import DEFAULT_UID

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "images" / "trainer" / "Dockerfile"
IGNORE = ROOT / "images" / "trainer" / "Dockerfile.dockerignore"


def ignore_patterns() -> list[str]:
    return [line.strip() for line in IGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule for the simple patterns used: the last matching pattern wins, and a pattern
    that matches a parent folder matches everything below it."""
    parts = path.split("/")
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


def copy_sources() -> list[str]:
    sources = []
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY "):
            args = [a for a in line.split()[1:] if not a.startswith("--")]
            sources += args[:-1]
    return sources


def test_everything_copied_exists_and_is_in_the_build_context() -> None:
    patterns = ignore_patterns()
    sources = copy_sources()
    assert "operators/airflow_torchrun" in sources and "images/trainer/*.py" in sources
    for source in sources:
        matches = glob.glob(str(ROOT / source))
        assert matches, f"COPY {source}: nothing there"
        for match in matches:
            rel = str(Path(match).relative_to(ROOT))
            assert not ignored(rel, patterns), f"{rel} is copied but excluded from the build context"
    assert (ROOT / "operators/airflow_torchrun/worker/launch.py").is_file()


def test_the_build_context_leaves_out_environments_and_state() -> None:
    patterns = ignore_patterns()
    for path in (
        ".venv/bin/python",
        ".state/airflow/airflow.db",
        "operators/airflow_torchrun.egg-info/PKG-INFO",
        "tests/k8s/test_image.py",
        "operators/airflow_torchrun/__pycache__/spec.cpython-311.pyc",
    ):
        assert ignored(path, patterns), path


def test_the_image_user_is_the_runtimes_default_non_root_user() -> None:
    text = DOCKERFILE.read_text()
    uid = re.search(r"^ARG UID=(\d+)$", text, re.MULTILINE)
    assert uid is not None and int(uid.group(1)) == DEFAULT_UID != 0
    assert re.search(r"^USER \$\{UID\}:\$\{UID\}$", text, re.MULTILINE)
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.MULTILINE)
    assert base is not None and ":" in base.group(1) and not base.group(1).endswith(":latest")  # pinned
