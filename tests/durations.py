"""How long each test took in a whole ``make test`` (``tests/durations.json``), for the xdist scheduler.

``make test`` spreads the tests over two workers; the scheduler of ``tests/conftest.py`` hands out
the costliest work first (a test, or a group that must stay on one worker, summed), so that a long
test does not start last while the other worker has nothing left to do. Only the order depends on
these figures: a test missing from the file counts as ``DEFAULT_S``, a stale figure only makes the
order less good.

Refresh them after a change that moves a test's cost (from the JUnit XML of a whole run)::

    make test PYTEST_ARGS="--junitxml=.state/junit.xml"
    .venv/bin/python -m tests.durations .state/junit.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

FILE = Path(__file__).with_name("durations.json")
# Tests under this are left out of the file (most of the suite: they change no order that matters).
KEEP_FROM_S = 1.0
DEFAULT_S = 0.5


def load(path: Path = FILE) -> dict[str, float]:
    """Node id -> seconds; empty when the file is missing or unreadable (the order is then the collection's)."""
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def node_id(classname: str, name: str) -> str:
    """JUnit's ``tests.chaos.test_chaos`` and ``test_fault[x]`` -> ``tests/chaos/test_chaos.py::test_fault[x]``."""
    return f"{classname.replace('.', '/')}.py::{name}"


def from_junit(xml: Path) -> dict[str, float]:
    """Each test's time (setup, call and teardown) from pytest's JUnit XML, the slow ones only."""
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        seconds = float(case.get("time") or 0)
        if seconds >= KEEP_FROM_S:
            out[node_id(case.get("classname", ""), case.get("name", ""))] = round(seconds, 1)
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.durations <junit.xml>", file=sys.stderr)
        return 2
    durations = from_junit(Path(argv[0]))
    FILE.write_text(json.dumps(durations, indent=1) + "\n")
    print(f"{FILE}: {len(durations)} tests of {KEEP_FROM_S:g} s or more, {sum(durations.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
