"""What the wiring, the ranks' launchers and the backends share: process markers, entry points, files.

Standard library only.
"""

from __future__ import annotations

# Which process is a worker of which group: every agent and rank inherits these, and teardown
# finds stragglers (torchrun puts each worker in a session of its own) by them.
GROUP_ID_VAR = "AIRFLOW_TORCHRUN_GROUP_ID"
NODE_RANK_VAR = "AIRFLOW_TORCHRUN_NODE_RANK"
# What every rank of a script= task runs under torchrun, and of a @task.torchrun task.
WORKER_ENTRY = "airflow_torchrun.worker.launch"
FUNCTION_ENTRY = "airflow_torchrun.worker.function"
# Which worker of a node's agent is which rank, {pid: [rank, local_rank]}: written by the local
# backend's agent, whose ranks are forked (their environment from exec is the agent's, without RANK).
# The agent and its ranks carry the file's path in this variable; its value is ``RANK_START_VAR``'s.
RANKS_FILE_VAR = "AIRFLOW_TORCHRUN_RANKS_FILE"
RANKS_FILE = "ranks.json"
# How the local backend's agent starts the ranks that run a launcher of ours: "fork" (from the
# agent, torch imported) or "exec" (a new interpreter each, as torchrun does).
RANK_START_VAR = "AIRFLOW_TORCHRUN_RANK_START"
# How the local backend starts each node's supervisor and agent: "fork" (from a zygote that has
# imported torch: airflow_torchrun.backends.local.zygote) or "exec" (a new interpreter each).
AGENT_START_VAR = "AIRFLOW_TORCHRUN_AGENT_START"
# Written by the launcher beside torchrun's per-rank error file: the process group a rank joined.
PROCESS_GROUP_FILE = "process_group.json"
# A rank of a group started while the group before it is torn down holds before its script until
# the gate (a JSON file at this path: {"env": {...}}) is there, and runs with that env added: what
# only the group before leaves behind (the resume point its save on SIGTERM committed). Set by the
# wiring for gated launches only; a gate not there within the timeout (seconds) ends the rank.
GATE_VAR = "AIRFLOW_TORCHRUN_GATE"
GATE_TIMEOUT_VAR = "AIRFLOW_TORCHRUN_GATE_TIMEOUT"
GATE_FILE = "gate.json"
# Written by a held rank beside torchrun's per-rank error file once its imports are done (ready at
# the gate): {"imported_at": epoch, "rank": RANK}.
HELD_FILE = "held.json"
