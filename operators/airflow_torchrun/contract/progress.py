"""The progress-record wire format: one line a rank prints, read back by the watch and the view.

::

    @torchrun-progress {"rank": 1, "step": 120, "total_steps": 460, "samples_per_s": 5120.0, ...}

Written by the ranks' helpers (:mod:`airflow_torchrun.worker.progress`), read by the Airflow side
(the watch, the trigger, the training view) from the ranks' logs, the one channel both backends
have. :func:`parse_records` reads them back from any text, robust to other output interleaved on
the same line, to lines cut short and to JSON nested too deep to decode. A line the launcher
prefixed ``[node N rank R]`` (torchrun's prefix, which a rank cannot write for another: it is put
before every line a rank prints) yields only rank R's records, so no rank can report for another.
Standard library only.

Besides the window's figures, a record may carry what the goodput ledger and the resume audit
need (:mod:`airflow_torchrun.goodput`, :mod:`airflow_torchrun.audit`):

- ``since``: when the window began (epoch seconds; the previous record's ``time``, or the start);
- ``data_s``, ``save_s``: seconds of the window spent waiting for data (``StepTimer``) and blocked
  in ``save_checkpoint``;
- ``losses``: ``[[step, "<hex float>"], ...]``, the loss of every step of the window, bit-exact
  (``float.hex``: the audit compares bits); at most :data:`MAX_LOSSES` per record (past that, only
  the steps on a coarser power-of-two grid, the same grid on every try);
- ``event``: a record that marks a moment rather than a window: ``"rendezvous"`` (the launcher saw
  ``init_process_group`` return; ``step`` 0) or ``"start"`` (the training loop starts after
  ``step``, the step resumed from, once data, model and checkpoint are loaded).

:func:`parse_bound_records` keeps only prefixed lines: what the goodput ledger and the audit read.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

MARKER = "@torchrun-progress "

# What a record's ``event`` may be (a moment, not a window of steps).
EVENT_RENDEZVOUS = "rendezvous"
EVENT_START = "start"
EVENTS = (EVENT_RENDEZVOUS, EVENT_START)

# Losses one record carries at most; a window of more steps keeps a power-of-two grid of them.
MAX_LOSSES = 256

INTERVAL_ENV = "AIRFLOW_TORCHRUN_PROGRESS_INTERVAL"

DEFAULT_INTERVAL = 2.0

_DECODER = json.JSONDecoder()
# The launcher's prefix of every line a rank prints (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE).
_RANK_PREFIX = re.compile(r"^\[node (\d+) rank (\d+)\] ")


@dataclass(frozen=True)
class ProgressRecord:
    """One rank's progress over the last window of steps."""

    rank: int
    step: int
    time: float  # epoch seconds, when it was written
    total_steps: int | None = None
    samples_per_s: float | None = None  # the group's samples per second as this rank sees it
    step_time: float | None = None  # mean seconds per step over the window (wall time)
    own_time: float | None = None  # the same without waiting for peers (``StepTimer.peers()``)
    data_wait: float | None = None  # fraction of the window's step time spent waiting for data
    loss: float | None = None
    since: float | None = None  # epoch seconds, when the window began
    data_s: float | None = None  # seconds of the window spent waiting for data
    save_s: float | None = None  # seconds of the window spent blocked in save_checkpoint
    losses: tuple[tuple[int, str], ...] = field(default=())  # (step, loss as float.hex()), in step order
    event: str | None = None  # EVENT_RENDEZVOUS / EVENT_START: a moment, not a window

    def to_line(self) -> str:
        data = {k: v for k, v in asdict(self).items() if v is not None and v != ()}
        if self.losses:
            data["losses"] = [list(pair) for pair in self.losses]
        return MARKER + json.dumps(data, separators=(",", ":"), allow_nan=False)

    @property
    def window(self) -> bool:
        """A window of steps (not an event)."""
        return self.event is None

    @classmethod
    def from_dict(cls, data: object) -> ProgressRecord | None:
        """A record from decoded JSON, or ``None`` when it is not one (never raises)."""
        if not isinstance(data, dict):
            return None
        try:
            rank, step, stamp = data["rank"], data["step"], data["time"]
            if not (_is_int(rank) and _is_int(step) and _is_number(stamp)) or rank < 0 or step < 0:
                return None
            names = ("samples_per_s", "step_time", "own_time", "data_wait", "loss", "since", "data_s", "save_s")
            numbers = {name: data.get(name) for name in names}
            fields = {
                name: float(v) if isinstance(v, int | float) and _is_number(v) else None for name, v in numbers.items()
            }
            total = data.get("total_steps")
            event = data.get("event")
            return cls(
                rank=int(rank),
                step=int(step),
                time=float(stamp),
                total_steps=total if isinstance(total, int) and _is_int(total) and total > 0 else None,
                losses=_losses(data.get("losses")),
                event=event if event in EVENTS else None,
                **fields,
            )
        except (KeyError, TypeError, ValueError):
            return None


