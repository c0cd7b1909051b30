"""Thin sync and async executors of the backend's request descriptions, through the provider's hooks.

A *flow* is a generator that yields :class:`~airflow_torchrun.backends.kubernetes.api.Request` (or
:class:`~airflow_torchrun.backends.kubernetes.api.Sleep`) steps and receives each parsed answer; an API
error is thrown into it at the ``yield`` as :class:`~airflow_torchrun.backends.kubernetes.api.ClusterApiError`.
:meth:`SyncExecutor.run` drives a flow with :class:`KubernetesHook`'s API client (the worker),
:func:`run_async` with :class:`AsyncKubernetesHook`'s (the triggerer: no thread, no sync client).
Everything else, building requests, reading answers, deciding, is shared.

Every failure to talk to the cluster comes out as ``ClusterApiError``: an HTTP error with its
status, a timeout or refused connection as transient with ``status`` None.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from airflow_torchrun.backends.kubernetes.api import ClusterApiError, Request, Sleep, Step, read_answer
from airflow_torchrun.errors import is_transient

if TYPE_CHECKING:
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook, KubernetesHook

T = TypeVar("T")
Flow = Generator[Step, Any, T]


@dataclass(frozen=True)
class Connection:
    """How to reach the cluster: an Airflow connection, or a kubeconfig file instead."""

    conn_id: str
    config_file: str | None = None
    cluster_context: str | None = None
    in_cluster: bool | None = None

    def sync_hook(self) -> KubernetesHook:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

        if self.config_file:
            # No connection at all: the file is the whole configuration.
            return KubernetesHook(
                conn_id=None,
                kubernetes_conn_id=None,
                config_file=self.config_file,
                cluster_context=self.cluster_context,
            )
        return KubernetesHook(conn_id=self.conn_id, cluster_context=self.cluster_context, in_cluster=self.in_cluster)

    async def async_hook(self) -> AsyncKubernetesHook:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook

        if self.config_file:
            # AsyncKubernetesHook reads kubeconfig paths only from the connection; hand it the
            # file's content instead (read off the event loop).
            import yaml

            text = await asyncio.to_thread(Path(self.config_file).read_text)
            return AsyncKubernetesHook(
                config_dict=yaml.safe_load(text),
                connection_extras={},
                conn_id=None,
                kubernetes_conn_id=None,
                cluster_context=self.cluster_context,
            )
        return AsyncKubernetesHook(
            conn_id=self.conn_id, cluster_context=self.cluster_context, in_cluster=self.in_cluster
        )


def unreachable(request: Request, exc: BaseException, timeout: float) -> ClusterApiError:
    """A request that got no HTTP answer: timed out, refused, reset (transient), or could not be
    made at all (a bad kubeconfig, a missing connection: permanent)."""
    detail = str(exc).strip() or type(exc).__name__
    timed_out = "timeout" in type(exc).__name__.lower() or "timed out" in detail.lower()
    if isinstance(exc, TimeoutError | asyncio.TimeoutError) or timed_out:
        detail = f"no answer within {timeout + request.server_seconds:g}s ({detail})"
    return ClusterApiError(request, status=None, message=detail, transient=is_transient(exc))


def _headers(request: Request) -> dict[str, str]:
    return {"Accept": "*/*" if request.text else "application/json", "Content-Type": "application/json"}


def _drive(flow: Flow[T], send: Callable[[Request], Any], sleep: Callable[[float], None]) -> T:
    reply: Any = None
    error: ClusterApiError | None = None
    try:
        while True:
            try:
                step = flow.throw(error) if error is not None else flow.send(reply)
            except StopIteration as stop:
                return stop.value
            reply, error = None, None
            if isinstance(step, Sleep):
                sleep(step.seconds)
                continue
            try:
                reply = send(step)
            except ClusterApiError as exc:
                error = exc
    finally:
        flow.close()


class SyncExecutor:
    """Sends requests with the sync hook's API client (built on first use)."""

    def __init__(self, hook: Callable[[], KubernetesHook], request_timeout: float) -> None:
        self._hook = hook
        self.request_timeout = request_timeout

    def send(self, request: Request) -> Any:
        from kubernetes.client.exceptions import ApiException

        timeout = self.request_timeout + request.server_seconds
        try:
            resp = self._hook().api_client.call_api(
                request.path,
                request.method,
                query_params=list(request.query),
                header_params=_headers(request),
                body=dict(request.body) if request.body is not None else None,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=timeout,
            )
        except ApiException as exc:
            return read_answer(request, int(exc.status or 0), exc.body)
        except Exception as exc:
            raise unreachable(request, exc, self.request_timeout) from exc
        try:
            if request.stream:
                # Done at the first event (a line), or when the server ends the watch.
                for chunk in resp.stream(amt=None, decode_content=False):
                    if b"\n" in chunk:
                        break
                data = b""
            else:
                data = resp.data
        except Exception as exc:
            raise unreachable(request, exc, self.request_timeout) from exc
        finally:
            resp.release_conn()
        return read_answer(request, resp.status, data)

    def run(self, flow: Flow[T]) -> T:
        return _drive(flow, self.send, time.sleep)


class AsyncExecutor:
    """Sends requests with one of the async hook's API clients."""

    def __init__(self, api: Any, request_timeout: float) -> None:
        self._api = api
        self.request_timeout = request_timeout

    async def send(self, request: Request) -> Any:
        timeout = self.request_timeout + request.server_seconds
        try:
            resp = await self._api.call_api(
                request.path,
                request.method,
                query_params=list(request.query),
                header_params=_headers(request),
                body=dict(request.body) if request.body is not None else None,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=timeout,
            )
            try:
                status = resp.status
                if request.stream and 200 <= status <= 299:
                    await resp.content.readline()  # the first event, or the end of the watch
                    data = b""
                else:
                    data = await resp.read()
            finally:
                resp.release()
        except Exception as exc:
            raise unreachable(request, exc, self.request_timeout) from exc
        return read_answer(request, status, data)

    async def run(self, flow: Flow[T]) -> T:
        reply: Any = None
        error: ClusterApiError | None = None
        try:
            while True:
                try:
                    step = flow.throw(error) if error is not None else flow.send(reply)
                except StopIteration as stop:
                    return stop.value
                reply, error = None, None
                if isinstance(step, Sleep):
                    await asyncio.sleep(step.seconds)
                    continue
                try:
                    reply = await self.send(step)
                except ClusterApiError as exc:
                    error = exc
        finally:
            flow.close()


async def run_async(flow: Flow[T], connection: Connection, request_timeout: float) -> T:
    """Drive ``flow`` over one async API client of ``connection``'s hook."""
    async with contextlib.AsyncExitStack() as stack:
        try:
            hook = await connection.async_hook()
            api = await stack.enter_async_context(hook.get_conn())
        except Exception as exc:
            flow.close()
            raise unreachable(Request("CONNECT", f"cluster of {connection.conn_id}"), exc, request_timeout) from exc
        return await AsyncExecutor(api, request_timeout).run(flow)
