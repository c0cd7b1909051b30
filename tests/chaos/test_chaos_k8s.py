"""The Kubernetes API answering 5xx for 20 s while a group trains, sync and deferred.

The training task (``backend="kubernetes"``, 2 nodes) runs through ``dag.test()`` against the fake
API server of ``tests/k8s`` (no cluster exists here: an autopilot thread plays kubelet and Job
controller, as in ``tests/k8s/test_operator_k8s.py``). Once both pods run and rank 0 has logged a
step, every request (watch, list, logs, delete) is answered with a 5xx, drawn per trial from 500,
502, 503, 504, for 20 s, while the ranks keep "training"; 1 s after the API is back the pods
complete. What must hold afterwards, per trial:

- recovered: the task succeeded, and its log says it rode the trouble out (a transient failed
  look, then "observing again");
- injected: requests did arrive in the window and got the 5xx;
- no second Job (nor Service) was created: the healthy group was never torn down and relaunched;
- left behind: Jobs, pods and Services of the trial still in the fake afterwards (must be 0);
- recovery: the API back -> the operator's (or trigger's) next answered request.

Nothing trains for real, so "bit-identical" and "steps lost" do not apply (shown as "-").
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from tests.chaos.matrix import SEED, Trial, record, trials
from tests.k8s import conftest as k8s_fixtures
from tests.k8s.fake_api import Call, FakeKubeAPI
from tests.k8s.test_operator_k8s import NS, TASK, Autopilot

pytestmark = pytest.mark.slow

# The fixtures of tests/k8s (a fake API server, the connection to it, checkpoints on moto's S3).
fake_api = k8s_fixtures.fake_api
kubeconfig = k8s_fixtures.kubeconfig
pod_storage = k8s_fixtures.pod_storage
k8s_connection = k8s_fixtures.k8s_connection

OUTAGE_S = 20.0
# At most this many requests reach the failing API in the outage (the watch backs off to one look
# every 2 s; a look is a watch of the pods and a log read).
MAX_REQUESTS_IN_OUTAGE = 80
FAULTS = {False: "Kubernetes API 5xx for 20 s (sync)", True: "Kubernetes API 5xx for 20 s (deferred)"}


class Outage:
    """The scenario of one trial: run the pods, log a step, 5xx for ``OUTAGE_S``, then complete."""

    def __init__(self, status: int, lead_s: float) -> None:
        self.status, self.lead_s = status, lead_s
        self.start: float | None = None
        self.end: float | None = None

    def __call__(self, fake: FakeKubeAPI, job: str) -> None:
        fake.create_pods(NS, job)
        fake.set_running(NS, job)
        for index in (0, 1):
            pod = fake.pod(NS, job, index)["metadata"]["name"]
            fake.add_log(pod, f"[node {index} rank {index}] step 1 loss 0.50")
        time.sleep(self.lead_s)
        self.start = time.time()
        fake.outage(OUTAGE_S, status=self.status)
        time.sleep(OUTAGE_S)
        self.end = time.time()
        for index in (0, 1):  # the ranks trained on through the outage
            pod = fake.pod(NS, job, index)["metadata"]["name"]
            fake.add_log(pod, f"[node {index} rank {index}] step 2 loss 0.40")
        time.sleep(1.0)
        fake.set_terminated(NS, job, None, exit_code=0, reason="Completed")


def left_in(fake: FakeKubeAPI, names: set[str]) -> list[tuple[str, str, str]]:
    """The trial's Jobs, pods and Services still in the fake (pods and Services carry the Job's name)."""
    return [
        key
        for key in list(fake.objects)
        if key[0] in ("jobs", "pods", "services", "networkpolicies") and any(key[2].startswith(n) for n in names)
    ]


def _kind(call: Call) -> str:
    """``GET watch pods``, ``GET log``: what a request was for, without names."""
    parts = call.path.strip("/").split("/")
    what = "log" if parts[-1] == "log" else next((r for r in ("jobs", "pods", "services", "events") if r in parts), "?")
    return f"{call.method} {'watch ' if call.is_watch else ''}{what}"


def run_trial(fake: FakeKubeAPI, run_dag: Callable[..., Any], deferrable: bool, n: int) -> Trial:
    fault = FAULTS[deferrable]
    rng = random.Random(f"{SEED}-{fault}-{n}")
    scenario = Outage(rng.choice([500, 502, 503, 504]), lead_s=rng.uniform(0.5, 3.0))
    first_call = len(fake.calls)
    body = TASK.replace("track=False,", f"track=False,\n    deferrable={deferrable},\n    defer_after=0,")
    with Autopilot(fake, scenario):
        result = run_dag(body)
    calls = fake.calls[first_call:]
    posted = [c.body["metadata"]["name"] for c in calls if c.method == "POST" and c.path.endswith("/jobs")]
    services = [c for c in calls if c.method == "POST" and c.path.endswith("/services")]
    start, end = scenario.start, scenario.end
    hit = [c for c in calls if start is not None and end is not None and start <= c.at < end]
    after = [c.at for c in calls if end is not None and c.at >= end]
    recovery = (min(after) - end) if after and end is not None else None
    left = left_in(fake, set(posted))
    rode_out = "could not look at the group (transient" in result.log and "observing again after" in result.log
    # Failed looks back off (Watch.pause): without it one task sent 664 requests in these 20 s.
    calm = len(hit) <= MAX_REQUESTS_IN_OUTAGE
    ok = result.task_states == {"train": "success"} and rode_out and calm and len(posted) == 1 and len(services) == 1
    kinds = ", ".join(f"{k} x{v}" for k, v in Counter(_kind(c) for c in hit).most_common(3))
    note = (
        f"seed {SEED}: HTTP {scenario.status} for {OUTAGE_S:g}s, {scenario.lead_s:.1f}s after the pods ran; "
        f"{len(hit)} request(s) answered {scenario.status} ({kinds}); "
        f"Jobs created {len(posted)}, Services {len(services)}"
    )
    if not rode_out:
        note += "; the log does not show the trouble ridden out"
    if not calm:
        note += f"; more than {MAX_REQUESTS_IN_OUTAGE} requests to an API in trouble"
    if result.task_states != {"train": "success"}:
        tail = [ln for ln in result.log.splitlines() if "Group " in ln or "ERROR" in ln][-2:]
        note += " | " + " / ".join(line[:300] for line in tail)
    return record(Trial(fault, bool(hit), ok, None, len(left), 0, recovery, note))


@pytest.mark.parametrize(
    "deferrable",
    [pytest.param(d, marks=pytest.mark.fault(FAULTS[d]), id="deferred" if d else "sync") for d in (False, True)],
)
def test_kubernetes_api_5xx_for_20s(
    fake_api: FakeKubeAPI, k8s_connection: str, run_dag: Callable[..., Any], deferrable: bool
) -> None:
    results = [run_trial(fake_api, run_dag, deferrable, n) for n in range(trials())]
    for t in results:
        assert t.injected, t
        assert t.recovered, t
        assert t.left_behind == 0, t
