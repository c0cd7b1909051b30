"""Checkpoint benchmark: save/load throughput against a raw copy of the same bytes (ours with
the checksums written and verified), the cost of the save on SIGTERM against a raw write of the same
bytes (on the disk, and on a tmpfs where no disk sets the pace: :data:`MEMORY`), and the
training-time overhead of checkpointing in the example trainer.

Each I/O row, and the save on SIGTERM, is paired: one of ours and one raw, alternating which goes
first, repeated until the 95% interval of ours' throughput as a fraction of raw's (a geometric mean)
is within about +/-5%, or a cap of pairs or seconds is reached (:data:`IO_RULES`, :data:`STOP_RULE`).
The goal is 0.9 of raw. A write's clock holds what the save holds the training for: the removal of
the step retention pruned (ours: on the saver's background thread) and of raw's previous copy (before
its clock) are outside both. The disk of a virtual machine is noisy (a raw write of 168 MB took 0.08 s to
0.5 s within one run here, of 1 GB 0.56 s to 2.2 s): medians of three could not tell 0.5 from 1.

Run standalone (about 5 minutes on 2 cores)::

    .venv/bin/python bench/bench_checkpoint.py [--size-mb 160] [--repeat 3] [--max-pairs N] [--skip-s3]
        [--skip-train] [--stop-sizes-mb 100,1000] [--skip-memory] [--json rows.json]

S3 is moto's server on localhost (started here, in a process of its own), reached through s3fs over
HTTP: compare S3 numbers with the raw PUT/GET of the same endpoint, not with the disk.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import logging
import math
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
from typing import Any

import torch
from rows import Samples, row, write_json
from stats import Interval, RepeatRule, mean_interval

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
    stopped: str = ""  # why the pairs stopped (RepeatRule.stopped_by)

    @property
    def fraction(self) -> Interval | None:
        return fraction_of_raw(self.ours_all, self.raw_all)

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
            shown(self.fraction),
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


def _settle() -> None:
    """Let the file system finish what the last run left (its deleted blocks are discarded at the
    next journal commit on a disk mounted with ``discard``): the next run, ours or raw, starts clean."""
    os.sync()


def settled(fn: Callable[[], object]) -> float:
    """``fn`` timed once the file system finished what the run before left (:func:`_settle`)."""
    _settle()
    return timed(fn)


IO_GOAL = 0.9  # of raw's throughput, for writes and reads on both stores and the save on SIGTERM (issue 26)
# Pairs per I/O row: at least --repeat, then until the 95% interval of ours / raw is within about
# +/-5% (0.05 on the log scale), or the cap, or the budget. A save or load of 168 MB takes 0.1-0.5 s
# on disk and 1-3 s through moto; a save on SIGTERM of 1 GB, with its process, 5-10 s a pair. The
# disk's own spread (a write of 168 MB took 0.2 to 0.4 s in one run) needed more than 30 pairs for
# +/-5%: 60 pairs, or two minutes, whichever comes first.
_LOG = "on the log scale"
IO_RULES = {
    "file": RepeatRule(half_width=0.05, cap=60, budget_s=120, unit=_LOG),
    "s3 (moto)": RepeatRule(half_width=0.05, cap=12, budget_s=120, unit=_LOG),
}
STOP_RULE = RepeatRule(half_width=0.05, cap=15, budget_s=150, unit=_LOG)
# The save on SIGTERM is also measured on a memory file system, where the disk does not set the pace:
# what the save itself costs (1 GB: ours about 0.5 s here, as a raw write, where this disk's raw write of
# the same bytes took 1.2 s to 2.7 s on different hours). Only the largest size; skipped where no tmpfs has
# room for it.
MEMORY = "tmpfs"
MEMORY_ROOT = Path("/dev/shm")


def memory_root(size_mb: int, where: Path = MEMORY_ROOT) -> Path | None:
    """A fresh directory on the tmpfs mounted at ``where`` (or where it links to) with room for ours and
    raw's copy of ``size_mb`` and one more as a margin, or None."""
    mount = os.path.realpath(where)
    try:
        with open("/proc/self/mounts") as mounts:
            tmpfs = any(line.split()[1:3] == [mount, "tmpfs"] for line in mounts)
        free = shutil.disk_usage(where).free
    except OSError:
        return None
    if not tmpfs or free < 3 * size_mb * 1_000_000:
        return None
    return Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=mount))


