"""``NewDataTrigger``: an asset watcher's trigger that fires when new data lands under a prefix.

Put it in an ``AssetWatcher`` of the asset a retraining DAG is scheduled on::

    data = Asset("digits-incoming", uri="s3://ml-data/digits/", watchers=[
        AssetWatcher(name="digits-incoming", trigger=NewDataTrigger("s3://aws_data@ml-data/digits/")),
    ])
    with DAG("retrain", schedule=[data], ...): ...

It lists the prefix every ``poll_interval`` seconds (``s3://[conn_id@]bucket/prefix`` through the
Amazon provider's async client, the connection from the URI or ``aws_conn_id``; ``file://`` or a
local path through the file system) and fires one event per look that found something new: an
object that was not there, or one that changed (another ETag or size and modification time: a new
version of a manifest under the same key counts). The event's payload, which becomes the asset
event's ``extra`` (under ``payload``), names the new objects, oldest first (up to :data:`MAX_KEYS`:
the newest are kept), and their count.

**De-duplication.** What was seen is kept in Airflow's asset state store (Airflow 3.3's store of
the watched asset, in the metadata database), not in the triggerer's memory: a restarted triggerer,
or another one taking the trigger over, reads it back and does not fire again for data it already
reported. Its first look ever records what is there without firing: only data that lands after the
watcher started retrains. The state is a watermark (the newest modification time seen) plus the
objects modified within ``settle`` seconds of it (default an hour), so an object whose modification
time is older than the newest one seen (an S3 multipart upload carries the time it started, a copy
keeps its source's) is still caught when it arrives within that window; one older than that is
taken as old data. The state is saved right after the event is handed to the triggerer: a triggerer
killed in that instant reports the same objects again on restart (at least once, never lost).
Without an asset state store (a trigger run outside an asset watcher) it keeps the state in memory
and says so in its log.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from airflow.triggers.base import BaseEventTrigger, TriggerEvent

from airflow_torchrun.naming import short_hash
from airflow_torchrun.storage.uri import split_conn_id

#: Keys named in one event's payload (the count says how many there were).
MAX_KEYS = 100
DEFAULT_POLL_INTERVAL = 60.0
DEFAULT_SETTLE = 3600.0
STATE_KEY_PREFIX = "torchrun.new_data:"


@dataclass(frozen=True)
class Seen:
    """What the watcher has seen: the newest modification time, and each recent object's tag."""

    watermark: float
    recent: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return {"watermark": self.watermark, "recent": dict(self.recent)}

    @classmethod
    def from_json(cls, data: object) -> Seen | None:
        if not isinstance(data, Mapping):
            return None
        mark, recent = data.get("watermark"), data.get("recent")
        if not isinstance(mark, int | float) or isinstance(mark, bool) or not isinstance(recent, Mapping):
            return None
        return cls(float(mark), {str(k): str(v) for k, v in recent.items()})


def compare(seen: Seen | None, listing: Mapping[str, tuple[float, str]], settle: float) -> tuple[list[str], Seen]:
    """``(new keys, oldest first; what is seen now)`` for a listing of ``key -> (modified, tag)``. Pure.

    ``seen`` None (the first look ever): nothing is new, everything is recorded.
    """
    newest = max([m for m, _ in listing.values()], default=seen.watermark if seen else 0.0)
    mark = max(newest, seen.watermark) if seen else newest
    recent = {key: tag for key, (modified, tag) in listing.items() if modified >= mark - settle}
    if seen is None:
        return [], Seen(mark, recent)
    # Oldest first, so the last one named is the newest (what a retraining most likely wants).
    new = sorted(
        (
            key
            for key, (modified, tag) in listing.items()
            if modified >= seen.watermark - settle and seen.recent.get(key) != tag
        ),
        key=lambda k: (listing[k][0], k),
    )
    return new, Seen(mark, recent)