def _losses(raw: object) -> tuple[tuple[int, str], ...]:
    """``[[step, hex], ...]`` as read; pairs that are not a step and a hex float are dropped."""
    if not isinstance(raw, list):
        return ()
    out = []
    for pair in raw[: 4 * MAX_LOSSES]:
        ok = isinstance(pair, list) and len(pair) == 2 and _is_int(pair[0]) and isinstance(pair[1], str)
        if ok and hex_to_float(pair[1]) is not None:
            out.append((int(pair[0]), pair[1]))
    return tuple(out)


def float_to_hex(value: float) -> str:
    """``value`` bit-exact and short: ``float.hex`` without the mantissa's trailing zeros
    (``0x1.3c8a6ep-2``); ``float.fromhex`` reads it back."""
    text = float(value).hex()
    mantissa, _, exponent = text.partition("p")
    if "." in mantissa:
        mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}p{exponent}" if exponent else mantissa


def hex_to_float(text: str) -> float | None:
    """Inverse of :func:`float_to_hex`; None for anything that is not a finite hex float."""
    try:
        value = float.fromhex(text)
    except (ValueError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def thin_losses(losses: Sequence[tuple[int, str]], cap: int = MAX_LOSSES) -> tuple[tuple[int, str], ...]:
    """At most ``cap`` of ``losses``: all of them, or those whose step is a multiple of the smallest
    power of two that fits. The grid depends on the step alone, so two tries keep the same steps."""
    kept = list(losses)
    stride = 1
    while len(kept) > cap:
        stride *= 2
        kept = [pair for pair in kept if pair[0] % stride == 0]
    return tuple(kept)


def records_enabled(raw: str | None) -> bool:
    """Whether ``AIRFLOW_TORCHRUN_PROGRESS_INTERVAL`` (``raw``) leaves records on (``0`` turns them off)."""
    if not raw:
        return True
    try:
        return float(raw) > 0
    except ValueError:
        return True


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def parse_line(line: str) -> list[ProgressRecord]:
    """Every record in one line of text. Other output before, between or after records (two
    ranks' writes interleaved on one line) is ignored, as is a record cut short or nested too deep.
    On a line prefixed ``[node N rank R]``, a record that names another rank than R is a forgery
    and is dropped."""
    out: list[ProgressRecord] = []
    prefixed = _RANK_PREFIX.match(line)
    owner = int(prefixed.group(2)) if prefixed else None
    start = line.find(MARKER)
    while start >= 0:
        at = start + len(MARKER)
        try:
            data, _end = _DECODER.raw_decode(line, at)
        except (ValueError, RecursionError):  # cut short, or '[[[[...' deep enough to exhaust the stack
            data = None
        record = ProgressRecord.from_dict(data)
        if record is not None and (owner is None or record.rank == owner):
            out.append(record)
        start = line.find(MARKER, at)
    return out


def parse_records(lines: Iterable[str]) -> list[ProgressRecord]:
    """Every record in ``lines``, in order."""
    return [record for line in lines for record in parse_line(line)]


def parse_bound_records(lines: Iterable[str]) -> list[ProgressRecord]:
    """The records of ``lines`` that the rank named by the line's torchrun prefix wrote about itself:
    a line without the prefix, or a record of another rank than the prefix's, is dropped. What the
    goodput ledger and the resume audit read, so that no rank speaks for another."""
    out: list[ProgressRecord] = []
    for line in lines:
        prefix = _RANK_PREFIX.match(line)
        if prefix is None:
            continue
        rank = int(prefix.group(2))
        out += [record for record in parse_line(line[prefix.end() :]) if record.rank == rank]
    return out


class RecordStream:
    """Records from text that arrives in chunks (a log read while it is written): a line is
    parsed only once its newline came, so a record split across two reads is read whole."""

    def __init__(self) -> None:
        self._rest = ""

    def feed(self, chunk: str) -> list[ProgressRecord]:
        data = self._rest + chunk
        *lines, self._rest = data.split("\n")
        return parse_records(lines)