def log_fractions(ours_t: list[float], raw_t: list[float]) -> list[float]:
    """Per pair, ours' throughput as a fraction of raw's (raw seconds / ours seconds), as its log."""
    return [math.log(r / o) for o, r in zip(ours_t, raw_t, strict=False) if o > 0 and r > 0]


def fraction_of_raw(ours_t: list[float], raw_t: list[float]) -> Interval | None:
    """Ours' throughput as a fraction of raw's over the pairs: the geometric mean of raw s / ours s,
    with its 95% interval. A ratio is averaged on the log scale, where one slow moment of the disk
    weighs the same on either side (the arithmetic mean of ratios is pulled up by ours' lucky pairs)."""
    logs = log_fractions(ours_t, raw_t)
    if not logs:
        return None
    i = mean_interval(logs)
    return Interval(
        math.exp(i.mean),
        i.n,
        None if i.low is None else math.exp(i.low),
        None if i.high is None else math.exp(i.high),
    )


def shown(f: Interval | None) -> str:
    """A fraction of raw with its interval, for the printed tables."""
    if f is None:
        return "-"
    if f.low is None or f.high is None:
        return f"{f.mean:.2f} (n={f.n})"
    return f"{f.mean:.2f} (95%: {f.low:.2f} to {f.high:.2f}, n={f.n})"


def paired(
    ours: Callable[[], float], raw: Callable[[], float], rule: RepeatRule
) -> tuple[list[float], list[float], str]:
    """Seconds of each side (each call returns its own), one pair at a time, alternating which goes
    first, while ``rule`` wants more pairs; and why they stopped."""
    ours_t: list[float] = []
    raw_t: list[float] = []
    started = time.perf_counter()
    while rule.more(log_fractions(ours_t, raw_t), time.perf_counter() - started):
        for side in ("ours", "raw") if len(ours_t) % 2 == 0 else ("raw", "ours"):
            (ours_t if side == "ours" else raw_t).append(ours() if side == "ours" else raw())
    return ours_t, raw_t, rule.stopped_by(log_fractions(ours_t, raw_t), time.perf_counter() - started)


def progress(what: str) -> None:
    print(f"  [bench:checkpoint] {what}", flush=True)


def make_state(size_mb: int) -> dict[str, object]:
    """A model-like state dict: float32 matrices of 4 MiB each, plus a few small entries."""
    generator = torch.Generator().manual_seed(0)
    count = max(1, round(size_mb / 4))
    layers = {f"layers.{i}.weight": torch.randn(1024, 1024, generator=generator) for i in range(count)}
    return {"model": layers, "step": 1, "lr": 1e-3}


