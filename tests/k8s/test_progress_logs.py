"""Progress records travel through pod logs: the Kubernetes backend reads them from every pod
(the task log's own stream stays node 0's), at most every few seconds, sync and async alike."""

from __future__ import annotations

import asyncio

import pytest

from airflow_torchrun.backends.kubernetes import backend as kubernetes
from airflow_torchrun.backends.kubernetes.backend import KubernetesBackend
from airflow_torchrun.contract.progress import ProgressRecord, parse_records

from .fake_api import FakeKubeAPI
from .test_backend import NS, running_group


def record(rank: int, step: int) -> str:
    return f"[node {rank} rank {rank}] " + ProgressRecord(rank=rank, step=step, time=1.0 + step).to_line()


def test_records_are_read_from_every_pod_and_only_once(
    fake_api: FakeKubeAPI, backend: KubernetesBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kubernetes, "PROGRESS_READ_EVERY", 0.0)
    handle, job_name = running_group(fake_api, backend)
    pods = [fake_api.pod(NS, job_name, n)["metadata"]["name"] for n in (0, 1)]
    fake_api.add_log(pods[0], "[node 0 rank 0] hello", record(0, 10))
    fake_api.add_log(pods[1], record(1, 10), "[node 1 rank 1] a line for people")
    backend.observe(handle)
    got = parse_records(backend.read_progress_lines(handle))
    assert sorted((r.rank, r.step) for r in got) == [(0, 10), (1, 10)]
    # The task log's stream is untouched by it: node 0's lines are all still new there.
    assert backend.read_new_log_lines(handle) == ["[node 0 rank 0] hello", record(0, 10)]
    fake_api.add_log(pods[1], record(1, 20))
    got = parse_records(asyncio.run(backend.read_progress_lines_async(handle)))
    assert [(r.rank, r.step) for r in got] == [(1, 20)]
    assert backend.read_progress_lines(handle) == []


def test_the_pods_logs_are_read_for_records_at_most_every_few_seconds(
    fake_api: FakeKubeAPI, backend: KubernetesBackend
) -> None:
    handle, job_name = running_group(fake_api, backend)
    fake_api.add_log(fake_api.pod(NS, job_name, 0)["metadata"]["name"], record(0, 5))
    backend.observe(handle)
    assert len(backend.read_progress_lines(handle)) == 1
    before = len(fake_api.calls)
    for _ in range(20):  # a watch looking ten times a second
        assert backend.read_progress_lines(handle) == []
    assert len(fake_api.calls) == before
