"""Reading a pod's log incrementally, pure: which lines of a timestamped log are new.

The log endpoint has no offsets. Each read asks for ``timestamps=true`` from ``sinceTime`` (the
second of the last line seen, the API's resolution) and drops what was already returned; lines
within one nanosecond timestamp are told apart by counting them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

_STAMP = re.compile(r"^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?(Z|[+-]\d{2}:\d{2}) ?(.*)$")

Stamp = tuple[int, int]  # (epoch seconds, nanoseconds)


def split_stamp(line: str) -> tuple[Stamp | None, str]:
    """``"2026-11-30T10:00:01.5Z text"`` -> ((1795..., 500000000), "text")."""
    m = _STAMP.match(line)
    if m is None:
        return None, line
    whole, frac, zone, text = m.groups()
    seconds = int(datetime.fromisoformat(f"{whole}{'+00:00' if zone == 'Z' else zone}").timestamp())
    nanos = int((frac or "0").ljust(9, "0"))
    return (seconds, nanos), text


@dataclass
class LogCursor:
    """Where one container's log was read up to."""

    last: Stamp | None = None
    seen_at_last: int = 0

    def since_time(self) -> str | None:
        """The ``sinceTime`` for the next read (whole seconds, RFC 3339)."""
        if self.last is None:
            return None
        return datetime.fromtimestamp(self.last[0], tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def feed(self, text: str) -> list[str]:
        """The lines of a timestamped log read that were not returned before, without stamps."""
        out: list[str] = []
        repeats: dict[Stamp, int] = {}
        for raw in text.splitlines():
            if not raw:
                continue
            stamp, line = split_stamp(raw)
            if stamp is None:  # not timestamped (should not happen with timestamps=true): keep it
                out.append(line)
                continue
            if self.last is not None and stamp < self.last:
                continue
            if stamp == self.last:
                repeats[stamp] = repeats.get(stamp, 0) + 1
                if repeats[stamp] <= self.seen_at_last:
                    continue
                self.seen_at_last += 1
            else:
                self.last, self.seen_at_last = stamp, 1
                repeats[stamp] = 1
            out.append(line)
        return out