def bench_io(backend: str, root_uri: str, state: dict[str, object], rule: RepeatRule) -> list[Row]:
    from airflow_torchrun.storage.checkpoints import CheckpointStore
    from airflow_torchrun.worker import load_checkpoint, save_checkpoint, wait_for_checkpoint

    store = CheckpointStore(root_uri)
    fs = store.fs
    buffer = io.BytesIO()
    torch.save(state, buffer)
    blob = buffer.getvalue()
    size_mb = len(blob) / 1e6
    raw_copies = (f"{store.location.path}/raw-copy-{n}.bin" for n in range(1, 10_000))
    raw_path = [next(raw_copies)]

    def raw_write() -> float:
        """The same bytes to a new name, as durably as save_checkpoint locally: write, fsync, rename
        and fsync of the directory, which makes the new name durable (as the save on SIGTERM's raw
        write does; ours fsyncs its step directory once its marker is in); the previous copy is
        removed before the clock starts, as ours removes the step its retention pruned after the save
        returns (deleting 168 MB frees its page cache: about 0.1 s here)."""
        previous, raw_path[0] = raw_path[0], next(raw_copies)
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(previous)
        if backend != "file":
            return settled(lambda: fs.pipe_file(raw_path[0], blob))
        os.makedirs(store.location.path, exist_ok=True)

        def write() -> None:
            tmp = raw_path[0] + ".tmp"
            with open(tmp, "wb") as fp:
                fp.write(blob)
                fp.flush()
                os.fsync(fp.fileno())
            os.replace(tmp, raw_path[0])
            folder = os.open(store.location.path, os.O_RDONLY)
            try:
                os.fsync(folder)
            finally:
                os.close(folder)

        return settled(write)

    def raw_read() -> float:
        if backend == "file":
            return settled(lambda: Path(raw_path[0]).read_bytes())
        return settled(lambda: fs.cat_file(raw_path[0]))

    steps = iter(range(1, 10_000))
    last_uri: list[str] = []

    def ours_write() -> float:
        """What the save holds the training for; then, outside the clock, the removal of the step its
        retention pruned (the background thread's), so that nothing of it overlaps the next write."""

        def save() -> None:
            last_uri[:] = [save_checkpoint(state, next(steps), uri=root_uri, keep_last=1)]

        seconds = settled(save)
        wait_for_checkpoint()
        return seconds

    def ours_read() -> float:
        """The load, and a touch of every page of the state it gives (a mapped load pays its page faults
        at first use; raw's read has put every byte in memory)."""

        def load() -> None:
            loaded = load_checkpoint(uri=last_uri[0])
            for tensor in (loaded or {})["model"].values():
                tensor.view(-1).view(torch.uint8)[::4096].sum()

        return settled(load)

    # One unmeasured round each, so that connection set-up and first allocations are not timed.
    raw_write()
    ours_write()
    med = statistics.median
    rows = []
    for op, ours_fn, raw_fn in (("write", ours_write, raw_write), ("read", ours_read, raw_read)):
        ours_t, raw_t, stopped = paired(ours_fn, raw_fn, rule)
        r = Row(backend, op, size_mb, med(ours_t), med(raw_t), ours_t, raw_t, stopped)
        rows.append(r)
        progress(f"{backend} {op} {size_mb:.0f} MB: ours {med(ours_t):.2f} s, raw {med(raw_t):.2f} s")
        progress(f"{backend} {op}: ours / raw throughput {shown(r.fraction)}; {stopped}")
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


# The raw anchor of the save on SIGTERM: the same tensors' bytes written and made durable by a process
# like ours, the disk's best way for the size: buffered below streams.DIRECT_BYTES (the page cache
# takes them at memory speed), O_DIRECT from there (as `dd oflag=direct bs=16M`: past a few hundred
# MB a buffered write is held back by the kernel's dirty-page throttle, 1 GB in up to 3 s here).
RAW_CHILD = """
import ctypes, errno, json, mmap, os, sys, time
import torch
from airflow_torchrun.worker.checkpoint.streams import DIRECT_BYTES
count = max(1, round(int(sys.argv[2]) / 4))
tensors = [torch.randn(1024, 1024) for _ in range(count)]
path = sys.argv[1]
total = sum(t.numel() * t.element_size() for t in tensors)
direct = total >= DIRECT_BYTES
chunk = mmap.mmap(-1, 16 << 20) if direct else None
started = time.time()
try:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0), 0o644)
except OSError as exc:  # a file system without O_DIRECT (tmpfs before Linux 6.6): the same buffers, buffered
    if not direct or exc.errno != errno.EINVAL:
        raise
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # the refused open may have made it
fill = 0
for t in tensors:
    n = t.numel() * t.element_size()
    view = memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
    while view.nbytes:
        if chunk is None:
            view = view[os.write(fd, view):]
            continue
        take = min(len(chunk) - fill, view.nbytes)
        chunk[fill:fill + take] = view[:take]
        fill, view = fill + take, view[take:]
        if fill == len(chunk):
            os.write(fd, chunk)
            fill = 0
if chunk is not None and fill:
    chunk[fill:] = bytes(len(chunk) - fill)
    os.write(fd, memoryview(chunk)[:-(-fill // 4096) * 4096])
    os.ftruncate(fd, total)
os.fsync(fd)
os.close(fd)
folder = os.open(os.path.dirname(path), os.O_RDONLY)
os.fsync(folder)
os.close(folder)
print(json.dumps({"seconds": time.time() - started, "bytes": os.path.getsize(path), "direct": direct}), flush=True)
"""


@dataclass
class StopRow:
    requested_mb: int  # the state's size asked for
    size_mb: float  # what the checkpoint holds
    ours_all: list[float]  # signal -> committed marker, each repeat
    raw_all: list[float]  # the raw write of the same bytes, each repeat
    stopped: str = ""  # why the pairs stopped (RepeatRule.stopped_by)
    medium: str = "disk"  # or MEMORY: where root was (a tmpfs, so no disk sets the pace)

    @property
    def seconds(self) -> float:
        return statistics.median(self.ours_all)

    @property
    def where(self) -> str:
        return "file://" if self.medium == "disk" else f"file:// on {self.medium}"

    @property
    def fraction(self) -> Interval | None:
        return fraction_of_raw(self.ours_all, self.raw_all)


