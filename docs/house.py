"""The package as a house: floors (layers) of rooms (modules), drawn from the code's own imports.

``python docs/house.py`` redraws ``docs/architecture.png``; ``tests/test_architecture.py`` checks
the same model (every import that runs points down a floor). An import counts when it runs, also
inside a function (imported lazily); one under ``if TYPE_CHECKING:`` does not (it never runs).
Needs matplotlib only to draw (it comes with MLflow).
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "operators" / "airflow_torchrun"
OUT = Path(__file__).resolve().parent / "architecture.png"

# Floors, bottom to top. Entries are module names or dotted prefixes (the longest match wins);
# ``name=`` is that module only (``backends=``: the registry of backend names, the package's
# __init__, below the spec that checks a task's backend against it). The ranks' side stands apart:
# it may use the shared floors, nothing of the Airflow side, and the Airflow side never uses it.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundations",
        ("errors", "compat", "state", "naming", "deployment", "redaction", "contract", "mlflow_http", "backends="),
    ),
    (
        "core",
        (
            "spec",
            "status",
            "wiring",
            "diagnosis",
            "storage",
            "sharding",
            "progress",
            "timeline",
            "goodput",
            "audit",
            "integrations.detect",
        ),
    ),
    ("backends", ("backends",)),
    (
        "watch and settings",
        ("watch", "settings", "tracking", "links", "assets", "publishing", "lineage_openlineage", "lineage_schemas"),
    ),
    ("engine and operators", ("operators", "engine", "books", "triggers", "watchers")),
    ("entry points", ("decorators", "cli", "plugin", "ui", "provider", "demo", "__init__")),
]
RANKS = "the ranks' side"
# The local backend's torchrun agent runs beside its ranks, not in Airflow: it forks them from
# itself (torch imported), into the launcher's entry point.
RANKS_ENTRIES = ("worker", "integrations", "backends.local.agent")
SHARED = ("foundations", "core")
ORDER = [name for name, _ in FLOORS]


def modules() -> dict[str, Path]:
    """Dotted module name (without ``airflow_torchrun.``; ``__init__`` for the package) -> file."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" and len(rel.parts) > 1 else rel.parts
        out[".".join(parts)] = path
    return out


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    out: list[ast.AST] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for branch in node.orelse:
                out += [branch, *_runtime_nodes(branch)]
            continue
        out += [node, *_runtime_nodes(node)]
    return out


def _imported(path: Path) -> set[str]:
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("airflow_torchrun"):
            base = node.module.removeprefix("airflow_torchrun").lstrip(".")
            names = [f"{base}.{a.name}".lstrip(".") for a in node.names]
            found.update([*names, base] if base else names)
        elif isinstance(node, ast.Import):
            prefix = "airflow_torchrun."
            found.update(a.name.removeprefix(prefix) for a in node.names if a.name.startswith(prefix))
    return found


def graph() -> dict[str, set[str]]:
    """Each module -> the package's modules it imports when it runs."""
    known = modules()
    out = {}
    for module, path in known.items():
        deps = set()
        for imported in _imported(path):
            target = imported
            while target and target not in known:  # `from x import name`: the module is x
                target = target.rpartition(".")[0]
            if target and target != module:
                deps.add(target)
        out[module] = deps
    return out


def _matches(module: str, entry: str) -> int:
    if entry.endswith("="):
        return len(entry) if module == entry[:-1] else 0
    return len(entry) if module == entry or module.startswith(entry + ".") else 0


def floor(module: str) -> str:
    """The floor a module is on; an unknown module raises (the house must say where it goes)."""
    candidates = [(_matches(module, e), name) for name, entries in FLOORS for e in entries]
    candidates += [(_matches(module, e), RANKS) for e in RANKS_ENTRIES]
    best = max(candidates)
    if best[0] == 0:
        raise ValueError(f"module {module} is on no floor of the house; add it to docs/house.py")
    return best[1]


