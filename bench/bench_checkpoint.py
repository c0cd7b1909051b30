"""Checkpoint benchmark: save/load throughput against a raw copy of the same bytes (ours with
the checksums written and verified), the cost of the save on SIGTERM, and the training-time
overhead of checkpointing in the example trainer.

Run standalone (about 3 minutes on 2 cores)::

    .venv/bin/python bench/bench_checkpoint.py [--size-mb 160] [--repeat 3] [--skip-s3] [--skip-train]
        [--stop-sizes-mb 100,1000] [--json rows.json]

S3 is moto's server on localhost (started here, in a process of its own), reached through s3fs over
HTTP: compare S3 numbers with the raw PUT/GET of the same endpoint, not with the disk.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rows import Samples, row, write_json

ROOT = Path(__file__).resolve().parent.parent
TRAINER = ROOT / "images" / "trainer" / "train.py"


@dataclass
class Row:
    backend: str
    op: str
    size_mb: float
    ours_s: float  # median
    raw_s: float  # median
    ours_all: list[float] = field(default_factory=list)  # every measurement, seconds
    raw_all: list[float] = field(default_factory=list)

    def cells(self) -> list[str]:
        ours_rate = self.size_mb / self.ours_s
        raw_rate = self.size_mb / self.raw_s
        return [
            self.backend,
            self.op,
            f"{self.size_mb:.0f}",
            f"{self.ours_s:.2f}",
            f"{ours_rate:.0f}",
            f"{self.raw_s:.2f}",
            f"{raw_rate:.0f}",
            f"{ours_rate / raw_rate:.2f}",
        ]


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += [
        "  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]
    return "\n".join(lines)


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def interleaved(ours: Callable[[], object], raw: Callable[[], object], repeat: int) -> tuple[list[float], list[float]]:
    """``repeat`` timings of each, alternating ours and raw (and which goes first)."""
    ours_t: list[float] = []
    raw_t: list[float] = []
    for i in range(repeat):
        for side in ("ours", "raw") if i % 2 == 0 else ("raw", "ours"):
            (ours_t if side == "ours" else raw_t).append(timed(ours if side == "ours" else raw))
    return ours_t, raw_t


def progress(what: str) -> None:
    print(f"  [bench:checkpoint] {what}", flush=True)


def make_state(size_mb: int) -> dict[str, object]:
    """A model-like state dict: float32 matrices of 4 MiB each, plus a few small entries."""
    generator = torch.Generator().manual_seed(0)
    count = max(1, round(size_mb / 4))
    layers = {f"layers.{i}.weight": torch.randn(1024, 1024, generator=generator) for i in range(count)}
    return {"model": layers, "step": 1, "lr": 1e-3}


def bench_io(backend: str, root_uri: str, state: dict[str, object], repeat: int) -> list[Row]:
    from airflow_torchrun.storage.checkpoints import CheckpointStore
    from airflow_torchrun.worker import load_checkpoint, save_checkpoint

    store = CheckpointStore(root_uri)
    fs = store.fs
    buffer = io.BytesIO()
    torch.save(state, buffer)
    blob = buffer.getvalue()
    size_mb = len(blob) / 1e6
    raw_path = f"{store.location.path}/raw-copy.bin"

    def raw_write() -> None:
        if backend == "file":
            # Same durability as save_checkpoint: write, fsync, rename.
            os.makedirs(store.location.path, exist_ok=True)
            tmp = raw_path + ".tmp"
            with open(tmp, "wb") as fp:
                fp.write(blob)
                fp.flush()
                os.fsync(fp.fileno())
            os.replace(tmp, raw_path)
        else:
            fs.pipe_file(raw_path, blob)

    def raw_read() -> None:
        if backend == "file":
            with open(raw_path, "rb") as fp:
                fp.read()
        else:
            fs.cat_file(raw_path)

    steps = iter(range(1, 10_000))
    last_uri: list[str] = []

    def ours_write() -> None:
        last_uri[:] = [save_checkpoint(state, next(steps), uri=root_uri, keep_last=1)]

    def ours_read() -> None:
        load_checkpoint(uri=last_uri[0])

    # One unmeasured round each, so that connection set-up and first allocations are not timed.
    raw_write()
    ours_write()
    med = statistics.median
    rows = []
    for op, ours_fn, raw_fn in (("write", ours_write, raw_write), ("read", ours_read, raw_read)):
        ours_t, raw_t = interleaved(ours_fn, raw_fn, repeat)
        rows.append(Row(backend, op, size_mb, med(ours_t), med(raw_t), ours_t, raw_t))
        progress(f"{backend} {op} {size_mb:.0f} MB: ours {med(ours_t):.2f} s, raw {med(raw_t):.2f} s")
    fs.rm(store.location.path, recursive=True)
    return rows


STOP_CHILD = """
import json, os, signal, sys, time
import torch
from airflow_torchrun.worker import save_if_stopping
count = max(1, round(int(sys.argv[2]) / 4))
state = {"model": {f"l{i}": torch.randn(1024, 1024) for i in range(count)}}
save_if_stopping(state, 0)  # the first call installs the handler; no signal yet
signalled = time.time()
os.kill(os.getpid(), signal.SIGTERM)  # what a teardown, eviction or torchrun's agent sends
print(json.dumps({"signalled": signalled}), flush=True)
save_if_stopping(state, 1)  # the next step boundary: saves step 1 and exits 75
"""


@dataclass
class StopRow:
    size_mb: float
    seconds: float  # signal -> committed marker, median


def bench_stop(root: Path, sizes_mb: list[int], repeat: int) -> list[StopRow]:
    """Seconds from SIGTERM to the committed checkpoint of the next step boundary (one process)."""
    import json

    from airflow_torchrun.contract import STOPPED_TO_SAVE_EXIT_CODE
    from airflow_torchrun.storage.checkpoints import CheckpointStore

    rows = []
    for size in sizes_mb:
        times = []
        for _ in range(repeat):
            uri = f"file://{root}/stop-{uuid.uuid4().hex[:8]}"
            env = {**os.environ, "TRAIN_CHECKPOINT_URI": uri, "OMP_NUM_THREADS": "1"}
            proc = subprocess.run(
                [sys.executable, "-c", STOP_CHILD, uri, str(size)],
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            if proc.returncode != STOPPED_TO_SAVE_EXIT_CODE:
                raise RuntimeError(f"the stop child exited {proc.returncode}: {proc.stderr[-2000:]}")
            signalled = json.loads(proc.stdout.strip().splitlines()[-1])["signalled"]
            store = CheckpointStore(uri)
            marker = store.read_marker(1)
            times.append(float(marker["committed_at"]) - signalled)
            size_mb = marker["total_bytes"] / 1e6
            shutil.rmtree(store.location.path, ignore_errors=True)
        rows.append(StopRow(size_mb, statistics.median(times)))
    return rows


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    """moto's S3 server in a process of its own (as S3 is another machine: in this process, its
    request handling would share our GIL and be counted against our reads and writes)."""
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"moto_server did not start on {endpoint}") from None
            time.sleep(0.2)
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,
        }
    )
    return server, endpoint


FINAL = re.compile(r"FINAL step=(\d+) .*train_s=([0-9.]+) checkpoint_s=([0-9.]+)")


TRAINER_TIMEOUT_S = 180.0  # a run takes 10-20 s here; past this it hung


def kill_run(tag: str) -> None:
    """SIGKILL what is left of one trainer run (its workers run in sessions of their own)."""
    want = f"BENCH_TRAINER_RUN={tag}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            if want in Path(f"/proc/{name}/environ").read_bytes().split(b"\0"):
                os.kill(int(name), 9)
        except (OSError, ProcessLookupError):
            continue


def run_trainer(extra_env: dict[str, str], args: list[str]) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAIN_")}
    env.update(extra_env)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["BENCH_TRAINER_RUN"] = tag = uuid.uuid4().hex
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(TRAINER), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=TRAINER_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"trainer {' '.join(args)} still running after {TRAINER_TIMEOUT_S:.0f} s (hung)") from exc
    finally:
        kill_run(tag)
    match = FINAL.search(proc.stdout)
    if proc.returncode != 0 or not match:
        raise RuntimeError(f"trainer failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return float(match.group(2)), float(match.group(3))


@dataclass
class TrainRow:
    mode: str
    train_s: float  # median training-loop time
    blocked_s: float  # median time inside save_checkpoint
    baseline_s: float  # median training-loop time without checkpointing, same run
    train_all: list[float] = field(default_factory=list)
    baseline_all: list[float] = field(default_factory=list)
    failed: str = ""  # why some runs of this mode did not finish
    attempts: int | None = None

    def cells(self) -> list[str]:
        overhead = 100.0 * (self.train_s - self.baseline_s) / self.baseline_s
        share = 100.0 * self.blocked_s / self.train_s
        return [self.mode, f"{self.train_s:.2f}", f"{overhead:+.1f}%", f"{self.blocked_s:.3f}", f"{share:.1f}%"]


def report_rows(
    io_rows: list[Row], train_rows: list[TrainRow], stop_rows: list[StopRow] | None = None
) -> list[dict[str, object]]:
    def rates(r: Row, times: list[float], median_s: float) -> Samples | float:
        return Samples([r.size_mb / t for t in times]) if times else r.size_mb / median_s

    rows = [
        row(
            f"checkpoint {r.op} (verified), {r.backend}, {r.size_mb:.0f} MB",
            rates(r, r.ours_all, r.ours_s),
            "raw copy of the same bytes",
            rates(r, r.raw_all, r.raw_s),
            "MB/s",
        )
        for r in io_rows
    ]
    rows += [
        row(
            f"example trainer's training time, {t.mode}",
            Samples(t.train_all, t.attempts) if t.train_all or t.attempts else t.train_s,
            "no checkpointing, same run",
            Samples(t.baseline_all) if t.baseline_all else t.baseline_s,
            "s",
            note=f"failed runs: {t.failed}" if t.failed else "",
        )
        for t in train_rows
        if t.mode != "no checkpointing"
    ]
    rows += [
        row(f"save on SIGTERM, file, {r.size_mb:.0f} MB: signal to committed", r.seconds, "none", None, "s")
        for r in stop_rows or []
    ]
    return rows


def bench_training(epochs: int, repeat: int, workdir: Path) -> list[TrainRow]:
    base = ["--epochs", str(epochs), "--log-every", "1000"]
    modes = [
        ("no checkpointing", {}, []),
        ("sync, default interval", {"TRAIN_CHECKPOINT_URI": ""}, []),
        ("async, default interval", {"TRAIN_CHECKPOINT_URI": ""}, ["--async-checkpoint"]),
    ]
    results: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in modes}
    failures: dict[str, str] = {}
    # Interleave the modes so that load from other processes on the machine hits them alike.
    for _ in range(repeat):
        for name, env, extra in modes:
            run_env = dict(env)
            if "TRAIN_CHECKPOINT_URI" in run_env:
                run_env["TRAIN_CHECKPOINT_URI"] = str(workdir / f"train-{uuid.uuid4().hex[:8]}")
            try:
                results[name].append(run_trainer(run_env, base + extra))
            except RuntimeError as exc:
                failures.setdefault(name, str(exc).splitlines()[0])
                progress(f"trainer, {name}: FAILED ({failures[name]})")
                continue
            progress(f"trainer, {name}: train {results[name][-1][0]:.2f} s, blocked {results[name][-1][1]:.3f} s")
    base_all = [t for t, _ in results["no checkpointing"]]
    if not base_all:
        raise RuntimeError(f"the trainer without checkpointing never finished: {failures}")
    return [
        TrainRow(
            name,
            statistics.median(t for t, _ in results[name]) if results[name] else float("nan"),
            statistics.median(c for _, c in results[name]) if results[name] else float("nan"),
            statistics.median(base_all),
            [t for t, _ in results[name]],
            base_all,
            failed=failures.get(name, ""),
            attempts=repeat,
        )
        for name, _, _ in modes
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=160, help="size of the state dict (default 160 MB)")
    parser.add_argument("--repeat", type=int, default=3, help="measurements per number; the median is shown")
    parser.add_argument("--epochs", type=int, default=30, help="trainer epochs for the overhead runs (default 30)")
    parser.add_argument("--skip-s3", action="store_true", help="no S3 (moto) measurements")
    parser.add_argument("--skip-train", action="store_true", help="no training-overhead measurements")
    parser.add_argument(
        "--stop-sizes-mb",
        default=None,
        help="state sizes for the save-on-SIGTERM cost, e.g. 100,1000 (the default; --size-mb below 100: that size)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the report rows (bench/rows.py) to PATH")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    workdir = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    try:
        state = make_state(args.size_mb)
        rows = bench_io("file", f"file://{workdir}/ckpt", state, args.repeat)
        if not args.skip_s3:
            server, _ = start_moto()
            import boto3

            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            boto3.client("s3").create_bucket(Bucket=bucket)
            try:
                rows += bench_io("s3 (moto)", f"s3://{bucket}/ckpt", state, args.repeat)
            finally:
                server.kill()
                server.wait()
        print()
        print(f"Checkpoint I/O, single process, median of {args.repeat} (MB = 1e6 bytes)")
        header = ["backend", "op", "MB", "ours s", "ours MB/s", "raw s", "raw MB/s", "ours/raw"]
        print(table(header, [r.cells() for r in rows]))
        print("ours = save_checkpoint/load_checkpoint (torch.save/load, CRC-32 of every byte written and")
        print("verified on load, commit marker); raw = the same bytes written (fsync + rename on disk) or read.")
        stop_rows: list[StopRow] = []
        spec = args.stop_sizes_mb if args.stop_sizes_mb is not None else ("100,1000" if args.size_mb >= 100 else "")
        sizes = [int(x) for x in spec.split(",") if x.strip()] or [args.size_mb]
        if sizes:
            stop_rows = bench_stop(workdir, sizes, args.repeat)
            print()
            print(f"Save on SIGTERM (save_if_stopping), file://, one process, median of {args.repeat}")
            print(table(["MB", "signal -> committed s"], [[f"{r.size_mb:.0f}", f"{r.seconds:.2f}"] for r in stop_rows]))
        train_rows: list[TrainRow] = []
        if not args.skip_train:
            del state
            print()
            print(
                f"Example trainer, 2 gloo ranks, {args.epochs} epochs, checkpoint every 50 steps (default), "
                f"median of {args.repeat}"
            )
            header = ["mode", "train s", "vs none", "blocked in save s", "blocked share"]
            train_rows = bench_training(args.epochs, args.repeat, workdir)
            print(table(header, [t.cells() for t in train_rows]))
            print("train s = the training loop (periodic saves included, the final save not);")
            print("blocked = time the training loop spent inside save_checkpoint.")
        write_json(args.json, report_rows(rows, train_rows, stop_rows))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
