"""docs/security.md names, for each finding, the test that holds its boundary: each must exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_the_trust_model_names_exists() -> None:
    doc = (ROOT / "docs" / "security.md").read_text()
    named = set(re.findall(r"`(test_[a-z0-9_]+)`", doc))
    files = set(re.findall(r"`(tests/[\w/]+\.py)`", doc))
    assert len(named) >= 10 and files, "the trust model names its tests"
    sources = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    missing = sorted(t for t in named if not re.search(rf"def {t}\(", sources))
    assert not missing, f"docs/security.md names tests that do not exist: {missing}"
    assert all((ROOT / f).is_file() for f in files), files