def upward_imports() -> list[str]:
    """Every import that runs up the house (or between the ranks' side and the Airflow side)."""
    bad = []
    for module, deps in graph().items():
        here = floor(module)
        for dep in deps:
            there = floor(dep)
            if here == RANKS:
                if there not in (*SHARED, RANKS):
                    bad.append(f"{module} (ranks) imports {dep} ({there})")
            elif there == RANKS:
                bad.append(f"{module} ({here}) imports the ranks' {dep}")
            elif ORDER.index(there) > ORDER.index(here):
                bad.append(f"{module} ({here}) imports {dep} ({there})")
    return sorted(bad)


def room(module: str, packages: frozenset[str] = frozenset()) -> str:
    """What a module is drawn in: its folder (``worker/``, ``kubernetes/``) or itself; a package's
    own ``__init__`` is in its folder (``packages``: the package names)."""
    parts = module.split(".")
    if module in packages and module != "backends":
        parts = [*parts, "__init__"]
    if module == "backends":
        return "backends (registry)"
    if module == "backends.local.agent":
        return "local/agent"
    if parts[0] == "backends":
        return f"{parts[1]}/" if len(parts) > 2 else "backends (base, handles)"
    if module == "integrations.detect" or len(parts) == 1:
        return module
    return f"{parts[0]}/"


def _packages(known: dict[str, Path]) -> frozenset[str]:
    return frozenset(m for m, p in known.items() if p.name == "__init__.py" and m != "__init__")


def draw(out: Path = OUT) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    known, deps = modules(), graph()
    packages = _packages(known)
    lines = {m: len(p.read_text().splitlines()) for m, p in known.items()}
    rooms: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))  # floor -> room -> lines
    for m in known:
        rooms[floor(m)][room(m, packages)] += lines[m]
    floors = [*ORDER, RANKS]
    width, floor_h, gap = 16.0, 1.6, 0.5
    fig, ax = plt.subplots(figsize=(16, 12))
    boxes: dict[str, tuple[float, float, float, float]] = {}
    for i, name in enumerate(floors):
        y = i * (floor_h + gap) if name != RANKS else -1 * (floor_h + gap)
        total = sum(rooms[name].values()) or 1
        x = 0.0
        ax.text(-0.2, y + floor_h / 2, name, ha="right", va="center", fontsize=11, weight="bold")
        for r, n in sorted(rooms[name].items(), key=lambda kv: -kv[1]):
            w = max(0.6, width * n / max(total, 2500))
            colour = "#f4cccc" if name == RANKS else "#cfe2f3"
            ax.add_patch(Rectangle((x, y), w, floor_h, facecolor=colour, edgecolor="#333", lw=0.8))
            narrow = w < 1.2
            ax.text(
                x + w / 2, y + floor_h / 2, f"{r}\n{n}", ha="center", va="center", fontsize=6.5, rotation=90 * narrow
            )
            boxes[r] = (x, y, w, floor_h)
            x += w + 0.1
    arrows = {(room(a, packages), room(b, packages)) for a, ds in deps.items() for b in ds}
    arrows = {(a, b) for a, b in arrows if a != b}
    for a, b in sorted(arrows):
        (xa, ya, wa, ha), (xb, yb, wb, hb) = boxes[a], boxes[b]
        start = (xa + wa / 2, ya) if yb < ya else (xa + wa / 2, ya + ha)
        end = (xb + wb / 2, yb + hb) if yb < ya else (xb + wb / 2, yb)
        if ya == yb:
            continue  # same floor: not drawn (a line along the floor says nothing)
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=7, lw=0.4, color="#666", alpha=0.5))
    total_lines = sum(lines.values())
    ax.set_title(
        f"airflow_torchrun: {len(known)} modules, {total_lines} lines, {len(arrows)} imports between rooms; "
        "rooms = folders or modules (area ~ lines), arrows point to what is imported\n"
        "every arrow of the Airflow side points down; the ranks' side (below) uses only the two shared floors",
        fontsize=10,
    )
    ax.set_xlim(-3.5, width + 1)
    ax.set_ylim(-(floor_h + gap) - 0.3, len(ORDER) * (floor_h + gap))
    ax.axis("off")
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


if __name__ == "__main__":
    problems = upward_imports()
    if problems:
        sys.exit("imports that run up the house:\n" + "\n".join(problems))
    print(draw())
