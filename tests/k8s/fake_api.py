"""A small fake Kubernetes API server: real HTTP on 127.0.0.1, real-shaped objects, every call recorded.

It serves the few endpoints the Kubernetes backend uses (Jobs, Services, Pods and their logs,
Events, Kueue Workloads, watches of Pods) and plays two parts of the control plane on request of
the test: the Job controller (``create_pods``, ``fail_job``) and the kubelet/scheduler (``set_*``
helpers that move pods through phases). It validates what it is sent against the official
OpenAPI schema (``kubernetes-validate``) and label values as the API server does, and answers 422
like an API server would. :meth:`FakeKubeAPI.outage` makes it answer an error status (503 by
default), or hold requests without answer, for a window of time. No cluster is involved: nothing
here claims to behave like one beyond these shapes.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import kubernetes_validate

SCHEMA_VERSION = "1.34.0"
_KINDS = {
    "jobs": "Job",
    "services": "Service",
    "pods": "Pod",
    "events": "Event",
    "workloads": "Workload",
    "networkpolicies": "NetworkPolicy",
}
_LIST_API = {
    "jobs": "batch/v1",
    "services": "v1",
    "pods": "v1",
    "events": "v1",
    "workloads": "kueue.x-k8s.io/v1beta1",
    "networkpolicies": "networking.k8s.io/v1",
}


def now_rfc3339(offset: float = 0.0) -> str:
    return datetime.fromtimestamp(time.time() + offset, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def stamp_nano(t: float) -> str:
    dt = datetime.fromtimestamp(t, tz=UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond:06d}000Z"


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, str]
    body: Any = None
    at: float = field(default_factory=time.time)  # when the request arrived

    @property
    def is_watch(self) -> bool:
        return self.query.get("watch", "").lower() in ("true", "1")

    @property
    def precondition_uid(self) -> str | None:
        return ((self.body or {}).get("preconditions") or {}).get("uid") if isinstance(self.body, dict) else None

    @property
    def propagation_policy(self) -> str | None:
        if self.query.get("propagationPolicy"):
            return self.query["propagationPolicy"]
        return (self.body or {}).get("propagationPolicy") if isinstance(self.body, dict) else None


_REASONS = {
    400: "BadRequest",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    422: "Invalid",
    429: "TooManyRequests",
}
_REASONS |= {500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_MESSAGE = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for "
    "validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)


@dataclass
class Outage:
    """Requests matching ``method``/``resource`` (None: any) until ``until`` (monotonic) get
    ``status``, or, with ``hang``, no answer until the window is over (then the normal one)."""

    until: float
    status: int = 503
    hang: bool = False
    method: str | None = None
    resource: str | None = None

    def hits(self, call: Call) -> bool:
        if time.monotonic() >= self.until or (self.method and call.method != self.method):
            return False
        return self.resource is None or f"/{self.resource}" in call.path


def invalid_labels(obj: dict[str, Any]) -> list[str]:
    """The API server's label value check, on the object and its pod template."""
    out = []
    for where, meta in (
        ("metadata", obj.get("metadata")),
        ("spec.template.metadata", _get_path(obj, "spec.template.metadata")),
    ):
        for key, value in ((meta or {}).get("labels") or {}).items():
            if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
                out.append(f"{where}.labels: Invalid value: {json.dumps(value)}: {_LABEL_MESSAGE} ({key})")
    return out


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure" if code >= 400 else "Success",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _get_path(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def matches_labels(obj: dict[str, Any], selector: str | None) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, (selector or "").split(",")):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k) != v:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def matches_fields(obj: dict[str, Any], selector: str | None) -> bool:
    for term in filter(None, (selector or "").split(",")):
        k, v = term.split("=", 1)
        if str(_get_path(obj, k)) != v:
            return False
    return True


