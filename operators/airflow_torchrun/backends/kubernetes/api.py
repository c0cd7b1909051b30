"""Pure descriptions of the Kubernetes API requests the backend makes, and the reading of answers.

Each function returns a :class:`Request` (verb, path, query, body, and which error answers are
expected rather than errors); nothing here does I/O. The executors of
:mod:`~airflow_torchrun.backends.kubernetes.client` send a request through the provider's sync or async
hook and hand the status and body to :func:`read_answer`, so both paths read answers, and fail,
the same way. The flows (launch, observe, logs, teardown) are generators that yield these
requests and get the parsed answers back (lightkube's split of request building from clients).

Raw JSON, not the client's models: the pure status code reads the API's own shapes, including
fields newer than the installed client.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from airflow_torchrun.errors import TorchrunError

KUEUE_GROUP, KUEUE_VERSION, KUEUE_PLURAL = "kueue.x-k8s.io", "v1beta1", "workloads"


@dataclass(frozen=True)
class Request:
    """One API request, described. ``tolerate``: statuses that answer ``None`` instead of raising
    (404 for a read of what may be gone...). ``stream``: a watch, done at its first event."""

    method: str
    path: str
    query: tuple[tuple[str, str], ...] = ()
    body: Mapping[str, Any] | None = None
    text: bool = False
    tolerate: frozenset[int] = frozenset()
    stream: bool = False
    # Seconds the server may take on purpose (a watch's timeoutSeconds), on top of the request timeout.
    server_seconds: float = 0.0

    @property
    def what(self) -> str:
        return f"{self.method} {self.path}"


@dataclass(frozen=True)
class Sleep:
    """A pause inside a flow (waiting for a deletion); the executor sleeps its own way."""

    seconds: float


Step = Request | Sleep


class ClusterApiError(TorchrunError):
    """The API server refused a request (``status``) or could not be reached (``status`` None).

    Transient for 5xx, 408, 429 and for a server that did not answer; permanent for other 4xx.
    ``status`` is what :func:`airflow_torchrun.errors.http_status` reads.
    """

    def __init__(
        self,
        request: Request,
        *,
        status: int | None,
        reason: str = "",
        message: str = "",
        transient: bool | None = None,
    ) -> None:
        self.request = request
        self.status = status
        self.reason = reason
        self.api_message = message
        if transient is None:
            transient = status is not None and (status >= 500 or status in (408, 429))
        said = ": ".join(p for p in (f"{status} {reason}".strip() if status is not None else "", message) if p)
        super().__init__(f"{request.what}: {said or 'no answer'}", transient=transient)


def api_message(body: bytes | str | None) -> tuple[str, str]:
    """(reason, message) of a ``Status`` body; the raw text when it is not one."""
    if body is None:
        return "", ""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else str(body)
    try:
        data = json.loads(text)
    except ValueError:
        return "", text.strip()[:500]
    if isinstance(data, dict):
        return str(data.get("reason") or ""), str(data.get("message") or "")
    return "", text.strip()[:500]


def read_answer(request: Request, status: int, body: bytes | str | None) -> Any:
    """The parsed answer (JSON, or text for logs), ``None`` for a tolerated status; else raises
    :class:`ClusterApiError`."""
    if 200 <= status <= 299:
        if request.stream:
            return None
        raw = body.decode("utf-8", "replace") if isinstance(body, bytes) else (body or "")
        if request.text:
            return raw
        return json.loads(raw) if raw else {}
    if status in request.tolerate:
        return None
    reason, message = api_message(body)
    raise ClusterApiError(request, status=status, reason=reason, message=message)


def items(listed: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    return list((listed or {}).get("items") or [])


# -- the requests ------------------------------------------------------------------------------
def _jobs(ns: str) -> str:
    return f"/apis/batch/v1/namespaces/{ns}/jobs"


def _core(ns: str, resource: str) -> str:
    return f"/api/v1/namespaces/{ns}/{resource}"


def create_job(ns: str, job: Mapping[str, Any]) -> Request:
    return Request("POST", _jobs(ns), body=job)


def read_job(ns: str, name: str) -> Request:
    """The Job, or ``None`` when it is gone."""
    return Request("GET", f"{_jobs(ns)}/{name}", tolerate=frozenset({404}))


def list_jobs(ns: str, label_selector: str) -> Request:
    return Request("GET", _jobs(ns), query=(("labelSelector", label_selector),))


def _delete_options(uid: str | None, propagation: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1"}
    if propagation:
        body["propagationPolicy"] = propagation
    if uid:
        body["preconditions"] = {"uid": uid}
    return body


def delete_job(ns: str, name: str, uid: str | None = None) -> Request:
    """Foreground: the pods go first, then the Job (and the Service it owns). Gone already is fine.

    With ``uid``, only that very Job: one of the same name that is not it (another deployment's,
    a later launch's) fails the precondition (409), which is tolerated too: ours is gone.
    """
    query = (("propagationPolicy", "Foreground"),)
    tolerate = frozenset({404, 409}) if uid else frozenset({404})
    return Request(
        "DELETE", f"{_jobs(ns)}/{name}", query=query, body=_delete_options(uid, "Foreground"), tolerate=tolerate
    )


def create_service(ns: str, service: Mapping[str, Any]) -> Request:
    return Request("POST", _core(ns, "services"), body=service)


def read_service(ns: str, name: str) -> Request:
    """The Service, or ``None`` when it is gone."""
    return Request("GET", f"{_core(ns, 'services')}/{name}", tolerate=frozenset({404}))


def delete_service(ns: str, name: str, uid: str) -> Request:
    """That very Service (uid precondition): gone already, or replaced by another, is fine."""
    return Request(
        "DELETE", f"{_core(ns, 'services')}/{name}", body=_delete_options(uid), tolerate=frozenset({404, 409})
    )


def _networking(ns: str) -> str:
    return f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies"


def create_network_policy(ns: str, policy: Mapping[str, Any]) -> Request:
    return Request("POST", _networking(ns), body=policy)


def read_network_policy(ns: str, name: str) -> Request:
    """The NetworkPolicy, or ``None`` when it is gone."""
    return Request("GET", f"{_networking(ns)}/{name}", tolerate=frozenset({404}))


def delete_network_policy(ns: str, name: str, uid: str) -> Request:
    """That very NetworkPolicy (uid precondition): gone already, or replaced by another, is fine."""
    return Request("DELETE", f"{_networking(ns)}/{name}", body=_delete_options(uid), tolerate=frozenset({404, 409}))


def list_pods(ns: str, label_selector: str) -> Request:
    return Request("GET", _core(ns, "pods"), query=(("labelSelector", label_selector),))


def watch_pods(ns: str, label_selector: str, resource_version: str | None, seconds: int) -> Request:
    """Ends at the first change after ``resource_version``, or after ``seconds``. 410 Gone (the
    version expired) is fine: the list that follows starts afresh."""
    query = [("labelSelector", label_selector), ("watch", "true"), ("timeoutSeconds", str(seconds))]
    if resource_version:
        query.append(("resourceVersion", resource_version))
    return Request(
        "GET", _core(ns, "pods"), query=tuple(query), stream=True, tolerate=frozenset({410}), server_seconds=seconds
    )


def list_job_events(ns: str, job_name: str) -> Request:
    selector = f"involvedObject.kind=Job,involvedObject.name={job_name}"
    return Request("GET", _core(ns, "events"), query=(("fieldSelector", selector),))


def list_pod_events(ns: str, pod_name: str, reason: str) -> Request:
    selector = f"involvedObject.kind=Pod,involvedObject.name={pod_name},reason={reason}"
    return Request("GET", _core(ns, "events"), query=(("fieldSelector", selector),))


def list_workloads(ns: str, job_uid: str | None) -> Request:
    """Kueue's Workloads of a Job; ``None`` when Kueue is absent (404) or not readable (403)."""
    return Request(
        "GET",
        f"/apis/{KUEUE_GROUP}/{KUEUE_VERSION}/namespaces/{ns}/{KUEUE_PLURAL}",
        query=(("labelSelector", f"kueue.x-k8s.io/job-uid={job_uid}"),),
        tolerate=frozenset({403, 404}),
    )


def pod_log(
    ns: str,
    pod: str,
    container: str,
    *,
    since_time: str | None = None,
    tail_lines: int | None = None,
    timestamps: bool = False,
    limit_bytes: int | None = None,
) -> Request:
    """A container's log as text; ``None`` when it has not started (400) or is gone (404).

    ``sinceTime`` is the API's own parameter (the generated client offers only the clock-skew
    prone ``sinceSeconds``)."""
    query = [("container", container)]
    if timestamps:
        query.append(("timestamps", "true"))
    if since_time is not None:
        query.append(("sinceTime", since_time))
    if tail_lines is not None:
        query.append(("tailLines", str(tail_lines)))
    if limit_bytes is not None:
        query.append(("limitBytes", str(limit_bytes)))
    return Request(
        "GET", f"{_core(ns, 'pods')}/{pod}/log", query=tuple(query), text=True, tolerate=frozenset({400, 404})
    )
