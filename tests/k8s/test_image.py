"""The trainer image's Dockerfile, checked without building it.

Building it and running the rendered pods in it is ``make image-test`` (``images/image_test.py``,
run by CI); these checks are the cheap part that every ``pytest`` run does, and they check the
build-context filter that image test stages its context with.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from airflow_torchrun.backends.kubernetes.runtimes import DEFAULT_UID

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "images" / "trainer" / "Dockerfile"
IGNORE = ROOT / "images" / "trainer" / "Dockerfile.dockerignore"


@functools.cache
def image_test() -> ModuleType:
    """``images/image_test.py``, imported (a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("airflow_torchrun_image_test", ROOT / "images" / "image_test.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def ignore_patterns() -> list[str]:
    return list(image_test().ignore_patterns(IGNORE))


def ignored(path: str, patterns: list[str]) -> bool:
    return bool(image_test().ignored(path, patterns))


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


@pytest.mark.slow
def test_the_image_test_stages_exactly_the_build_context(tmp_path: Path) -> None:
    count = image_test().stage_context(tmp_path / "context")
    staged = sorted(str(p.relative_to(tmp_path / "context")) for p in (tmp_path / "context").rglob("*") if p.is_file())
    assert len(staged) == count
    assert "pyproject.toml" in staged and "images/trainer/Dockerfile" in staged
    assert "operators/airflow_torchrun/worker/launch.py" in staged
    assert not [p for p in staged if p.startswith(("tests/", ".state/", ".venv/")) or p.endswith(".pyc")]
