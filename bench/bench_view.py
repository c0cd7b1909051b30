"""What the training view's refresh costs the training, as a ratio measured in one run.

One ``airflow standalone`` (the API server shares the machine's cores with the ranks, as on a
laptop or a single-node deployment), one training task of constant work per step (2 local nodes x
1 rank, gloo), and while it trains, alternating phases: *closed* (nobody polls) and *open* (the
plugin's API polled over HTTP with the REST token every ``--interval`` seconds, what the view's
page does every 3 s; ``--interval 0.3`` is ten open tabs). Throughput per phase comes from the
ranks' own progress records (rank 0's steps per second inside the phase). Goal: open / closed >= 0.99.

Run: ``.venv/bin/python bench/bench_view.py [--phases 4] [--phase-s 10] [--interval 3] [--json rows.json]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from urllib.parse import quote

from rows import row, write_json

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCRIPT = textwrap.dedent(
    """
    import os, time
    import torch, torch.distributed as dist
    from airflow_torchrun.worker import ProgressLogger
    from airflow_torchrun.worker.tracking import StepTimer, RunLogger
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    steps = int(os.environ["STEPS"])
    progress, timer, tracker = ProgressLogger(steps, every=1000, samples_per_step=512), StepTimer(), RunLogger()
    for step in range(1, steps + 1):
        with timer.compute():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
        progress.update(step, loss=loss.item())
        tracker.log_step(step, loss=loss.item(), samples=512, timing=timer.lap())
    dist.destroy_process_group()
    """
)

DAG = textwrap.dedent(
    """
    import pendulum
    from airflow.sdk import DAG
    from airflow_torchrun import DistributedTrainingOperator

    with DAG("bench_view", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False):
        DistributedTrainingOperator(
            task_id="train", script={script!r}, num_nodes=2, nproc_per_node=1, track=False,
            env={{"STEPS": "{steps}", "AIRFLOW_TORCHRUN_PROGRESS_INTERVAL": "0.5"}},
        )
    """
)


def steps_per_s(records: list[tuple[float, int]], start: float, end: float) -> float | None:
    inside = [(t, s) for t, s in records if start <= t <= end]
    if len(inside) < 2:
        return None
    (t0, s0), (t1, s1) = inside[0], inside[-1]
    return (s1 - s0) / (t1 - t0) if t1 > t0 else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phases", type=int, default=4, help="closed/open pairs")
    parser.add_argument("--phase-s", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between two polls while open")
    parser.add_argument("--steps", type=int, default=0, help="training steps (default: enough for the phases)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from airflow_torchrun.contract.progress import parse_records
    from tests.standalone import start_standalone, wait_for

    work = Path(tempfile.mkdtemp(prefix="bench-view-"))
    dags = work / "dags"
    dags.mkdir()
    script = work / "job.py"
    script.write_text(SCRIPT)
    # About 150 steps/s on two cores; the phases plus a margin for start-up.
    steps = args.steps or int(150 * (2 * args.phases * args.phase_s + 30))
    (dags / "bench_view.py").write_text(DAG.format(script=str(script), steps=steps))
    with start_standalone(work / "standalone", dags, "bench_view", "train") as server:
        server.unpause()
        run_id = server.trigger({})
        path = f"/torchrun/api/v1/dags/bench_view/dagRuns/{quote(run_id, safe='')}/taskInstances/train"

        def training() -> bool:
            code, doc = server.request("GET", path)
            return code == 200 and isinstance(doc, dict) and bool(doc.get("progress"))

        wait_for("the training to report progress", training, 300)
        time.sleep(3)  # past the warm-up
        phases: list[tuple[str, float, float]] = []
        polls, poll_s = 0, 0.0
        for _ in range(args.phases):
            for kind in ("closed", "open"):
                start = time.time()
                while time.time() - start < args.phase_s:
                    if kind == "open":
                        tick = time.perf_counter()
                        code, _doc = server.request("GET", path)
                        poll_s += time.perf_counter() - tick
                        assert code == 200, code
                        polls += 1
                        time.sleep(args.interval)
                    else:
                        time.sleep(0.2)
                phases.append((kind, start, time.time()))
        state = server.wait_run_state(run_id, {"success", "failed"}, 600)
        logs = sorted((server.state_dir / "groups").glob("*/node-0/node.log"))
        records = [(r.time, r.step) for r in parse_records(logs[-1].read_text().splitlines()) if r.rank == 0]
    rates: dict[str, list[float]] = {"closed": [], "open": []}
    measured = [(kind, steps_per_s(records, start, end)) for kind, start, end in phases]
    for kind, rate in measured:
        if rate is not None:
            rates[kind].append(rate)
    # Each open phase against the closed phases on either side: slow drifts of the machine's load cancel.
    paired = []
    for i, (kind, rate) in enumerate(measured):
        around = [r for k, r in measured[max(0, i - 1) : i + 2] if k == "closed" and r]
        if kind == "open" and rate and around:
            paired.append(rate / statistics.mean(around))
    closed, opened = statistics.median(rates["closed"]), statistics.median(rates["open"])
    print(
        f"run {state}; {polls} polls every {args.interval:g}s while open ({1000 * poll_s / max(polls, 1):.0f} ms "
        f"each); phases of {args.phase_s:g}s"
    )
    print(f"steps/s closed {[round(r, 1) for r in rates['closed']]} open {[round(r, 1) for r in rates['open']]}")
    ratio = statistics.median(paired)
    print(f"throughput with the view open / closed: {ratio:.3f} (median of {len(paired)} paired phases; goal >= 0.99)")
    print(f"  (medians of all phases: {opened:.1f} / {closed:.1f} = {opened / closed:.3f})")
    measure = f"training throughput, view polling every {args.interval:g}s / closed"
    rows = [row(measure, ratio, "view closed", 1.0, "ratio")]
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
