"""The chaos tests' trainer and fault selection; their report (one row per fault, written when the
session ends) is kept by ``tests/chaos/matrix.py``.

``make chaos`` (``TRIALS=N``) runs ``tests/chaos`` alone and writes ``.state/chaos/report.md`` and
``report.json``; ``make test`` runs the same faults with ``CHAOS_TRIALS`` (default 1) and writes the
same report. Each trial is recorded by ``matrix.record`` whatever its outcome, so a miss shows in the
report (and fails its test) rather than disappearing.

``CHAOS_FAULTS`` (``make chaos FAULTS=...``) runs only the faults whose name contains one of its
comma-separated parts (case-insensitive), e.g. ``FAULTS="kill -9 a"`` for the random kills: each
chaos test names its fault(s) with ``@pytest.mark.fault(name, ...)`` (a test parametrized by
``fault`` is named by its parameter). A filter that matches no fault is an error, not an empty
report. ``CHAOS_SEED`` fixes the random steps and ranks; the report gives the seed it ran with.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.chaos.matrix import ROOT, trials, wanted_faults
from tests.conftest import make_runner, once_per_run

# The trainer every training fault runs, and how its logs are read.
TRAINER = ROOT / "images" / "trainer" / "train.py"
# 2 epochs of digits on 2 nodes (about 46 steps), a checkpoint every 10 steps, a progress line
# every step; a wider hidden layer makes each checkpoint write long enough to be caught in it.
ARGS = ["--epochs", "2", "--batch-size", "32", "--checkpoint-every", "10", "--log-every", "1", "--hidden", "2048"]
FINAL = re.compile(r"FINAL step=(\d+) weights_sha256=([0-9a-f]{64})")
# torchrun's --tee prefixes each line ("[default0]:"): no anchor.
STEP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank0 train INFO step (\d+)/\d+")
IMPORTS = "from datetime import timedelta"


def trainer_task(**kwargs: object) -> str:
    """The training task's source (inside ``with DAG(...)``), with the trial's arguments."""
    args = ", ".join(f"{k}={v!r}" for k, v in {"track": False, **kwargs}.items())
    return f"""
    DistributedTrainingOperator(
        task_id="train", script={str(TRAINER)!r}, num_nodes=2, nproc_per_node=1,
        script_args={ARGS!r}, retry_delay=timedelta(0), teardown_grace=5, {args}
    )
    """


@pytest.fixture(scope="session")
def uninterrupted(airflow_db: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final weights' digest of the trainer run once without a fault (once per run: xdist's
    workers share it, see :func:`tests.conftest.once_per_run`)."""

    def run_once(_folder: Path) -> str:
        run, cleanup = make_runner(None)
        try:
            result = run(trainer_task(retries=0), imports=IMPORTS)
        finally:
            cleanup()
        assert result.state == "success", result.node_logs("train")[-4000:]
        found = FINAL.findall(result.node_logs("train"))
        assert found
        return str(found[-1][1])

    return str(once_per_run(tmp_path_factory, "chaos-uninterrupted-digest", run_once))


def fault_names(item: pytest.Item) -> list[str]:
    """The faults a chaos test runs: its ``fault`` marker(s), or its ``fault`` parameter."""
    names = [str(n) for m in item.iter_markers("fault") for n in m.args]
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "fault" in callspec.params:
        names.append(str(callspec.params["fault"]))
    return names


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fault(*names): the chaos fault(s) a test runs (CHAOS_FAULTS selects by them)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        # A chaos test runs trials() trials in a row: the suite's 300 s per test scales with them.
        if here in Path(str(item.path)).parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(300 * trials()))
    wanted = wanted_faults()
    if not wanted:
        return
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        if here not in Path(str(item.path)).parents:
            keep.append(item)
            continue
        names = [n.lower() for n in fault_names(item)]
        (keep if any(w in n for w in wanted for n in names) else drop).append(item)
    if not any(here in Path(str(i.path)).parents for i in keep):
        known = sorted({n for i in items if here in Path(str(i.path)).parents for n in fault_names(i)})
        raise pytest.UsageError(f"CHAOS_FAULTS={os.environ['CHAOS_FAULTS']!r} matches no chaos fault; faults: {known}")
    config.hook.pytest_deselected(items=drop)
    items[:] = keep
