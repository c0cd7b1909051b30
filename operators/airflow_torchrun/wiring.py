"""Rendezvous wiring: a pure function from a spec and a group identity to each node's command and env.

Every backend runs exactly these commands; a backend only decides *where* a node runs.

Rendezvous is torchrun's ``static`` backend: node ``i`` is torchrun's ``--node-rank i``, so global
ranks are ``node_rank * nproc_per_node + local_rank`` on every backend (on Kubernetes the node rank
is the Job's completion index). In-place restarts are off (``--max-restarts 0``): a failed group is
torn down and Airflow's retry starts a new one that resumes from the latest checkpoint. That avoids
torchrun's re-rendezvous hangs: with ``--max-restarts 3`` and a worker killed mid-run, torchrun on
its defaults recovered only 6 of 12 times (5 runs hung in ``init_process_group``, the restarted
ranks dialling the previous incarnation's store), measured on a 2-core machine on 2026-11-30.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from airflow_torchrun.contract import CONTRACT_ENV
from airflow_torchrun.contract.launch import (
    FUNCTION_ENTRY,
    GATE_TIMEOUT_VAR,
    GATE_VAR,
    GROUP_ID_VAR,
    NODE_RANK_VAR,
    WORKER_ENTRY,
)
from airflow_torchrun.naming import GroupIdentity
from airflow_torchrun.spec import RESERVED_ENV, GroupSpec

# Torchrun's default; used where every node has its own network namespace (Kubernetes).
DEFAULT_MASTER_PORT = 29500
# What each node runs by default as its agent (``python -m``).
TORCHRUN_MODULE = "torch.distributed.run"


@dataclass(frozen=True)
class NodePlan:
    node_rank: int
    argv: tuple[str, ...]
    env: Mapping[str, str]


@dataclass(frozen=True)
class GroupPlan:
    group_id: str
    spec: GroupSpec
    identity: GroupIdentity
    master_addr: str
    master_port: int
    nodes: tuple[NodePlan, ...] = field(default=())


def threads_per_proc(spec: GroupSpec, cpus_per_node: float | None) -> int:
    """OMP threads per rank: explicit, else the node's CPUs split between its ranks.

    torchrun sets OMP_NUM_THREADS=1 for ``--standalone`` but not with ``--nnodes > 1``; two ranks
    fighting over two cores without it ran 2.7x slower (measured on a 2-core machine, 2026-11-30),
    so the wiring always sets it.
    """
    if spec.threads_per_proc:
        return spec.threads_per_proc
    if not cpus_per_node:
        return 1
    return max(1, int(cpus_per_node // spec.nproc_per_node))


def holds_at_gate(spec: GroupSpec) -> bool:
    """Whether the ranks run a launcher of ours, which can hold them at a gate before the user's code
    (:mod:`airflow_torchrun.worker.gate`): a ``script=`` and ``@task.torchrun``'s function do, a
    ``command=`` of the user's does not."""
    return spec.script is not None or tuple(spec.command[1:]) == ("-m", FUNCTION_ENTRY)


def plan(
    spec: GroupSpec,
    identity: GroupIdentity,
    *,
    master_addr: str,
    master_port: int,
    python: str = "python",
    agent_module: str = TORCHRUN_MODULE,
    log_dir: str | None = None,
    cpus_per_node: float | None = None,
    extra_env: Mapping[str, str] | None = None,
    gate: str | None = None,
) -> GroupPlan:
    """Render every node's torchrun command and environment. Pure: no I/O, no clock.

    ``agent_module``: what ``python -m`` runs as each node's agent, torchrun's own module or one that
    runs it (the local backend's :mod:`airflow_torchrun.backends.local.agent`). ``log_dir`` may
    hold ``{node_rank}``. ``extra_env`` carries what the operator and the platform
    add: the rank contract (checkpoint, shard and MLflow variables), storage access, a Kubernetes
    runtime's ``env``. The user's ``spec.env`` overrides the wiring's defaults (``OMP_NUM_THREADS``,
    ``PYTHONUNBUFFERED``) and ``extra_env``, but never a contract or a reserved variable: those
    reach a rank only from the operator and the wiring, whatever ``spec.env`` holds.

    ``gate``: the ranks hold before the script until a file appears there (a launch started during
    the teardown of the group before it); only for a spec that :func:`holds_at_gate`. They wait
    for it up to the spec's ``startup_timeout``.
    """
    if gate is not None and not holds_at_gate(spec):
        raise ValueError("a gate needs ranks that run a launcher of ours (script= or @task.torchrun), not a command=")
    user_env = {k: v for k, v in spec.env.items() if k not in CONTRACT_ENV and k not in RESERVED_ENV}
    group_id = identity.group_id
    nodes = []
    for node_rank in range(spec.num_nodes):
        argv = [
            python,
            "-m",
            agent_module,
            f"--nnodes={spec.num_nodes}",
            f"--nproc-per-node={spec.nproc_per_node}",
            f"--node-rank={node_rank}",
            "--rdzv-backend=static",
            f"--master-addr={master_addr}",
            f"--master-port={master_port}",
            f"--rdzv-conf=timeout={int(spec.rdzv_timeout)}",
            f"--rdzv-id={group_id}",
            "--max-restarts=0",
            "--monitor-interval=0.1",
        ]
        if log_dir is not None:
            argv += ["--tee=3", f"--log-dir={log_dir.format(node_rank=node_rank)}"]
        if spec.script is not None:
            argv += ["-m", WORKER_ENTRY, spec.script]
        else:
            argv += ["--no-python", *spec.command]
        argv += list(spec.script_args)

        env: dict[str, str] = {
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": str(threads_per_proc(spec, cpus_per_node)),
            # Each rank's lines carry their origin in the task log; ${rank} is torchrun's.
            "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": f"[node {node_rank} rank ${{rank}}] ",
        }
        env.update(extra_env or {})
        env.update(user_env)
        env[GROUP_ID_VAR] = group_id
        env[NODE_RANK_VAR] = str(node_rank)
        if gate is not None:
            env[GATE_VAR] = gate
            env[GATE_TIMEOUT_VAR] = f"{spec.startup_timeout:g}"
        nodes.append(NodePlan(node_rank=node_rank, argv=tuple(argv), env=env))
    return GroupPlan(
        group_id=group_id,
        spec=spec,
        identity=identity,
        master_addr=master_addr,
        master_port=master_port,
        nodes=tuple(nodes),
    )


def gate_env(spec: GroupSpec, extra_env: Mapping[str, str]) -> dict[str, str]:
    """What of ``extra_env`` (the rank contract's, storage access) a held rank gets at its gate: what
    :func:`plan` would have put in its environment, so the user's ``spec.env`` still wins over it."""
    user = {k for k in spec.env if k not in CONTRACT_ENV and k not in RESERVED_ENV}
    return {k: v for k, v in extra_env.items() if k not in user}