class NewDataTrigger(BaseEventTrigger):
    """Fire when objects land or change under ``uri`` (see the module's docstring for de-duplication).

    :param uri: ``s3://[conn_id@]bucket/prefix`` or ``file:///dir`` (a local path works too). A
        prefix is matched as S3 matches it: ``s3://b/data/`` is everything under ``data/``,
        ``s3://b/data/manifest.json`` that one object (its new versions).
    :param poll_interval: Seconds between two looks (default 60).
    :param aws_conn_id: The AWS connection when the URI names none; default: the worker's AWS chain.
    :param settle: Seconds before the newest modification time seen within which an object that was
        not seen still counts as new (default 3600).
    """

    def __init__(
        self,
        uri: str,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        aws_conn_id: str | None = None,
        settle: float = DEFAULT_SETTLE,
    ) -> None:
        super().__init__()
        conn, plain = split_conn_id(uri)
        if conn and aws_conn_id and conn != aws_conn_id:
            raise ValueError(f"{uri!r} names the connection {conn!r} but aws_conn_id is {aws_conn_id!r}; give one")
        if not isinstance(poll_interval, int | float) or poll_interval <= 0:
            raise ValueError(f"poll_interval must be a positive number of seconds, got {poll_interval!r}")
        if not plain.startswith(("s3://", "file://", "/")):
            raise ValueError(f"NewDataTrigger watches s3:// or file:// prefixes, got {uri!r}")
        self.uri = uri
        self.poll_interval = float(poll_interval)
        self.aws_conn_id = aws_conn_id
        self.settle = float(settle)
        self._conn_id = conn or aws_conn_id
        self._plain = plain
        self._memory: Seen | None = None
        self._hook: Any = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "uri": self.uri,
                "poll_interval": self.poll_interval,
                "aws_conn_id": self.aws_conn_id,
                "settle": self.settle,
            },
        )

    @property
    def state_key(self) -> str:
        """The state's key in the asset's store: one per watched prefix (two watchers of one asset differ)."""
        return STATE_KEY_PREFIX + short_hash(self._plain)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        seen = await self._load()
        self.log.info(
            "Watching %s every %gs for new data (%s)",
            self.uri,
            self.poll_interval,
            "first look: what is there now is recorded, not reported" if seen is None else "resuming from its state",
        )
        while True:
            try:
                listing = await self._list()
            except Exception as exc:  # the store away for a while: keep watching, never fire on an error
                self.log.warning("Could not list %s (%s); looking again in %gs", self.uri, exc, self.poll_interval)
                await asyncio.sleep(self.poll_interval)
                continue
            new, now_seen = compare(seen, listing, self.settle)
            if seen is None:
                self.log.info("%s holds %d object(s) now; only data landing later is reported", self.uri, len(listing))
            if new:
                self.log.info("New data under %s: %d object(s), e.g. %s", self.uri, len(new), ", ".join(new[:3]))
                # At least once: a triggerer killed before the state below is saved reports these again.
                yield TriggerEvent(
                    {
                        "uri": self._plain,
                        "new": [self._object_uri(k) for k in new[-MAX_KEYS:]],
                        "count": len(new),
                        "watermark": now_seen.watermark,
                    }
                )
            if new or seen is None or now_seen != seen:
                await self._save(now_seen)
            seen = now_seen
            await asyncio.sleep(self.poll_interval)

    # -- state --------------------------------------------------------------------------------
    async def _load(self) -> Seen | None:
        store = self.asset_state_store
        if store is None:
            self.log.warning("No asset state store (not run by an asset watcher): what was seen is kept in memory only")
            return self._memory
        return Seen.from_json(await store.aget(self.state_key, default=None))

    async def _save(self, seen: Seen) -> None:
        store = self.asset_state_store
        if store is None:
            self._memory = seen
            return
        await store.aset(self.state_key, seen.to_json())

    # -- listing ------------------------------------------------------------------------------
    def _object_uri(self, key: str) -> str:
        if self._plain.startswith("s3://"):
            bucket = self._plain[len("s3://") :].split("/", 1)[0]
            return f"s3://{bucket}/{key}"
        return f"file://{key}"

    async def _list(self) -> dict[str, tuple[float, str]]:
        if self._plain.startswith("s3://"):
            return await self._list_s3()
        return await asyncio.to_thread(_list_files, self._plain)

    async def _list_s3(self) -> dict[str, tuple[float, str]]:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        bucket, _, prefix = self._plain[len("s3://") :].partition("/")
        if self._hook is None:  # once: the connection is read once per trigger, not per look
            self._hook = S3Hook(aws_conn_id=self._conn_id)
        hook = self._hook
        out: dict[str, tuple[float, str]] = {}
        async with await hook.get_async_conn() as client:
            paginator = client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    modified = obj["LastModified"].timestamp()
                    out[str(obj["Key"])] = (modified, f"{obj.get('ETag', '')}:{obj.get('Size', '')}")
        return out


def _list_files(uri: str) -> dict[str, tuple[float, str]]:
    """Every file under a local directory (or the one file), ``path -> (mtime, size:mtime_ns)``.
    Files whose name starts with a dot are skipped: writers' temporary files (``.x.tmp``) until renamed."""
    root = uri[len("file://") :] if uri.startswith("file://") else uri
    out: dict[str, tuple[float, str]] = {}
    if os.path.isfile(root):
        st = os.stat(root)
        return {root: (st.st_mtime, f"{st.st_size}:{st.st_mtime_ns}")}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if name.startswith("."):
                continue
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:  # removed between the listing and now
                continue
            out[path] = (st.st_mtime, f"{st.st_size}:{st.st_mtime_ns}")
    return out
