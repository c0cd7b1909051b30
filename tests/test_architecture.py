"""The house as docs/architecture.md draws it (``docs/house.py``): floors that only import down.

Every import that runs counts, also the ones inside functions (imported lazily, they still run);
imports under ``if TYPE_CHECKING:`` do not (they never run). No process is started.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _house() -> ModuleType:
    spec = importlib.util.spec_from_file_location("house", ROOT / "docs" / "house.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


house = _house()


def test_every_import_points_down_a_floor_or_stays_on_it() -> None:
    assert not house.upward_imports(), "imports that run up the house:\n" + "\n".join(house.upward_imports())


def test_every_module_is_on_a_floor() -> None:
    assert {house.floor(m) for m in house.modules()} <= {*house.ORDER, house.RANKS}


def test_an_import_that_runs_up_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: a core module that imports the engine is reported (lazily, in a function)."""
    fake = tmp_path / "airflow_torchrun"
    (fake / "operators").mkdir(parents=True)
    (fake / "spec.py").write_text("def f():\n    from airflow_torchrun.engine import RunEngine\n")
    (fake / "engine.py").write_text("from airflow_torchrun.spec import f\n")
    (fake / "worker").mkdir()
    (fake / "worker" / "x.py").write_text("import airflow_torchrun.engine\n")
    monkeypatch.setattr(house, "PACKAGE", fake)
    assert house.upward_imports() == [
        "spec (core) imports engine (engine and operators)",
        "worker.x (ranks) imports engine (engine and operators)",
    ]


def test_no_backend_is_named_outside_backends() -> None:
    """A backend answers its own questions; nothing else compares a backend's name."""
    named = re.compile(r"""(==|!=|\bin\b)\s*\(?["'](local|kubernetes)["']|["'](local|kubernetes)["']\s*(==|!=)""")
    found = []
    for module, path in house.modules().items():
        if module.split(".")[0] == "backends":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if named.search(line):
                found.append(f"{module}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("side", ["spec", "status", "wiring", "storage.checkpoints", "contract.progress", "naming"])
def test_the_shared_floors_import_neither_airflow_nor_torch(side: str) -> None:
    tree = ast.parse((house.PACKAGE / f"{side.replace('.', '/')}.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"airflow", "torch", "kubernetes", "mlflow", "s3fs"}, imported
