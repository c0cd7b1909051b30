"""kubectl, with the cluster's admin kubeconfig, for the launcher and the tests."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from cluster.build import binary
from cluster.layout import state


def kubectl(*args: str, input: str | None = None, check: bool = True, timeout: float = 120) -> str:
    done = subprocess.run(
        [str(binary("kubectl")), f"--kubeconfig={state().kubeconfig}", *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done.stdout


def kubectl_json(*args: str, timeout: float = 60) -> Any:
    return json.loads(kubectl(*args, "-o", "json", timeout=timeout))


def api_ready() -> bool:
    try:
        return kubectl("get", "--raw", "/readyz", check=False, timeout=10).strip() == "ok"
    except (subprocess.TimeoutExpired, SystemExit):
        return False


def ready_nodes() -> list[str]:
    try:
        nodes = kubectl_json("get", "nodes", timeout=15)["items"]
    except (RuntimeError, subprocess.TimeoutExpired, ValueError):
        return []
    names = []
    for node in nodes:
        conditions = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
        if conditions.get("Ready") == "True":
            names.append(node["metadata"]["name"])
    return names