@dataclass
class FakeKubeAPI:
    """The fake server; start it with :meth:`start`, point a kubeconfig at :attr:`url`."""

    max_watch_wait: float = 0.3
    validate: bool = True
    hold_deletion: bool = False  # keep deleted Jobs (with deletionTimestamp) until release_deletions()
    calls: list[Call] = field(default_factory=list)
    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    logs: dict[str, list[tuple[float, str]]] = field(default_factory=dict)
    changes: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)  # pod watch log
    outages: list[Outage] = field(default_factory=list)
    # Called with each request once its answer is made and before it is sent (never for a watch):
    # the control plane moving between two of the client's requests.
    answered: Callable[[Call], None] | None = None

    def __post_init__(self) -> None:
        self._rv = 1000
        self._cond = threading.Condition()
        self._server: ThreadingHTTPServer | None = None

    # -- server ------------------------------------------------------------------------------
    def start(self) -> FakeKubeAPI:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self, method: str) -> None:
                parsed = urlparse(self.path)
                query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                call = Call(method, parsed.path, query, body)
                with api._cond:
                    api.calls.append(call)
                    outage = next((o for o in api.outages if o.hits(call)), None)
                try:
                    if outage is not None and outage.hang:
                        time.sleep(max(0.0, outage.until - time.monotonic()))
                    elif outage is not None:
                        reason = _REASONS.get(outage.status, "InternalError")
                        api._send(self, outage.status, _status(outage.status, reason, f"fake outage: {reason}"))
                        return
                    api.dispatch(self, call)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

            def do_DELETE(self) -> None:
                self._handle("DELETE")

            def do_PATCH(self) -> None:
                self._handle("PATCH")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def kubeconfig(self, namespace: str = "default") -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}],
            "current-context": "fake",
        }

    def outage(
        self,
        seconds: float,
        *,
        status: int = 503,
        hang: bool = False,
        method: str | None = None,
        resource: str | None = None,
    ) -> Outage:
        """From now on, for ``seconds``: answer matching requests with ``status``, or (``hang``)
        hold them unanswered until the window ends."""
        window = Outage(time.monotonic() + seconds, status, hang, method, resource)
        with self._cond:
            self.outages.append(window)
        return window

    # -- responses ---------------------------------------------------------------------------
    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, code: int, payload: Any, content_type: str = "application/json") -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        handler.send_response(code)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def dispatch(self, handler: BaseHTTPRequestHandler, call: Call) -> None:
        parts = call.path.strip("/").split("/")
        # /api/v1/namespaces/NS/RES[/NAME[/SUB]] or /apis/GROUP/VERSION/namespaces/NS/RES[/NAME[/SUB]]
        rest = parts[2:] if parts[0] == "api" else parts[3:]
        if len(rest) < 3 or rest[0] != "namespaces":
            self._send(handler, 404, _status(404, "NotFound", f"no route {call.path}"))
            return
        ns, resource = rest[1], rest[2]
        name = rest[3] if len(rest) > 3 else None
        sub = rest[4] if len(rest) > 4 else None
        if resource not in _KINDS:
            self._send(handler, 404, _status(404, "NotFound", f"the server could not find {resource}"))
            return
        if call.method == "GET" and name is None and call.is_watch:
            self._watch(handler, ns, resource, call.query)
            return
        code, payload = self.respond(call, ns, resource, name, sub)
        if self.answered is not None:  # before the client has the answer: it cannot ask again first
            self.answered(call)
        if isinstance(payload, str):
            self._send(handler, code, payload.encode(), "text/plain")
        else:
            self._send(handler, code, payload)

    def respond(self, call: Call, ns: str, resource: str, name: str | None, sub: str | None) -> tuple[int, Any]:
        kind = _KINDS[resource]
        with self._cond:
            if call.method == "POST" and name is None:
                return self._create(ns, resource, call.body)
            if call.method == "GET" and name is None:
                items = [
                    copy.deepcopy(o)
                    for (r, n, _), o in sorted(self.objects.items())
                    if r == resource
                    and n == ns
                    and matches_labels(o, call.query.get("labelSelector"))
                    and matches_fields(o, call.query.get("fieldSelector"))
                ]
                return 200, {
                    "kind": f"{kind}List",
                    "apiVersion": _LIST_API[resource],
                    "metadata": {"resourceVersion": str(self._rv)},
                    "items": items,
                }
            assert name is not None
            obj = self.objects.get((resource, ns, name))
            if obj is None:
                return 404, _status(404, "NotFound", f'{resource} "{name}" not found')
            if call.method == "GET" and sub == "log":
                return self._log(obj, call.query)
            if call.method == "GET":
                return 200, copy.deepcopy(obj)
            if call.method == "DELETE":
                wanted = ((call.body or {}).get("preconditions") or {}).get("uid")
                if wanted is not None and wanted != obj["metadata"]["uid"]:
                    # What the API server answers when DeleteOptions.preconditions.uid does not match.
                    message = (
                        f"Precondition failed: UID in precondition: {wanted}, UID in object meta: "
                        f"{obj['metadata']['uid']}"
                    )
                    return 409, _status(409, "Conflict", message)
                return self._delete(resource, ns, name, call.propagation_policy)
        return 405, _status(405, "MethodNotAllowed", f"{call.method} {call.path}")

    def _bump(self) -> str:
        self._rv += 1
        self._cond.notify_all()
        return str(self._rv)

    def _create(self, ns: str, resource: str, body: Any) -> tuple[int, Any]:
        kind = _KINDS[resource]
        if not isinstance(body, dict) or body.get("kind") != kind:
            return 400, _status(400, "BadRequest", f"expected a {kind}")
        if self.validate:
            try:
                kubernetes_validate.validate(body, SCHEMA_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                return 422, _status(422, "Invalid", f"{kind} is invalid: {exc.message}")
        bad = invalid_labels(body)
        if bad:
            group = ".batch" if kind == "Job" else ""
            name = (body.get("metadata") or {}).get("name")
            return 422, _status(422, "Invalid", f'{kind}{group} "{name}" is invalid: {"; ".join(bad)}')
        name = body["metadata"]["name"]
        if (resource, ns, name) in self.objects:
            return 409, _status(409, "AlreadyExists", f'{resource} "{name}" already exists')
        obj = copy.deepcopy(body)
        meta = obj["metadata"]
        meta.update(
            namespace=ns,
            uid=str(uuid.uuid4()),
            creationTimestamp=now_rfc3339(),
            resourceVersion=self._bump(),
            generation=1,
        )
        if kind == "Job":
            uid = meta["uid"]
            obj["spec"]["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
            tmpl_labels = obj["spec"]["template"]["metadata"].setdefault("labels", {})
            tmpl_labels.update(
                {
                    "batch.kubernetes.io/controller-uid": uid,
                    "batch.kubernetes.io/job-name": name,
                    "controller-uid": uid,
                    "job-name": name,
                }
            )
            obj["status"] = {}
        if kind == "Service":
            obj["spec"].setdefault("type", "ClusterIP")
            obj["status"] = {"loadBalancer": {}}
        self.objects[(resource, ns, name)] = obj
        return 201, copy.deepcopy(obj)

    def _delete(self, resource: str, ns: str, name: str, policy: str | None) -> tuple[int, Any]:
        obj = self.objects[(resource, ns, name)]
        if resource == "jobs" and self.hold_deletion:
            obj["metadata"]["deletionTimestamp"] = now_rfc3339()
            obj["metadata"]["finalizers"] = ["foregroundDeletion"] if policy == "Foreground" else []
            obj["metadata"]["resourceVersion"] = self._bump()
            return 200, copy.deepcopy(obj)
        self._remove(resource, ns, name)
        return 200, _status(200, "", "") | {"details": {"name": name, "kind": resource}}

    def _remove(self, resource: str, ns: str, name: str) -> None:
        obj = self.objects.pop((resource, ns, name))
        uid = obj["metadata"]["uid"]
        if resource == "pods":
            self.changes.append((int(self._bump()), "DELETED", copy.deepcopy(obj)))
        else:
            self._bump()
        # Garbage collection of dependents (pods of a Job, the Service it owns).
        for key, other in list(self.objects.items()):
            if key not in self.objects:
                continue  # already collected in this sweep
            owners = (other.get("metadata") or {}).get("ownerReferences") or []
            if any(o.get("uid") == uid for o in owners):
                self._remove(*key)

    def release_deletions(self) -> None:
        with self._cond:
            for key, obj in list(self.objects.items()):
                if key in self.objects and obj["metadata"].get("deletionTimestamp"):
                    self._remove(*key)

    def _log(self, pod: dict[str, Any], query: dict[str, str]) -> tuple[int, Any]:
        name = pod["metadata"]["name"]
        container = query.get("container", "trainer")
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        state = next((cs.get("state") or {} for cs in statuses if cs["name"] == container), {})
        if "running" not in state and "terminated" not in state:
            return 400, _status(
                400, "BadRequest", f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating'
            )
        lines = self.logs.get(name, [])
        since = query.get("sinceTime")
        if since:
            cutoff = datetime.fromisoformat(since.replace("Z", "+00:00")).timestamp()
            lines = [(t, line) for t, line in lines if t >= cutoff]
        if query.get("tailLines"):
            lines = lines[-int(query["tailLines"]) :]
        stamps = query.get("timestamps") in ("true", "True", "1")
        text = "".join(f"{stamp_nano(t)} {line}\n" if stamps else f"{line}\n" for t, line in lines)
        if query.get("limitBytes"):  # the API's own cut: the first bytes, mid-line if need be
            text = text.encode()[: int(query["limitBytes"])].decode("utf-8", "ignore")
        return 200, text

    def _watch(self, handler: BaseHTTPRequestHandler, ns: str, resource: str, query: dict[str, str]) -> None:
        since = int(query.get("resourceVersion") or 0)
        wait = min(float(query.get("timeoutSeconds") or 1), self.max_watch_wait)
        deadline = time.monotonic() + wait
        selector = query.get("labelSelector")
        with self._cond:
            while True:
                events = [
                    (kind, obj)
                    for rv, kind, obj in self.changes
                    if rv > since and obj["metadata"]["namespace"] == ns and matches_labels(obj, selector)
                ]
                remaining = deadline - time.monotonic()
                if events or remaining <= 0 or resource != "pods":
                    break
                self._cond.wait(remaining)
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Connection", "close")
        handler.end_headers()
        for kind, obj in events:
            handler.wfile.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
        handler.wfile.flush()

    # -- the control plane's part, driven by tests ------------------------------------------------
    def calls_to(self, method: str, resource: str) -> list[Call]:
        return [c for c in self.calls if c.method == method and f"/{resource}" in c.path]

    def job(self, ns: str, name: str) -> dict[str, Any]:
        return self.objects[("jobs", ns, name)]

    def pods(self, ns: str, job: str) -> list[dict[str, Any]]:
        with self._cond:
            return [
                o
                for (r, n, _), o in sorted(self.objects.items())
                if r == "pods" and n == ns and o["metadata"]["labels"].get("batch.kubernetes.io/job-name") == job
            ]

    def pod(self, ns: str, job: str, index: int) -> dict[str, Any]:
        for pod in self.pods(ns, job):
            if pod["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] == str(index):
                return pod
        raise KeyError(f"no pod for index {index} of {job}")

    def _touch(self, obj: dict[str, Any], kind: str = "MODIFIED") -> None:
        obj["metadata"]["resourceVersion"] = self._bump()
        if obj["kind"] == "Pod":
            self.changes.append((int(obj["metadata"]["resourceVersion"]), kind, copy.deepcopy(obj)))

    def create_pods(self, ns: str, job_name: str) -> list[str]:
        """What the Job controller does: one pod per completion index, from the template."""
        with self._cond:
            job = self.job(ns, job_name)
            uid = job["metadata"]["uid"]
            template = copy.deepcopy(job["spec"]["template"])
            names = []
            for index in range(job["spec"]["completions"]):
                name = f"{job_name}-{index}-{uuid.uuid4().hex[:5]}"
                labels = {
                    **template["metadata"].get("labels", {}),
                    "batch.kubernetes.io/job-completion-index": str(index),
                }
                annotations = {
                    **template["metadata"].get("annotations", {}),
                    "batch.kubernetes.io/job-completion-index": str(index),
                }
                spec = copy.deepcopy(template["spec"])
                spec["hostname"] = f"{job_name}-{index}"
                pod = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": name,
                        "generateName": f"{job_name}-{index}-",
                        "namespace": ns,
                        "uid": str(uuid.uuid4()),
                        "creationTimestamp": now_rfc3339(),
                        "labels": labels,
                        "annotations": annotations,
                        "finalizers": ["batch.kubernetes.io/job-tracking"],
                        "ownerReferences": [
                            {
                                "apiVersion": "batch/v1",
                                "kind": "Job",
                                "name": job_name,
                                "uid": uid,
                                "controller": True,
                                "blockOwnerDeletion": True,
                            }
                        ],
                    },
                    "spec": spec,
                    "status": {"phase": "Pending", "qosClass": "Guaranteed"},
                }
                self.objects[("pods", ns, name)] = pod
                self._touch(pod, "ADDED")
                names.append(name)
            job["status"] = {"active": len(names), "startTime": now_rfc3339(), "ready": 0}
            self._touch(job)
            return names

    def _each(self, ns: str, job: str, index: int | None) -> Iterator[dict[str, Any]]:
        for pod in self.pods(ns, job):
            if index is None or pod["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] == str(
                index
            ):
                yield pod

    @staticmethod
    def _cstatus(pod: dict[str, Any], name: str, state: dict[str, Any], ready: bool = False) -> dict[str, Any]:
        image = next(
            c["image"] for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []) if c["name"] == name
        )
        return {
            "name": name,
            "image": image,
            "imageID": "",
            "ready": ready,
            "restartCount": 0,
            "started": "running" in state,
            "state": state,
            "lastState": {},
        }

    def _set(self, ns: str, job: str, index: int | None, status: dict[str, Any]) -> None:
        with self._cond:
            for pod in self._each(ns, job, index):
                pod["status"] = {"qosClass": "Guaranteed", **status}
                if status.get("phase") != "Pending" or any(
                    c["type"] == "PodScheduled" and c["status"] == "True" for c in status.get("conditions", [])
                ):
                    pod["spec"]["nodeName"] = "node-a"
                self._touch(pod)

    def _cond_list(self, *items: tuple[str, str]) -> list[dict[str, Any]]:
        return [{"type": t, "status": s, "lastProbeTime": None, "lastTransitionTime": now_rfc3339()} for t, s in items]

    def set_unschedulable(self, ns: str, job: str, message: str, index: int | None = None) -> None:
        cond = self._cond_list(("PodScheduled", "False"))
        cond[0].update(reason="Unschedulable", message=message)
        self._set(ns, job, index, {"phase": "Pending", "conditions": cond})

    def set_waiting(self, ns: str, job: str, index: int | None, reason: str, message: str) -> None:
        with self._cond:
            for pod in self._each(ns, job, index):
                init = [
                    self._cstatus(pod, c["name"], {"waiting": {"reason": reason, "message": message}})
                    for c in pod["spec"].get("initContainers", [])
                ]
                main = [
                    self._cstatus(pod, c["name"], {"waiting": {"reason": "PodInitializing"}})
                    for c in pod["spec"]["containers"]
                ]
                pod["status"] = {
                    "phase": "Pending",
                    "qosClass": "Guaranteed",
                    "startTime": now_rfc3339(),
                    "conditions": self._cond_list(("PodScheduled", "True"), ("Initialized", "False")),
                    "initContainerStatuses": init,
                    "containerStatuses": main,
                }
                pod["spec"]["nodeName"] = "node-a"
                self._touch(pod)

    def set_running(self, ns: str, job: str, index: int | None = None) -> None:
        with self._cond:
            for pod in self._each(ns, job, index):
                done = {"terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": now_rfc3339()}}
                pod["status"] = {
                    "phase": "Running",
                    "qosClass": "Guaranteed",
                    "podIP": "10.0.0.7",
                    "startTime": now_rfc3339(),
                    "conditions": self._cond_list(
                        ("PodScheduled", "True"),
                        ("Initialized", "True"),
                        ("ContainersReady", "True"),
                        ("Ready", "True"),
                    ),
                    "initContainerStatuses": [
                        self._cstatus(pod, c["name"], done) for c in pod["spec"].get("initContainers", [])
                    ],
                    "containerStatuses": [
                        self._cstatus(pod, c["name"], {"running": {"startedAt": now_rfc3339()}}, ready=True)
                        for c in pod["spec"]["containers"]
                    ],
                }
                pod["spec"]["nodeName"] = "node-a"
                self._touch(pod)

    def set_terminated(
        self,
        ns: str,
        job: str,
        index: int | None,
        *,
        exit_code: int,
        reason: str,
        message: str | None = None,
        finished_offset: float = 0.0,
        disruption: tuple[str, str] | None = None,
        disruption_offset: float = 0.0,
        pod_reason: tuple[str, str] | None = None,
    ) -> None:
        """The trainer container ended: Succeeded for exit 0, else Failed (with the given reason,
        termination message, DisruptionTarget condition or pod-level reason such as Evicted)."""
        with self._cond:
            for pod in self._each(ns, job, index):
                status = pod.setdefault("status", {})
                term: dict[str, Any] = {
                    "exitCode": exit_code,
                    "reason": reason,
                    "startedAt": now_rfc3339(-5),
                    "finishedAt": now_rfc3339(finished_offset),
                }
                if message:
                    term["message"] = message
                status["phase"] = "Succeeded" if exit_code == 0 else "Failed"
                status["containerStatuses"] = [
                    self._cstatus(pod, c["name"], {"terminated": term}) for c in pod["spec"]["containers"]
                ]
                conds = self._cond_list(("PodScheduled", "True"), ("Ready", "False"))
                if disruption is not None:
                    extra = self._cond_list(("DisruptionTarget", "True"))[0]
                    extra.update(
                        reason=disruption[0], message=disruption[1], lastTransitionTime=now_rfc3339(disruption_offset)
                    )
                    conds.append(extra)
                status["conditions"] = conds
                if pod_reason is not None:
                    status["reason"], status["message"] = pod_reason
                self._touch(pod)

    def delete_pod_gracefully(self, ns: str, job: str, index: int) -> None:
        """What the Job controller does to the rest of a failed Job: delete, SIGTERM, exit 143."""
        with self._cond:
            for pod in self._each(ns, job, index):
                pod["metadata"]["deletionTimestamp"] = now_rfc3339()
        self.set_terminated(ns, job, index, exit_code=143, reason="Error")

    def take_pod_away(self, ns: str, job: str, index: int) -> str:
        """``kubectl delete pod`` as the real cluster (v1.37) did it, once it is over: the kubelet's
        ``Killing`` event, torchrun exiting 1 on the SIGTERM, no DisruptionTarget, the Job
        controller's verdict naming the pod, and the pod removed (its finalizer dropped). The name."""
        name = self.pod(ns, job, index)["metadata"]["name"]
        self.add_object(
            "events",
            ns,
            {
                "metadata": {"name": f"{name}.killing"},
                "involvedObject": {"kind": "Pod", "name": name, "namespace": ns},
                "reason": "Killing",
                "message": "Stopping container trainer",
                "type": "Normal",
                "firstTimestamp": now_rfc3339(),
                "lastTimestamp": now_rfc3339(),
            },
        )
        self.set_terminated(ns, job, index, exit_code=1, reason="Error")
        self.fail_job(
            ns,
            job,
            "PodFailurePolicy",
            f"Container trainer for pod {ns}/{name} failed with exit code 1 matching FailJob rule at index 1",
            terminal=False,
        )
        with self._cond:
            self._remove("pods", ns, name)
        return name

    def fail_job(self, ns: str, job: str, reason: str, message: str, *, terminal: bool = True) -> None:
        """The Job controller's verdict as a real API server (v1.37) shows it: FailureTarget first,
        and Failed (same reason and message) only once every pod has terminated (``terminal``)."""
        with self._cond:
            obj = self.job(ns, job)
            conds = [
                {
                    "type": kind,
                    "status": "True",
                    "reason": reason,
                    "message": message,
                    "lastProbeTime": now_rfc3339(),
                    "lastTransitionTime": now_rfc3339(),
                }
                for kind in (("FailureTarget", "Failed") if terminal else ("FailureTarget",))
            ]
            obj.setdefault("status", {})["conditions"] = conds
            if terminal:
                obj["status"]["failed"] = 1
            self._touch(obj)

    def add_log(self, pod_name: str, *lines: str) -> None:
        with self._cond:
            entries = self.logs.setdefault(pod_name, [])
            for line in lines:
                t = time.time()
                if entries and t <= entries[-1][0]:
                    t = entries[-1][0] + 1e-6
                entries.append((t, line))

    def add_object(self, resource: str, ns: str, obj: dict[str, Any]) -> None:
        with self._cond:
            obj = copy.deepcopy(obj)
            meta = obj.setdefault("metadata", {})
            meta.setdefault("namespace", ns)
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", now_rfc3339())
            meta["resourceVersion"] = self._bump()
            self.objects[(resource, ns, meta["name"])] = obj