def bench_stop(root: Path, sizes_mb: list[int], rule: RepeatRule, medium: str = "disk") -> list[StopRow]:
    """Seconds from SIGTERM to the committed checkpoint of the next step boundary (one process),
    paired with a raw write of the same bytes by a process like it, under ``root`` (on ``medium``)."""
    import json

    from airflow_torchrun.contract import STOPPED_TO_SAVE_EXIT_CODE
    from airflow_torchrun.storage.checkpoints import CheckpointStore

    written: list[float] = []

    def child(code: str, target: str, size: int, expected: int, **env: str) -> dict[str, Any]:
        """Run ``code`` in a fresh process (after the disk settled); its last line of JSON."""
        _settle()
        proc = subprocess.run(
            [sys.executable, "-c", code, target, str(size)],
            env={**os.environ, "OMP_NUM_THREADS": "1", **env},
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if proc.returncode != expected:
            raise RuntimeError(f"the child exited {proc.returncode} (expected {expected}): {proc.stderr[-2000:]}")
        return dict(json.loads(proc.stdout.strip().splitlines()[-1]))

    def ours(size: int) -> float:
        uri = f"file://{root}/stop-{uuid.uuid4().hex[:8]}"
        signalled = child(STOP_CHILD, uri, size, STOPPED_TO_SAVE_EXIT_CODE, TRAIN_CHECKPOINT_URI=uri)["signalled"]
        store = CheckpointStore(uri)
        marker = store.read_marker(1)
        shutil.rmtree(store.location.path, ignore_errors=True)
        written.append(marker["total_bytes"] / 1e6)
        return float(marker["committed_at"]) - signalled

    def raw(size: int) -> float:
        path = root / f"raw-{uuid.uuid4().hex[:8]}.bin"
        seconds = child(RAW_CHILD, str(path), size, 0)["seconds"]
        path.unlink()
        return float(seconds)

    rows = []
    for size in sizes_mb:
        ours_all, raw_all, stopped = paired(functools.partial(ours, size), functools.partial(raw, size), rule)
        r = StopRow(size, written[-1], ours_all, raw_all, stopped, medium)
        rows.append(r)
        progress(
            f"save on SIGTERM, {r.where}, {r.size_mb:.0f} MB: ours {r.seconds:.2f} s, "
            f"raw {statistics.median(raw_all):.2f} s; "
            f"ours / raw throughput {shown(r.fraction)}"
        )
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
    logs = tempfile.mkdtemp(prefix="torchrun-logs-")  # without --log-dir torchrun leaves one in /tmp
    try:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        proc = subprocess.run(
            [*launcher, f"--log-dir={logs}", str(TRAINER), *args],
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
        shutil.rmtree(logs, ignore_errors=True)
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


def fraction_row(measure: str, r: Row | StopRow) -> dict[str, object]:
    """The paired row of ``r``: ours' throughput as a fraction of raw's (geometric mean, 95% interval)
    against the goal of :data:`IO_GOAL`."""
    f = r.fraction
    return row(
        f"{measure}: ours / raw throughput (paired; geometric mean)",
        f.mean if f is not None else Samples([], 0),
        "goal",
        IO_GOAL,
        "x raw",
        repeats=f.n if f is not None else 0,
        interval=(f.low, f.high) if f is not None and f.low is not None else None,
        note=r.stopped,
    )


def report_rows(
    io_rows: list[Row], train_rows: list[TrainRow], stop_rows: list[StopRow] | None = None
) -> list[dict[str, object]]:
    from airflow_torchrun.worker.checkpoint.streams import DIRECT_BYTES

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
    rows += [fraction_row(f"checkpoint {r.op} (verified), {r.backend}, {r.size_mb:.0f} MB", r) for r in io_rows]
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
        row(
            f"save on SIGTERM, {r.where}, {r.requested_mb} MB state ({r.size_mb:.0f} MB written): signal to committed",
            Samples(r.ours_all),
            f"raw write of the same bytes (fsync; O_DIRECT from {DIRECT_BYTES >> 20} MiB, as dd oflag=direct), "
            "a process like ours",
            Samples(r.raw_all),
            "s",
        )
        for r in stop_rows or []
    ]
    rows += [fraction_row(f"save on SIGTERM, {r.where}, {r.requested_mb} MB state", r) for r in stop_rows or []]
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
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="measurements per number (the median is shown); for the I/O rows, the fewest pairs",
    )
    parser.add_argument(
        "--max-pairs",
        type=int,
        default=None,
        help="the most pairs per paired row (default: 60 on disk, 12 on S3, 15 for the save on SIGTERM; fewer "
        "when the interval is narrow sooner)",
    )
    parser.add_argument("--epochs", type=int, default=30, help="trainer epochs for the overhead runs (default 30)")
    parser.add_argument("--skip-s3", action="store_true", help="no S3 (moto) measurements")
    parser.add_argument("--skip-train", action="store_true", help="no training-overhead measurements")
    parser.add_argument(
        "--stop-sizes-mb",
        default=None,
        help="state sizes for the save-on-SIGTERM cost, e.g. 100,1000 (the default; --size-mb below 100: that size)",
    )
    parser.add_argument(
        "--skip-memory",
        action="store_true",
        help=f"no save on SIGTERM on a {MEMORY} (by default also measured at {MEMORY_ROOT}, the largest size)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the report rows (bench/rows.py) to PATH")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    workdir = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    try:
        state = make_state(args.size_mb)
        rules = {
            backend: dataclasses.replace(rule, minimum=args.repeat, cap=max(args.repeat, args.max_pairs or rule.cap))
            for backend, rule in IO_RULES.items()
        }
        rows = bench_io("file", f"file://{workdir}/ckpt", state, rules["file"])
        if not args.skip_s3:
            server, _ = start_moto()
            import boto3

            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            boto3.client("s3").create_bucket(Bucket=bucket)
            try:
                rows += bench_io("s3 (moto)", f"s3://{bucket}/ckpt", state, rules["s3 (moto)"])
            finally:
                server.kill()
                server.wait()
        print()
        print("Checkpoint I/O, single process, medians of the pairs (MB = 1e6 bytes)")
        header = ["backend", "op", "MB", "ours s", "ours MB/s", "raw s", "raw MB/s", "ours/raw", "paired ours/raw"]
        print(table(header, [r.cells() for r in rows]))
        print("ours = save_checkpoint/load_checkpoint (torch.save/load, CRC-32 of every byte written and")
        print("verified on load, commit marker); raw = the same bytes written to a new name (fsync, rename and")
        print("the directory's fsync on disk) or read. Neither clock holds the removal of the previous copy: raw's")
        print("is done before its clock starts, ours (the step retention pruned) on the saver's background thread")
        print("after the save returns.")
        print("Ours' read touches every page of the state it loaded (a mapped load pays its faults at first use).")
        stop_rows: list[StopRow] = []
        spec = args.stop_sizes_mb if args.stop_sizes_mb is not None else ("100,1000" if args.size_mb >= 100 else "")
        sizes = [int(x) for x in spec.split(",") if x.strip()] or [args.size_mb]
        if sizes:
            cap = max(args.repeat, args.max_pairs or STOP_RULE.cap)
            rule = dataclasses.replace(STOP_RULE, minimum=args.repeat, cap=cap)
            stop_rows = bench_stop(workdir, sizes, rule)
            memory = None if args.skip_memory else memory_root(max(sizes))
            if memory is None:
                print(f"save on SIGTERM on {MEMORY}: not run (--skip-memory, or no tmpfs at {MEMORY_ROOT} with room)")
            else:
                try:
                    stop_rows += bench_stop(memory, [max(sizes)], rule, MEMORY)
                except RuntimeError as exc:  # a child failed there: the disk's rows stand, this one is not run
                    print(f"save on SIGTERM on {MEMORY}: not run: {exc}")
                finally:
                    shutil.rmtree(memory, ignore_errors=True)
            print()
            print("Save on SIGTERM (save_if_stopping), file://, one process, medians of the pairs")
            print(
                table(
                    ["on", "MB", "signal -> committed s", "raw write s"],
                    [
                        [r.medium, f"{r.size_mb:.0f}", f"{r.seconds:.2f}", f"{statistics.median(r.raw_all):.2f}"]
                        for r in stop_rows
                    ],
                )
            )
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
