"""The Ray Train anchor's own virtualenv, made by ``make bench`` (``bench/run.py``) when missing.

Ray is never a dependency of airflow-torchrun nor of ``make test``: it lives in
``.state/bench/ray-venv`` only. torch is pinned to the package's CPU build (an unpinned ``torch``
resolves to a multi-GB CUDA build); Ray to the release this benchmark was checked with. A stamp
file naming both marks a finished install, so a later run reuses it.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

RAY_PIN = "ray[train]==2.60.0"
ROOT = Path(__file__).resolve().parents[1]
# PyTorch's CPU wheel where a local folder holds it (../shared/wheels on our machines, as the
# Makefile does: PyPI's torch==2.13.0 is the multi-GB CUDA build); PyPI's torch elsewhere.
TORCH_WHEELS = next((p for p in (ROOT.parent / "shared" / "wheels", Path("/work/shared/wheels")) if p.is_dir()), None)
TORCH_PIN = "torch==2.13.0+cpu" if TORCH_WHEELS is not None else "torch==2.13.0"
TORCH_FIND_LINKS = ["--find-links", str(TORCH_WHEELS)] if TORCH_WHEELS is not None else []


@dataclass(frozen=True)
class RayVenv:
    """The venv's python when usable; otherwise ``reason`` says why there is none."""

    python: Path | None
    reason: str = ""


def stamp(venv: Path) -> Path:
    return venv / f".installed-{TORCH_PIN}-{RAY_PIN}".replace("[", "-").replace("]", "").replace("+", "-")


def commands(venv: Path, base_python: str = "python3") -> list[list[str]]:
    """What creating the venv runs, in order (torch first, so that Ray's resolution keeps it)."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *TORCH_FIND_LINKS]
    return [[base_python, "-m", "venv", str(venv)], [*pip, TORCH_PIN], [*pip, RAY_PIN, TORCH_PIN]]


def _why(stderr: str) -> str:
    lines = stderr.strip().splitlines() or ["no output"]
    errors = [line for line in lines if "ERROR" in line or "Error" in line]
    return (errors or lines)[-1]


def ensure(venv: Path, *, skip: str = "", base_python: str = "python3") -> RayVenv:
    """Reuse or create the venv. ``skip``: a reason not to (``--no-ray``); nothing is run then."""
    if skip:
        return RayVenv(None, skip)
    python = venv / "bin" / "python"
    if stamp(venv).exists() and python.exists():
        return RayVenv(python)
    print(f"Creating the Ray virtualenv {venv} ({TORCH_PIN}, {RAY_PIN}); about a minute", flush=True)
    for argv in commands(venv, base_python):
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            return RayVenv(None, f"`{' '.join(argv[-2:])}` failed (exit {proc.returncode}): {_why(proc.stderr)}")
    check = subprocess.run([str(python), "-c", "import ray.train.torch"], capture_output=True, text=True, check=False)
    if check.returncode != 0:
        return RayVenv(None, f"import ray.train.torch failed: {_why(check.stderr)}")
    stamp(venv).write_text(f"{TORCH_PIN} {RAY_PIN}\n")
    return RayVenv(python)


if __name__ == "__main__":
    result = ensure(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".state/bench/ray-venv"))
    print(result.python or f"no Ray virtualenv: {result.reason}")
    sys.exit(0 if result.python else 1)
