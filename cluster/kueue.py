"""Kueue on the cluster: its CRDs and webhooks from the pinned release's own manifests, its manager
as a host process (like the control plane), one ClusterQueue and a LocalQueue for the tests.

The webhooks point at the manager on loopback by URL (``clientConfig.url``) with a certificate of
the cluster's CA, instead of a Service with Kueue's internal certificate rotation: there is no
Service network to reach a host process through. Only the webhooks of what is enabled here are
registered (batch/Job and Kueue's own kinds): one of a framework the manager does not serve
(the Pod webhook, failurePolicy Fail) would refuse every pod of the cluster.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import yaml

from cluster.build import BY_NAME, go_env
from cluster.kube import kubectl
from cluster.layout import KUEUE_HEALTH_PORT, KUEUE_METRICS_PORT, KUEUE_WEBHOOK_PORT, NAMESPACE, VERSIONS, State
from cluster.proc import Processes

CLUSTER_QUEUE = "airflow-torchrun"
LOCAL_QUEUE = "training"
# Enough for one 2-node group of the cluster's `cpu` runtime (1 CPU, 2 GiB per node), not two:
# the second group waits for the first, which is what the queueing test looks at.
QUOTA = {"cpu": "2", "memory": "6Gi"}
SERVED_PATHS = ("batch-v1-job", "kueue-x-k8s-io")


def source() -> Path:
    return Path(go_env()["GOMODCACHE"]) / f"sigs.k8s.io/kueue@{VERSIONS['kueue']}"


def webhooks(ca_bundle: str) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((source() / "config/components/webhook/manifests.yaml").read_text()) if d]
    out = []
    for original in docs:
        doc = copy.deepcopy(original)
        kind = doc["kind"]
        doc["metadata"]["name"] = {
            "MutatingWebhookConfiguration": "kueue-mutating-webhook-configuration",
            "ValidatingWebhookConfiguration": "kueue-validating-webhook-configuration",
        }[kind]
        kept = []
        for hook in doc.get("webhooks", []):
            path = hook["clientConfig"]["service"]["path"]
            if not any(p in path for p in SERVED_PATHS):
                continue
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{KUEUE_WEBHOOK_PORT}{path}", "caBundle": ca_bundle}
            kept.append(hook)
        doc["webhooks"] = kept
        out.append(doc)
    return out


def config(st: State) -> dict[str, Any]:
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": "kueue-system",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{KUEUE_HEALTH_PORT}"},
        "metrics": {"bindAddress": f"127.0.0.1:{KUEUE_METRICS_PORT}"},
        "webhook": {"host": "127.0.0.1", "port": KUEUE_WEBHOOK_PORT, "certDir": str(st.dir / "kueue" / "certs")},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": ["batch/job"]},
    }


def queues() -> list[dict[str, Any]]:
    return [
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "default"}},
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ClusterQueue",
            "metadata": {"name": CLUSTER_QUEUE},
            "spec": {
                "namespaceSelector": {},
                "resourceGroups": [
                    {
                        "coveredResources": sorted(QUOTA),
                        "flavors": [
                            {
                                "name": "default",
                                "resources": [{"name": k, "nominalQuota": v} for k, v in sorted(QUOTA.items())],
                            }
                        ],
                    }
                ],
            },
        },
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "LocalQueue",
            "metadata": {"name": LOCAL_QUEUE, "namespace": NAMESPACE},
            "spec": {"clusterQueue": CLUSTER_QUEUE},
        },
    ]


def up(st: State, procs: Processes) -> None:
    from cluster.build import build

    build(BY_NAME["kueue"])
    certs = st.dir / "kueue" / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    shutil.copy(st.pki / "kueue-webhook.crt", certs / "tls.crt")
    shutil.copy(st.pki / "kueue-webhook.key", certs / "tls.key")
    crds = str(source() / "config/components/crd/bases")
    kubectl("apply", "--server-side", "--force-conflicts", "-f", crds)
    # The manager looks its kinds up once, at start: started before the API server serves them, it
    # exited with 'no matches for kind "Workload"' (measured on a warm start, 2026-12-02).
    kubectl("wait", "--for=condition=Established", "--timeout=120s", "-f", crds)
    kubectl("create", "namespace", "kueue-system", check=False)
    (st.dir / "kueue" / "config.yaml").write_text(yaml.safe_dump(config(st), sort_keys=False))
    import base64

    ca = base64.b64encode((st.pki / "ca.crt").read_bytes()).decode()
    # Without its internal certificate management the manager reads its metrics certificate from
    # the fixed path /etc/kueue/metrics/certs. It gets one in a mount namespace of its own, where a
    # read-only overlay adds that folder to /etc; the machine's /etc is not touched.
    extra = st.dir / "kueue" / "etc"
    metrics = extra / "kueue" / "metrics" / "certs"
    metrics.mkdir(parents=True, exist_ok=True)
    shutil.copy(st.pki / "kueue-webhook.crt", metrics / "tls.crt")
    shutil.copy(st.pki / "kueue-webhook.key", metrics / "tls.key")
    overlay = f'mount -t overlay airflow-torchrun-kueue -o lowerdir={extra}:/etc /etc && exec "$@"'
    procs.start(
        "kueue",
        [
            *("unshare", "--mount", "--propagation", "private", "--", "sh", "-c", overlay, "kueue"),
            str(BY_NAME["kueue"].bin_dir / "kueue"),
            f"--config={st.dir / 'kueue' / 'config.yaml'}",
            f"--kubeconfig={st.pki / 'kueue.kubeconfig'}",
            "--feature-gates=VisibilityOnDemand=false",
        ],
    )
    from cluster.up import http_ok

    procs.wait_for("kueue", lambda: http_ok(f"http://127.0.0.1:{KUEUE_HEALTH_PORT}/readyz"), 120, "ready Kueue")
    kubectl("apply", "-f", "-", input=yaml.safe_dump_all(webhooks(ca)))
    # The webhooks validate these: applied once the manager serves them (retried while it settles).
    import time

    deadline = time.monotonic() + 60
    while True:
        try:
            kubectl("apply", "-f", "-", input=yaml.safe_dump_all(queues()))
            break
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)
