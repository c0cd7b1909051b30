"""``NewDataTrigger`` without a triggerer: the pure comparison, and its loop on a local prefix with a
state store that outlives the trigger (as the asset state store outlives a triggerer)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from airflow_torchrun.watchers import NewDataTrigger, Seen, compare


def test_the_first_look_reports_nothing_then_new_and_changed_objects_oldest_first() -> None:
    listing = {"a": (100.0, "e1"), "b": (200.0, "e2")}
    new, seen = compare(None, listing, settle=50)
    assert new == [] and seen == Seen(200.0, {"b": "e2"})
    new, seen = compare(seen, {**listing, "d": (260.0, "e4"), "c": (250.0, "e3")}, settle=50)
    assert new == ["c", "d"] and seen.watermark == 260.0
    new, seen = compare(seen, {"c": (250.0, "e3"), "d": (261.0, "e5")}, settle=50)
    assert new == ["d"]  # a new version under the same key
    assert compare(seen, {"c": (250.0, "e3"), "d": (261.0, "e5")}, settle=50)[0] == []


def test_an_object_older_than_the_newest_seen_counts_within_the_settle_window_only() -> None:
    seen = Seen(1000.0, {"x": "t"})
    # A multipart upload carries the time it began: older than what was seen, yet new.
    assert compare(seen, {"x": (1000.0, "t"), "late": (990.0, "t2")}, settle=60)[0] == ["late"]
    assert compare(seen, {"x": (1000.0, "t"), "ancient": (100.0, "t3")}, settle=60)[0] == []


class FakeStore:
    """The asset state store's two calls, kept across trigger instances."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}

    async def aget(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    async def aset(self, key: str, value: Any) -> None:
        self.data[key] = value


async def _events(trigger: NewDataTrigger, looks: int, between: Any = None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    gen = trigger.run()

    async def collect() -> None:
        async for event in gen:
            out.append(event.payload)

    task = asyncio.create_task(collect())
    for n in range(looks):
        await asyncio.sleep(trigger.poll_interval * 1.5)
        if between is not None:
            between(n)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return out


def test_a_trigger_started_again_resumes_from_the_store_and_fires_once_per_object(tmp_path: Path) -> None:
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    (incoming / "old.npz").write_bytes(b"old")
    store = FakeStore()

    def make() -> NewDataTrigger:
        trigger = NewDataTrigger(f"file://{incoming}", poll_interval=0.2)
        trigger.asset_state_store = store  # type: ignore[assignment]
        return trigger

    def land(n: int) -> None:
        if n == 1:
            (incoming / "new.npz").write_bytes(b"new")
            (incoming / ".partial.tmp").write_bytes(b"a writer's temporary file")

    first = asyncio.run(_events(make(), 4, land))
    assert [e["new"] for e in first] == [[f"file://{incoming / 'new.npz'}"]]
    assert first[0]["count"] == 1 and first[0]["uri"] == f"file://{incoming}"
    # Stopped and started again (a triggerer restart): nothing twice; what landed meanwhile, once.
    (incoming / "meanwhile.npz").write_bytes(b"x")
    os.utime(incoming / "meanwhile.npz")
    second = asyncio.run(_events(make(), 3))
    assert [e["new"] for e in second] == [[f"file://{incoming / 'meanwhile.npz'}"]]


def test_bad_arguments_fail_when_the_dag_is_parsed() -> None:
    with pytest.raises(ValueError, match="names the connection 'a' but aws_conn_id is 'b'"):
        NewDataTrigger("s3://a@bucket/x/", aws_conn_id="b")
    with pytest.raises(ValueError, match="poll_interval must be a positive number"):
        NewDataTrigger("s3://bucket/x/", poll_interval=0)
    with pytest.raises(ValueError, match="watches s3:// or file:// prefixes"):
        NewDataTrigger("gs://bucket/x/")
    classpath, kwargs = NewDataTrigger("s3://c@bucket/x/", poll_interval=5).serialize()
    assert classpath == "airflow_torchrun.watchers.NewDataTrigger"
    assert NewDataTrigger(**kwargs).serialize() == (classpath, kwargs)
